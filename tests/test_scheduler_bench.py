"""`kvflow bench scheduler`: the benchmark command runs and writes the promised JSON shape.

It prints decision latency; no speed is asserted here (timings are the benchmark's output).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvflow.scheduler.build import scheduler_build

KVFLOW = str(Path(sys.executable).with_name("kvflow"))


def test_bench_scheduler_prints_a_table_and_writes_latency_json(tmp_path: Path) -> None:
    out = tmp_path / "latency.json"
    done = subprocess.run(
        [KVFLOW, "bench", "scheduler", "--sizes", "16,64", "--decisions", "30", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "Scheduler decision latency" in done.stdout
    # It says which build it measured: the one this environment imports (see
    # test_scheduler_compiled.py, which runs this test against the compiled build too).
    build = scheduler_build()
    assert json.loads(out.read_text())["scheduler_build"] == build
    assert ("compiled with mypyc" in done.stdout) == (build == "mypyc")
    figures = json.loads(out.read_text())["decision_latency_us"]
    assert set(figures) == {"16", "64"}
    for size in figures.values():
        assert 0 < size["p50"] <= size["p99"]
        assert 0 < size["fixed_work_p50"] <= size["fixed_work_p99"]
        assert 0 < size["settle_p50"] <= size["settle_p99"]
        assert size["decisions"] == 30
        assert size["placed"] + size["refused"] == 30
    assert "Placement quality" in done.stdout
    quality = json.loads(out.read_text())["placement_quality"]
    assert set(quality) == {"16", "64"}
    for size in quality.values():
        assert 0 < size["decisions"] <= 30
        assert 0 <= size["not_best"] <= size["decisions"]
        assert 0 <= size["mean_regret"] <= size["p99_regret"]
        # The search's own misses, counted with the affinity load bound lifted.
        assert 0 <= size["search_misses"] <= size["decisions"]
        assert size["search_misses_mean_regret"] >= 0


def test_bench_scheduler_rejects_a_bad_size_with_exit_code_2(tmp_path: Path) -> None:
    done = subprocess.run(
        [KVFLOW, "bench", "scheduler", "--sizes", "16,seven"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "--sizes" in done.stderr and "multiples of 4" in done.stderr
    assert "Traceback" not in done.stderr

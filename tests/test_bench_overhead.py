"""`kvflow bench overhead`: the command runs both stacks and writes every figure.

The goals' thresholds are the benchmark's to report; nothing here asserts them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.bench.overhead import percentile

KVFLOW = str(Path(sys.executable).with_name("kvflow"))


def test_percentile_interpolates_between_closest_ranks() -> None:
    assert percentile([5.0], 0.99) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0
    assert percentile([10.0, 20.0], 0.5) == pytest.approx(15.0)
    assert percentile(list(range(101)), 0.99) == pytest.approx(99.0)


@pytest.mark.timeout(300)
def test_quick_run_writes_every_figure_of_the_json_format(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    run = subprocess.run(
        [
            KVFLOW,
            "bench",
            "overhead",
            "--quick",
            "--serial-steps",
            "4",
            "--tasks",
            "3",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env={"COLUMNS": "160", "PATH": str(Path(sys.executable).parent)},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "kvflow step vs plain Temporal activity" in run.stdout
    assert run.stdout.count("goal:") == 4
    figures = json.loads(out.read_text())
    expected = {
        "bare_activity_ms": {"p50", "p99"},
        "kvflow_step_ms": {"p50", "p99"},
        "history_bytes_per_step": {"bare", "kvflow"},
        "cpu_ms_per_step": {"bare", "kvflow"},
        "concurrent": {"tasks", "bare_steps_per_s", "kvflow_steps_per_s"},
    }
    for key, inner in expected.items():
        assert set(figures[key]) >= inner, key
        for name in inner:
            assert figures[key][name] > 0, (key, name)
    assert figures["concurrent"]["tasks"] == 3
    assert figures["serial_steps"] == 4
    assert len(figures["goals"]) == 4
    assert all(isinstance(goal["met"], bool) for goal in figures["goals"])


def test_json_into_a_missing_folder_is_a_usage_error(tmp_path: Path) -> None:
    run = subprocess.run(
        [KVFLOW, "bench", "overhead", "--quick", "--json", str(tmp_path / "no" / "f.json")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "does not exist" in run.stderr

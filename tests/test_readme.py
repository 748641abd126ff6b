"""The README's commands and its example workflow, run as a reader would run them.

Every shell line of the README and of the documentation site's pages (docs/) must appear in
`WALKTHROUGH` or `ELSEWHERE`, or be a benchmark command that tests/test_docs.py parses, so
neither can drift from what is tested. The walkthrough runs each line as written, with only the
substitutions listed beside it (free ports instead of the defaults, a temporary ledger and
output files), against a dev server started the README's way.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from kvflow.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def shell_lines(text: str = README) -> list[str]:
    """Every command line of the ```sh blocks of `text`, without trailing comments."""
    lines: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            command = re.sub(r"\s+#.*$", "", line).strip()
            if command:
                lines.append(command)
    return lines


ELSEWHERE = {
    "make demo": "tests/test_demo.py runs `kvflow demo`, which is all `make demo` adds to setup",
    "make test": "the CI job itself",
    "make lint": "part of `make test`",
    "make bench": "tests/test_scheduler_compiled.py runs `make compiled`, and the benchmark "
    "tests run `kvflow bench` against that build; `make bench` runs the two benchmark lines",
    "make chaos": "the fault suite itself (tests/chaos); .ci/run runs it after `make test`",
    ".venv/bin/python scripts/record_histories.py": "writes tests/data/histories, which "
    "tests/chaos/test_replay.py replays; run on purpose, when recorded behaviour must change",
}


class Process:
    """A README command started in the background, stopped with Ctrl-C."""

    def __init__(self, command: str, env: dict[str, str], log: Path) -> None:
        self.command = command
        self.log = log
        self.popen = subprocess.Popen(
            shlex.split(command),
            cwd=ROOT,
            env=env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_for(self, text: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if text in self.log.read_text():
                return
            if self.popen.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"`{self.command}` never printed {text!r}:\n{self.log.read_text()}")

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        return self.popen.returncode


def run(command: str, env: dict[str, str], timeout_s: float = 300) -> str:
    done = subprocess.run(
        shlex.split(command),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, (
        f"`{command}` exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    )
    assert "Traceback" not in done.stdout + done.stderr
    return done.stdout


@pytest.fixture
def walkthrough_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    yield {
        **os.environ,
        "COLUMNS": "200",
        "KVFLOW_LEDGER_URL": f"sqlite:///{tmp_path}/ledger.db",
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    }


# Benchmark commands run for minutes: tests/test_docs.py parses each against its command.
BENCHMARKS = (".venv/bin/kvflow bench ", ".venv/bin/python -m kvflow.bench.")


def test_every_readme_command_is_exercised():
    lines = shell_lines()
    assert lines, "the README has no shell commands?"
    missing = [line for line in lines if line not in WALKTHROUGH and line not in ELSEWHERE]
    assert not missing, f"README commands no test runs: {missing}"


def test_every_command_of_the_documentation_pages_is_exercised():
    pages = sorted((ROOT / "docs").rglob("*.md"))
    lines = {
        line: page.relative_to(ROOT)
        for page in pages
        for line in shell_lines(page.read_text(encoding="utf-8"))
    }
    assert ".venv/bin/python article.py" in lines, "the pages lost the README's walkthrough?"
    missing = [
        f"{page}: {line}"
        for line, page in lines.items()
        if line not in WALKTHROUGH and line not in ELSEWHERE and not line.startswith(BENCHMARKS)
    ]
    assert not missing, f"documentation commands no test runs: {missing}"


def test_every_walkthrough_line_is_still_shown_to_a_reader():
    # The walkthrough runs these lines: one that no page shows any more tests nothing a
    # reader runs.
    texts = [README, *(page.read_text(encoding="utf-8") for page in (ROOT / "docs").rglob("*.md"))]
    shown = {line for text in texts for line in shell_lines(text)}
    assert [line for line in WALKTHROUGH if line not in shown] == []


# The README's lines, exactly; the tests below run each (see the substitutions there).
WALKTHROUGH: list[str] = [
    ".venv/bin/kvflow fleet check fleet.toml",
    ".venv/bin/kvflow server --port 7233 --ui-port 8233",
    ".venv/bin/kvflow sim serve --fleet fleet.toml --replica h100/0 --port 8100 --time-scale 10",
    ".venv/bin/kvflow worker gpu --fleet fleet.toml --replica h100/0 --endpoint http://127.0.0.1:8100",
    ".venv/bin/python article.py",
    ".venv/bin/kvflow worker workflow --fleet fleet.toml --endpoint h100/0=http://127.0.0.1:8100",
    ".venv/bin/python -m samples.research_assistant.starter --address 127.0.0.1:7233 --tenant acme",
    "export KVFLOW_LEDGER_URL=postgresql://kvflow@db.internal:5432/kvflow",
    ".venv/bin/kvflow worker gpu --fleet fleet.toml --replica h100/0",
    ".venv/bin/kvflow worker workflow --fleet fleet.toml --module samples.research_assistant",
    ".venv/bin/kvflow ledger migrate",
    ".venv/bin/kvflow report",
    ".venv/bin/kvflow report --group-by tenant,day --since 2026-11-01 --until 2026-11-30",
    ".venv/bin/kvflow report --group-by pool --tenant acme --format json",
    ".venv/bin/kvflow report --format html --output report.html",
    ".venv/bin/kvflow ledger reconcile --address 127.0.0.1:7233 --namespace default",
    ".venv/bin/kvflow bench scheduler --json scheduler-latency.json",
    ".venv/bin/kvflow sim bench --json sim-bench.json",
]


def _line(prefix: str) -> str:
    """The README line that is `prefix`, or else the only one that starts with it."""
    if prefix in WALKTHROUGH:
        return prefix
    matches = [line for line in WALKTHROUGH if line.startswith(prefix)]
    assert len(matches) == 1, (prefix, matches)
    return matches[0]


def _sub(command: str, replacements: dict[str, str]) -> str:
    for old, new in replacements.items():
        assert old in command, f"{old!r} not in {command!r}"
        command = command.replace(old, new)
    return command


def test_readme_walkthrough_runs_a_sample_end_to_end(
    walkthrough_env: dict[str, str], tmp_path: Path
):
    env = walkthrough_env
    grpc, ui, sim = free_port(), free_port(), free_port()
    ports = {"--port 7233": f"--port {grpc}", "--ui-port 8233": f"--ui-port {ui}"}
    at = {"127.0.0.1:7233": f"127.0.0.1:{grpc}"}
    env["TEMPORAL_ADDRESS"] = f"127.0.0.1:{grpc}"  # fleet.toml says 127.0.0.1:7233

    assert "is valid" in run(_line(".venv/bin/kvflow fleet check"), env)
    started: list[Process] = []
    try:
        server = Process(
            _sub(_line(".venv/bin/kvflow server"), ports) + f" --state-dir {tmp_path}/temporal",
            env,
            tmp_path / "server.log",
        )
        started.append(server)
        server.wait_for("Web UI")
        simulator = Process(
            _sub(_line(".venv/bin/kvflow sim serve"), {"--port 8100": f"--port {sim}"}),
            env,
            tmp_path / "sim.log",
        )
        started.append(simulator)
        for _ in range(200):
            try:
                if httpx.get(f"http://127.0.0.1:{sim}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        gpu = Process(
            _sub(
                _line(".venv/bin/kvflow worker gpu --fleet fleet.toml --replica h100/0 --endpoint"),
                {"127.0.0.1:8100": f"127.0.0.1:{sim}"},
            ),
            env,
            tmp_path / "gpu.log",
        )
        started.append(gpu)
        gpu.wait_for("polls kvflow.gpu.h100.0")
        # The README's program, saved as the README says, run as it says.
        [program] = re.findall(
            r"Save this as `article.py`:\n\n(?:<!--.*?-->\n)?```python\n(.*?)```", README, re.S
        )
        article = tmp_path / "article.py"
        article.write_text(_sub(program, {"127.0.0.1:8100": f"127.0.0.1:{sim}"}))
        written = run(_sub(_line(".venv/bin/python article.py"), {"article.py": str(article)}), env)
        assert written.strip()
        workflows = Process(
            _sub(
                _line(".venv/bin/kvflow worker workflow --fleet fleet.toml --endpoint"),
                {"127.0.0.1:8100": f"127.0.0.1:{sim}"},
            ),
            env,
            tmp_path / "workflow.log",
        )
        started.append(workflows)
        workflows.wait_for("workflow worker on kvflow.workflows")
        answer = run(_sub(_line(".venv/bin/python -m samples.research_assistant"), at), env)
        assert answer.strip()

        # The report commands, on the ledger the workers just wrote.
        run(_line(".venv/bin/kvflow ledger migrate"), env)
        by_type = run(".venv/bin/kvflow report", env)
        assert "ResearchAssistant" in by_type and "WriteArticle" in by_type
        # The README's example range is a fixed month; the walkthrough asks for the UTC day
        # its task closed on (read from the ledger), so it holds on any date.
        [closed] = json.loads(run(".venv/bin/kvflow report --group-by day --format json", env))[
            "rows"
        ]
        by_day = _sub(
            _line(".venv/bin/kvflow report --group-by tenant,day"),
            {"2026-11-01": closed["day"], "2026-11-30": closed["day"]},
        )
        assert "acme" in run(by_day, env)
        rows = json.loads(run(_line(".venv/bin/kvflow report --group-by pool"), env))["rows"]
        assert [row["pool"] for row in rows] == ["h100"]
        run(
            _sub(
                _line(".venv/bin/kvflow report --format html"),
                {"report.html": str(tmp_path / "report.html")},
            ),
            env,
        )
        assert "<svg" in (tmp_path / "report.html").read_text()
        run(_sub(_line(".venv/bin/kvflow ledger reconcile"), at), env)

        # The production lines: a fleet whose h100 pool lists its vLLM servers, and the
        # ledger URL exported (here a SQLite file stands in for the PostgreSQL server).
        fleet = (
            (ROOT / "fleet.toml")
            .read_text()
            .replace(
                'name = "h100"\ngpu = "H100"\nreplicas = 2\n',
                f'name = "h100"\ngpu = "H100"\nreplicas = 2\n'
                f'endpoints = ["http://127.0.0.1:{sim}", "http://127.0.0.1:{sim}"]\n',
            )
        )
        (tmp_path / "fleet.toml").write_text(fleet)
        export = _line("export KVFLOW_LEDGER_URL=")
        assert export.startswith("export KVFLOW_LEDGER_URL=postgresql://")
        production = Process(
            _sub(
                _line(".venv/bin/kvflow worker gpu --fleet fleet.toml --replica h100/0"),
                {"fleet.toml": str(tmp_path / "fleet.toml")},
            ).replace("h100/0", "h100/1"),
            env,
            tmp_path / "gpu-production.log",
        )
        started.append(production)
        production.wait_for("polls kvflow.gpu.h100.1")
        module_worker = Process(
            _sub(
                _line(".venv/bin/kvflow worker workflow --fleet fleet.toml --module"),
                {"fleet.toml": str(tmp_path / "fleet.toml")},
            )
            + " --task-queue other",
            env,
            tmp_path / "workflow-module.log",
        )
        started.append(module_worker)
        # It says which scheduler build it runs: this environment runs the source.
        module_worker.wait_for("workflow worker on other: ResearchAssistant (scheduler uncompiled)")
    finally:
        codes = [p.stop() for p in reversed(started)]
    assert all(code == 0 for code in codes), codes


def test_readme_benchmark_commands_print_figures_and_write_json(
    walkthrough_env: dict[str, str], tmp_path: Path
):
    scheduler_json = tmp_path / "scheduler-latency.json"
    run(
        # The README's line, on two of its sizes: the 256- and 1,024-replica fleets take a
        # minute and run the same code.
        _sub(
            _line(".venv/bin/kvflow bench scheduler"),
            {"scheduler-latency.json": str(scheduler_json)},
        )
        + " --sizes 16,64 --decisions 300",
        walkthrough_env,
        timeout_s=600,
    )
    assert "64" in json.loads(scheduler_json.read_text())["decision_latency_us"]
    sim_json = tmp_path / "sim-bench.json"
    run(
        _sub(_line(".venv/bin/kvflow sim bench"), {"sim-bench.json": str(sim_json)}),
        walkthrough_env,
        timeout_s=600,
    )
    assert sim_json.read_text().strip().startswith("{")

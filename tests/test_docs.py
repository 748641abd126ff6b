"""The documentation site's pages, run as a reader would run them.

A page marks a program to run with a file name on its fence, ```python title="NAME.py"```:
each one is saved under that name and run against the local stack its page starts (the sh
block of "Your own agent"), as tests/test_readme.py runs the README's program. A block
without a title is a fragment and is not run. The benchmark commands a page shows run for
minutes, so each is parsed by the command it names, flags and values, without running it.
The API page must document every public name. `make docs` builds the site with --strict.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from typer.core import TyperGroup
from typer.main import get_command

from kvflow.ports import free_port
from tests.test_readme import Process, run, shell_lines

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
STACK_PAGE = DOCS / "developers" / "your-agent.md"
"""The page whose sh block starts the stack every runnable program of the site runs on."""

PROGRAM = re.compile(r'```python title="([\w.-]+\.py)"\n(.*?)```', re.S)
BENCH_PREFIXES = (".venv/bin/kvflow bench ", ".venv/bin/python -m kvflow.bench.")


def programs() -> list[tuple[str, str, str]]:
    """(page, file name, source) of every program a page marks as runnable."""
    found = []
    for page in PAGES:
        for name, source in PROGRAM.findall(page.read_text(encoding="utf-8")):
            found.append((str(page.relative_to(ROOT)), name, source))
    return found


def benchmark_commands() -> list[str]:
    """Every benchmark command line of the pages' sh blocks."""
    return [
        line
        for page in PAGES
        for line in shell_lines(page.read_text(encoding="utf-8"))
        if line.startswith(BENCH_PREFIXES)
    ]


def test_the_pages_mark_programs_to_run():
    # The step API's saga program at least; a page that loses its title stops being run.
    assert ("docs/developers/your-agent.md", "trip.py") in [(p, n) for p, n, _ in programs()]


def test_every_public_name_has_its_entry_on_the_api_page():
    import kvflow

    page = (DOCS / "reference" / "api.md").read_text(encoding="utf-8")
    entries = dict(
        re.findall(r"^::: ([\w.]+)\n    options:\n      heading: kvflow\.(\w+)$", page, re.M)
    )
    documented = {heading: path for path, heading in entries.items()}
    assert sorted(documented) == sorted(kvflow.__all__)
    for name, path in documented.items():
        module, _, attribute = path.rpartition(".")
        # The entry documents the object `kvflow.NAME` is, from the module that defines it.
        assert attribute == name and getattr(importlib.import_module(module), name) is getattr(
            kvflow, name
        ), f"{path} is not kvflow.{name}"


def _command(words: list[str]) -> tuple[Any, list[str]]:
    """The command a benchmark line names (typer's), and the arguments it passes it."""
    if words[0] == ".venv/bin/kvflow":
        from kvflow.cli.main import app

        command = get_command(app)
        words = words[1:]
        while isinstance(command, TyperGroup):
            name, *words = words
            sub = command.get_command(command.make_context("kvflow", [name]), name)
            assert sub is not None, f"kvflow has no command {name!r}"
            command = sub
        return command, words
    assert words[:2] == [".venv/bin/python", "-m"], words
    single = typer.Typer()
    single.command()(importlib.import_module(words[2]).main)
    return get_command(single), words[3:]


def test_every_benchmark_command_on_the_pages_parses_with_known_names():
    from kvflow.simulator.policies import ALL_POLICIES
    from kvflow.simulator.policies.base import MECHANISMS
    from kvflow.simulator.policies.kvflow_scheduler import LEVERS
    from kvflow.simulator.workloads import WORKLOADS

    lines = benchmark_commands()
    assert len(lines) >= 10, lines
    for line in lines:
        command, args = _command(shlex.split(line))
        try:
            params = command.make_context(command.name or "bench", args).params
        except typer.TyperException as error:
            raise AssertionError(f"`{line}`: {error}") from None
        if params.get("workload") is not None:
            assert params["workload"] in WORKLOADS, line
        for key in ("policies", "sweep_policies", "policy", "anchor"):
            for policy in filter(None, (params.get(key) or "").split(",")):
                assert policy in ALL_POLICIES, f"`{line}`: no policy {policy!r}"
        for mechanism in filter(None, (params.get("mechanisms") or "").split(",")):
            assert mechanism in (*MECHANISMS, "none"), f"`{line}`: no mechanism {mechanism!r}"
        for lever in filter(None, (params.get("levers") or "").split(",")):
            assert lever.split("=")[0] in LEVERS, f"`{line}`: no lever {lever!r}"


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[dict[str, str], int]]:
    """The stack of "Your own agent" on free ports: its environment and the simulator's port."""
    grpc, ui, sim = free_port(), free_port(), free_port()
    env = {
        **os.environ,
        "COLUMNS": "200",
        "KVFLOW_LEDGER_URL": f"sqlite:///{tmp_path}/ledger.db",
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        "TEMPORAL_ADDRESS": f"127.0.0.1:{grpc}",  # fleet.toml says 127.0.0.1:7233
    }
    # The page's first sh block: three terminals, then the program.
    first = re.search(r"```sh\n.*?```", STACK_PAGE.read_text(encoding="utf-8"), re.S)
    assert first is not None
    server, simulator, gpu, _program = shell_lines(first.group(0))
    started: list[Process] = []
    try:
        command = server.replace("--port 7233", f"--port {grpc}")
        command = command.replace("--ui-port 8233", f"--ui-port {ui}")
        started.append(
            Process(f"{command} --state-dir {tmp_path}/temporal", env, tmp_path / "server.log")
        )
        started[-1].wait_for("Web UI")
        command = simulator.replace("--port 8100", f"--port {sim}")
        started.append(Process(command, env, tmp_path / "sim.log"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{sim}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        command = gpu.replace("127.0.0.1:8100", f"127.0.0.1:{sim}")
        started.append(Process(command, env, tmp_path / "gpu.log"))
        started[-1].wait_for("polls kvflow.gpu.h100.0")
        yield env, sim
    finally:
        codes = [process.stop() for process in reversed(started)]
    assert all(code == 0 for code in codes), codes


@pytest.mark.timeout(300)
def test_every_program_the_pages_mark_runs_and_bills_its_task(
    stack: tuple[dict[str, str], int], tmp_path: Path
):
    env, sim = stack
    workflow_types = []
    for page, name, source in programs():
        assert "http://127.0.0.1:8100" in source, f"{page}: {name} runs on the page's stack"
        program = tmp_path / name
        program.write_text(source.replace("127.0.0.1:8100", f"127.0.0.1:{sim}"))
        printed = run(f".venv/bin/python {program}", env)
        assert printed.strip(), f"{page}: {name} printed nothing"
        workflow_types += re.findall(r"@workflow\.defn\nclass (\w+)", source)
    # Each program's task is in the report, as the page says `kvflow report` shows it.
    rows = json.loads(run(".venv/bin/kvflow report --format json", env))["rows"]
    assert {row["workflow_type"] for row in rows} == set(workflow_types)
    assert all(row["succeeded"] == 1 for row in rows), rows

"""No process the test run started outlives it: a run that leaves one fails, naming it.

At the end of the session, every process still running below this one (a simulator, a
Temporal or vLLM server, a CLI) is listed, stopped, and named in the summary, and the run
exits non-zero. With xdist each worker checks its own processes and hands the list to the
controller, which fails the run. On Linux this process is also made a child subreaper: a
grandchild whose own parent ended is adopted by it rather than by init, so it is still
found. Off Linux (no /proc) nothing is checked.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

GRACE_S = 10.0
"""How long a process may take to end after its owner stopped it (a SIGTERM handled under
load) before it counts as left behind."""
STOP_S = 5.0
"""How long a leftover gets to end on SIGTERM before SIGKILL."""

_PR_SET_CHILD_SUBREAPER = 36
"""`prctl` option from <linux/prctl.h>: orphaned descendants are re-parented to this process."""
_OUTPUT_KEY = "leftover_processes"
_LEFT: pytest.StashKey[list[str]] = pytest.StashKey()


def process_table() -> dict[int, tuple[int, str]]:
    """pid → (parent pid, state) of every process, from /proc/*/stat."""
    table: dict[int, tuple[int, str]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # ended while we looked
        # The command name in parentheses may hold spaces; the fields after it do not.
        state, ppid = text[text.rindex(")") + 2 :].split()[:2]
        table[int(stat.parent.name)] = (int(ppid), state)
    return table


def descendants(pid: int) -> set[int]:
    """The live processes below `pid`: children, their children, and so on (not zombies)."""
    table = process_table()
    found: set[int] = set()
    parents = {pid}
    while parents:
        # A zombie has ended (it waits to be reaped), but its children may still run.
        below = {child for child, (ppid, _) in table.items() if ppid in parents}
        below -= found
        found |= below
        parents = below
    return {p for p in found if table[p][1] != "Z"}


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "(gone)"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:300]


def _stop(pids: set[int]) -> None:
    """SIGTERM, then SIGKILL to what still runs after `STOP_S`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + STOP_S
        while (pids := pids & descendants(os.getpid())) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not pids:
            return


def left_running(grace_s: float = GRACE_S) -> dict[int, str]:
    """The processes below this one still running after `grace_s`: pid → command line."""
    deadline = time.monotonic() + grace_s
    while (left := descendants(os.getpid())) and time.monotonic() < deadline:
        time.sleep(0.1)
    return {pid: _cmdline(pid) for pid in sorted(left)}


def _is_xdist_controller(config: pytest.Config) -> bool:
    return config.pluginmanager.has_plugin("dsession")


def pytest_configure(config: pytest.Config) -> None:
    """Adopt orphaned descendants (Linux), so that the end-of-run check still sees them."""
    config.stash[_LEFT] = []
    if sys.platform != "linux" or _is_xdist_controller(config):
        return
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """List, stop and report what this process's tests left running; fail the run if any."""
    config = session.config
    found = config.stash[_LEFT]
    if sys.platform == "linux" and not _is_xdist_controller(config):
        left = left_running()
        if left:
            _stop(set(left))
            found += [f"pid {pid}: {command}" for pid, command in left.items()]
    workeroutput: dict[str, Any] | None = getattr(config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput[_OUTPUT_KEY] = list(found)  # the controller reports and fails the run
    elif found and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object | None) -> None:
    """xdist controller: collect what a worker found left running."""
    found = getattr(node, "workeroutput", {}).get(_OUTPUT_KEY) or []
    node.config.stash[_LEFT] += [f"{line} (worker {node.gateway.id})" for line in found]


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """Name every process the run left running (it was stopped since)."""
    found = config.stash.get(_LEFT, [])
    if not found:
        return
    terminalreporter.section("processes the tests left running", sep="=", red=True, bold=True)
    terminalreporter.line(
        f"{len(found)} process(es) started by the tests were still running after the last "
        "test: their owners did not stop them (stopped now). The run fails."
    )
    for line in found:
        terminalreporter.line(f"  {line}", red=True)

"""`kvflow server` and `kvflow demo` as a user runs them: real processes, real ports.

Both must leave nothing behind however they end: Ctrl-C, SIGTERM, even SIGKILL.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import httpx
import pytest

from kvflow.ports import free_port, port_is_free
from tests.leftover_processes import descendants, process_table

KVFLOW = Path(sys.executable).parent / "kvflow"
ROOT = Path(__file__).resolve().parent.parent


def _read_until(process: subprocess.Popen[str], marker: str, timeout_s: float = 60) -> str:
    assert process.stdout is not None
    seen = ""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            break
        seen += line
        if marker in line:
            return seen
    raise AssertionError(f"{marker!r} never printed; output so far:\n{seen}")


def _start_server(port: int, ui_port: int, state_dir: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            str(KVFLOW),
            "server",
            "--port",
            str(port),
            "--ui-port",
            str(ui_port),
            "--state-dir",
            str(state_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _time_wait_on(port: int) -> bool:
    """Whether a TCP socket on local `port` is in TIME_WAIT (state 06 of /proc/net/tcp)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "06":
            return True
    return False


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    entry = process_table().get(pid)
    return entry is not None and entry[1] != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "(gone)"


def _wait_for(condition: Callable[[], bool], timeout_s: float = 60) -> bool:
    """Poll `condition` until it holds or `timeout_s` passes; whether it held."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _assert_all_exit(pids: Iterable[int], what: str) -> None:
    """Wait for every pid to end; kill and name the ones that did not."""
    pids = set(pids)
    if _wait_for(lambda: not any(_alive(p) for p in pids)):
        return
    left = {p: _cmdline(p) for p in pids if _alive(p)}
    for pid in left:
        os.kill(pid, signal.SIGKILL)  # they are this test's own grandchildren
    raise AssertionError(f"{what} left these processes running: {left}")


def test_server_prints_the_ui_address_serves_it_and_stops_on_ctrl_c(tmp_path: Path):
    port, ui_port = free_port(), free_port()
    process = _start_server(port, ui_port, tmp_path)
    try:
        output = _read_until(process, "Web UI")
        assert f"http://127.0.0.1:{ui_port}" in output
        assert (
            httpx.get(f"http://127.0.0.1:{ui_port}/namespaces/default/workflows").status_code == 200
        )
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert (tmp_path / "temporal.db").exists()
    # The dev server went with it: both ports can be bound again.
    assert port_is_free(port) and port_is_free(ui_port)


def test_server_on_a_taken_port_says_so_and_names_the_flag(tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                str(KVFLOW),
                "server",
                "--port",
                str(port),
                "--ui-port",
                str(free_port()),
                "--state-dir",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    assert f"port {port}" in done.stderr and "--port" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="reads TCP states from /proc/net/tcp")
@pytest.mark.timeout(180)
def test_server_restarts_at_once_on_a_port_its_clients_left_in_time_wait(tmp_path: Path):
    port, ui_port = free_port(), free_port()
    first = _start_server(port, ui_port, tmp_path)
    try:
        _read_until(first, "Web UI")
        # A worker's connection: the server closes it when it stops, which leaves the server's
        # side in TIME_WAIT on `port` for a minute.
        worker = socket.create_connection(("127.0.0.1", port))
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=30) == 0
        worker.settimeout(10)
        while worker.recv(4096):  # drain until the server's FIN
            pass
        worker.close()
    finally:
        if first.poll() is None:
            first.kill()
    assert _time_wait_on(port), "stopping the server left no TIME_WAIT socket on its port"
    second = _start_server(port, ui_port, tmp_path)
    try:
        output = _read_until(second, "Web UI")
        assert "already in use" not in output
        second.send_signal(signal.SIGINT)
        assert second.wait(timeout=30) == 0
    finally:
        if second.poll() is None:
            second.kill()


@pytest.mark.skipif(sys.platform != "linux", reason="parent-death signals are Linux's")
@pytest.mark.timeout(180)
def test_server_killed_with_sigkill_takes_the_temporal_server_with_it(tmp_path: Path):
    port, ui_port = free_port(), free_port()
    process = _start_server(port, ui_port, tmp_path)
    try:
        _read_until(process, "Web UI")
        children = descendants(process.pid)
        assert any("temporal" in _cmdline(p) for p in children), children
        process.kill()
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    _assert_all_exit(children, "kvflow server killed with SIGKILL")
    assert _wait_for(lambda: port_is_free(port) and port_is_free(ui_port)), (
        "the Temporal ports were not freed after kvflow server was killed"
    )


def _start_demo(
    port: int, ui_port: int, state_dir: Path, *, in_background: bool = False
) -> tuple[subprocess.Popen[str], int, str]:
    """`kvflow demo --keep-running` with one task, up to "The stack stays up".

    With `in_background` it runs as `sh -c 'kvflow demo ... &'` starts it: a non-interactive
    shell starts a background job with SIGINT ignored. Returns the process whose output to
    read (kvflow, or the shell), kvflow's pid, and what it printed up to there.
    """
    command = [
        str(KVFLOW),
        "demo",
        "--tasks",
        "1",
        "--keep-running",
        "--port",
        str(port),
        "--ui-port",
        str(ui_port),
        "--state-dir",
        str(state_dir),
    ]
    if in_background:
        command = ["/bin/sh", "-c", '"$@" & echo "kvflow pid $!"; wait $!', "sh", *command]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    pid = process.pid
    try:
        if in_background:
            seen = _read_until(process, "kvflow pid")
            pid = int(seen.rsplit("kvflow pid", 1)[1].split()[0])
        seen = _read_until(process, "The stack stays up", timeout_s=240)
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        process.kill()
        raise
    return process, pid, seen


def _simulators_and_temporal(pid: int) -> set[int]:
    """The demo's child processes; asserts that there are simulators and a Temporal server."""
    children = descendants(pid)
    commands = [_cmdline(p) for p in children]
    assert any("kvflow.cli.sim" in c for c in commands), commands
    assert any("temporal" in c for c in commands), commands
    return children


@pytest.mark.skipif(sys.platform != "linux", reason="parent-death signals are Linux's")
@pytest.mark.timeout(360)
def test_demo_killed_with_sigkill_takes_its_simulators_and_temporal_with_it(tmp_path: Path):
    port, ui_port = free_port(), free_port()
    process, pid, _ = _start_demo(port, ui_port, tmp_path)
    children = _simulators_and_temporal(pid)
    process.kill()
    process.wait(timeout=30)
    _assert_all_exit(children, "kvflow demo killed with SIGKILL")
    assert _wait_for(lambda: port_is_free(port) and port_is_free(ui_port)), (
        "the Temporal ports were not freed after kvflow demo was killed"
    )


@pytest.mark.skipif(sys.platform != "linux", reason="reads processes from /proc")
@pytest.mark.timeout(360)
def test_demo_in_a_shells_background_stops_in_order_on_sigterm(tmp_path: Path):
    port, ui_port = free_port(), free_port()
    shell, pid, shown = _start_demo(port, ui_port, tmp_path, in_background=True)
    children = _simulators_and_temporal(pid)
    # The stack stays up: each simulated replica's URL is printed, and it answers there.
    urls = re.findall(r"^\s+(\S+/\d+)\s+(http://127\.0\.0\.1:\d+)$", shown, re.M)
    assert {name for name, _ in urls} == {"h200/0", "h200/1", "h100/0", "h100/1", "l4/0", "l4/1"}
    for name, url in urls:
        if name != "h200/1":  # the demo's crash fault may have ended that one
            assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 200, name
    try:
        os.kill(pid, signal.SIGTERM)
        try:
            code = shell.wait(timeout=120)
        except subprocess.TimeoutExpired:
            raise AssertionError("kvflow demo still ran 120 s after its SIGTERM") from None
        # The shell's `wait $!` returns kvflow's exit status: 0 for a stop on request.
        assert code == 0, f"kvflow demo exited {code} on SIGTERM, not 0"
        assert shell.stdout is not None
        rest = shell.stdout.read()
        assert "Embedded stack stopped." in rest, rest
        assert "Traceback" not in rest, rest
    finally:
        if shell.poll() is None:
            os.kill(pid, signal.SIGKILL)
            shell.kill()
    # It stopped them itself: nothing is left, not even for the parent-death signal to end.
    assert not any(_alive(p) for p in children), {p: _cmdline(p) for p in children}
    assert port_is_free(port) and port_is_free(ui_port)

"""`kvflow server` and `kvflow demo` as a user runs them: real processes, real ports."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvflow.workers.devserver import free_port, port_is_free

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


def test_server_prints_the_ui_address_serves_it_and_stops_on_ctrl_c(tmp_path: Path):
    port, ui_port = free_port(), free_port()
    process = subprocess.Popen(
        [
            str(KVFLOW),
            "server",
            "--port",
            str(port),
            "--ui-port",
            str(ui_port),
            "--state-dir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
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

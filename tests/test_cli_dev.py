"""`kvflow dev` as a newcomer runs it: `kvflow init`, `kvflow dev`, then their own program.

The program is the starter `kvflow init` wrote, unmodified: it finds the simulated replicas
through the endpoints file `kvflow dev` writes, with no `endpoints=` of its own.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from temporalio import activity
from temporalio.client import Client
from temporalio.worker import Worker

from kvflow import KvflowPlugin, load_fleet
from kvflow.ports import free_port, port_is_free
from kvflow.workers.config import EXAMPLE_FLEET
from kvflow.workers.dev_endpoints import ENDPOINTS_FILE_ENV, write_endpoints_file
from tests.leftover_processes import descendants
from tests.test_cli_server import _assert_all_exit, _read_until, _wait_for

KVFLOW = Path(sys.executable).parent / "kvflow"
READY = "Ctrl-C stops everything kvflow dev started."


@pytest.mark.skipif(sys.platform != "linux", reason="reads processes from /proc")
@pytest.mark.timeout(600)
def test_dev_runs_the_starter_init_wrote_and_ctrl_c_leaves_no_process(tmp_path: Path):
    env = {
        k: v for k, v in os.environ.items() if k not in ("KVFLOW_LEDGER_URL", ENDPOINTS_FILE_ENV)
    }
    env["COLUMNS"] = "200"
    init = subprocess.run(
        [str(KVFLOW), "init"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert init.returncode == 0, init.stdout + init.stderr
    port, ui_port = free_port(), free_port()
    dev = subprocess.Popen(
        [str(KVFLOW), "dev", "--port", str(port), "--ui-port", str(ui_port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        banner = _read_until(dev, READY, timeout_s=240)
        # What to paste is printed, and the replicas' URLs are where the plugin looks.
        assert f"export TEMPORAL_ADDRESS=127.0.0.1:{port}" in banner
        assert f"http://127.0.0.1:{ui_port}" in banner
        assert "h200/0" in banner and "l4/1" in banner
        assert (tmp_path / ".kvflow" / "dev.toml").is_file()
        children = descendants(dev.pid)
        starter = subprocess.run(
            [sys.executable, "starter.py"],
            cwd=tmp_path,
            env=env | {"TEMPORAL_ADDRESS": f"127.0.0.1:{port}"},
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert starter.returncode == 0, starter.stdout + starter.stderr
        assert "2 steps, $0." in starter.stdout, starter.stdout
        dev.send_signal(signal.SIGINT)
        assert dev.wait(timeout=120) == 0
        assert dev.stdout is not None
        rest = dev.stdout.read()
        assert "kvflow dev stopped" in rest and "Traceback" not in rest, rest
    finally:
        if dev.poll() is None:
            dev.kill()
            dev.wait()
    # Temporal, the simulators: every process it started has ended, and freed its port.
    _assert_all_exit(children, "kvflow dev stopped with Ctrl-C")
    assert _wait_for(lambda: port_is_free(port) and port_is_free(ui_port))
    # A stopped stack leaves no endpoints file that would send a plugin to dead replicas.
    assert not (tmp_path / ".kvflow" / "dev.toml").exists()


@activity.defn
async def idle() -> None:
    """An activity for a worker that is never meant to start."""


def _worker_plugin(tmp_path: Path) -> KvflowPlugin:
    return KvflowPlugin(
        load_fleet(EXAMPLE_FLEET),
        ledger=f"sqlite:///{tmp_path / 'ledger.db'}",
        context_dir=tmp_path / "context",
    )


@pytest.mark.timeout(60)
async def test_worker_without_replica_urls_refuses_to_start_naming_endpoints_and_kvflow_dev(
    temporal_client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(tmp_path)  # no .kvflow/dev.toml here
    monkeypatch.delenv(ENDPOINTS_FILE_ENV, raising=False)
    plugin = _worker_plugin(tmp_path)
    with pytest.raises(ValueError) as refused:
        Worker(temporal_client, task_queue="no-urls", activities=[idle], plugins=[plugin])
    message = str(refused.value)
    assert "endpoints=" in message and "kvflow dev" in message
    assert "h200/0" in message


@pytest.mark.timeout(60)
async def test_worker_refuses_an_endpoints_file_whose_kvflow_dev_has_stopped(
    temporal_client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # A process that has ended: the pid of a `kvflow dev` that was killed.
    gone = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await gone.wait()
    path = tmp_path / "dev.toml"
    fleet = load_fleet(EXAMPLE_FLEET)
    urls = {n: f"http://127.0.0.1:{free_port()}" for p in fleet.pools for n in p.replica_names()}
    write_endpoints_file(path, urls, temporal_address="127.0.0.1:1", ui_url=None, pid=gone.pid)
    monkeypatch.setenv(ENDPOINTS_FILE_ENV, str(path))
    plugin = _worker_plugin(tmp_path)
    with pytest.raises(ValueError) as refused:
        Worker(temporal_client, task_queue="stale-urls", activities=[idle], plugins=[plugin])
    message = str(refused.value)
    assert str(path) in message and "no longer runs" in message and "kvflow dev" in message


@pytest.mark.timeout(60)
async def test_a_partial_endpoints_list_starts_the_worker_and_names_the_replicas_left_down(
    temporal_client: Client,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
):
    # One simulator started by hand, as the README's program does: a choice, not a mistake.
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(ENDPOINTS_FILE_ENV, raising=False)
    plugin = KvflowPlugin(
        load_fleet(EXAMPLE_FLEET),
        endpoints={"h100/0": f"http://127.0.0.1:{free_port()}"},
        ledger=f"sqlite:///{tmp_path / 'ledger.db'}",
        context_dir=tmp_path / "context",
    )
    with caplog.at_level("WARNING", logger="kvflow.workers.plugin"):
        Worker(temporal_client, task_queue="one-url", activities=[idle], plugins=[plugin])
    [warning] = [r.getMessage() for r in caplog.records if "no vLLM URL" in r.getMessage()]
    assert "h200/0" in warning and "h100/0," not in warning


@pytest.mark.timeout(60)
def test_dev_refuses_to_start_where_another_kvflow_dev_serves(tmp_path: Path):
    # This test's own process stands for the running one: it is alive.
    write_endpoints_file(
        tmp_path / ".kvflow" / "dev.toml",
        {},
        temporal_address="127.0.0.1:1",
        ui_url=None,
        pid=os.getpid(),
    )
    done = subprocess.run(
        [str(KVFLOW), "dev", "--port", str(free_port()), "--ui-port", str(free_port())],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert done.returncode == 2, done.stdout + done.stderr
    message = " ".join(done.stderr.split())
    assert f"another `kvflow dev` (pid {os.getpid()}) serves this directory" in message
    assert "Traceback" not in done.stderr

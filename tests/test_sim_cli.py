"""`kvflow sim serve` and `kvflow sim bench` as a user runs them."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from kvflow.cli.main import app
from kvflow.ports import port_is_free
from kvflow.simulator import SimProcess
from kvflow.simulator.faults import CRASH_EXIT_CODE

ROOT = Path(__file__).resolve().parent.parent
FLEET = ROOT / "fleet.toml"
runner = CliRunner()


def test_serve_from_a_fleet_replica_serves_its_pools_models(tmp_path: Path) -> None:
    args = ["--fleet", str(FLEET), "--replica", "h100/1", "--time-scale", "20"]
    with SimProcess(args, log_path=tmp_path / "sim.log") as sim:
        models = httpx.get(f"{sim.base_url}/v1/models", timeout=10).json()
        metrics = httpx.get(f"{sim.base_url}/metrics", timeout=10).text
    assert {m["id"] for m in models["data"]} == {"llama-3.1-8b", "llama-3.2-1b"}
    assert 'block_size="16"' in metrics


def test_crash_fault_ends_the_process_mid_stream(tmp_path: Path) -> None:
    args = ["--model", "llama-3.2-1b", "--time-scale", "20", "--fault-crash-after", "3"]
    sim = SimProcess(args, log_path=tmp_path / "sim.log").start()
    try:
        body = {"prompt": "go", "max_tokens": 50, "ignore_eos": True, "stream": True}
        received: list[str] = []
        with (
            pytest.raises(httpx.TransportError),
            httpx.stream("POST", f"{sim.base_url}/v1/completions", json=body, timeout=10) as r,
        ):
            received.extend(line for line in r.iter_lines() if line.startswith("data: {"))
        assert len(received) == 3
        assert sim.wait(timeout=10) == CRASH_EXIT_CODE
    finally:
        sim.stop()


def test_bench_prints_requests_per_minute_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = runner.invoke(
        app, ["sim", "bench", "--replicas", "4", "--tasks", "40", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "requests per wall minute" in result.output
    figures = json.loads(out.read_text())
    assert figures["replicas"] == 4
    assert figures["requests"] > 40
    assert figures["requests_per_wall_minute"] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "no-such-model"], "unknown model no-such-model"),
        (["--replica", "h100/0"], "--replica needs --fleet"),
        (["--fleet", str(FLEET), "--replica", "h100/9"], "INDEX from 0 to 1"),
        (["--fleet", str(FLEET), "--replica", "tpu/0"], "no pool 'tpu'"),
        (["--model", "llama-3.1-70b", "--gpu", "L4"], "does not fit on L4"),
        ([], "name a model to serve"),
        (["--model", "llama-3.2-1b", "--fault-error-code", "418"], "error_code"),
    ],
)
def test_bad_serve_options_exit_2_saying_what_to_fix(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["sim", "serve", *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_every_router_the_bench_offers_exists() -> None:
    from kvflow.bench.simulator_speed import ROUTERS
    from kvflow.cli.sim import ROUTER_NAMES

    assert set(ROUTER_NAMES) == set(ROUTERS)


@pytest.mark.timeout(60)
def test_a_port_taken_after_it_was_picked_is_traded_for_another(tmp_path: Path) -> None:
    args = ["--model", "llama-3.2-1b", "--time-scale", "20"]
    sim = SimProcess(args, log_path=tmp_path / "sim.log")
    picked = sim.port
    # Another socket takes the picked port before the simulator binds it, as an outgoing
    # connection's ephemeral port can.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taker:
        taker.bind(("127.0.0.1", picked))
        taker.listen()
        with sim.start():
            assert sim.port != picked
            assert httpx.get(f"{sim.base_url}/health", timeout=10).status_code == 200
        assert "address already in use" in (tmp_path / "sim.log").read_text()
        # A port the caller chose is theirs: taken, it is an error at once, not another port.
        mine = SimProcess(args, port=picked, log_path=tmp_path / "mine.log").spawn()
        with pytest.raises(RuntimeError, match=r"exited with status 1 at start$"):
            mine.wait_ready()


@pytest.mark.timeout(60)
def test_a_started_simulator_entered_with_with_is_the_one_stopped_at_its_end(
    tmp_path: Path,
) -> None:
    args = ["--model", "llama-3.2-1b", "--time-scale", "20"]
    sim = SimProcess(args, log_path=tmp_path / "sim.log").start()
    started, port = sim.process, sim.port
    assert started is not None
    try:
        with sim:
            # Entering takes charge of the running simulator; it starts no second one.
            assert (sim.process, sim.port) == (started, port)
            assert httpx.get(f"{sim.base_url}/health", timeout=10).status_code == 200
        assert started.poll() is not None, "the simulator start() launched is still running"
        assert port_is_free(port)
    finally:
        started.kill()
        sim.stop()


@pytest.mark.timeout(60)
def test_starting_a_running_simulator_again_is_refused_and_starts_no_other(
    tmp_path: Path,
) -> None:
    sim = SimProcess(["--model", "llama-3.2-1b"], log_path=tmp_path / "sim.log").spawn()
    first = sim.process
    assert first is not None
    try:
        with pytest.raises(RuntimeError, match=r"already running on port \d+ .*stop\(\) it"):
            sim.spawn()
        assert sim.process is first
    finally:
        sim.stop()
        for process in (first, sim.process):
            if process is not None and process.poll() is None:
                process.kill()  # where spawning again was not refused: both, whatever they do


@pytest.mark.timeout(60)
def test_a_simulator_stopped_while_it_starts_is_not_started_again_on_another_port(
    tmp_path: Path,
) -> None:
    sim = SimProcess(["--model", "llama-3.2-1b"], log_path=tmp_path / "sim.log").spawn()
    # A stop (the stack closing, Ctrl-C) while another thread waits for the simulator to serve.
    sim.stop()
    try:
        with pytest.raises(RuntimeError, match="was stopped"):
            sim.wait_ready()
        assert sim.returncode is not None
    finally:
        sim.stop()

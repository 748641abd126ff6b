"""`kvflow demo` as a newcomer runs it: a real process, the embedded stack, a small workload."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvflow.ports import free_port, port_is_free
from kvflow.scheduler.fleet import ModelSpec
from kvflow.simulator import SimServer, resolve_models
from kvflow.workers.config import load_fleet
from kvflow.workers.demo import EndpointError, check_endpoints, parse_endpoints
from kvflow.workers.vllm_server import vllm_install
from tests.fixtures_vllm import skip_or_fail

KVFLOW = Path(sys.executable).parent / "kvflow"
ROOT = Path(__file__).resolve().parent.parent


def test_demo_in_an_empty_directory_ends_with_a_report_kvflow_report_repeats(tmp_path: Path):
    # A newcomer's first run: no fleet file, no flags but ports, a directory of their own.
    port, ui_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "KVFLOW_LEDGER_URL"} | {"COLUMNS": "200"}
    done = subprocess.run(
        [
            str(KVFLOW),
            "demo",
            "--tasks",
            "9",
            "--seed",
            "3",
            "--port",
            str(port),
            "--ui-port",
            str(ui_port),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    # The finance report and the placement summary; no link into the UI, which stopped with
    # the demo: where tasks failed, it says how to keep the stack up to look at them.
    assert "Cost per successful task" in out
    assert "Where the model calls ran" in out
    assert f"127.0.0.1:{ui_port}/namespaces" not in out and "?query=" not in out
    assert ("run it with --keep-running" in out) == ("Tasks that did not succeed" in out)
    assert "tasks succeeded" in out
    for tenant in ("acme", "globex", "initech"):
        assert tenant in out
    assert "Traceback" not in out + done.stderr
    assert "(`kvflow report`)" in out
    # `kvflow report` in the same directory reads the demo's ledger; nothing is left running.
    report = subprocess.run(
        [str(KVFLOW), "report", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=env,
    )
    assert report.returncode == 0, report.stderr
    rows = json.loads(report.stdout)["rows"]
    assert sum(row["tasks"] for row in rows) == 9
    assert port_is_free(port) and port_is_free(ui_port)


def run_demo(tmp_path: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`kvflow demo ARGS` on free ports, its state in `tmp_path`."""
    return subprocess.run(
        [
            str(KVFLOW),
            "demo",
            *args,
            "--port",
            str(free_port()),
            "--ui-port",
            str(free_port()),
            "--state-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200"},
    )


def tasks_per_pool(state_dir: Path) -> dict[str, int]:
    """Tasks per pool in the ledger the demo left in `state_dir` (`kvflow report`)."""
    ledger = state_dir / "ledger.db"
    report = subprocess.run(
        [
            str(KVFLOW),
            "report",
            "--db",
            f"sqlite:///{ledger}",
            "--group-by",
            "pool",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert report.returncode == 0, report.stderr
    return {row["pool"]: row["tasks"] for row in json.loads(report.stdout)["rows"]}


def fleet_models() -> list[ModelSpec]:
    """The models of the example fleet.toml (what the demo's samples ask for)."""
    fleet = load_fleet(ROOT / "fleet.toml")
    return resolve_models([m.name for m in fleet.models], fleet.models)


def test_demo_on_running_servers_places_every_call_on_the_vllm_pool(
    tmp_path: Path, sim_server_factory: Callable[..., SimServer]
):
    # Two vLLM-compatible servers that already run, serving the fleet's models.
    servers = [
        sim_server_factory(models=fleet_models(), engine={"max_model_len": None}, seed=i)
        for i in range(2)
    ]
    urls = ",".join(server.base_url for server in servers)
    done = run_demo(tmp_path, "--endpoints", urls, "--tasks", "6", "--seed", "5")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "Traceback" not in out + done.stderr
    assert "Faults: none" in out
    assert "Where the model calls ran" in out
    # One pool, one replica per server, and every task's calls ran there.
    assert "vllm/0" in out and "vllm/1" in out and "h200/0" not in out
    assert tasks_per_pool(tmp_path) == {"vllm": 6}


def tasks_per_workflow_type(state_dir: Path) -> dict[str, tuple[int, int]]:
    """(tasks, succeeded) per workflow type in the demo's ledger (`kvflow report`)."""
    report = subprocess.run(
        [
            str(KVFLOW),
            "report",
            "--db",
            f"sqlite:///{state_dir / 'ledger.db'}",
            "--group-by",
            "workflow_type",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert report.returncode == 0, report.stderr
    rows = json.loads(report.stdout)["rows"]
    return {row["workflow_type"]: (row["tasks"], row["succeeded"]) for row in rows}


def admission_waits(out: str) -> dict[str, int]:
    """The "admission waits" column of the demo's last Tasks table, by tenant."""
    header = [line for line in out.splitlines() if "admission waits" in line][-1]
    names = [cell.strip() for cell in header.split("┃")[1:-1]]
    column = names.index("admission waits")
    rows = [line.split("│")[1:-1] for line in out.splitlines() if line.startswith("│ ")]
    return {
        cells[0].strip(): int(cells[column].strip())
        for cells in rows
        if len(cells) == len(names) and cells[column].strip().isdigit()
    }


@pytest.mark.timeout(400)
def test_demo_shows_tier_5_calls_waiting_for_admission_and_tier_1_never(tmp_path: Path):
    done = run_demo(tmp_path, "--seed", "7")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    waits = admission_waits(done.stdout)
    # tier 1, tier 3, tier 5 (the example fleet.toml's tenants)
    assert set(waits) == {"acme", "globex", "initech"}, waits
    assert waits["initech"] > 0 and waits["acme"] == 0, waits
    assert "Admission: a call waits" in done.stdout and "75%" in done.stdout


def test_demo_mixes_the_agent_framework_samples_into_its_workload(tmp_path: Path):
    done = run_demo(
        tmp_path, "--samples", "openai_agents_travel,pydantic-ai-support", "--tasks", "6"
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr
    # Both frameworks' agents ran on their own workers, placed and billed by kvflow.
    per_type = tasks_per_workflow_type(tmp_path)
    assert set(per_type) == {"TravelAgent", "PydanticAISupport"}, per_type
    assert sum(tasks for tasks, _ in per_type.values()) == 6
    assert all(succeeded > 0 for _, succeeded in per_type.values()), per_type


def test_demo_refuses_a_sample_it_does_not_have_and_names_the_choices(tmp_path: Path):
    done = run_demo(tmp_path, "--samples", "research_assistant,travel", timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    message = " ".join(done.stderr.split())
    assert "no sample 'travel'" in message and "openai_agents_travel" in message
    assert "Traceback" not in done.stdout + done.stderr


def test_demo_on_an_endpoint_that_does_not_answer_names_it_and_exits_2(tmp_path: Path):
    url = f"http://127.0.0.1:{free_port()}"
    done = run_demo(tmp_path, "--endpoints", url, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{url} does not answer" in done.stderr
    assert "--served-model-name llama-3.1-8b" in done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_demo_on_a_server_without_the_samples_model_says_how_to_serve_it(
    tmp_path: Path, sim_server_factory: Callable[..., SimServer]
):
    server = sim_server_factory()  # serves llama-3.2-1b only
    done = run_demo(tmp_path, "--endpoints", server.base_url + "/v1", timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    message = " ".join(done.stderr.split())
    assert f"{server.base_url} serves llama-3.2-1b, not llama-3.1-8b" in message
    assert "--served-model-name llama-3.1-8b llama-3.2-1b" in message
    assert "Traceback" not in done.stdout + done.stderr


def test_demo_refuses_engine_vllm_without_a_model_or_with_endpoints(tmp_path: Path):
    no_model = run_demo(tmp_path, "--engine", "vllm", timeout=60)
    assert no_model.returncode == 2
    assert "--engine vllm needs --model DIR" in no_model.stderr
    both = run_demo(
        tmp_path, "--engine", "vllm", "--model", str(tmp_path), "--endpoints", "http://x:1"
    )
    assert both.returncode == 2
    assert "give one of them" in both.stderr
    assert "Traceback" not in no_model.stderr + both.stderr


@pytest.mark.vllm
def test_demo_with_engine_vllm_runs_tasks_on_a_real_vllm_server_and_stops_it(tmp_path: Path):
    install = vllm_install()
    missing = install.missing()
    if missing is not None:
        skip_or_fail(missing)
    done = run_demo(
        tmp_path,
        "--engine",
        "vllm",
        "--model",
        str(install.model_dir),
        "--replicas",
        "1",
        "--tasks",
        "4",
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "Traceback" not in out + done.stderr
    assert "serving llama-3.1-8b, llama-3.2-1b" in out
    assert "Faults: none" in out
    assert tasks_per_pool(tmp_path) == {"vllm": 4}
    # Its server runs kvflow's engine scheduler, and every task's end reached it.
    assert "kvflow_vllm.scheduler.TaskEndScheduler" in (tmp_path / "vllm-0.log").read_text()
    assert "task-end releases: 4 sent, 0 failed" in (tmp_path / "demo.log").read_text()
    # The server it started is gone: its port is free again.
    ready = re.search(r"vLLM servers ready at http://127\.0\.0\.1:(\d+)", out)
    assert ready is not None, out[:2000]
    assert port_is_free(int(ready.group(1)))


@pytest.mark.timeout(30)
def test_endpoint_errors_name_the_server_without_its_password() -> None:
    port = free_port()
    secret = "S3cr%t!pw"
    with pytest.raises(EndpointError) as unreachable:
        check_endpoints([f"http://ops:{secret}@127.0.0.1:{port}"], ["m"])
    with pytest.raises(EndpointError) as twice:
        parse_endpoints(f"http://ops:{secret}@h:1,http://ops:{secret}@h:1")
    with pytest.raises(EndpointError) as not_a_url:
        parse_endpoints(f"ftp://ops:{secret}@h:1")
    for error in (unreachable, twice, not_a_url):
        message = str(error.value)
        assert "ops:***@" in message and secret not in message, message

"""Liveness of replicas: a crashed engine, a dead GPU worker, an outage of Temporal itself.

A replica serves calls only while its engine answers `/metrics` and a GPU worker polls its
task queue; a timeout that the control plane's own outage explains is charged to neither the
replica's circuit nor the tenant's retry budget. The end-to-end tests run the real dev server,
simulated replicas and real GPU workers, and read where calls went from the ledger.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.api.enums.v1 import EventType, TimeoutType
from temporalio.client import Client, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter

from kvflow.activities.inference import INFER_ACTIVITY, ReplicaBinding
from kvflow.ledger.records import AttemptRecord
from kvflow.ports import free_port
from kvflow.scheduler.config import (
    CircuitBreakerConfig,
    LatencyConfig,
    LivenessConfig,
    RetryBudgetConfig,
    SchedulerConfig,
)
from kvflow.scheduler.core import Scheduler
from kvflow.scheduler.fleet import Fleet
from kvflow.scheduler.telemetry import MetricsScraper
from kvflow.simulator import SimServer
from kvflow.simulator.faults import FaultSpec
from kvflow.workers.devserver import EmbeddedTemporal
from kvflow.workers.gpu_worker import GpuWorker
from kvflow.workflows.agent import TaskSpec
from tests import agent_workflows as wf
from tests.fixtures_sim import sim_settings
from tests.history import wait_until_streaming
from tests.stacks import MODEL, PoolPlan, Stack, fleet_for, fleet_stack

VLLM_PAGE = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="llama-3.2-1b"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="llama-3.2-1b"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="llama-3.2-1b"} 0.1
"""


def cheap_first(cheap: PoolPlan | None = None) -> list[PoolPlan]:
    """A cheap replica the scheduler prefers and a dearer one to fall back to."""
    return [
        cheap or PoolPlan("cheap", gpu="H200", prices=("0.05", "0.005", "0.15")),
        PoolPlan("backup", gpu="H100", prices=("0.40", "0.04", "1.20")),
    ]


async def start(
    s: Stack, tenant: str = "acme", steps: int = 1, max_tokens: int = 16
) -> WorkflowHandle[Any, Any]:
    """Start a `MultiStepAgent` task of `steps` calls of `max_tokens` each for `tenant`."""
    task = wf.StepsInput(
        spec=TaskSpec(tenant=tenant, expected_steps=steps),
        model=MODEL,
        steps=steps,
        max_tokens=max_tokens,
    )
    return await s.start(wf.MultiStepAgent.run, task)


async def attempts(s: Stack, handle: WorkflowHandle[Any, Any]) -> list[AttemptRecord]:
    """The attempt rows of `handle`'s run."""
    _, rows = await s.rows(handle)
    return rows


@dataclass
class Calls:
    """The inference calls of one task as its history records them."""

    queues: list[str]
    """The task queue of each call, in order."""
    timeouts: list[str]
    """The timeout type of each call that timed out (`SCHEDULE_TO_START`, `HEARTBEAT`...)."""


async def calls_of(handle: WorkflowHandle[Any, Any]) -> Calls:
    calls = Calls(queues=[], timeouts=[])
    history = await handle.fetch_history()
    for event in history.events:
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            scheduled = event.activity_task_scheduled_event_attributes
            if scheduled.activity_type.name == INFER_ACTIVITY:
                calls.queues.append(scheduled.task_queue.name)
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT:
            failure = event.activity_task_timed_out_event_attributes.failure
            kind = TimeoutType.Name(failure.timeout_failure_info.timeout_type)
            calls.timeouts.append(kind.removeprefix("TIMEOUT_TYPE_"))
    return calls


def up(scheduler: Scheduler) -> dict[str, bool]:
    return {s.replica: s.up for s in scheduler.status()}


async def wait_for(condition: Any, timeout_s: float = 30.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"still not true after {timeout_s} s")


# ---- a crashed engine ------------------------------------------------------------------------


@pytest.fixture
def lone_sim() -> Iterator[SimServer]:
    with SimServer(sim_settings()) as server:
        yield server


def one_replica_fleet() -> Fleet:
    return fleet_for([PoolPlan("cpu")])


async def test_a_crashed_engine_is_down_after_one_scrape(lone_sim: SimServer) -> None:
    fleet = one_replica_fleet()
    scheduler = Scheduler(fleet)
    async with MetricsScraper(scheduler, {"cpu/0": lone_sim.base_url}) as scraper:
        assert await scraper.scrape_once() != {"cpu/0": None}
        lone_sim.stop()  # nothing listens on its port any more
        await scraper.scrape_once()
        assert up(scheduler) == {"cpu/0": False}


def flaky_transport(answers: list[int | Exception]) -> httpx.MockTransport:
    """An HTTP transport that answers `/metrics` with each status (or raises) in turn."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": MODEL}]})
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, Exception):
            raise answer
        return httpx.Response(answer, text=VLLM_PAGE)

    return httpx.MockTransport(handle)


async def test_a_scrape_that_times_out_twice_marks_the_replica_down_at_once() -> None:
    url = "http://replica.test"
    scheduler = Scheduler(one_replica_fleet())
    timeout = httpx.ReadTimeout("no answer")
    client = httpx.AsyncClient(transport=flaky_transport([200, timeout, timeout, 200]))
    async with client, MetricsScraper(scheduler, {"cpu/0": url}, client=client) as scraper:
        await scraper.scrape_once()
        await scraper.scrape_once()  # the failure is confirmed in the same round
        assert up(scheduler) == {"cpu/0": False}
        await scraper.scrape_once()
        assert up(scheduler) == {"cpu/0": True}


async def test_one_slow_scrape_of_a_healthy_replica_does_not_mark_it_down() -> None:
    url = "http://replica.test"
    scheduler = Scheduler(one_replica_fleet())
    client = httpx.AsyncClient(transport=flaky_transport([200, httpx.ReadTimeout("slow"), 200]))
    async with client, MetricsScraper(scheduler, {"cpu/0": url}, client=client) as scraper:
        await scraper.scrape_once()
        metrics = await scraper.scrape_once()  # fails once, answers when asked again
        assert metrics["cpu/0"] is not None
        assert up(scheduler) == {"cpu/0": True}


@pytest.mark.timeout(120)
async def test_a_crashed_replica_takes_no_second_call(
    temporal_client: Client, tmp_path: Path
) -> None:
    crashing = PoolPlan(
        "cheap", gpu="H200", prices=("0.05", "0.005", "0.15"), faults=FaultSpec(crash_after=20)
    )
    # Scrapes a minute apart: only the failed call itself can tell the control plane in time.
    async with fleet_stack(
        temporal_client, tmp_path, cheap_first(crashing), scrape_interval_s=60.0
    ) as s:
        first = await start(s, max_tokens=60)
        assert (await first.result()).replicas == ["backup/0"]
        assert [a.replica for a in await attempts(s, first)] == ["cheap/0", "backup/0"]
        # The failed call's own check (not the scrape a minute away) marks the replica down.
        await wait_for(lambda: up(s.control.scheduler) == {"cheap/0": False, "backup/0": True})
        for _ in range(3):
            handle = await start(s, max_tokens=60)
            assert (await handle.result()).replicas == ["backup/0"]
            assert [a.replica for a in await attempts(s, handle)] == ["backup/0"]


# ---- a dead GPU worker -----------------------------------------------------------------------

CHEAP_QUEUE, BACKUP_QUEUE = "kvflow.gpu.cheap.0", "kvflow.gpu.backup.0"
WATCHFUL = SchedulerConfig(
    latency=LatencyConfig(schedule_to_start_margin_s=1.0, min_schedule_to_start_s=1.0),
    liveness=LivenessConfig(worker_check_interval_s=0.5, worker_stall_s=1.0),
)
"""Calls that give up waiting to start after about a second; queues described twice a second."""


@pytest.mark.timeout(180)
async def test_a_replica_whose_gpu_worker_died_takes_no_calls_until_a_worker_polls_again(
    temporal_client: Client, tmp_path: Path
) -> None:
    async with fleet_stack(temporal_client, tmp_path, cheap_first(), scheduler=WATCHFUL) as s:
        warm_up = await start(s)
        assert (await warm_up.result()).replicas == ["cheap/0"]
        # The cheap replica's worker stops polling; its engine keeps serving /metrics.
        await s.embedded.gpu_workers["cheap/0"].shutdown()

        # The first call sent there waits out its schedule-to-start timeout: that is how the
        # control plane learns that nobody polls the queue.
        first = await start(s)
        assert (await first.result()).replicas == ["backup/0"]
        assert await calls_of(first) == Calls([CHEAP_QUEUE, BACKUP_QUEUE], ["SCHEDULE_TO_START"])
        await wait_for(lambda: not up(s.control.scheduler)["cheap/0"])
        assert s.embedded.sims["cheap/0"].base_url  # the engine still answers
        assert (await s.control.scraper.scrape_once())["cheap/0"] is not None

        # From then on every call goes to the live replica, and none waits to start in vain.
        for _ in range(4):
            handle = await start(s)
            assert (await handle.result()).replicas == ["backup/0"]
            assert await calls_of(handle) == Calls([BACKUP_QUEUE], [])

        # A worker polls the cheap replica's queue again: the replica is back.
        pool = s.embedded.fleet.pools[0]
        binding = ReplicaBinding(pool=pool, index=0, base_url=s.embedded.sims["cheap/0"].base_url)
        async with GpuWorker(temporal_client, binding, ledger=s.ledger, spool_dir=None):
            await wait_for(lambda: up(s.control.scheduler)["cheap/0"])
            handle = await start(s)
            assert (await handle.result()).replicas == ["cheap/0"]
            assert await calls_of(handle) == Calls([CHEAP_QUEUE], [])


@pytest.mark.timeout(180)
async def test_a_busy_replica_with_a_backlog_stays_up(
    temporal_client: Client, tmp_path: Path
) -> None:
    # One slot, calls of about 1.5 s, patient schedule-to-start timeouts: calls queue up
    # in Temporal behind a worker that polls only when its slot frees.
    busy = PoolPlan("busy", gpu="L4", max_concurrency=1)
    patient = SchedulerConfig(
        latency=LatencyConfig(schedule_to_start_margin_s=120.0),
        liveness=LivenessConfig(worker_check_interval_s=0.2, worker_stall_s=1.0),
    )
    async with fleet_stack(
        temporal_client, tmp_path, [busy], scheduler=patient, time_scale=1.0
    ) as s:
        await wait_for(lambda: s.control.worker_watch is not None)
        watch = s.control.worker_watch
        assert watch is not None
        handles = [await start(s, max_tokens=100) for _ in range(6)]
        views, ups = [], []
        while not all([(await h.describe()).close_time for h in handles]):
            views.append(await watch.view("busy/0"))
            ups.append(up(s.control.scheduler)["busy/0"])
            await asyncio.sleep(0.1)
        # The backlog was there, older than the stall limit, and the replica stayed up.
        assert any(v.backlog and v.backlog_age_s >= 1.0 for v in views)
        assert all(ups) and not watch.liveness.missing("busy/0")
        for handle in handles:
            assert (await handle.result()).replicas == ["busy/0"]
            assert await calls_of(handle) == Calls(["kvflow.gpu.busy.0"], [])


# ---- an outage of Temporal itself ------------------------------------------------------------


@pytest.fixture
def own_temporal(tmp_path: Path) -> Iterator[EmbeddedTemporal]:
    """A dev server of this test's own, on a SQLite file, so it can be stopped and restarted."""
    server = EmbeddedTemporal(port=free_port(), ui_port=None, state_dir=tmp_path / "temporal")
    with server:
        yield server


@pytest.mark.timeout(240)
async def test_an_outage_of_temporal_opens_no_circuit_and_spends_no_retry_budget(
    own_temporal: EmbeddedTemporal, tmp_path: Path
) -> None:
    client = await Client.connect(own_temporal.address, data_converter=pydantic_data_converter)
    # Any failure charged to a replica opens its circuit; globex may re-place no call at all.
    unforgiving = SchedulerConfig(
        circuit=CircuitBreakerConfig(consecutive_failures=1),
        retries=RetryBudgetConfig(tenant_retry_fraction=0.0, tenant_min_retries=0),
    )
    async with fleet_stack(
        client, tmp_path, cheap_first(), scheduler=unforgiving, time_scale=4.0
    ) as s:
        handles = [await start(s, tenant="globex", max_tokens=2000) for _ in range(3)]
        for handle in handles:
            await wait_until_streaming(handle)
        # Temporal goes away for longer than a heartbeat timeout (2 s), then comes back.
        await asyncio.to_thread(own_temporal.stop)
        await asyncio.sleep(4.0)
        await asyncio.to_thread(own_temporal.start)

        for handle in handles:
            out = await handle.result()
            calls = await calls_of(handle)
            # The call the outage cut timed out, and was placed again.
            assert calls.timeouts == ["HEARTBEAT"] and len(calls.queues) == 2
            assert len(out.replicas) == 1
            # Both attempts are billed (the cut one at what its GPU worker counted).
            rows = await attempts(s, handle)
            assert len(rows) == 2 and all(row.cost_micros > 0 for row in rows)
        assert {status.circuit for status in s.control.scheduler.status()} == {"closed"}

"""kvflow's workers stop: the end of `async with worker` never waits for ever."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker

from kvflow.scheduler.fleet import task_queue_for
from kvflow.simulator import SimServer
from kvflow.workers.config import FleetConfig
from kvflow.workers.control_plane import ControlPlane
from kvflow.workers.plugin import KvflowPlugin, role_worker
from kvflow.workers.replica import GpuWorkerError
from kvflow.workers.search_attributes import SearchAttributesMissing
from kvflow.workers.stopping import WorkerStopTimeout
from kvflow.workers.workflow_worker import workflow_worker
from tests import agent_workflows as wf
from tests.stacks import PoolPlan, fleet_for

_started = asyncio.Event()
_released = asyncio.Event()


@activity.defn
async def ignores_its_cancellation() -> None:
    """An activity that goes on after it is cancelled, until the test releases it."""
    _started.set()
    try:
        await _released.wait()
    except asyncio.CancelledError:
        await _released.wait()


@workflow.defn(sandboxed=False)
class RunsAStubbornActivity:
    """Runs `ignores_its_cancellation` once."""

    @workflow.run
    async def run(self) -> None:
        """Wait for the activity."""
        await workflow.execute_activity(
            ignores_its_cancellation, start_to_close_timeout=timedelta(minutes=5)
        )


@pytest.mark.timeout(30)
async def test_a_workflow_worker_that_cannot_start_fails_its_async_with_at_once_with_the_reason(
    temporal_client: Client,
) -> None:
    # A namespace kvflow cannot read the search attributes of: the worker's checks fail
    # before it polls, which used to leave the end of `async with` waiting for ever.
    client = Client(
        temporal_client.service_client,
        namespace=f"kvflow-missing-{uuid.uuid4().hex[:8]}",
        data_converter=pydantic_data_converter,
    )
    worker = await workflow_worker(
        client,
        ControlPlane(fleet_for([PoolPlan("gpu")])),
        workflows=[wf.ToolLoop],
        task_queue=f"agents-{uuid.uuid4()}",
    )
    with pytest.raises(SearchAttributesMissing, match="cannot list the search attributes"):
        async with worker:
            await asyncio.sleep(20)


@pytest.mark.timeout(30)
async def test_a_worker_whose_activity_ignores_its_cancellation_stops_within_its_bound_naming_it(
    temporal_client: Client,
) -> None:
    queue = f"stubborn-{uuid.uuid4()}"
    worker = role_worker(
        temporal_client,
        KvflowPlugin(),
        task_queue=queue,
        workflows=[RunsAStubbornActivity],
        activities=[ignores_its_cancellation],
        stop_timeout=timedelta(seconds=2),
    )
    _started.clear()
    _released.clear()
    try:
        with pytest.raises(WorkerStopTimeout, match=r"within 2 s; still running: ignores_its"):
            async with worker:
                await temporal_client.start_workflow(
                    RunsAStubbornActivity.run, id=queue, task_queue=queue
                )
                await _started.wait()
    finally:
        _released.set()  # the abandoned activity ends, and nothing is left in the loop
        await temporal_client.get_workflow_handle(queue).terminate()


@pytest.mark.timeout(30)
async def test_a_worker_of_the_plugin_whose_vllm_is_down_fails_at_once_and_a_retry_starts(
    temporal_client: Client, tmp_path: Path, sim_server_factory: Callable[..., SimServer]
) -> None:
    # As a user builds it: a plain Worker with a GPU worker's KvflowPlugin, its vLLM not up.
    fleet = FleetConfig(**fleet_for([PoolPlan("gpu")]).model_dump())

    def gpu_worker(endpoint: str) -> Worker:
        plugin = KvflowPlugin(
            fleet,
            replica="gpu/0",
            endpoint=endpoint,
            ledger=f"sqlite:///{tmp_path}/ledger.db",
            context_dir=tmp_path / "context",
            spool_dir=tmp_path / "spool",
        )
        return Worker(temporal_client, task_queue=task_queue_for("gpu", 0), plugins=[plugin])

    with pytest.raises(GpuWorkerError, match="vLLM for gpu/0 is not answering"):
        async with gpu_worker("http://127.0.0.1:9"):  # the discard port: nothing answers
            await asyncio.sleep(20)
    # Once vLLM is up, the user's next worker for the same replica starts: the failed one
    # does not hold the queue.
    async with gpu_worker(sim_server_factory().base_url) as worker:
        assert worker.task_queue == task_queue_for("gpu", 0)

"""The stack end-to-end tests run tasks on, and the small fleets they describe it with.

`fleet_stack` builds it on the session's Temporal dev server: simulated vLLM replicas (in this
process) with a GPU worker each, the control plane, a workflow worker and a ledger. A test
describes its fleet as `PoolPlan`s (GPU, size, prices, faults, whether a GPU worker polls) or
hands a `Fleet` of its own, then starts tasks with `Stack.start` and reads the books with
`Stack.rows`.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, Plugin, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.worker import Replayer

from kvflow.activities.context_store import DirectoryContextStore
from kvflow.ledger.records import AttemptRecord, TaskBook
from kvflow.ledger.store import AsyncLedger, open_async_ledger
from kvflow.scheduler.config import SchedulerConfig
from kvflow.scheduler.fleet import Fleet, Pool, Tenant, TokenPrices
from kvflow.simulator import BUILTIN_MODELS
from kvflow.simulator.faults import FaultSpec
from kvflow.workers.control_plane import ControlPlane
from kvflow.workers.embedded import EmbeddedFleet
from kvflow.workers.gpu_worker import GpuWorker
from kvflow.workers.plugin import KvflowPlugin
from kvflow.workers.workflow_worker import workflow_worker
from kvflow.workflows import errors
from kvflow.workflows.agent import TaskSpec
from tests import agent_workflows as wf

MODEL = "llama-3.2-1b"
"""The model every pool of a `fleet_for` fleet serves."""


@dataclass
class PoolPlan:
    """One pool of the test fleet: its GPU, size, prices and what is wrong with it."""

    name: str
    gpu: str = "H100"
    replicas: int = 1
    prices: tuple[str, str, str] = ("0.20", "0.02", "0.60")
    faults: FaultSpec = field(default_factory=FaultSpec)
    gpu_worker: bool = True
    max_model_len: int = 4096
    max_concurrency: int = 16


def fleet_for(pools: Sequence[PoolPlan], tenants: list[Tenant] | None = None) -> Fleet:
    """The test fleet of `pools`, all serving `MODEL`; tenants acme (tier 1) and globex (3)."""
    return Fleet(
        models=[BUILTIN_MODELS[MODEL]],
        pools=[
            Pool(
                name=plan.name,
                gpu=plan.gpu,
                replicas=plan.replicas,
                price_per_gpu_hour_usd=Decimal("2.00"),
                token_prices=TokenPrices(
                    input_per_mtok_usd=Decimal(plan.prices[0]),
                    cached_input_per_mtok_usd=Decimal(plan.prices[1]),
                    output_per_mtok_usd=Decimal(plan.prices[2]),
                ),
                warm_models=[MODEL],
                max_concurrency=plan.max_concurrency,
            )
            for plan in pools
        ],
        tenants=tenants
        or [Tenant(name="acme", tier=1, fairness_weight=3.0), Tenant(name="globex", tier=3)],
    )


def cheap_pool_that_crashes(backups: int = 1, backup_slowdown: float = 1.0) -> list[PoolPlan]:
    """The scheduler's first choice, whose only replica dies 20 tokens into a stream, and a
    dearer backup pool where the cut call resumes, its engine steps `backup_slowdown` times
    longer."""
    return [
        PoolPlan(
            "cheap", gpu="H200", prices=("0.05", "0.005", "0.15"), faults=FaultSpec(crash_after=20)
        ),
        PoolPlan(
            "backup",
            gpu="H100",
            replicas=backups,
            prices=("0.40", "0.04", "1.20"),
            faults=FaultSpec(slowdown=backup_slowdown),
        ),
    ]


WORKFLOW_WORKER_STOP = timedelta(seconds=20)
"""How long the stack's workflow worker may take to stop. Its activities end as soon as they
are cancelled, so a stop that takes longer is stuck: the test fails naming what still ran
(`WorkerStopTimeout`), within its own timeout, instead of being cut while it waits."""

LATE_START_TRIES = 3
"""Tries `fails_for_its_deadline` gives a task whose workflow began after its budget."""


async def fails_for_its_deadline(
    start: Callable[[], Awaitable[WorkflowHandle[Any, Any]]],
    *,
    started_late: Callable[[str], bool],
) -> tuple[WorkflowHandle[Any, Any], ApplicationError]:
    """Run a task with a budget of milliseconds until it fails for its deadline where it should.

    `start` starts the task afresh; it must fail DEADLINE_EXCEEDED, non-retryable. On a busy
    machine its first workflow task can begin after so short a budget, and the task then fails
    before it reaches the step the test is about: `started_late(message)` says so from the
    failure's message, and such a try is run again, up to `LATE_START_TRIES` times.
    Returns the handle and the failure of the try that got there.
    """
    for _ in range(LATE_START_TRIES):
        handle = await start()
        with pytest.raises(WorkflowFailureError) as failed:
            await handle.result()
        cause = failed.value.cause
        assert isinstance(cause, ApplicationError), cause
        assert cause.type == errors.TaskErrorType.DEADLINE_EXCEEDED and cause.non_retryable, cause
        if not started_late(cause.message):
            return handle, cause
    pytest.fail(f"the task's workflow began after its budget in all {LATE_START_TRIES} tries")


def task_spec(**kwargs: Any) -> TaskSpec:
    """A task of tenant acme expecting five steps, but for `kwargs`."""
    return TaskSpec(**{"tenant": "acme", "expected_steps": 5, **kwargs})


def refund_task(refund: wf.Refund, *, max_tokens: int = 16, **spec: Any) -> wf.RefundInput:
    """A refund task (`wf.RefundThenReply` and its kin) on `MODEL`: `refund`, then a reply of
    `max_tokens`; its spec is `task_spec(**spec)`."""
    return wf.RefundInput(spec=task_spec(**spec), model=MODEL, refund=refund, max_tokens=max_tokens)


@dataclass
class Stack:
    """A running stack: where a test starts its tasks and reads their books."""

    client: Client
    """The client tasks are started with, which the workflow worker polls with too."""
    fleet: Fleet
    ledger: AsyncLedger
    task_queue: str
    """The workflow worker's task queue."""
    embedded: EmbeddedFleet
    """The replicas, their GPU workers and the control plane."""
    context_dir: Path
    """The context store's folder, which every worker of the stack shares."""
    ledger_url: str

    @property
    def control(self) -> ControlPlane:
        """The control plane: the scheduler, its scrapers and its activities."""
        assert self.embedded.control_plane is not None
        return self.embedded.control_plane

    @property
    def gpu_workers(self) -> dict[str, GpuWorker]:
        """The GPU worker of each replica that has one, by replica name."""
        return self.embedded.gpu_workers

    async def start(self, run: Callable[..., Any], arg: Any) -> WorkflowHandle[Any, Any]:
        """Start the workflow whose run method is `run` on `arg`, on the stack's queue."""
        return await self.client.start_workflow(
            run, arg, id=f"task-{uuid.uuid4()}", task_queue=self.task_queue
        )

    async def rows(
        self, handle: WorkflowHandle[Any, Any]
    ) -> tuple[TaskBook | None, list[AttemptRecord]]:
        """The task row (None while there is none) and the attempt rows of `handle`'s run."""
        run_id = (await handle.describe()).run_id or ""
        task = await self.ledger.task(handle.id, run_id)
        return task, await self.ledger.attempts_for(handle.id, run_id)


@asynccontextmanager
async def fleet_stack(
    temporal_client: Client,
    tmp_path: Path,
    pools: Sequence[PoolPlan] | None = None,
    *,
    fleet: Fleet | None = None,
    workflows: Sequence[type] = wf.ALL_WORKFLOWS,
    activities: Sequence[Any] = wf.ALL_ACTIVITIES,
    ledger_url: str | None = None,
    plugins: Sequence[Plugin] | None = None,
    scheduler: SchedulerConfig | None = None,
    max_model_len: int | None = None,
    faults: Mapping[str, FaultSpec] | None = None,
    **embedded_options: Any,
) -> AsyncIterator[Stack]:
    """A stack of `pools` (or of `fleet`), its workers running, on `temporal_client`'s server.

    - `fleet`: the fleet to run instead of `fleet_for(pools)` (other tenants, real endpoints);
      `pools` still name each pool's faults and whether it has GPU workers.
    - `ledger_url`: the ledger's database; SQLite under `tmp_path` when not given.
    - `plugins`: client plugins besides kvflow's (an agent framework's). When given, even
      empty, tasks start and the workflow worker polls with a client of `KvflowPlugin` on the
      stack's context store and then `plugins`, and the GPU workers with one of `KvflowPlugin`
      alone, as `kvflow worker gpu` connects; otherwise `temporal_client` serves them all.
    - `max_model_len`: the simulated engines'; the largest of the pools' when not given.
    - `faults`: per replica, over the pools' (a fault on one replica of a larger pool).
    - `embedded_options`: the rest of `EmbeddedFleet`'s options (`time_scale`,
      `scrape_interval_s`...).
    """
    plans = list(pools or ())
    assert plans or fleet is not None, "a stack needs pools or a fleet"
    fleet = fleet or fleet_for(plans)
    by_pool = {plan.name: plan for plan in plans}
    replicas = [
        (name, by_pool[pool.name])
        for pool in fleet.pools
        if pool.name in by_pool
        for name in pool.replica_names()
    ]
    context_dir = tmp_path / "context"
    ledger_url = ledger_url or f"sqlite:///{tmp_path}/ledger.db"
    client = gpu_client = temporal_client
    if plugins is not None:

        def connected(*more: Plugin) -> Client:
            return Client(
                temporal_client.service_client,
                namespace=temporal_client.namespace,
                plugins=[KvflowPlugin(context_dir=context_dir), *more],
            )

        client, gpu_client = connected(*plugins), connected()
    ledger = await open_async_ledger(ledger_url, migrate=True)
    task_queue = f"agents-{uuid.uuid4()}"
    try:
        async with EmbeddedFleet(
            gpu_client,
            fleet,
            ledger=ledger,
            store=DirectoryContextStore(context_dir),
            scheduler_config=scheduler,
            max_model_len=max_model_len or max((p.max_model_len for p in plans), default=None),
            faults={**{name: plan.faults for name, plan in replicas}, **(faults or {})},
            without_gpu_worker=[name for name, plan in replicas if not plan.gpu_worker],
            **embedded_options,
        ) as embedded:
            assert embedded.control_plane is not None
            worker = await workflow_worker(
                client,
                embedded.control_plane,
                workflows=workflows,
                activities=activities,
                task_queue=task_queue,
                stop_timeout=WORKFLOW_WORKER_STOP,
            )
            async with worker:
                try:
                    yield Stack(
                        client=client,
                        fleet=fleet,
                        ledger=ledger,
                        task_queue=task_queue,
                        embedded=embedded,
                        context_dir=context_dir,
                        ledger_url=ledger_url,
                    )
                except GeneratorExit:
                    raise  # closed without a loop to report in
                except BaseException:
                    # A failed or cut test: say what its open tasks were waiting on.
                    await report_open_tasks(client, task_queue)
                    raise
    finally:
        await ledger.close()


async def report_open_tasks(client: Client, task_queue: str) -> None:
    """Print each task still running on `task_queue` and the activities it waits on (stderr).

    A test that hangs shows, in its captured output, whether a model call was never picked
    up, is running on a replica, or is being retried, and after which failure.
    """
    try:
        async with asyncio.timeout(5):
            query = f'TaskQueue="{task_queue}" AND ExecutionStatus="Running"'
            async for execution in client.list_workflows(query):
                handle = client.get_workflow_handle(execution.id, run_id=execution.run_id)
                pending = (await handle.describe()).raw_description.pending_activities
                events = (await handle.fetch_history()).events[-3:]
                last = ", ".join(
                    EventType.Name(e.event_type).removeprefix("EVENT_TYPE_") for e in events
                )
                print(
                    f"open task {execution.id} ({execution.workflow_type}), last events: {last}",
                    file=sys.stderr,
                )
                for a in pending:
                    print(
                        f"  waits on {a.activity_type.name} #{a.activity_id}: state "
                        f"{a.state}, attempt {a.attempt}, worker {a.last_worker_identity!r}, "
                        f"last failure {a.last_failure.message!r}",
                        file=sys.stderr,
                    )
    except Exception as err:  # a report must not hide the test's own failure
        print(f"could not list the open tasks on {task_queue}: {err!r}", file=sys.stderr)


async def assert_replays(
    handle: WorkflowHandle[Any, Any], workflows: Sequence[type] = wf.ALL_WORKFLOWS
) -> None:
    """The run's history replays on `workflows`: the workflow code is deterministic."""
    history = await handle.fetch_history()
    replayer = Replayer(workflows=workflows, data_converter=handle._client.data_converter)
    await replayer.replay_workflow(history)

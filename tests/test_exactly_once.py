"""Every attempt is billed exactly once, even when its completion or the ledger is lost.

Real Temporal dev server, simulated replicas, real GPU workers and the real ledger, on SQLite
and on PostgreSQL. Three ways the books could drift apart are reproduced on purpose:

- a GPU worker bills its attempt and its result never reaches Temporal (the worker died, or
  the server was down when it completed): the workflow sees a heartbeat timeout, bills the
  attempt and runs the step again;
- the worker's row reaches the ledger only after the workflow billed the attempt from its
  last heartbeat (a spool replayed when the ledger or the worker came back);
- the ledger's PostgreSQL connection is cut for a few seconds while tasks run.

Afterwards every attempt has one row, written by the GPU worker, and each task's row, its
`kvflow_spend` query and its spend search attribute all equal the sum of its attempt rows.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from pydantic import BaseModel
from temporalio import activity, workflow
from temporalio.client import Client, WorkflowHandle, WorkflowHistory
from temporalio.worker import Replayer, Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from kvflow.activities.inference import (
    INFER_ACTIVITY,
    InferenceActivities,
    ReplicaBinding,
    default_http_client,
)
from kvflow.activities.wire import InferenceRequest, InferenceResult
from kvflow.ledger import (
    AsyncLedger,
    AttemptRecord,
    Ledger,
    LedgerUnavailable,
    TaskOutcome,
    open_ledger,
)
from kvflow.ledger.spool import AttemptSpool, SpooledAttemptWriter
from kvflow.ports import free_port
from kvflow.scheduler.fleet import Tenant, task_queue_for
from kvflow.workers.embedded import EmbeddedFleet
from kvflow.workflows.agent import SPEND_QUERY, SpendBreakdown
from tests import agent_workflows as wf
from tests.fixtures_ledger import attempt_record, task_record, with_schema
from tests.ledger_books import assert_books_balance
from tests.stacks import MODEL, PoolPlan, Stack, fleet_for, fleet_stack, task_spec
from tests.waiting import eventually

# This file defines a workflow, so the sandbox re-imports it; pass kvflow through.
with workflow.unsafe.imports_passed_through():
    from kvflow.activities.wire import ChatMessage, Sampling
    from kvflow.workflows.agent import Agent, TaskSpec


class PausedInput(BaseModel):
    spec: TaskSpec
    model: str
    max_tokens: int = 24


@workflow.defn
class AnswersThenWaits:
    """One model call, then a wait for `finish` before the task closes."""

    def __init__(self) -> None:
        self.finished = False

    @workflow.run
    async def run(self, task: PausedInput) -> str:
        agent = Agent(task.spec)
        async with agent:
            answer = await agent.infer(
                [ChatMessage(role="user", content="Summarize the incident.")],
                model=task.model,
                max_tokens=task.max_tokens,
                step="summary",
                sampling=Sampling(ignore_eos=True),
            )
            await workflow.wait_condition(lambda: self.finished)
            return answer.text

    @workflow.signal
    def finish(self) -> None:
        self.finished = True


def _pools() -> list[PoolPlan]:
    """A cheap pool the scheduler tries first, whose GPU worker loses completions, and a
    dearer backup."""
    return [
        PoolPlan("lossy", gpu="H200", prices=("0.05", "0.005", "0.15"), gpu_worker=False),
        PoolPlan("backup", gpu="H100", prices=("0.40", "0.04", "1.20")),
    ]


def ledger_stack(
    client: Client,
    tmp_path: Path,
    ledger_url: str,
    pools: list[PoolPlan],
    **embedded_options: Any,
) -> AbstractAsyncContextManager[Stack]:
    """`fleet_stack` on the ledger at `ledger_url` (SQLite or PostgreSQL), tenant acme alone,
    with `AnswersThenWaits` among the workflows; `embedded_options` as `fleet_stack`'s."""
    return fleet_stack(
        client,
        tmp_path,
        pools,
        fleet=fleet_for(pools, [Tenant(name="acme", tier=1, fairness_weight=3.0)]),
        workflows=[*wf.ALL_WORKFLOWS, AnswersThenWaits],
        ledger_url=ledger_url,
        **embedded_options,
    )


class HeldRows:
    """A GPU worker's attempt rows, held back instead of written (a spool not yet replayed)."""

    def __init__(self) -> None:
        self.rows: list[AttemptRecord] = []

    async def record_attempt(self, record: AttemptRecord) -> bool:
        self.rows.append(record)
        return True


class LosesCompletions:
    """A GPU worker whose calls run and are billed, and whose results never reach Temporal.

    Each call streams from the replica and writes its attempt row like any GPU worker's,
    then goes silent instead of completing: what Temporal sees of a worker killed right
    after its ledger write, or of a completion lost while the server was down.
    """

    def __init__(
        self,
        client: Client,
        embedded: EmbeddedFleet,
        replica: str,
        ledger: AsyncLedger | HeldRows,
    ) -> None:
        pool_name, index = replica.split("/")
        pool = embedded.fleet.pool(pool_name)
        binding = ReplicaBinding(
            pool=pool, index=int(index), base_url=embedded.sims[replica].base_url
        )
        self.http = default_http_client()
        self.inference = InferenceActivities(
            binding, self.http, ledger, store=embedded.store, heartbeat_interval_s=0.2
        )
        self.lost: list[str] = []
        """Activity ids of the calls whose completion was lost."""
        self.worker = Worker(
            client,
            task_queue=task_queue_for(pool.name, int(index)),
            activities=[self.infer],
        )

    @activity.defn(name=INFER_ACTIVITY)
    async def infer(self, request: InferenceRequest) -> InferenceResult:
        result = await self.inference.infer(request)
        self.lost.append(activity.info().activity_id)
        await asyncio.Event().wait()  # the completion never leaves the worker
        return result

    async def __aenter__(self) -> LosesCompletions:
        await self.worker.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.worker.__aexit__(None, None, None)
        await self.http.aclose()


async def _assert_replays(handle: WorkflowHandle[Any, Any]) -> None:
    """The run's history replays: billing from the ledger added no nondeterminism."""
    history = await handle.fetch_history()
    # As the workflow worker runs them: kvflow passed through, and this module with it.
    runner = SandboxedWorkflowRunner(
        restrictions=SandboxRestrictions.default.with_passthrough_modules("kvflow", "tests")
    )
    replayer = Replayer(
        workflows=[*wf.ALL_WORKFLOWS, AnswersThenWaits],
        data_converter=handle._client.data_converter,
        workflow_runner=runner,
    )
    await replayer.replay_workflow(history)


async def _run_id(handle: WorkflowHandle[Any, Any]) -> str:
    return (await handle.describe()).run_id or ""


async def _assert_lost_attempt_billed_from_its_row(
    s: Stack, handle: WorkflowHandle[Any, Any], activity_id: str
) -> None:
    """The lost attempt's one row is the worker's exact one, and the task counted exactly it."""
    rows = await s.ledger.attempts_for(handle.id, await _run_id(handle))
    [row] = [r for r in rows if r.activity_id == activity_id]
    assert row.replica == "lossy/0" and not row.provisional and row.cost_micros > 0
    breakdown = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
    [billed] = [
        a for step in breakdown.steps for a in step.attempts if a.activity_id == activity_id
    ]
    assert billed.outcome == "TimeoutHeartbeat", billed
    assert billed.cost_micros == row.cost_micros
    assert billed.completion_tokens == row.completion_tokens


@pytest.mark.timeout(240)
async def test_completion_lost_after_the_worker_billed_it_is_counted_once_at_its_real_cost(
    temporal_client: Client, tmp_path: Path, ledger_url: str
) -> None:
    async with (
        ledger_stack(temporal_client, tmp_path, ledger_url, _pools()) as s,
        LosesCompletions(temporal_client, s.embedded, "lossy/0", s.ledger) as lossy,
    ):
        task = wf.StepsInput(spec=task_spec(expected_steps=2), model=MODEL, steps=2, max_tokens=24)
        handles = [await s.start(wf.MultiStepAgent.run, task) for _ in range(3)]
        outs = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 180)
        assert all(r == "backup/0" for out in outs for r in out.replicas)
        assert lossy.lost, "no call went to the lossy replica"
        for handle in handles:
            task_row = await assert_books_balance(s, handle)
            rows = await s.ledger.attempts_for(handle.id, task_row.run_id)
            for row in rows:
                if row.activity_id in lossy.lost:
                    await _assert_lost_attempt_billed_from_its_row(s, handle, row.activity_id)
            await _assert_replays(handle)


@pytest.mark.timeout(240)
async def test_worker_row_that_arrives_after_the_estimate_replaces_it_before_the_task_closes(
    temporal_client: Client, tmp_path: Path, ledger_url: str
) -> None:
    held = HeldRows()
    async with (
        ledger_stack(temporal_client, tmp_path, ledger_url, _pools()) as s,
        LosesCompletions(temporal_client, s.embedded, "lossy/0", held) as lossy,
    ):
        task = PausedInput(spec=task_spec(expected_steps=1), model=MODEL)
        handle = await s.start(AnswersThenWaits.run, task)

        # The step is answered by the backup once the lossy call went silent.
        async def answered() -> bool:
            breakdown = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
            return bool(breakdown.steps) and breakdown.steps[0].outcome == "ok"

        await eventually(answered, within=30, what="the backup answers the step")
        [activity_id] = lossy.lost
        [late] = held.rows
        rows = await s.ledger.attempts_for(handle.id, await _run_id(handle))
        [estimate] = [r for r in rows if r.activity_id == activity_id]
        assert estimate.provisional and estimate.cost_micros < late.cost_micros

        # The worker's row reaches the ledger now (its spool replayed), then the task ends.
        assert await s.ledger.record_attempt(late) is True
        await handle.signal(AnswersThenWaits.finish)
        await asyncio.wait_for(handle.result(), 60)
        await assert_books_balance(s, handle)
        await _assert_lost_attempt_billed_from_its_row(s, handle, activity_id)
        await _assert_replays(handle)


# ---- rows that come after the task row ---------------------------------------------------------


def test_exact_row_after_the_close_moves_the_task_row_from_the_estimate_to_the_bill(
    ledger: Ledger,
) -> None:
    answered = attempt_record(activity_id="1", completion_tokens=40)
    exact = attempt_record(activity_id="2", completion_tokens=102)
    estimate = exact.model_copy(
        update={"completion_tokens": 45, "cost_micros": 33, "provisional": True}
    )
    ledger.record_attempt(answered)
    ledger.record_attempt(estimate)
    ledger.record_task(task_record(attempts=2, spend_micros=answered.cost_micros + 33))

    # The worker's spool is replayed after the workflow closed, then replayed once more.
    assert ledger.record_attempt(exact) is True
    assert ledger.record_attempt(exact) is False
    _assert_task_row_is_the_sum(ledger, attempts=2)


def test_row_after_a_reconciled_task_row_is_added_to_it_once(ledger: Ledger) -> None:
    first = attempt_record(activity_id="1")
    ledger.record_attempt(first)
    reconciled = task_record(attempts=1, spend_micros=first.cost_micros)
    ledger.record_task(reconciled.model_copy(update={"source": "reconcile"}))

    # The timed-out run's last attempt is billed by its GPU worker after reconcile ran.
    late = attempt_record(activity_id="2", completion_tokens=7)
    assert ledger.record_attempt(late) is True
    assert ledger.record_attempt(late) is False
    _assert_task_row_is_the_sum(ledger, attempts=2)


def test_row_after_the_workflow_closed_is_not_counted_twice(ledger: Ledger) -> None:
    # The workflow counted the answer from its result; the row was in a spool at the close.
    answer = attempt_record(activity_id="1")
    ledger.record_task(task_record(attempts=1, spend_micros=answer.cost_micros))
    assert ledger.record_attempt(answer) is True
    _assert_task_row_is_the_sum(ledger, attempts=1)


def _assert_task_row_is_the_sum(ledger: Ledger, *, attempts: int) -> None:
    rows = ledger.attempts_for("wf-1", "run-1")
    task = ledger.task("wf-1", "run-1")
    assert task is not None and len(rows) == attempts == task.attempts
    assert not any(row.provisional for row in rows)
    assert task.spend_micros == sum(row.cost_micros for row in rows)


# ---- a spool that cannot be written ------------------------------------------------------------


class LedgerDown:
    """The real ledger behind a switch: while `down`, every write is refused."""

    def __init__(self, ledger: AsyncLedger) -> None:
        self.ledger = ledger
        self.down = True

    async def record_attempt(self, record: AttemptRecord) -> bool:
        if self.down:
            raise LedgerUnavailable("ledger: connection refused")
        return await self.ledger.record_attempt(record)


class FullDisk(AttemptSpool):
    """A spool on a disk that has no room left while `full`."""

    full = True

    def add(self, record: AttemptRecord) -> None:
        if self.full:
            raise OSError(28, "No space left on device")
        super().add(record)


async def test_row_the_spool_cannot_take_is_held_and_written_when_the_ledger_is_back(
    ledger_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with AsyncLedger(open_ledger(ledger_url, migrate=True)) as ledger:
        target = LedgerDown(ledger)
        spool = FullDisk(tmp_path / "attempts-cpu-0.db")
        writer = SpooledAttemptWriter(target, spool, retries=1, backoff_s=0.01)
        row = attempt_record()
        async with writer:
            # Neither the ledger nor the disk takes it: the call still returns.
            assert await writer.record_attempt(row) is False
            assert list(writer.held) == [row.key] and len(spool) == 0
            # A replay while the ledger is still down keeps it.
            assert await writer.replay() == 0 and list(writer.held) == [row.key]
            target.down = False
            assert await writer.replay() == 1
            assert writer.held == {}
            assert await writer.record_attempt(row) is False  # a retry: still one row
        assert await ledger.attempts_for("wf-1", "run-1") == [row]
        assert not [r for r in caplog.records if r.levelno >= logging.CRITICAL]


async def test_held_row_moves_to_the_spool_when_the_disk_recovers_before_the_ledger(
    ledger_url: str, tmp_path: Path
) -> None:
    async with AsyncLedger(open_ledger(ledger_url, migrate=True)) as ledger:
        target = LedgerDown(ledger)
        spool = FullDisk(tmp_path / "attempts-cpu-0.db")
        row = attempt_record()
        async with SpooledAttemptWriter(target, spool, retries=0) as writer:
            await writer.record_attempt(row)
            spool.full = False
            await writer.replay()
            assert writer.held == {} and len(spool) == 1
        # The worker restarts after the ledger is back and replays its spool.
        target.down = False
        restarted = SpooledAttemptWriter(target, AttemptSpool(tmp_path / "attempts-cpu-0.db"))
        async with restarted:
            assert await ledger.attempts_for("wf-1", "run-1") == [row]


# ---- the ledger's PostgreSQL connection cut mid-run ------------------------------------------


class CuttableTcpProxy:
    """A TCP proxy in front of PostgreSQL whose connections can be cut, then let back.

    `cut()` drops every open connection and refuses new ones (each is accepted and closed at
    once, as a restarting server or a failing-over address does) until `restore()`. It runs
    its own event loop in a thread, so that it answers while the test's loop waits.
    """

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = free_port()
        self.dropped = 0
        """Open connections cut."""
        self.refused = 0
        """Connections refused while cut."""
        self._refusing = False
        self._open: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    def start(self) -> CuttableTcpProxy:
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        return self

    def url(self, direct_url: str) -> str:
        """`direct_url` with its host and port replaced by the proxy's."""
        parts = urlsplit(direct_url)
        netloc = parts.netloc.rsplit("@", 1)
        address = f"127.0.0.1:{self.port}"
        return urlunsplit(
            parts._replace(netloc=f"{netloc[0]}@{address}" if len(netloc) == 2 else address)
        )

    def cut(self) -> None:
        async def cut() -> None:
            self._refusing = True
            for writer in list(self._open):
                writer.transport.abort()
                self.dropped += 1

        self._call(cut())

    def restore(self) -> None:
        async def restore() -> None:
            self._refusing = False

        self._call(restore())

    def stop(self) -> None:
        async def stop() -> None:
            assert self._server is not None
            self._server.close()
            for writer in list(self._open):
                writer.transport.abort()

        self._call(stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def _call(self, work: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(timeout=10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._refusing:
            self.refused += 1
            writer.transport.abort()
            return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            return
        self._open.update((writer, upstream_writer))
        await asyncio.gather(
            self._pipe(reader, upstream_writer),
            self._pipe(upstream_reader, writer),
            return_exceptions=True,
        )

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            self._open.discard(writer)
            writer.transport.abort()


@pytest.mark.postgres
@pytest.mark.timeout(300)
async def test_ledger_connection_cut_mid_run_loses_no_row_and_doubles_none(
    temporal_client: Client,
    tmp_path: Path,
    postgres_server_url: str,
    postgres_schema_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    direct = with_schema(postgres_server_url, f"{postgres_schema_prefix}_cut")
    upstream = urlsplit(postgres_server_url)
    proxy = CuttableTcpProxy(upstream.hostname or "127.0.0.1", upstream.port or 5432).start()
    caplog.set_level(logging.WARNING, logger="kvflow.ledger.spool")
    pools = [PoolPlan("gpu", gpu="H100", replicas=2)]
    task = wf.StepsInput(spec=task_spec(expected_steps=3), model=MODEL, steps=3, max_tokens=24)
    try:
        async with ledger_stack(temporal_client, tmp_path, proxy.url(direct), pools) as s:
            handles = [await s.start(wf.MultiStepAgent.run, task) for _ in range(4)]
            async with AsyncLedger(open_ledger(direct)) as books:
                first = handles[0]
                await eventually(
                    lambda: books.attempts_for(first.id, first.result_run_id or ""),
                    within=30,
                    what="the first task's first step is billed",
                )

                # The ledger's connections are cut for 5 s; tasks started meanwhile run too.
                proxy.cut()
                handles += [await s.start(wf.MultiStepAgent.run, task) for _ in range(3)]
                await asyncio.sleep(5)
                proxy.restore()
                outs = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 180)
                assert all(len(out.replicas) == 3 for out in outs)
                assert proxy.dropped >= 1 and proxy.refused >= 1
                spooled = [r for r in caplog.records if "spooled to" in r.getMessage()]
                assert spooled, "no attempt ended while the ledger was cut"

                # What the GPU workers spooled reaches the ledger by itself.
                writers = [w.spooler for w in s.gpu_workers.values() if w.spooler is not None]
                await eventually(
                    lambda: all(len(w.spool) == 0 and not w.held for w in writers),
                    within=30,
                    what="every spooled and held row reached the ledger",
                )
                for handle in handles:
                    task_row = await assert_books_balance(s, handle)
                    assert task_row.outcome == TaskOutcome.SUCCEEDED
                    assert len(await books.attempts_for(handle.id, task_row.run_id)) == 3
    finally:
        proxy.stop()


# ---- runs started before the ledger reads replay unchanged -----------------------------------

LOST_ATTEMPT_HISTORY = Path(__file__).parent / "data" / "history_lost_attempt_before_patch.json"
"""One step whose first attempt's completion was lost, recorded before a lost attempt was
billed from the ledger (no patch marker, no `attempt_bill` reads)."""


async def test_run_recorded_before_lost_attempts_were_billed_from_the_ledger_replays(
    temporal_client: Client,
) -> None:
    history = WorkflowHistory.from_json("recorded-lost-attempt", LOST_ATTEMPT_HISTORY.read_text())
    replayer = Replayer(workflows=wf.ALL_WORKFLOWS, data_converter=temporal_client.data_converter)
    await replayer.replay_workflow(history)

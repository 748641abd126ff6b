"""The books balance after any kind of run: what finance reads agrees with what really ran.

One stack of simulated replicas runs tasks that end every way a task can end: normally, cut
mid-stream and resumed elsewhere, cancelled mid-call, timed out (its row then written by
`reconcile`), and while the ledger is locked by another writer for longer than a heartbeat
timeout. Afterwards, for every task:

- every attempt the workflow made has exactly one ledger row, exact (not an estimate), priced
  to the micro-dollar from its own usage and the prices stored with it;
- the task's spend is the sum of its attempt rows, and equals `KvflowSpendMicros` and the
  `kvflow_spend` query's total;
- every closed workflow has one task row whose outcome matches the workflow's status.

Then the orders in which rows reach the ledger late, each on the real stack: a cancelled
call's row still in its GPU worker's spool when the task closes, and a lost attempt's exact
row landing between the workflow's bill read and its task-row write. The ledger counts the
row either way and lists the task as moved after its close. (A GPU worker whose context store
fails after billing: `tests/test_worker_billing.py`.)
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from temporalio.client import Client, WorkflowExecutionStatus

from kvflow.activities.inference import ReplicaBinding
from kvflow.ledger.records import AttemptOutcome, TaskOutcome, TaskRecord
from kvflow.ledger.report import ReportQuery
from kvflow.workers.gpu_worker import GpuWorker
from kvflow.workers.reconcile import reconcile
from kvflow.workflows.agent import SPEND_QUERY, SpendBreakdown
from tests import agent_workflows as wf
from tests.history import wait_until_streaming
from tests.ledger_books import OUTCOMES, assert_books_balance, settled
from tests.stacks import (
    MODEL,
    PoolPlan,
    cheap_pool_that_crashes,
    fleet_stack,
    refund_task,
    task_spec,
)
from tests.test_exactly_once import (
    AnswersThenWaits,
    HeldRows,
    LosesCompletions,
    PausedInput,
    _pools,
    ledger_stack,
)
from tests.test_ledger_reconcile import _wait_until_closed_in_visibility
from tests.waiting import eventually

__all__ = ["OUTCOMES", "assert_books_balance"]  # what other suites take from here


async def test_every_way_a_task_ends_leaves_the_ledger_exact(
    temporal_client: Client, tmp_path: Path
):
    wf.REFUNDS.clear()
    wf.REVERSED.clear()
    # The cheap replica dies mid-stream on its first long call; the backups take over. They
    # run 4x slower, so that the cancelled task's answer (3,000 tokens, about 2.6 s at full
    # speed) is still streaming when the cancellation reaches its GPU worker, a heartbeat
    # later, however fast the machine.
    pools = cheap_pool_that_crashes(backups=2, backup_slowdown=4.0)
    async with fleet_stack(temporal_client, tmp_path, pools) as s:
        # Short answers first: they fit under the cheap replica's crash point.
        normal = await s.start(
            wf.MultiStepAgent.run,
            wf.StepsInput(spec=task_spec(expected_steps=3), model=MODEL, steps=3, max_tokens=8),
        )
        await settled(normal)
        # Another writer holds the ledger's write lock for longer than a heartbeat timeout
        # while a task's attempts end.
        blocker = sqlite3.connect(
            tmp_path / "ledger.db", isolation_level=None, timeout=30, check_same_thread=False
        )
        blocker.execute("BEGIN IMMEDIATE")
        release = threading.Timer(4.0, lambda: blocker.execute("COMMIT"))
        release.start()
        slow_ledger = await s.start(
            wf.MultiStepAgent.run,
            wf.StepsInput(spec=task_spec(expected_steps=2), model=MODEL, steps=2, max_tokens=8),
        )
        await settled(slow_ledger)
        release.join()
        blocker.close()
        # A long answer: the cheap replica dies mid-stream and the call resumes on backup.
        cut = await s.start(
            wf.MultiStepAgent.run,
            wf.StepsInput(spec=task_spec(expected_steps=1), model=MODEL, steps=1, max_tokens=60),
        )
        await settled(cut)
        refund = wf.Refund(account="C-9", amount_cents=300)
        cancelled = await s.start(
            wf.RefundThenReply.run,
            refund_task(refund, expected_steps=2, max_tokens=3000),
        )
        await wait_until_streaming(cancelled)
        await cancelled.cancel()
        timed_out = await s.client.start_workflow(
            wf.MultiStepAgent.run,
            wf.StepsInput(spec=task_spec(expected_steps=2), model=MODEL, steps=2, max_tokens=3000),
            id=f"timed-out-{tmp_path.name}",
            task_queue=s.task_queue,
            execution_timeout=timedelta(seconds=3),
        )
        handles = [normal, slow_ledger, cut, cancelled, timed_out]
        await asyncio.gather(*(settled(h) for h in handles))

        # The timed-out run never ran its own close: reconcile writes its row, once visibility
        # (which it reads, a second or more behind) lists the run as closed.
        await _wait_until_closed_in_visibility(s.client, f"WorkflowId = '{timed_out.id}'", 1)
        result = await reconcile(s.ledger, s.client, query=f"WorkflowId = '{timed_out.id}'")
        assert [row.workflow_id for row in result.written] == [timed_out.id], result

        statuses = [(await h.describe()).status for h in handles]
        assert statuses == [
            WorkflowExecutionStatus.COMPLETED,
            WorkflowExecutionStatus.COMPLETED,
            WorkflowExecutionStatus.COMPLETED,
            WorkflowExecutionStatus.CANCELED,
            WorkflowExecutionStatus.TIMED_OUT,
        ]
        rows = [await assert_books_balance(s, h) for h in handles]
        # The cut attempt was billed, and so was the cancelled one: no row reads 0.
        cut_attempts = await s.ledger.attempts_for(cut.id, rows[2].run_id)
        assert len(cut_attempts) == 2 and all(a.cost_micros > 0 for a in cut_attempts)
        assert rows[3].spend_micros > 0


@pytest.mark.timeout(180)
async def test_cancelled_call_whose_row_was_spooled_is_counted_when_replayed(
    temporal_client: Client, tmp_path: Path, ledger_url: str
) -> None:
    held = HeldRows()  # the GPU worker's ledger is down: its rows wait in the spool
    pools = [PoolPlan("spooling", gpu_worker=False)]
    # A stream of seconds, not the default tenth of one: the cancellation reaches the call
    # with a heartbeat (up to 1.6 s apart), and must find it still running.
    async with ledger_stack(temporal_client, tmp_path, ledger_url, pools, time_scale=2.0) as s:
        binding = ReplicaBinding(
            pool=s.fleet.pool("spooling"),
            index=0,
            base_url=s.embedded.sims["spooling/0"].base_url,
        )
        worker = GpuWorker(
            temporal_client,
            binding,
            ledger=held,
            store=s.embedded.store,
            heartbeat_interval_s=0.2,
            spool_dir=None,
        )
        async with worker:
            refund = wf.Refund(account="C-7", amount_cents=100)
            handle = await s.start(
                wf.RefundThenReply.run,
                refund_task(refund, expected_steps=2, max_tokens=3000),
            )
            await wait_until_streaming(handle)
            await handle.cancel()
            await settled(handle)
            await eventually(lambda: held.rows, within=10, what="the cancelled call is billed")
        run_id = (await handle.describe()).run_id or ""
        [row] = held.rows
        assert row.outcome is AttemptOutcome.CANCELLED and row.cost_micros > 0
        closed = await s.ledger.task(handle.id, run_id)
        assert closed is not None and closed.outcome is TaskOutcome.CANCELLED
        # The workflow could not read a bill that was in the spool: its view at the close.
        breakdown = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
        assert closed.spend_at_close_micros == breakdown.spend_micros == 0

        await s.ledger.record_attempt(row)  # the spool is replayed
        book = await s.ledger.task(handle.id, run_id)
        assert book is not None
        assert book.spend_micros == row.cost_micros == book.wasted_micros
        assert book.moved_micros == row.cost_micros
        report = await s.ledger.report(ReportQuery.parse("", tenant="acme"))
        assert [t.workflow_id for t in report.moved] == [handle.id]
        assert report.totals.spend_micros == row.cost_micros


@pytest.mark.timeout(240)
async def test_lost_attempts_exact_row_landing_before_the_task_row_is_counted(
    temporal_client: Client, tmp_path: Path, ledger_url: str
) -> None:
    held = HeldRows()
    async with (
        ledger_stack(temporal_client, tmp_path, ledger_url, _pools()) as s,
        LosesCompletions(temporal_client, s.embedded, "lossy/0", held) as lossy,
    ):
        write_task_row = s.ledger.record_task

        async def exact_row_lands_first(record: TaskRecord) -> bool:
            # The workflow has read the lost attempt's bill (the estimate) for its task row;
            # the worker's spool is replayed in the moment before that row is written.
            for late in held.rows:
                await s.ledger.record_attempt(late)
            return await write_task_row(record)

        s.ledger.record_task = exact_row_lands_first  # type: ignore[method-assign]
        handle = await s.start(
            AnswersThenWaits.run, PausedInput(spec=task_spec(expected_steps=1), model=MODEL)
        )
        await eventually(lambda: lossy.lost, within=60, what="a call goes silent on lossy/0")
        await handle.signal(AnswersThenWaits.finish)
        await asyncio.wait_for(handle.result(), 60)

        # The lost call's row; a call cut on lossy/0 before it (a busy machine) has one too.
        [exact] = [row for row in held.rows if row.activity_id in lossy.lost]
        run_id = (await handle.describe()).run_id or ""
        rows = await s.ledger.attempts_for(handle.id, run_id)
        [stored] = [r for r in rows if r.activity_id == exact.activity_id]
        assert not stored.provisional and stored.cost_micros == exact.cost_micros
        book = await s.ledger.task(handle.id, run_id)
        assert book is not None
        assert book.spend_micros == sum(r.cost_micros for r in rows)
        # The task row holds the estimate the workflow billed; the ledger counts the bill.
        breakdown = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
        assert book.spend_at_close_micros == breakdown.spend_micros
        assert book.moved_micros == book.spend_micros - breakdown.spend_micros > 0

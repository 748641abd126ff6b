"""The books balance after any kind of run: what finance reads agrees with what really ran.

One stack of simulated replicas runs tasks that end every way a task can end: normally, cut
mid-stream and resumed elsewhere, cancelled mid-call, timed out (its row then written by
`reconcile`), and while the ledger is locked by another writer for longer than a heartbeat
timeout. Afterwards, for every task:

- every attempt the workflow made has exactly one ledger row, exact (not an estimate), priced
  to the micro-dollar from its own usage and the prices stored with it;
- the task row's spend is the sum of its attempt rows, and equals `KvflowSpendMicros` and the
  `kvflow_spend` query's total;
- every closed workflow has one task row whose outcome matches the workflow's status.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle

from kvflow.ledger.records import TaskBook, TaskOutcome
from kvflow.workers.reconcile import reconcile
from kvflow.workflows import search_attributes
from kvflow.workflows.agent import SPEND_QUERY, SpendBreakdown
from tests import agent_workflows as wf
from tests.history import wait_until_streaming
from tests.test_workflows import MODEL, Stack, _spec, cheap_pool_that_crashes, stack

OUTCOMES = {
    WorkflowExecutionStatus.COMPLETED: {TaskOutcome.SUCCEEDED},
    WorkflowExecutionStatus.FAILED: {TaskOutcome.FAILED, TaskOutcome.COMPENSATED},
    WorkflowExecutionStatus.CANCELED: {TaskOutcome.CANCELLED},
    WorkflowExecutionStatus.TIMED_OUT: {TaskOutcome.TIMED_OUT},
}


async def _settled(handle: WorkflowHandle[Any, Any]) -> None:
    """Wait, bounded, for the task to close however it ends."""
    try:
        await asyncio.wait_for(handle.result(), timeout=120)
    except TimeoutError:
        raise
    except Exception:
        pass  # failed, cancelled and timed-out tasks are part of the point


async def assert_books_balance(s: Stack, handle: WorkflowHandle[Any, Any]) -> TaskBook:
    description = await handle.describe()
    run_id = description.run_id or ""
    task = await s.ledger.task(handle.id, run_id)
    assert task is not None, f"{handle.id} closed {description.status} without a task row"
    assert description.status is not None
    assert task.outcome in OUTCOMES[description.status], (description.status, task.outcome)
    attempts = await s.ledger.attempts_for(handle.id, run_id)
    for row in attempts:
        assert not row.provisional, f"{handle.id}: an estimate stands for {row.activity_id}"
        exact = row.prices.cost_micros(row.prompt_tokens, row.cached_tokens, row.completion_tokens)
        assert row.cost_micros == exact, (row.activity_id, row.cost_micros, exact)
    assert task.spend_micros == sum(row.cost_micros for row in attempts)
    if task.source == "workflow":
        # The workflow's own books at the close agree with the ledger's: the query, the
        # search attribute and the task row's figure at the close.
        assert task.spend_at_close_micros == task.spend_micros, task
        breakdown = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
        made = [a for step in breakdown.steps for a in step.attempts]
        assert len(made) == len(attempts), (handle.id, made, attempts)
        assert breakdown.spend_micros == task.spend_micros
        spend_attribute = description.typed_search_attributes.get(search_attributes.SPEND_MICROS)
        assert spend_attribute == task.spend_micros
    return task


async def test_every_way_a_task_ends_leaves_the_ledger_exact(
    temporal_client: Client, tmp_path: Path
):
    wf.REFUNDS.clear()
    wf.REVERSED.clear()
    # The cheap replica dies mid-stream on its first long call; the backups take over.
    async with stack(temporal_client, tmp_path, cheap_pool_that_crashes(backups=2)) as s:
        # Short answers first: they fit under the cheap replica's crash point.
        normal = await s.start(
            wf.MultiStepAgent.run,
            wf.StepsInput(spec=_spec(expected_steps=3), model=MODEL, steps=3, max_tokens=8),
        )
        await _settled(normal)
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
            wf.StepsInput(spec=_spec(expected_steps=2), model=MODEL, steps=2, max_tokens=8),
        )
        await _settled(slow_ledger)
        release.join()
        blocker.close()
        # A long answer: the cheap replica dies mid-stream and the call resumes on backup.
        cut = await s.start(
            wf.MultiStepAgent.run,
            wf.StepsInput(spec=_spec(expected_steps=1), model=MODEL, steps=1, max_tokens=60),
        )
        await _settled(cut)
        refund = wf.Refund(account="C-9", amount_cents=300)
        cancelled = await s.start(
            wf.RefundThenReply.run,
            wf.RefundInput(
                spec=_spec(expected_steps=2), model=MODEL, refund=refund, max_tokens=3000
            ),
        )
        await wait_until_streaming(cancelled)
        await cancelled.cancel()
        timed_out = await s.client.start_workflow(
            wf.MultiStepAgent.run,
            wf.StepsInput(spec=_spec(expected_steps=2), model=MODEL, steps=2, max_tokens=3000),
            id=f"timed-out-{tmp_path.name}",
            task_queue=s.task_queue,
            execution_timeout=timedelta(seconds=3),
        )
        handles = [normal, slow_ledger, cut, cancelled, timed_out]
        await asyncio.gather(*(_settled(h) for h in handles))

        # The timed-out run never ran its own close: reconcile writes its row.
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

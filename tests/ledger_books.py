"""What a test that ran tasks asserts of the books afterwards: the ledger agrees with Temporal.

`assert_books_balance(stack, handle)`: the closed task has one task row whose outcome matches
the workflow's status; every attempt the workflow made has one exact row, priced to the
micro-dollar; the task's spend is the sum of its rows and, for a row the workflow wrote,
equals its own figures at the close (the `kvflow_spend` query, `KvflowSpendMicros`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio.client import WorkflowExecutionStatus, WorkflowHandle

from kvflow.ledger.records import TaskBook, TaskOutcome
from kvflow.workflows import search_attributes
from kvflow.workflows.agent import SPEND_QUERY, SpendBreakdown
from tests.stacks import Stack

OUTCOMES = {
    WorkflowExecutionStatus.COMPLETED: {TaskOutcome.SUCCEEDED},
    WorkflowExecutionStatus.FAILED: {TaskOutcome.FAILED, TaskOutcome.COMPENSATED},
    WorkflowExecutionStatus.CANCELED: {TaskOutcome.CANCELLED},
    WorkflowExecutionStatus.TIMED_OUT: {TaskOutcome.TIMED_OUT},
}


async def settled(handle: WorkflowHandle[Any, Any]) -> None:
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

"""Activities a task starts without `agent.tool` (a framework's tools) end by its deadline.

A real Temporal dev server and a workflow worker with `KvflowPlugin`, which installs
`TaskDeadlineInterceptor`; the history says what each activity was given.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType, TimeoutType
from temporalio.client import Client, WorkflowFailureError

from kvflow.ledger.records import TaskOutcome
from tests import agent_workflows as wf
from tests.stacks import PoolPlan, fleet_stack, task_spec


@pytest.mark.timeout(90)
async def test_tool_of_another_library_is_cut_at_the_deadline_and_the_saga_still_undoes(
    temporal_client: Client, tmp_path: Path
) -> None:
    wf.REVERSED.clear()
    refund = wf.Refund(account="D-1", amount_cents=120)
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("gpu")]) as s:
        # 2 s of budget, a tool that takes 30 s under its own 60 s timeout.
        handle = await s.start(
            wf.RawActivityInBlock.run,
            wf.RawActivityInput(spec=task_spec(latency_budget_s=2.0), seconds=30.0, refund=refund),
        )
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        history = await handle.fetch_history()
        scheduled = {
            e.event_id: e.activity_task_scheduled_event_attributes
            for e in history.events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        }
        by_type = {a.activity_type.name: a for a in scheduled.values()}
        slow = by_type["slow_lookup"]
        budget = timedelta(seconds=2)
        assert timedelta(0) < slow.schedule_to_close_timeout.ToTimedelta() <= budget
        assert slow.start_to_close_timeout.ToTimedelta() <= budget
        # It timed out at the cap, not after the 30 s it would have taken.
        (timed_out,) = [
            e.activity_task_timed_out_event_attributes
            for e in history.events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT
        ]
        assert timed_out.failure.timeout_failure_info.timeout_type in (
            TimeoutType.TIMEOUT_TYPE_SCHEDULE_TO_CLOSE,
            TimeoutType.TIMEOUT_TYPE_START_TO_CLOSE,
        )
        # The compensation runs after the deadline on purpose: its own 60 s, no cap.
        undo = by_type["reverse_refund"]
        assert undo.start_to_close_timeout.ToTimedelta() == timedelta(seconds=60)
        assert undo.schedule_to_close_timeout.ToTimedelta() in (timedelta(0), None)
        assert [refund] == wf.REVERSED
        run_id = (await handle.describe()).run_id or ""
        task = await s.ledger.task(handle.id, run_id)
        assert task is not None and task.outcome == TaskOutcome.COMPENSATED

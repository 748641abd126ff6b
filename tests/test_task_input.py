"""A task's input and its clock: bad input fails the task at once with `InvalidTask` and a
message that names the value and the fix; the latency budget counts from the workflow's start.

Real Temporal dev server, simulated replicas, real GPU workers and a SQLite ledger, built by
`tests.test_workflows.stack`.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, timedelta
from pathlib import Path

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from kvflow.activities.inference import INFER_ACTIVITY
from kvflow.activities.wire import InferenceRequest
from kvflow.ledger.records import TaskOutcome
from kvflow.workers.workflow_worker import workflow_worker
from kvflow.workflows.agent import TaskSpec
from tests import agent_workflows as wf
from tests.test_workflows import MODEL, PoolPlan, stack

RESULT_TIMEOUT_S = 60
"""How long a test waits for a task's result before it calls the task hung."""
WORKER_OUTAGE_S = 3.0
"""How long a started task waits for a workflow worker in the outage test."""


# ---- the task's clock --------------------------------------------------------------------------


async def test_budget_counts_from_the_workflow_start_not_from_a_late_first_workflow_task(
    temporal_client: Client, tmp_path: Path
):
    budget_s = 120.0
    async with stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        # Started while no workflow worker polls its queue: the first workflow task waits.
        queue = f"late-{uuid.uuid4()}"
        task = wf.StepsInput(
            spec=TaskSpec(tenant="acme", latency_budget_s=budget_s), model=MODEL, steps=1
        )
        handle = await s.client.start_workflow(
            wf.MultiStepAgent.run, task, id=f"task-{uuid.uuid4()}", task_queue=queue
        )
        await asyncio.sleep(WORKER_OUTAGE_S)
        worker = await workflow_worker(
            s.client,
            s.control,
            workflows=wf.ALL_WORKFLOWS,
            activities=wf.ALL_ACTIVITIES,
            task_queue=queue,
        )
        async with worker:
            await asyncio.wait_for(handle.result(), RESULT_TIMEOUT_S)
        history = await handle.fetch_history()
        run_id = (await handle.describe()).run_id or ""
        row = await s.ledger.task(handle.id, run_id)

    events = history.events
    assert events[0].event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED
    started = events[0].event_time.ToDatetime(tzinfo=UTC)
    first_task = next(
        e.event_time.ToDatetime(tzinfo=UTC)
        for e in events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED
    )
    # The outage happened: the first workflow task started well after the workflow.
    assert first_task - started >= timedelta(seconds=WORKER_OUTAGE_S)

    # The task row and the deadline the model call carried are anchored at the start.
    assert row is not None and row.outcome == TaskOutcome.SUCCEEDED
    assert row.started_at == started
    [scheduled] = [
        e.activity_task_scheduled_event_attributes
        for e in events
        if e.activity_task_scheduled_event_attributes.activity_type.name == INFER_ACTIVITY
    ]
    [request] = await temporal_client.data_converter.decode(
        scheduled.input.payloads, [InferenceRequest]
    )
    assert isinstance(request, InferenceRequest)
    assert request.deadline == started + timedelta(seconds=budget_s)

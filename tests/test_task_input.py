"""A task's input and its clock: bad input fails the task at once with `InvalidTask` and a
message that names the value and the fix; the latency budget counts from the workflow's start.

Real Temporal dev server, simulated replicas, real GPU workers and a SQLite ledger, built by
`tests.stacks.fleet_stack`.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, timedelta
from typing import Any

import pytest
from pydantic import ValidationError
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import ApplicationError

from kvflow.activities.inference import INFER_ACTIVITY
from kvflow.activities.wire import ChatMessage, InferenceRequest
from kvflow.ledger.records import TaskOutcome
from kvflow.workers.workflow_worker import workflow_worker
from kvflow.workflows import errors
from kvflow.workflows.agent import TaskSpec
from tests import agent_workflows as wf
from tests.stacks import MODEL, PoolPlan, Stack, fleet_stack

RESULT_TIMEOUT_S = 60
"""How long a test waits for a task's result before it calls the task hung."""
WORKER_OUTAGE_S = 3.0
"""How long a started task waits for a workflow worker in the outage test."""


@pytest.fixture(scope="module")
async def one_pool(
    temporal_client: Client, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    """One stack for the module: its fleet has tenants acme and globex and one model."""
    async with fleet_stack(
        temporal_client, tmp_path_factory.mktemp("input"), [PoolPlan("only")]
    ) as s:
        yield s


# ---- budgets pydantic can check: refused where the TaskSpec is built ---------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tenant", ""),
        ("latency_budget_s", -5.0),
        ("latency_budget_s", 0.0),
        ("latency_budget_s", math.inf),
        ("latency_budget_s", math.nan),
        ("latency_budget_s", 1e20),
        ("retry_budget", -1),
        ("retry_budget", 1_000_000),
        ("expected_steps", 0),
        ("expected_steps", 10**9),
        ("schema_repairs", 500),
        ("budget_micros", -1),
        ("budget_micros", 10**20),
    ],
)
def test_task_spec_refuses_a_negative_or_absurd_budget_naming_the_field(field: str, value: Any):
    with pytest.raises(ValidationError) as refused:
        TaskSpec(**{"tenant": "acme", field: value})
    assert refused.value.errors()[0]["loc"] == (field,)
    assert field in str(refused.value)


def test_task_spec_takes_generous_budgets():
    spec = TaskSpec(
        tenant="acme",
        latency_budget_s=7 * 86_400,
        retry_budget=100,
        expected_steps=10_000,
        schema_repairs=10,
        budget_micros=50_000 * 1_000_000,
    )
    assert spec.latency_budget_s == 604_800


# ---- input only the fleet can check: the task fails at once with InvalidTask ------------------

HELLO = [ChatMessage(role="user", content="Say hello.")]
TOO_LONG_PROMPT = "word " * 40_000
"""About 40,000 tokens: more than the model's context of 32,768."""

BAD_CALLS: dict[str, tuple[dict[str, Any], list[str]]] = {
    "unknown tenant": (
        {"spec": TaskSpec(tenant="hooli")},
        ["unknown tenant 'hooli'", "one of acme, globex", "[[tenants]]"],
    ),
    "unknown model": (
        {"model": "gpt-9"},
        ["unknown model 'gpt-9'", f"one of {MODEL}", "[[models]]"],
    ),
    "prompt over the context": (
        {"messages": None, "prompt": TOO_LONG_PROMPT},
        ["40,002 tokens", "32,768", "shorten the prompt or lower max_tokens"],
    ),
    "output over the context": (
        {"max_tokens": 100_000},
        ["max_tokens 100,000", "32,768"],
    ),
    "empty messages": ({"messages": []}, ["`messages` is empty"]),
    "neither messages nor prompt": ({"messages": None}, ["exactly one of `messages`"]),
    "no output tokens": ({"max_tokens": 0}, ["max_tokens is 0", "at least 1"]),
    "empty model name": ({"model": ""}, ["model is empty"]),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
async def test_bad_call_fails_the_task_at_once_with_invalid_task_naming_the_value_and_fix(
    one_pool: Stack, case: str
):
    fields, expected = BAD_CALLS[case]
    task = wf.CallInput(
        **{"spec": TaskSpec(tenant="acme"), "model": MODEL, "messages": HELLO, **fields}
    )
    handle = await one_pool.start(wf.OneCall.run, task)
    with pytest.raises(WorkflowFailureError) as failed:
        await asyncio.wait_for(handle.result(), RESULT_TIMEOUT_S)

    cause = failed.value.cause
    assert isinstance(cause, ApplicationError) and cause.non_retryable, cause
    assert cause.type == errors.TaskErrorType.INVALID_TASK, cause.message
    assert cause.message.startswith("step 1/1 'call': ")
    for text in expected:
        assert text in cause.message
    # Failed as a task, not a workflow task Temporal retries, and before any model call.
    history = await handle.fetch_history()
    kinds = {e.event_type for e in history.events}
    assert EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED not in kinds
    activities = {
        e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
    }
    assert INFER_ACTIVITY not in activities
    row = await one_pool.ledger.task(handle.id, (await handle.describe()).run_id or "")
    assert row is not None and row.outcome == TaskOutcome.FAILED


# ---- the task's clock --------------------------------------------------------------------------


async def test_budget_counts_from_the_workflow_start_not_from_a_late_first_workflow_task(
    one_pool: Stack,
):
    budget_s = 120.0
    s = one_pool
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
    [request] = await s.client.data_converter.decode(scheduled.input.payloads, [InferenceRequest])
    assert isinstance(request, InferenceRequest)
    assert request.deadline == started + timedelta(seconds=budget_s)

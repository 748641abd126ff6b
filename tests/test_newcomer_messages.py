"""What a first-time user reads when they get something wrong or watch a task run.

A budget out of range names the field, its unit and its range; the step counter's numerator and
denominator count the same thing (model calls); an expected failure logs one line, not a
traceback; the example fleet file explains each setting once. The task tests run on a real
Temporal dev server with simulated replicas and real workers (`tests.stacks.fleet_stack`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError

from kvflow import ChatMessage, TaskSpec
from kvflow.simulator import FaultSpec
from kvflow.workflows import errors
from tests import agent_workflows as wf
from tests.stacks import MODEL, PoolPlan, Stack, fleet_stack, refund_task

ROOT = Path(__file__).parent.parent
RESULT_TIMEOUT_S = 60
"""How long a test waits for a task's result before it calls the task hung."""

# ---- TaskSpec budgets: the refusal says what the field counts and what it takes ----------------


def _refusal(**budget: object) -> str:
    with pytest.raises(ValidationError) as refused:
        TaskSpec(tenant="acme", **budget)
    [error] = refused.value.errors()
    assert error["loc"] == (next(iter(budget)),)
    return str(error["msg"])


def test_a_40_day_latency_budget_is_refused_in_seconds_and_days():
    message = _refusal(latency_budget_s=40 * 86_400)
    assert message == (
        "latency_budget_s must be more than 0 s and at most 30 days (2,592,000 s), in seconds "
        "(2 minutes is 120), or None for no deadline; got 3,456,000 s (40 days)"
    )


def test_a_negative_latency_budget_is_refused_with_the_range_not_a_generic_message():
    message = _refusal(latency_budget_s=-5)
    assert message.startswith("latency_budget_s must be more than 0 s and at most 30 days")
    assert message.endswith("got -5 s")
    assert "greater than" not in message


@pytest.mark.parametrize(
    ("budget", "says"),
    [
        ({"step_slo_s": 0}, ["step_slo_s must be more than 0 s", "30 days", "got 0 s"]),
        ({"step_slo_s": float("nan")}, ["step_slo_s must be", "got nan"]),
        ({"expected_tool_s": -1.5}, ["expected_tool_s must be at least 0 s", "got -1.5 s"]),
        ({"retry_budget": -1}, ["retry_budget must be between 0 and 100 re-placements; got -1"]),
        (
            {"expected_steps": 10**9},
            ["expected_steps must be between 1 and 10,000 model calls; got 1,000,000,000"],
        ),
        ({"schema_repairs": 500}, ["schema_repairs must be between 0 and 10 re-asks; got 500"]),
        (
            {"budget_micros": -1},
            ["budget_micros must be between $0 and $1,000,000", "micro-dollars", "(-$0.000001)"],
        ),
        (
            {"budget_micros": 2_000_000 * 1_000_000},
            ["$2.50 is 2,500,000", "got 2,000,000,000,000 micro-dollars ($2,000,000)"],
        ),
    ],
)
def test_every_budget_refusal_names_its_field_unit_and_range(
    budget: dict[str, object], says: list[str]
):
    message = _refusal(**budget)
    for part in says:
        assert part in message


def test_budgets_at_the_edges_of_their_ranges_are_taken():
    spec = TaskSpec(
        tenant="acme",
        latency_budget_s=30 * 86_400,
        step_slo_s=0.001,
        expected_tool_s=0,
        retry_budget=0,
        expected_steps=10_000,
        schema_repairs=10,
        budget_micros=0,
    )
    assert spec.latency_budget_s == 2_592_000 and spec.budget_micros == 0


# ---- the example fleet file ------------------------------------------------------------------


def test_the_example_fleet_file_explains_each_commented_setting_once():
    text = (ROOT / "fleet.toml").read_text()
    settings = re.findall(r"^# ?([a-z_]+) = ", text, flags=re.MULTILINE)
    assert settings, "the example fleet file lost its commented settings"
    repeated = sorted({name for name in settings if settings.count(name) > 1})
    assert repeated == []


# ---- tasks on a real stack -------------------------------------------------------------------


@pytest.fixture(scope="module")
async def stack(
    temporal_client: Client, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    """One pool for the module; its fleet has tenants acme and globex."""
    async with fleet_stack(
        temporal_client, tmp_path_factory.mktemp("newcomer"), [PoolPlan("only")]
    ) as s:
        yield s


async def _failure(handle: WorkflowHandle[Any, Any]) -> ApplicationError:
    with pytest.raises(WorkflowFailureError) as failed:
        await asyncio.wait_for(handle.result(), RESULT_TIMEOUT_S)
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError), cause
    return cause


async def _summaries(handle: WorkflowHandle[Any, Any], activity_type: str) -> list[str]:
    """The UI summaries of the activities of `activity_type` the task scheduled, in order."""
    converter = handle._client.data_converter.payload_converter
    history = await handle.fetch_history()
    return [
        str(converter.from_payload(e.user_metadata.summary, str))
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == activity_type
    ]


@pytest.mark.timeout(120)
async def test_a_tool_before_the_only_model_call_does_not_push_the_counter_past_its_total(
    stack: Stack,
):
    refund = wf.Refund(account=f"N-{uuid.uuid4().hex[:6]}", amount_cents=300)
    # One model call declared, one made; the refund tool before it is no model call.
    handle = await stack.start(wf.RefundThenReply.run, refund_task(refund, expected_steps=1))
    await asyncio.wait_for(handle.result(), RESULT_TIMEOUT_S)

    [reply] = await _summaries(handle, "kvflow.infer")
    assert reply.startswith("step 1/1 'reply' · ")


@pytest.mark.timeout(120)
async def test_a_failed_tool_is_named_as_a_tool_not_as_a_numbered_model_call(stack: Stack):
    trip = wf.Trip(traveller=f"traveller-{uuid.uuid4().hex[:8]}")
    task = wf.TripInput(spec=TaskSpec(tenant="acme"), trip=trip, charge_attempts=1)
    cause = await _failure(await stack.start(wf.BookTrip.run, task))

    assert cause.type == errors.TaskErrorType.TOOL_FAILED
    assert cause.message.startswith("tool 'charge card': "), cause.message


def _of_task(caplog: pytest.LogCaptureFixture, handle: WorkflowHandle[Any, Any]) -> list[Any]:
    """The activity log records of `handle`'s task (other tests' tasks share the process)."""
    return [
        r
        for r in caplog.records
        if getattr(r, "temporal_activity", {}).get("workflow_id") == handle.id
    ]


def _completions(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    return [r for r in records if r.getMessage().startswith("Completing activity as failed")]


@pytest.mark.timeout(120)
async def test_an_unknown_tenant_logs_one_warning_line_and_its_traceback_only_at_debug(
    stack: Stack, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.DEBUG, logger="temporalio.activity")
    refund = wf.Refund(account=f"N-{uuid.uuid4().hex[:6]}", amount_cents=300)
    handle = await stack.start(wf.RefundThenReply.run, refund_task(refund, tenant="acmee"))
    cause = await _failure(handle)
    assert cause.type == errors.TaskErrorType.INVALID_TASK
    assert "unknown tenant 'acmee'" in cause.message

    ours = _of_task(caplog, handle)
    loud = [r for r in ours if r.levelno >= logging.INFO]
    assert [r for r in loud if r.exc_info] == [], "an expected refusal printed a traceback"
    [line] = [r for r in loud if "PlacementInputError" in r.getMessage()]
    assert line.levelno == logging.WARNING
    assert line.getMessage().startswith(
        "kvflow.place failed: PlacementInputError: unknown tenant 'acmee'"
    )
    # Still there for whoever turns DEBUG on.
    assert [r.levelno for r in _completions(ours)] == [logging.DEBUG]


@pytest.mark.timeout(120)
async def test_an_unexpected_tool_exception_still_logs_its_traceback(
    stack: Stack, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.DEBUG, logger="temporalio.activity")
    trip = wf.Trip(traveller=f"traveller-{uuid.uuid4().hex[:8]}")
    task = wf.TripInput(spec=TaskSpec(tenant="acme"), trip=trip, charge_attempts=1)
    handle = await stack.start(wf.BookTrip.run, task)
    await _failure(handle)

    [record] = _completions(_of_task(caplog, handle))
    assert record.levelno == logging.WARNING and record.exc_info is not None
    assert isinstance(record.exc_info[1], RuntimeError)


@pytest.mark.timeout(120)
async def test_a_replica_answering_500_logs_one_info_line_per_attempt_and_no_traceback(
    temporal_client: Client, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.DEBUG, logger="temporalio.activity")
    broken = [PoolPlan("broken", faults=FaultSpec(error=500))]
    async with fleet_stack(temporal_client, tmp_path, broken) as s:
        call = wf.CallInput(
            spec=TaskSpec(tenant="acme", retry_budget=1),
            model=MODEL,
            messages=[ChatMessage(role="user", content="Say hello.")],
        )
        handle = await s.start(wf.OneCall.run, call)
        await _failure(handle)

    ours = _of_task(caplog, handle)
    assert [r for r in ours if r.levelno >= logging.INFO and r.exc_info] == []
    lines = [r for r in ours if "ReplicaServerError" in r.getMessage() and not r.exc_info]
    assert lines, "the engine's 500 was not logged"
    assert all(r.levelno == logging.INFO for r in lines)
    assert lines[0].getMessage().startswith("kvflow.infer failed: ReplicaServerError: ")

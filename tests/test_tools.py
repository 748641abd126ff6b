"""Tool calls are bounded: a tool that keeps failing fails its task with `ToolFailed`, the
deadline cuts off a tool that would retry past it, the saga's compensations run either way,
and a tool retried after its answer was lost finds its first attempt's work by its key.

A task cut off at its deadline does not outlive its latency budget by more than one heartbeat
timeout plus the time its compensations took. Real Temporal dev server, simulated replicas,
real GPU workers and a SQLite ledger, built by `tests.stacks.fleet_stack`.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType, RetryState, TimeoutType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle, WorkflowHistory
from temporalio.exceptions import ApplicationError

from kvflow.ledger.records import TaskOutcome
from kvflow.workflows import errors
from kvflow.workflows.agent import HEARTBEAT_TIMEOUT, SPEND_QUERY, SpendBreakdown, TaskSpec
from tests import agent_workflows as wf
from tests.stacks import PoolPlan, Stack, assert_replays, fleet_stack
from tests.waiting import slowdown

RESULT_TIMEOUT_S = 60
"""How long a test waits for a task's result before it calls the task hung."""


def _trip(**kwargs: Any) -> wf.Trip:
    return wf.Trip(traveller=f"traveller-{uuid.uuid4().hex[:8]}", **kwargs)


async def _failure(handle: WorkflowHandle[Any, Any]) -> ApplicationError:
    with pytest.raises(WorkflowFailureError) as failed:
        await asyncio.wait_for(handle.result(), RESULT_TIMEOUT_S)
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError) and cause.non_retryable, cause
    return cause


def _time(event: HistoryEvent) -> datetime:
    return event.event_time.ToDatetime(tzinfo=UTC)


def _scheduled(history: WorkflowHistory, activity_type: str) -> list[HistoryEvent]:
    return [
        e
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == activity_type
    ]


def _ended(history: WorkflowHistory, scheduled: HistoryEvent) -> HistoryEvent:
    """The event that closed the activity `scheduled` started (completed, failed, timed out)."""
    for event in history.events:
        for attributes in (
            event.activity_task_completed_event_attributes,
            event.activity_task_failed_event_attributes,
            event.activity_task_timed_out_event_attributes,
        ):
            if attributes.scheduled_event_id == scheduled.event_id:
                return event
    raise AssertionError(f"activity {scheduled.event_id} never ended")


def assert_closed_within_budget(history: WorkflowHistory, budget_s: float) -> None:
    """The task closed no later than its budget plus a heartbeat timeout plus its compensations,
    all measured on the history's own clock, from the `WorkflowExecutionStarted` event.

    The budget is the workflow's own timer; only the slack after it (the heartbeat timeout the
    last attempt may take to be given up on) is stretched on a slow machine.
    """
    started, closed = history.events[0], history.events[-1]
    assert started.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED
    compensations = sum(
        (_time(_ended(history, s)) - _time(s) for s in _scheduled(history, "cancel_hotel")),
        timedelta(),
    )
    allowed = timedelta(seconds=budget_s) + HEARTBEAT_TIMEOUT * slowdown() + compensations
    took = _time(closed) - _time(started)
    print(f"\nbudget {budget_s:g} s: closed after {took.total_seconds():.2f} s of {allowed}")
    assert took <= allowed


async def _run_trip(s: Stack, task: wf.TripInput) -> tuple[ApplicationError, WorkflowHistory]:
    handle = await s.start(wf.BookTrip.run, task)
    cause = await _failure(handle)
    history = await handle.fetch_history()
    run_id = (await handle.describe()).run_id or ""
    row = await s.ledger.task(handle.id, run_id)
    assert row is not None and row.outcome == TaskOutcome.COMPENSATED
    spend = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
    assert [(step.kind, step.name, step.outcome) for step in spend.steps] == [
        ("tool", "book hotel", "ok"),
        ("tool", "charge card", "failed"),
        ("compensation", "undo book hotel", "ok"),
    ]
    await assert_replays(handle)
    return cause, history


# ---- a tool that keeps failing ----------------------------------------------------------------


async def test_tool_that_keeps_raising_fails_the_task_with_tool_failed_and_undoes_the_booking(
    temporal_client: Client, tmp_path: Path
):
    budget_s = 8.0
    trip = _trip()
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        task = wf.TripInput(spec=TaskSpec(tenant="acme", latency_budget_s=budget_s), trip=trip)
        cause, history = await _run_trip(s, task)

    assert cause.type == errors.TaskErrorType.TOOL_FAILED
    assert cause.message.startswith("tool 'charge card': ")
    assert "RuntimeError: the card of" in cause.message and "(attempt 3 of 3)" in cause.message
    # Three attempts (the default), then the booking was undone.
    assert wf.CHARGE_ATTEMPTS[trip.traveller] == [1, 2, 3]
    assert wf.CANCELLED.count(trip.traveller) == 1
    [charge] = _scheduled(history, "charge_card")
    [cancel] = _scheduled(history, "cancel_hotel")
    failed = _ended(history, charge)
    assert failed.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED
    assert (
        failed.activity_task_failed_event_attributes.retry_state
        == RetryState.RETRY_STATE_MAXIMUM_ATTEMPTS_REACHED
    )
    assert failed.event_id < cancel.event_id
    # The call was bounded by the task's deadline and a retry limit.
    attributes = charge.activity_task_scheduled_event_attributes
    assert attributes.retry_policy.maximum_attempts == 3
    # Workflow time is the workflow task's start, so that is what the bound counts from.
    deadline = _time(history.events[0]) + timedelta(seconds=budget_s)
    [*_, workflow_task] = (
        e
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED
        and e.event_id < charge.event_id
    )
    until_deadline = deadline - _time(workflow_task)
    assert timedelta(0) < attributes.schedule_to_close_timeout.ToTimedelta() <= until_deadline
    assert (
        attributes.start_to_close_timeout.ToTimedelta()
        <= attributes.schedule_to_close_timeout.ToTimedelta()
    )


async def test_tool_retried_without_limit_is_cut_off_at_the_deadline_and_compensated(
    temporal_client: Client, tmp_path: Path
):
    budget_s = 4.0
    trip = _trip()
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        task = wf.TripInput(
            spec=TaskSpec(tenant="acme", latency_budget_s=budget_s), trip=trip, charge_attempts=0
        )
        cause, history = await _run_trip(s, task)

    assert cause.type == errors.TaskErrorType.DEADLINE_EXCEEDED
    assert "'charge card'" in cause.message and "4 s latency budget ran out" in cause.message
    assert "RuntimeError: the card of" in cause.message
    # It was retried until the deadline stopped it, then the booking was undone.
    assert len(wf.CHARGE_ATTEMPTS[trip.traveller]) >= 2
    assert wf.CANCELLED.count(trip.traveller) == 1
    [charge] = _scheduled(history, "charge_card")
    [cancel] = _scheduled(history, "cancel_hotel")
    assert _ended(history, charge).event_id < cancel.event_id
    assert_closed_within_budget(history, budget_s)


# ---- a tool whose answer was lost -------------------------------------------------------------


async def test_booking_retried_after_its_answer_was_lost_is_made_once_under_one_key(
    temporal_client: Client, tmp_path: Path
):
    trip = _trip(card_declined=False, lose_first_booking_answer=True)
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        handle = await s.start(
            wf.BookTrip.run, wf.TripInput(spec=TaskSpec(tenant="acme"), trip=trip)
        )
        booking = await asyncio.wait_for(handle.result(), RESULT_TIMEOUT_S)
        history = await handle.fetch_history()
        run_id = (await handle.describe()).run_id or ""

    [book] = _scheduled(history, "book_hotel")
    activity_id = book.activity_task_scheduled_event_attributes.activity_id
    key = f"{handle.id}/{run_id}/{activity_id}"
    # Both attempts saw the same key; the second found the first one's booking.
    assert wf.BOOKING_KEYS[trip.traveller] == [key, key]
    assert wf.BOOKINGS[key] == booking
    assert trip.traveller not in wf.CANCELLED


async def test_a_tool_that_heartbeats_is_retried_when_its_heartbeats_stop(
    temporal_client: Client, tmp_path: Path
) -> None:
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        trip = _trip()
        handle = await s.start(
            wf.CheckIn.run, wf.TripInput(spec=TaskSpec(tenant="acme"), trip=trip)
        )
        assert await asyncio.wait_for(handle.result(), RESULT_TIMEOUT_S) == (
            f"checked in {trip.traveller}"
        )
        history = await handle.fetch_history()
        [scheduled] = _scheduled(history, "check_in")
        assert scheduled.activity_task_scheduled_event_attributes.heartbeat_timeout.seconds == 1
        # The attempt that went silent was given up on for its heartbeats, not after the 60 s
        # start-to-close limit: the attempt that succeeded records it as its last failure.
        [started] = [
            e
            for e in history.events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
            and e.activity_task_started_event_attributes.scheduled_event_id == scheduled.event_id
        ]
        attrs = started.activity_task_started_event_attributes
        assert attrs.attempt == 2
        timeout = attrs.last_failure.timeout_failure_info
        assert timeout.timeout_type == TimeoutType.TIMEOUT_TYPE_HEARTBEAT, attrs.last_failure

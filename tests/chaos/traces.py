"""What a task's history says happened: where each call was placed, by which worker, and how
each attempt ended.

The fault suite checks its invariants against history, the one record that survives every
process it kills: a placement is a local-activity marker (its result is the `PlaceAnswer`), the
workflow worker that made it is the identity of the workflow task that recorded the marker,
and an attempt is a `kvflow.infer` activity with its scheduled, started and closing events.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from temporalio.api.enums.v1 import EventType, TimeoutType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client, WorkflowHandle

from kvflow.activities.control_plane import OBSERVE_ACTIVITY, PLACE_ACTIVITY
from kvflow.activities.inference import INFER_ACTIVITY
from kvflow.activities.wire import PlaceAnswer

_CLOSED_ATTEMPT = {
    EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED: "ok",
    EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED: "failed",
    EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT: "timed_out",
    EventType.EVENT_TYPE_ACTIVITY_TASK_CANCELED: "cancelled",
}


@dataclass
class PlacedCall:
    """One placement decision, as recorded."""

    at: datetime
    """When the placing local activity completed on the worker."""
    worker: str
    """The identity (`pid@host`) of the workflow worker whose scheduler decided."""
    replica: str
    probe: bool
    rendezvous: bool
    reason: str


@dataclass
class Attempt:
    """One dispatch of an inference call to a GPU worker's task queue."""

    activity_id: str
    task_queue: str
    scheduled_at: datetime
    started: bool = False
    """A GPU worker took it (history has its started event): it must be billed."""
    outcome: str = "open"
    """ok, failed, timed_out, cancelled, or open while it runs."""
    timeout: str | None = None
    """The timeout type when it timed out, e.g. SCHEDULE_TO_START, HEARTBEAT."""
    error_type: str | None = None
    closed_at: datetime | None = None

    @property
    def replica(self) -> str:
        """`pool/index` from the queue `kvflow.gpu.<pool>.<index>`."""
        pool, index = self.task_queue.rsplit(".", 2)[-2:]
        return f"{pool}/{index}"


@dataclass
class Observation:
    """A call's outcome told to one worker's scheduler (the observe local activity)."""

    at: datetime
    worker: str
    replica: str
    ok: bool


@dataclass
class TaskTrace:
    """The placements, attempts and observations of one workflow run."""

    workflow_id: str
    run_id: str
    placements: list[PlacedCall] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    observations: list[Observation] = field(default_factory=list)
    worker_identities: set[str] = field(default_factory=set)
    """Every workflow worker that completed one of its workflow tasks."""

    @property
    def first_replica(self) -> str | None:
        """Where its first call was placed: the replica its prefix went to."""
        return self.placements[0].replica if self.placements else None


def _time(event: HistoryEvent) -> datetime:
    return event.event_time.ToDatetime(tzinfo=UTC)


def _json(data: bytes) -> Any:
    return json.loads(data) if data else None


async def trace(client: Client, handle: WorkflowHandle[Any, Any]) -> TaskTrace:
    """Read `handle`'s history (its latest run) into a `TaskTrace`."""
    description = await handle.describe()
    history = await handle.fetch_history()
    result = TaskTrace(workflow_id=handle.id, run_id=description.run_id or "")
    by_scheduled: dict[int, Attempt] = {}
    identity = ""
    for event in history.events:
        kind = event.event_type
        if kind == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
            identity = event.workflow_task_completed_event_attributes.identity
            result.worker_identities.add(identity)
        elif kind == EventType.EVENT_TYPE_MARKER_RECORDED:
            await _marker(client, event, identity, result)
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            attrs = event.activity_task_scheduled_event_attributes
            if attrs.activity_type.name == INFER_ACTIVITY:
                attempt = Attempt(
                    activity_id=attrs.activity_id,
                    task_queue=attrs.task_queue.name,
                    scheduled_at=_time(event),
                )
                by_scheduled[event.event_id] = attempt
                result.attempts.append(attempt)
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            scheduled = event.activity_task_started_event_attributes.scheduled_event_id
            if scheduled in by_scheduled:
                by_scheduled[scheduled].started = True
        elif kind in _CLOSED_ATTEMPT:
            _close(event, by_scheduled)
    return result


async def _marker(client: Client, event: HistoryEvent, identity: str, into: TaskTrace) -> None:
    details = event.marker_recorded_event_attributes.details
    if "data" not in details or not details["data"].payloads:
        return
    data = _json(details["data"].payloads[0].data) or {}
    kind = data.get("activity_type")
    complete = data.get("complete_time") or {}
    at = datetime.fromtimestamp(
        int(complete.get("seconds", 0)) + int(complete.get("nanos", 0)) / 1e9, UTC
    )
    if kind == PLACE_ACTIVITY and "result" in details:
        [answer] = await client.data_converter.decode(details["result"].payloads, [PlaceAnswer])
        if answer.placement is not None:
            placement = answer.placement
            into.placements.append(
                PlacedCall(
                    at=at,
                    worker=identity,
                    replica=placement.replica,
                    probe=placement.probe,
                    rendezvous=placement.rendezvous,
                    reason=placement.reason,
                )
            )
    elif kind == OBSERVE_ACTIVITY:
        # The workflow observes each call right after its attempt closes; the calls of the
        # suite's workflows run one at a time, so it is the latest closed attempt.
        closed = [a for a in into.attempts if a.outcome != "open"]
        if closed:
            last = max(closed, key=lambda a: a.closed_at or a.scheduled_at)
            into.observations.append(
                Observation(at=at, worker=identity, replica=last.replica, ok=last.outcome == "ok")
            )


def _close(event: HistoryEvent, by_scheduled: dict[int, Attempt]) -> None:
    kind = event.event_type
    if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
        scheduled = event.activity_task_completed_event_attributes.scheduled_event_id
    elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED:
        scheduled = event.activity_task_failed_event_attributes.scheduled_event_id
    elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT:
        scheduled = event.activity_task_timed_out_event_attributes.scheduled_event_id
    else:
        scheduled = event.activity_task_canceled_event_attributes.scheduled_event_id
    attempt = by_scheduled.get(scheduled)
    if attempt is None:
        return
    attempt.outcome = _CLOSED_ATTEMPT[kind]
    attempt.closed_at = _time(event)
    if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED:
        failure = event.activity_task_failed_event_attributes.failure
        attempt.error_type = failure.application_failure_info.type or None
    elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT:
        failure = event.activity_task_timed_out_event_attributes.failure
        attempt.timeout = TimeoutType.Name(failure.timeout_failure_info.timeout_type).removeprefix(
            "TIMEOUT_TYPE_"
        )

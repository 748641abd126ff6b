"""What a tool activity can use about the call it serves: its idempotency key, and heartbeats.

`Agent.tool` runs a tool with a bounded number of attempts, and any attempt may have done its
work (booked the room, moved the money) before its worker died or its answer was lost. The
next attempt must then find that work instead of doing it again; the key below names the call
so that the system the tool changes can tell.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import timedelta

from temporalio import activity


def tool_idempotency_key() -> str:
    """The idempotency key of the tool call this activity attempt serves.

    `"{workflow_id}/{run_id}/{activity_id}"`: the same on every attempt of one call (Temporal
    keeps the activity id across retries, and the workflow gives it deterministically, so a
    replay asks for the same one), and different for every other call, task or run. Pass it to
    the system the tool changes as that system's idempotency key, or store it with what the
    tool created and look it up first:

        @activity.defn
        async def book_hotel(stay: Stay) -> str:
            return await hotels.book(stay, idempotency_key=kvflow.tool_idempotency_key())

    A new run (a workflow retry, a workflow id used again, a reset) makes new keys: a failed
    run's compensations have undone its work, so the new run does it afresh. After a reset,
    which ends the old run without compensations, undo what the old run's tools did by hand.

    Raises `RuntimeError` outside an activity of a workflow.
    """
    info = activity.info()
    if info.workflow_id is None or info.workflow_run_id is None:
        raise RuntimeError(
            f"tool_idempotency_key() names a tool call of a workflow; activity "
            f"{info.activity_type!r} was not started by one"
        )
    return f"{info.workflow_id}/{info.workflow_run_id}/{info.activity_id}"


@contextlib.asynccontextmanager
async def tool_heartbeats(every: timedelta = timedelta(seconds=1)) -> AsyncIterator[None]:
    """Heartbeat in the background while the block runs, so a lost worker is noticed early.

    A tool's attempt that dies with its worker is only noticed when its start-to-close limit
    passes (60 s by default). Wrap the tool's body and give `Agent.tool` a
    `heartbeat_timeout` a few times `every`: Temporal then retries the attempt elsewhere
    once the heartbeats stop, and a cancellation of the task reaches the tool at its next
    heartbeat.

        @activity.defn
        async def book_hotel(stay: Stay) -> str:
            async with kvflow.tool_heartbeats():
                return await hotels.book(stay, idempotency_key=kvflow.tool_idempotency_key())

    The heartbeats run on the activity's event loop: a tool that blocks the loop (synchronous
    work in an `async def`) blocks them too, and is retried as if its worker had died.
    Raises `RuntimeError` outside an activity.
    """
    activity.info()  # outside an activity this raises, before anything starts
    seconds = every.total_seconds()
    if seconds <= 0:
        raise ValueError(f"tool_heartbeats(every={every}) needs a positive interval")

    async def beat() -> None:
        while True:
            activity.heartbeat()
            await asyncio.sleep(seconds)

    beating = asyncio.create_task(beat())
    try:
        yield
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating


__all__ = ["tool_heartbeats", "tool_idempotency_key"]

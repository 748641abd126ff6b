"""How workflow code runs kvflow's control-plane activities: bounded, and to their end.

Shared by the step API (`kvflow.workflows.agent`) and the spend meter
(`kvflow.workflows.spend`): a control-plane local activity is bounded in time and tries, and
bookkeeping that follows a call runs to its end even when the task is cancelled meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, CancelledError

with workflow.unsafe.imports_passed_through():
    from kvflow.activities.control_plane import PERMANENT_ERRORS

R = TypeVar("R")

LOCAL_TIMEOUT = timedelta(seconds=10)
"""The start-to-close limit of one try of a control-plane local activity."""
LOCAL_RETRY = RetryPolicy(
    initial_interval=timedelta(milliseconds=200),
    maximum_interval=timedelta(seconds=2),
    maximum_attempts=5,
    non_retryable_error_types=[e.__name__ for e in PERMANENT_ERRORS],
)
"""Control-plane local activities (place, observe, context store) retry a transient error a
few times; an error no retry can fix (unknown tenant, model or replica; missing context) runs
once and fails the task with its own type."""
LOCAL_SCHEDULE_TO_CLOSE = timedelta(seconds=30)
"""All tries of one control-plane local activity together."""
LEDGER_RETRY = RetryPolicy(
    initial_interval=timedelta(milliseconds=500),
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=10,
    non_retryable_error_types=[e.__name__ for e in PERMANENT_ERRORS],
)
"""Ledger writes from the workflow (task row, lost attempt, resumed marks) ride out a busy or
restarting database for about a minute."""
LEDGER_SCHEDULE_TO_CLOSE = timedelta(minutes=2)


async def uncancellable(operation: Awaitable[R]) -> R:
    """Run `operation` to its end even if the task is cancelled meanwhile, then re-raise.

    Bookkeeping that follows a call (tell the scheduler, write the ledger) must not be cut
    short by a cancellation that arrives while it runs.
    """
    task = asyncio.ensure_future(operation)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise


def is_cancellation(exc: BaseException) -> bool:
    """Whether `exc` is, or was caused by, the cancellation of the task."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, asyncio.CancelledError | CancelledError):
            return True
        seen = seen.cause if isinstance(seen, ActivityError) else seen.__cause__
    return False


def bounded_local(activity: str, arg: Any, result_type: type[R]) -> Awaitable[R]:
    """A control-plane local activity, bounded as every one of them is.

    `LOCAL_TIMEOUT` per try, retried within `LOCAL_RETRY` and `LOCAL_SCHEDULE_TO_CLOSE`.
    """
    return workflow.execute_local_activity(
        activity,
        arg,
        result_type=result_type,
        start_to_close_timeout=LOCAL_TIMEOUT,
        schedule_to_close_timeout=LOCAL_SCHEDULE_TO_CLOSE,
        retry_policy=LOCAL_RETRY,
    )

"""`TaskDeadlineInterceptor`: every activity a task starts ends by the task's deadline.

`Agent.tool` bounds the tools it runs by the task's remaining latency budget, and every model
call is bounded by it too. An activity started some other way inside an `async with agent:`
block is not: a framework's tool (`activity_as_tool` of the OpenAI Agents SDK, Pydantic AI's
tool activities) or a plain `workflow.execute_activity` comes with its own static timeouts,
often a minute or more, and the task would outlive its budget by that much. This workflow
interceptor, which `KvflowPlugin` installs on workflow workers, caps the schedule-to-close
(and start-to-close) timeout of such an activity at the time left until the task's deadline.
When it runs out the activity times out, and the failure follows the framework's own rules
(the next model call then fails the task with `DeadlineExceeded`).

Left alone: activities outside any `Agent` block, kvflow's own (`kvflow.*`, bounded already),
and compensations, which run after the deadline on purpose. Only timeouts change, so a
history recorded without the interceptor replays with it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.worker import (
    Interceptor,
    StartActivityInput,
    StartLocalActivityInput,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
    WorkflowOutboundInterceptor,
)

from kvflow.workflows.agent import Agent

KVFLOW_ACTIVITY_PREFIX = "kvflow."
"""kvflow's own activities (`kvflow.infer`, `kvflow.place`, ...), bounded where they start."""
SHORTEST = timedelta(milliseconds=1)
"""The timeout an activity gets when the deadline has passed: Temporal needs one above zero."""


def _left(activity: str) -> timedelta | None:
    """Time until the current task's deadline, for an activity it starts; None: no cap."""
    if activity.startswith(KVFLOW_ACTIVITY_PREFIX):
        return None
    task = Agent.current()
    deadline = task.activity_deadline() if task is not None else None
    if deadline is None:
        return None
    return max(deadline - workflow.now(), SHORTEST)


def _capped(timeout: timedelta | None, left: timedelta) -> timedelta:
    return left if timeout is None else min(timeout, left)


class _Outbound(WorkflowOutboundInterceptor):
    def start_activity(self, input: StartActivityInput) -> workflow.ActivityHandle[Any]:
        left = _left(input.activity)
        if left is not None:
            input.schedule_to_close_timeout = _capped(input.schedule_to_close_timeout, left)
            if input.start_to_close_timeout is not None:
                input.start_to_close_timeout = min(input.start_to_close_timeout, left)
        return super().start_activity(input)

    def start_local_activity(self, input: StartLocalActivityInput) -> workflow.ActivityHandle[Any]:
        left = _left(input.activity)
        if left is not None:
            input.schedule_to_close_timeout = _capped(input.schedule_to_close_timeout, left)
            if input.start_to_close_timeout is not None:
                input.start_to_close_timeout = min(input.start_to_close_timeout, left)
        return super().start_local_activity(input)


class _Inbound(WorkflowInboundInterceptor):
    def init(self, outbound: WorkflowOutboundInterceptor) -> None:
        super().init(_Outbound(outbound))


class TaskDeadlineInterceptor(Interceptor):
    """Caps the timeouts of activities a task starts at its deadline (module docstring)."""

    def workflow_interceptor_class(
        self, input: WorkflowInterceptorClassInput
    ) -> type[WorkflowInboundInterceptor] | None:
        """The interceptor every workflow on the worker runs with."""
        return _Inbound

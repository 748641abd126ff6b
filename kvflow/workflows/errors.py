"""The errors an agent task fails with: one `ApplicationError` type per cause.

Operators read these in the Temporal UI, so each message says which step failed, why, and what
would have helped, e.g. "step 3/5 'critique': no replica can finish 2,100 tokens in the 1.4 s
left; best h200/0 needs 2.3 s". All are non-retryable: the step API already re-placed what
could be re-placed, and a Temporal retry would only multiply spend.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from temporalio.exceptions import ApplicationError


class TaskErrorType(StrEnum):
    """The `ApplicationError.type` of a failed task; compare it with `cause.type`."""

    STEP_FAILED = "StepFailed"
    """A model call failed for a reason no replica can fix (bad request, context too long...)."""
    RETRY_BUDGET_EXHAUSTED = "RetryBudgetExhausted"
    """The task used every re-placement its retry budget allowed."""
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    """The task's latency budget cannot be met (no time left, or no replica fast enough)."""
    OVERLOADED = "Overloaded"
    """Refused at its first model call, before it spent anything: at the fleet's load the task
    was not expected to finish by its deadline. `details[0]["refusal"]["retry_after_s"]` says
    when to start it again."""
    PLACEMENT_REFUSED = "PlacementRefused"
    """The scheduler refused the call: tenant over quota, model not served, all circuits open..."""
    SCHEMA_INVALID_OUTPUT = "SchemaInvalidOutput"
    """Structured output did not match the schema after the allowed repairs."""
    TOOL_FAILED = "ToolFailed"
    """A tool call failed."""
    INVALID_TASK = "InvalidTask"
    """The task's input can never be served: a tenant or model the fleet does not list, a
    prompt and output longer than the model's context, an empty or missing prompt, no output
    tokens. The message names the value and the fix; nothing was retried."""
    CONTEXT_NOT_FOUND = "ContextNotFound"
    """A context reference names content the store does not hold (workers use other stores)."""
    CONTROL_PLANE_FAILED = "ControlPlaneFailed"
    """A control-plane activity (place, observe, context store) kept failing past its bound."""
    OUTSIDE_TASK = "OutsideTask"
    """`Agent.infer` or `Agent.tool` was called outside `async with agent:`, where no task is
    open to book it; the message shows the block to write. Nothing was spent."""


def task_error(error_type: str, message: str, **details: Any) -> ApplicationError:
    """A non-retryable task failure of `error_type` with structured details for tooling."""
    return ApplicationError(message, details, type=error_type, non_retryable=True)

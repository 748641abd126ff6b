"""One log line, not a traceback, for an activity failure kvflow expected and typed.

Temporal's activity worker logs every failed activity as "Completing activity as failed" with
its traceback at WARNING, except an `ApplicationError` of category `BENIGN`, which it logs at
DEBUG. kvflow raises its expected failures as `BENIGN` (`benign`): a placement refusal such as
an unknown tenant, a context that is not in the store, an engine error it classified (HTTP
4xx/5xx, timeouts, cut streams). This interceptor logs each of them as one line naming the
error's type and message, at WARNING when the call cannot succeed anywhere and at INFO when
the control plane re-places it; the traceback stays at DEBUG. Anything else (a bug, a tool's
own exception) keeps the SDK's WARNING with its traceback.
"""

from __future__ import annotations

from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory
from temporalio.worker import (
    ActivityInboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
)


def benign(error: ApplicationError) -> bool:
    """Whether the SDK logs `error` at DEBUG only: kvflow's mark of an expected failure."""
    return error.category == ApplicationErrorCategory.BENIGN


class ExpectedFailureLog(Interceptor):
    """Log an expected (`BENIGN`) activity failure as one line; see the module docstring."""

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        """Wrap every activity of the worker."""
        return _Inbound(next)


class _Inbound(ActivityInboundInterceptor):
    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        try:
            return await super().execute_activity(input)
        except ApplicationError as err:
            if benign(err):
                # Retryable: another replica may serve it, so this is news, not a problem yet.
                log = activity.logger.info if not err.non_retryable else activity.logger.warning
                log("%s failed: %s: %s", activity.info().activity_type, err.type, err.message)
            raise

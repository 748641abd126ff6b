"""A task's money in workflow code: its spend meter and the ledger rows the workflow writes.

`TaskSpend` is where the money path of one task can be read in one place. The step API
(`Agent`) hands it every attempt as it ends; it keeps the running total that the `kvflow_spend`
query, the `KvflowSpendMicros` search attribute and the task row's figure at the close show,
and it writes the rows only the workflow can write:

- a lost attempt (its GPU worker went silent): a provisional row from the last heartbeat,
  then the attempt billed at whichever row the ledger holds (the worker's exact row wins);
- a cancelled attempt: billed at its ledger row, since a cancellation carries no details;
- resumed marks: cut attempts whose output the next attempt continued (not waste);
- the task row, once, when the workflow ends.

The ledger is the book of record (`kvflow.ledger`): a row that reaches it after the close (a
spool replayed) counts in the task's ledger spend without any write from here, and the task is
listed as moved. Every write here is bookkeeping: it never changes how the task ends.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel, Field
from temporalio import workflow
from temporalio.exceptions import ActivityError, FailureError

from kvflow.workflows.calls import (
    LEDGER_RETRY,
    LEDGER_SCHEDULE_TO_CLOSE,
    bounded_local,
    is_cancellation,
    uncancellable,
)

with workflow.unsafe.imports_passed_through():
    from kvflow.activities.control_plane import (
        ATTEMPT_BILL_ACTIVITY,
        MARK_RESUMED_ACTIVITY,
        RECORD_LOST_ATTEMPT_ACTIVITY,
        RECORD_TASK_ACTIVITY,
    )
    from kvflow.activities.wire import AttemptBill, AttemptKey, LostAttempt, ResumedAttempts
    from kvflow.ledger.records import TaskOutcome, TaskRecord, chain_run_id

LOST_ATTEMPT_PATCH = "kvflow-lost-attempt-billed-from-ledger"
"""The patch under which a lost attempt is billed at its ledger row's figures: runs started
before it replay without the ledger reads it added."""
NOT_DISPATCHED = "ScheduleToStart"
"""The outcome of an attempt no GPU worker took: it ran nowhere and has no ledger row."""


class AttemptSpend(BaseModel):
    """One attempt of one step, as the spend meter saw it."""

    replica: str
    model: str = ""
    """The model the attempt ran (the fallback when the scheduler degraded the call)."""
    outcome: str
    """`ok`, an error type (`StreamCut`, `ReplicaServerError`...), or `ScheduleToStart`."""
    cost_micros: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reused_tokens: int = 0
    activity_id: str = ""
    """The inference activity's id: with the run, the key of the attempt's ledger row."""

    def charge(self, bill: AttemptBill) -> None:
        """Bill this attempt at `bill`, its ledger row's figures."""
        self.cost_micros = bill.cost_micros
        self.prompt_tokens = bill.usage.prompt_tokens
        self.cached_tokens = bill.usage.cached_tokens
        self.completion_tokens = bill.usage.completion_tokens


class StepSpend(BaseModel):
    """One step of the task: a model call, a tool call or a compensation."""

    index: int
    name: str
    kind: str
    """`infer`, `tool` or `compensation`."""
    model: str | None = None
    reason: str | None = None
    """The placement's reason, for model calls."""
    outcome: str = "running"
    attempts: list[AttemptSpend] = Field(default_factory=list)
    admission_waits: int = 0
    """Times the scheduler said "not now" (fleet saturated for this tier) and the step waited."""

    @property
    def cost_micros(self) -> int:
        """Everything this step spent, failed attempts included."""
        return sum(a.cost_micros for a in self.attempts)


class SpendBreakdown(BaseModel):
    """What the `kvflow_spend` query returns."""

    tenant: str
    outcome: str
    spend_micros: int
    steps: list[StepSpend]
    retries: int
    attempts: int


class TaskSpend:
    """The spend of one task as its workflow sees it, and the ledger rows the workflow writes."""

    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        self.steps: list[StepSpend] = []
        """Every step so far, in order: model calls, tool calls and compensations."""
        self._lost: list[AttemptSpend] = []
        """Attempts whose GPU worker went silent, billed from the ledger (see `close`)."""

    @property
    def spend_micros(self) -> int:
        """Everything the task has spent so far, failed attempts included."""
        return sum(step.cost_micros for step in self.steps)

    @property
    def attempts(self) -> int:
        """Model call attempts that ran somewhere, failed ones included.

        One that no GPU worker took (a schedule-to-start timeout) ran nowhere and has no
        ledger row, so it is not counted: the count matches the task's attempt rows.
        """
        return sum(1 for step in self.steps for a in step.attempts if a.outcome != NOT_DISPATCHED)

    @property
    def completed_steps(self) -> int:
        """Model and tool calls that completed; compensations are not steps of the task."""
        return sum(1 for s in self.steps if s.outcome == "ok" and s.kind != "compensation")

    def breakdown(self, *, outcome: str, retries: int) -> SpendBreakdown:
        """The full spend breakdown (the `kvflow_spend` query)."""
        return SpendBreakdown(
            tenant=self.tenant,
            outcome=outcome,
            spend_micros=self.spend_micros,
            steps=self.steps,
            retries=retries,
            attempts=self.attempts,
        )

    async def bill_lost_attempt(
        self,
        spent: AttemptSpend,
        *,
        step: str,
        error_type: str,
        dispatched_at: datetime,
    ) -> None:
        """Bill an attempt whose GPU worker went silent, at its ledger row's figures.

        The worker may have died before writing its row, or after (its completion lost on the
        way to Temporal, by a crash or a server outage). The workflow writes a provisional
        row from the last heartbeat, which an exact row under the same key beats whenever it
        arrives, then bills the attempt at whichever row the ledger holds: never the estimate
        next to the worker's real bill, never both.
        """
        info = workflow.info()
        await self.write(
            RECORD_LOST_ATTEMPT_ACTIVITY,
            LostAttempt(
                workflow_id=info.workflow_id,
                run_id=info.run_id,
                activity_id=spent.activity_id,
                attempt=1,
                workflow_type=info.workflow_type,
                step=step,
                tenant=self.tenant,
                model=spent.model,
                replica=spent.replica,
                started_at=dispatched_at,
                ended_at=workflow.now(),
                prompt_tokens=spent.prompt_tokens,
                cached_tokens=spent.cached_tokens,
                completion_tokens=spent.completion_tokens,
                cost_micros=spent.cost_micros,
                error_type=error_type,
            ),
            f"ledger: attempt lost on {spent.replica}",
        )
        self._lost.append(spent)
        await self._bill_from_ledger(spent)

    async def bill_cancelled(self, spent: AttemptSpend) -> None:
        """Bill a cancelled attempt at its ledger row: a cancellation carries no details.

        When the row is not there yet (the GPU worker's write is in its spool) the attempt
        stays at the workflow's own figure; the ledger counts the row when it lands and
        lists the task as moved after its close.
        """
        bill = await self._stored_bill(spent.activity_id)
        if bill is not None:
            spent.charge(bill)

    async def mark_resumed(self, activity_ids: list[str]) -> None:
        """Tell the ledger that these cut attempts' output was continued, not wasted."""
        info = workflow.info()
        await self.write(
            MARK_RESUMED_ACTIVITY,
            ResumedAttempts(
                workflow_id=info.workflow_id, run_id=info.run_id, activity_ids=activity_ids
            ),
            f"ledger: {len(activity_ids)} cut attempt(s) resumed",
        )

    async def close(
        self, outcome: TaskOutcome, *, started_at: datetime, chain: str | None = None
    ) -> None:
        """Write the task row with the workflow's figures at the close.

        `chain` is the first run of the task when the task continued as new into this run
        (`TaskRecord.chain_run_id`); None: this run is the task's first.

        Every attempt is billed at its row's figures: the result's or the error's (the GPU
        worker computed both from the same count) or, for a lost attempt, the row read back
        from the ledger, once more here since its exact row may have come meanwhile.
        """
        if self._lost and workflow.patched(LOST_ATTEMPT_PATCH):
            for spent in self._lost:
                await self._bill_from_ledger(spent)
        info = workflow.info()
        record = TaskRecord(
            workflow_id=info.workflow_id,
            run_id=info.run_id,
            tenant=self.tenant,
            workflow_type=info.workflow_type,
            started_at=started_at,
            closed_at=workflow.now(),
            outcome=outcome,
            steps=self.completed_steps,
            attempts=self.attempts,
            spend_micros=self.spend_micros,
            compensation_micros=sum(s.cost_micros for s in self.steps if s.kind == "compensation"),
            source="workflow",
            chain_run_id=chain_run_id(info.run_id, chain),
        )
        await self.write(RECORD_TASK_ACTIVITY, record, f"ledger: task {outcome.value}")

    async def write(self, activity: str, arg: Any, summary: str) -> bool:
        """Run a ledger-writing activity to its end; False (logged) if it failed for good.

        Bookkeeping never changes how the task ends: a row that could not be written is one
        `kvflow ledger reconcile` (task rows) or an operator (the log names it) can restore.
        It also runs to its end when the task is cancelled meanwhile (then re-raises).
        """
        try:
            await uncancellable(
                workflow.execute_activity(
                    activity,
                    arg,
                    start_to_close_timeout=timedelta(seconds=30),
                    schedule_to_close_timeout=LEDGER_SCHEDULE_TO_CLOSE,
                    retry_policy=LEDGER_RETRY,
                    summary=summary,
                )
            )
        except ActivityError as err:
            if is_cancellation(err):
                raise
            workflow.logger.error("%s failed for good: %s", summary, err.cause)
            return False
        return True

    async def _bill_from_ledger(self, spent: AttemptSpend) -> None:
        """Set `spent`'s cost and usage to its ledger row's, when the ledger can say."""
        if not workflow.patched(LOST_ATTEMPT_PATCH):
            return
        bill = await self._stored_bill(spent.activity_id)
        if bill is not None:
            spent.charge(bill)

    async def _stored_bill(self, activity_id: str) -> AttemptBill | None:
        """The attempt's bill as its ledger row holds it; None without a row or a ledger.

        A ledger that stays unreachable leaves the workflow's own figure standing (logged):
        bookkeeping never changes how the task ends.
        """
        info = workflow.info()
        key = AttemptKey(workflow_id=info.workflow_id, run_id=info.run_id, activity_id=activity_id)
        try:
            bill: AttemptBill | None = await uncancellable(
                bounded_local(ATTEMPT_BILL_ACTIVITY, key, AttemptBill)
            )
        except FailureError as err:
            if is_cancellation(err):
                raise
            workflow.logger.warning(
                "ledger: no bill for attempt %s, its own figure stands: %s", activity_id, err
            )
            return None
        return bill

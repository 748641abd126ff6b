"""The ledger after a fault: every attempt billed once, every task row there once, exact.

The audit compares three records that must agree after any fault: history (what ran: every
`kvflow.infer` activity a GPU worker took is an attempt), the ledger (one attempt row per
attempt, one task row per closed task), and the finance report over the whole ledger (what
finance reads). A row an estimate stands for is allowed only where no exact bill can exist:
an attempt whose GPU worker died (its history ends in a heartbeat or start-to-close timeout).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from temporalio.client import WorkflowExecutionStatus, WorkflowHandle

from kvflow.ledger.report import ReportQuery
from kvflow.ledger.store import AsyncLedger
from kvflow.workflows.agent import SPEND_QUERY, SpendBreakdown
from tests.chaos.traces import TaskTrace
from tests.test_ledger_invariants import OUTCOMES

NEVER_STARTED = "ScheduleToStart"
"""The outcome the workflow's books give a dispatch that no GPU worker took in time."""
LOST_TIMEOUTS = {"HEARTBEAT", "START_TO_CLOSE"}
"""How an attempt whose GPU worker died ends in history (see `_worker_went_silent`)."""


@dataclass
class BillingAudit:
    """What the ledger holds against what ran; `problems()` lists every disagreement."""

    tasks: int = 0
    task_rows: int = 0
    attempts: int = 0
    """Attempts a GPU worker took (started in history): each must have one row."""
    billed_once: int = 0
    estimates: int = 0
    """Rows that are the workflow's estimate of a lost attempt (provisional)."""
    spend_micros: int = 0
    """The sum of every attempt row of the tasks audited."""
    issues: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        """Every disagreement found, one line each (empty when the books balance)."""
        return list(self.issues)


async def audit(
    ledger: AsyncLedger,
    handles: list[WorkflowHandle[Any, Any]],
    traces: dict[str, TaskTrace],
    *,
    query_workflows: bool = True,
    since: datetime | None = None,
) -> BillingAudit:
    """Check the ledger against the histories of `handles` (all closed).

    With `query_workflows`, each workflow's own books (the `kvflow_spend` query) must list as
    many attempts as the ledger and the same spend; the query needs a workflow worker. The
    finance report over the ledger from `since` on (default: all of it) must count the same.
    """
    result = BillingAudit(tasks=len(handles))
    for handle in handles:
        task_trace = traces[handle.id]
        description = await handle.describe()
        run_id = description.run_id or ""
        rows = await ledger.attempts_for(handle.id, run_id)
        started = {a.activity_id: a for a in task_trace.attempts if a.started}
        per_activity = Counter(row.activity_id for row in rows)
        result.attempts += len(started)
        for activity_id, attempt in started.items():
            count = per_activity.get(activity_id, 0)
            if count == 1:
                result.billed_once += 1
            else:
                result.issues.append(
                    f"{handle.id}: attempt {activity_id} on {attempt.replica} "
                    f"({attempt.outcome}) has {count} ledger rows"
                )
        for row in rows:
            taken = started.get(row.activity_id)
            if taken is None:
                result.issues.append(
                    f"{handle.id}: ledger row for activity {row.activity_id} on {row.replica}, "
                    "which no GPU worker took"
                )
                continue
            if row.attempt != 1:
                result.issues.append(
                    f"{handle.id}: activity {row.activity_id} billed as attempt {row.attempt}; "
                    "inference calls are never retried by Temporal"
                )
            if row.provisional:
                result.estimates += 1
                if taken.timeout not in LOST_TIMEOUTS:
                    result.issues.append(
                        f"{handle.id}: an estimate stands for {row.activity_id} "
                        f"({taken.outcome}), whose GPU worker lived to bill it exactly"
                    )
            else:
                exact = row.prices.cost_micros(
                    row.prompt_tokens, row.cached_tokens, row.completion_tokens
                )
                if row.cost_micros != exact:
                    result.issues.append(
                        f"{handle.id}: {row.activity_id} billed {row.cost_micros} µ$, "
                        f"its tokens cost {exact}"
                    )
        spend = sum(row.cost_micros for row in rows)
        result.spend_micros += spend
        task = await ledger.task(handle.id, run_id)
        if task is None:
            result.issues.append(f"{handle.id}: closed {description.status} without a task row")
            continue
        result.task_rows += 1
        status = description.status
        if status is None or task.outcome not in OUTCOMES.get(status, set()):
            result.issues.append(f"{handle.id}: task row says {task.outcome}, workflow {status}")
        if task.spend_micros != spend:
            result.issues.append(
                f"{handle.id}: task row spend {task.spend_micros} µ$, its attempt rows {spend}"
            )
        if query_workflows and task.source == "workflow":
            books = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
            # A dispatch no GPU worker took in time never ran: the workflow lists it (cost 0),
            # the ledger has nothing to bill.
            made = sum(a.outcome != NEVER_STARTED for step in books.steps for a in step.attempts)
            if made != len(rows) or books.spend_micros != task.spend_micros:
                result.issues.append(
                    f"{handle.id}: the workflow counts {made} attempts for "
                    f"{books.spend_micros} µ$, the ledger {len(rows)} for {task.spend_micros}"
                )
    await _finance_agrees(ledger, handles, result, since)
    return result


async def _finance_agrees(
    ledger: AsyncLedger,
    handles: list[WorkflowHandle[Any, Any]],
    result: BillingAudit,
    since: datetime | None,
) -> None:
    """The report over the scenario's ledger schema counts what the audit did."""
    report = await ledger.report(ReportQuery(since=since))
    totals = report.totals
    succeeded = 0
    for handle in handles:
        if (await handle.describe()).status == WorkflowExecutionStatus.COMPLETED:
            succeeded += 1
    expected = (result.task_rows, succeeded, result.spend_micros, 0)
    seen = (totals.tasks, totals.succeeded, totals.spend_micros, report.unclosed_attempts)
    if seen != expected:
        result.issues.append(
            "the finance report reads (tasks, succeeded, spend µ$, unclosed attempts) = "
            f"{seen}; the audit counted {expected}"
        )

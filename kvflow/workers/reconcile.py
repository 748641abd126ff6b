"""Task rows for workflows that closed without writing their own.

A workflow writes its task row when its code reaches the end. A terminated or timed-out
workflow never does, so its spend would be missing from the cost per successful task.
`reconcile` lists closed workflows from Temporal visibility and, for each one that has no task
row, writes one from its attempt rows (`source = "reconcile"`):

- outcome: from the execution status (terminated, timed_out, cancelled, failed); for a
  completed or failed workflow, the `KvflowOutcome` search attribute when it names a final
  outcome (e.g. `compensated`), else `succeeded` for completed;
- tenant: the `KvflowTenant` search attribute, else the tenant of its attempts; a workflow with
  neither is not a kvflow task and is skipped;
- steps: the `KvflowSteps` search attribute, else the number of activities with an `ok` attempt;
- attempts and spend: counted and summed from its attempt rows (the ledger sums them again on
  every read, so an attempt that ends after the pass counts too);
- chain: the first run of the task's chain of runs (`TaskRecord.chain_run_id`), from the
  run's start event: the carry its continue-as-new passed (`kvflow.workflows.carry`), so a
  task that continued as new and was then terminated makes all its runs' spend waste; a cron
  run or a workflow retry starts a chain of its own.

It also lists the tasks whose ledger spend moved after they closed (`Ledger.tasks_moved`):
rows that arrived or changed since, which a figure read at the close does not show.

A run that continued as new gets the outcome `continued_as_new` (its task goes on in the next
run): its spend counts, and it is no task of its own. Running it twice writes nothing the
second time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime

from temporalio.api.enums.v1 import ContinueAsNewInitiator
from temporalio.client import Client, WorkflowExecution, WorkflowExecutionStatus
from temporalio.service import RPCError

from kvflow.ledger.records import (
    AttemptOutcome,
    TaskBook,
    TaskOutcome,
    TaskRecord,
    chain_run_id,
)
from kvflow.ledger.store import AsyncLedger
from kvflow.workflows import search_attributes
from kvflow.workflows.carry import TASK_CARRY_HEADER, TaskCarry

log = logging.getLogger(__name__)

CLOSED_QUERY = "ExecutionStatus != 'Running'"
"""The visibility query for closed workflows."""

_STATUS_OUTCOMES: dict[WorkflowExecutionStatus, TaskOutcome] = {
    WorkflowExecutionStatus.COMPLETED: TaskOutcome.SUCCEEDED,
    WorkflowExecutionStatus.FAILED: TaskOutcome.FAILED,
    WorkflowExecutionStatus.CANCELED: TaskOutcome.CANCELLED,
    WorkflowExecutionStatus.TERMINATED: TaskOutcome.TERMINATED,
    WorkflowExecutionStatus.TIMED_OUT: TaskOutcome.TIMED_OUT,
    WorkflowExecutionStatus.CONTINUED_AS_NEW: TaskOutcome.CONTINUED_AS_NEW,
}
# Statuses whose own code ran to the end, so the outcome it set is trustworthy.
_SELF_REPORTED = {WorkflowExecutionStatus.COMPLETED, WorkflowExecutionStatus.FAILED}
_BATCH = 200


@dataclass
class ReconcileResult:
    """What a reconcile pass found and wrote."""

    examined: int = 0
    """Closed workflow runs listed from visibility."""
    already_recorded: int = 0
    """Runs that had a task row already."""
    skipped: int = 0
    """Runs that are not kvflow tasks (no tenant, no attempts)."""
    written: list[TaskRecord] = field(default_factory=list)
    """Task rows written by this pass."""
    moved: list[TaskBook] = field(default_factory=list)
    """Tasks whose ledger spend differs from their spend at the close (closed since
    `closed_since`, when given)."""


def closed_query(extra: str | None = None, closed_since: datetime | None = None) -> str:
    """The visibility query: closed runs, optionally since a time and with an extra filter."""
    clauses = [CLOSED_QUERY]
    if closed_since is not None:
        if closed_since.tzinfo is None:  # a bare date or time from the command line means UTC
            closed_since = closed_since.replace(tzinfo=UTC)
        moment = closed_since.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        clauses.append(f"CloseTime >= '{moment}'")
    if extra:
        clauses.append(f"({extra})")
    return " AND ".join(clauses)


def outcome_for(execution: WorkflowExecution) -> TaskOutcome | None:
    """The task outcome of a closed run (see the module docstring); None to skip it."""
    status = execution.status
    if status is None or status not in _STATUS_OUTCOMES:
        return None
    if status in _SELF_REPORTED:
        reported = execution.typed_search_attributes.get(search_attributes.OUTCOME)
        if reported in {o.value for o in TaskOutcome}:
            return TaskOutcome(reported)
    return _STATUS_OUTCOMES[status]


async def _chain_of(client: Client, execution: WorkflowExecution) -> str | None:
    """The first run of the execution's task (`TaskRecord.chain_run_id`), from its start event.

    Only a run that a workflow continued as new continues a task: a cron run or a retry,
    which Temporal starts with the same `first_execution_run_id`, starts one. The chain is
    the carry's that the run it continued from passed; without one (a workflow of a kvflow
    from before the carry), `first_execution_run_id`, as that workflow wrote it.
    """
    handle = client.get_workflow_handle(execution.id, run_id=execution.run_id)
    try:
        async for event in handle.fetch_history_events(page_size=1):
            started = event.workflow_execution_started_event_attributes
            break
        else:
            return None
    except RPCError as err:
        # Gone since it was listed (retention): the row is still worth writing, unchained.
        log.warning("%s/%s: no chain of runs read: %s", execution.id, execution.run_id, err)
        return None
    continued_from = started.continued_execution_run_id
    if (
        not continued_from
        or started.initiator != ContinueAsNewInitiator.CONTINUE_AS_NEW_INITIATOR_WORKFLOW
    ):
        return None
    header = started.header.fields.get(TASK_CARRY_HEADER)
    carry = None if header is None else TaskCarry.from_payload(header)
    if carry is not None and carry.from_run_id == continued_from:
        return carry.chain_run_id
    return started.first_execution_run_id or None


async def _task_for(
    ledger: AsyncLedger, client: Client, execution: WorkflowExecution
) -> TaskRecord | None:
    outcome = outcome_for(execution)
    if outcome is None:
        return None
    attempts = await ledger.attempts_for(execution.id, execution.run_id or "")
    attrs = execution.typed_search_attributes
    tenant = attrs.get(search_attributes.TENANT) or (attempts[0].tenant if attempts else None)
    if not tenant:
        return None
    steps = attrs.get(search_attributes.STEPS)
    if steps is None:
        steps = len({a.activity_id for a in attempts if a.outcome is AttemptOutcome.OK})
    started_at = execution.start_time
    closed_at = execution.close_time or datetime.now(UTC)
    return TaskRecord(
        workflow_id=execution.id,
        run_id=execution.run_id or "",
        tenant=tenant,
        workflow_type=execution.workflow_type,
        started_at=min(started_at, closed_at),
        closed_at=closed_at,
        outcome=outcome,
        steps=steps,
        attempts=len(attempts),
        spend_micros=sum(a.cost_micros for a in attempts),
        source="reconcile",
        chain_run_id=chain_run_id(execution.run_id or "", await _chain_of(client, execution)),
    )


async def reconcile(
    ledger: AsyncLedger,
    client: Client,
    *,
    query: str | None = None,
    closed_since: datetime | None = None,
) -> ReconcileResult:
    """Write the missing task rows of closed workflows in `client`'s namespace.

    `query` is an extra visibility filter AND-ed to the closed-workflow query (for example
    `WorkflowType = 'ResearchAgent'`); `closed_since` limits the pass to recent closes.
    """
    result = ReconcileResult()
    batch: list[WorkflowExecution] = []

    async def flush() -> None:
        keys = [(e.id, e.run_id or "") for e in batch]
        missing = set(await ledger.tasks_missing(keys))
        for execution in batch:
            if (execution.id, execution.run_id or "") not in missing:
                result.already_recorded += 1
                continue
            task = await _task_for(ledger, client, execution)
            if task is None:
                result.skipped += 1
                continue
            if await ledger.record_task(task):
                # As booked: the ledger counts attempts that ended since they were summed.
                task = await ledger.task(task.workflow_id, task.run_id) or task
                result.written.append(task)
                log.info(
                    "reconciled %s/%s: %s, %d attempts, %d micro-dollars",
                    task.workflow_id,
                    task.run_id,
                    task.outcome.value,
                    task.attempts,
                    task.spend_micros,
                )
            else:
                # The workflow wrote its own row between our check and our write.
                result.already_recorded += 1
        batch.clear()

    async for execution in client.list_workflows(closed_query(query, closed_since)):
        result.examined += 1
        batch.append(execution)
        if len(batch) >= _BATCH:
            await flush()
    if batch:
        await flush()
    result.moved = await ledger.tasks_moved(closed_since)
    return result

"""What every fault scenario does around its fault: run the workload, then audit and report.

`finish` reads every task's history, audits the ledger against it, scans logs and histories
for the planted secret, and fills in the figures; the scenario records them before any
assertion, so a failing scenario still reports what it saw.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError

from kvflow.ledger.store import AsyncLedger
from tests.chaos.books import BillingAudit, audit
from tests.chaos.cluster import SECRET_CANARY, ChaosCluster
from tests.chaos.figures import ScenarioFigures, record
from tests.chaos.traces import TaskTrace, trace


@dataclass
class Outcome:
    """A finished scenario: statuses, traces, the audit and the figures recorded."""

    statuses: dict[str, WorkflowExecutionStatus | None]
    traces: dict[str, TaskTrace]
    books: BillingAudit
    figures: ScenarioFigures
    secrets_found: int = 0
    not_completed: dict[str, str] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    """Workflow id → why it did not complete."""

    def record(self, node_id: str) -> None:
        """Record the figures for the summary (call it before asserting)."""
        record(node_id, self.figures)


async def secrets_in(cluster: ChaosCluster, handles: list[WorkflowHandle[Any, Any]]) -> int:
    """Occurrences of the planted ledger password in every log and history of the run."""
    found = cluster.log_text().count(SECRET_CANARY)
    for handle in handles:
        found += (await handle.fetch_history()).to_json().count(SECRET_CANARY)
    return found


async def finish(
    cluster: ChaosCluster,
    ledger: AsyncLedger,
    handles: list[WorkflowHandle[Any, Any]],
    figures: ScenarioFigures,
    *,
    started_at: float,
    bad_inputs: list[WorkflowHandle[Any, Any]] | None = None,
    query_workflows: bool = True,
    since: datetime | None = None,
) -> Outcome:
    """Audit the run of `handles` and fill `figures` with what was found.

    `bad_inputs` are tasks started with input that must be refused: audited (they need a
    task row and no attempt), but not counted among the tasks run. `since`: the moment this
    run began, when the ledger also holds an earlier run's rows.

    The scenario adds its own notes, then calls `Outcome.record` before it asserts.
    """
    assert cluster.client is not None
    everything = [*handles, *(bad_inputs or [])]
    statuses = {h.id: (await h.describe()).status for h in everything}
    traces = {h.id: await trace(cluster.client, h) for h in everything}
    books = await audit(ledger, everything, traces, query_workflows=query_workflows, since=since)
    secrets = await secrets_in(cluster, everything)
    missing = {
        h.id: (status.name if status else "UNKNOWN")
        for h in handles
        if (status := statuses[h.id]) != WorkflowExecutionStatus.COMPLETED
    }
    failures = {wid: await _failure(cluster, wid) for wid in missing}
    _dump(cluster, traces, failures)
    figures.bad_inputs_tried = len(bad_inputs or [])
    figures.tasks_run = len(handles)
    figures.tasks_completed = len(handles) - len(missing)
    figures.attempts = books.attempts
    figures.attempts_billed_once = books.billed_once
    figures.estimates = books.estimates
    figures.spend_micros = books.spend_micros
    figures.secrets_found = secrets
    figures.duration_s = time.monotonic() - started_at
    if books.problems():
        figures.notes.append(f"{len(books.problems())} ledger disagreements")
    if missing:
        first = next(iter(failures.items()))
        figures.notes.append(
            f"{len(missing)} tasks did not complete, e.g. {first[0]}: {first[1][:300]}"
        )
    return Outcome(statuses, traces, books, figures, secrets, missing, failures)


async def _failure(cluster: ChaosCluster, workflow_id: str) -> str:
    """Why a task did not complete: its failure's type and message, or its status."""
    assert cluster.client is not None
    handle = cluster.client.get_workflow_handle(workflow_id)
    try:
        await asyncio.wait_for(handle.result(), 5)
    except WorkflowFailureError as failed:
        cause = failed.cause
        if isinstance(cause, ApplicationError):
            return f"{cause.type}: {cause.message}"
        return str(cause)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "completed"


def _dump(cluster: ChaosCluster, traces: dict[str, TaskTrace], failures: dict[str, str]) -> None:
    """Every task's placements and attempts, and the failures, beside the run's logs."""
    data = {"failures": failures, "tasks": {wid: asdict(t) for wid, t in traces.items()}}
    (cluster.root / "traces.json").write_text(json.dumps(data, indent=1, default=str) + "\n")

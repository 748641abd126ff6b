"""What every fault scenario does around its fault: run the workload, then audit and report.

`finish` reads every task's history, audits the ledger against it, scans logs and histories
for the planted secret, and fills in the figures; the scenario records them before any
assertion, so a failing scenario still reports what it saw.

The secret scan reads every string of a history and every payload decoded (the JSON form of a
history carries payloads base64-encoded, where a plain search finds nothing). It must find the
probe planted in every log and in every task's memo before its finding no password counts.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from google.protobuf.message import Message
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError

from kvflow.ledger.store import AsyncLedger
from tests.chaos.books import BillingAudit, audit
from tests.chaos.cluster import SCAN_PROBE, SECRET_CANARY, ChaosCluster
from tests.chaos.figures import ScenarioFigures, record
from tests.chaos.traces import TaskTrace, trace


@dataclass
class SecretScan:
    """What the secret scan read, and where it found the password and the probe."""

    logs: int = 0
    """Process logs the probe was planted in."""
    histories: int = 0
    """Histories read of tasks that carry the probe in their memo."""
    secrets: int = 0
    """Occurrences of the ledger password in every log and history read."""
    probed_logs: int = 0
    """Logs in which the scan found the probe."""
    probed_histories: int = 0
    """Histories in which the scan found the probe."""


@dataclass
class Outcome:
    """A finished scenario: statuses, traces, the audit and the figures recorded."""

    statuses: dict[str, WorkflowExecutionStatus | None]
    traces: dict[str, TaskTrace]
    books: BillingAudit
    figures: ScenarioFigures
    scan: SecretScan = field(default_factory=SecretScan)
    not_completed: dict[str, str] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    """Workflow id → why it did not complete."""

    def record(self, node_id: str) -> None:
        """Record the figures for the summary (call it before asserting)."""
        record(node_id, self.figures)


def assert_no_secret_leaked(outcome: Outcome) -> None:
    """No log or history holds the ledger password, and the scan that says so can see."""
    scan = outcome.scan
    assert scan.logs and scan.probed_logs == scan.logs, (
        f"the secret scan found the probe in {scan.probed_logs} of {scan.logs} logs"
    )
    assert scan.histories and scan.probed_histories == scan.histories, (
        f"the secret scan found the probe in {scan.probed_histories} of {scan.histories} "
        "task histories"
    )
    assert scan.secrets == 0, f"the ledger password appears {scan.secrets} times"


def _texts(message: Message) -> Iterator[str]:
    """Every string of `message`, however deep, and every bytes field (payloads) decoded."""
    for field_, value in message.ListFields():
        kind = field_.message_type
        nested = kind is not None
        if kind is not None and kind.GetOptions().map_entry:
            inner = kind.fields_by_name["value"].message_type is not None
            for key, item in value.items():
                yield str(key)
                yield from _texts(item) if inner else [_text(item)]
        elif field_.is_repeated:
            for item in value:
                yield from _texts(item) if nested else [_text(item)]
        elif nested:
            yield from _texts(value)
        else:
            yield _text(value)


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value if isinstance(value, str) else ""


async def _history_text(handle: WorkflowHandle[Any, Any]) -> str:
    history = await handle.fetch_history()
    return "\n".join(text for event in history.events for text in _texts(event))


async def scan_for_secrets(
    cluster: ChaosCluster,
    handles: list[WorkflowHandle[Any, Any]],
    others: list[WorkflowHandle[Any, Any]],
) -> SecretScan:
    """Plant the probe in every log, then look for it and for the ledger password.

    `handles` are tasks started with the probe in their memo; `others` are read for the
    password only.
    """
    scan = SecretScan(logs=cluster.plant_in_logs(SCAN_PROBE))
    for text in cluster.log_texts().values():
        scan.secrets += text.count(SECRET_CANARY)
        scan.probed_logs += SCAN_PROBE in text
    for handle in handles:
        text = await _history_text(handle)
        scan.histories += 1
        scan.secrets += text.count(SECRET_CANARY)
        scan.probed_histories += SCAN_PROBE in text
    for handle in others:
        scan.secrets += (await _history_text(handle)).count(SECRET_CANARY)
    return scan


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
    scan = await scan_for_secrets(cluster, handles, bad_inputs or [])
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
    figures.secrets_found = scan.secrets
    figures.duration_s = time.monotonic() - started_at
    if books.problems():
        figures.notes.append(f"{len(books.problems())} ledger disagreements")
    if missing:
        first = next(iter(failures.items()))
        figures.notes.append(
            f"{len(missing)} tasks did not complete, e.g. {first[0]}: {first[1][:300]}"
        )
    return Outcome(statuses, traces, books, figures, scan, missing, failures)


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

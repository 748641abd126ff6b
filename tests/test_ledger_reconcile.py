"""Reconcile on the real Temporal dev server: terminated and timed-out runs get task rows."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
from temporalio import workflow
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.worker import UnsandboxedWorkflowRunner, Worker
from typer.testing import CliRunner

from kvflow.cli.main import app
from kvflow.ledger import AsyncLedger, AttemptOutcome, Ledger, ReportQuery, TaskOutcome
from kvflow.scheduler.fleet import format_usd
from kvflow.workers.reconcile import CLOSED_QUERY, reconcile
from kvflow.workflows.search_attributes import TENANT
from tests.fixtures_ledger import attempt_record, task_record

VISIBILITY_WAIT_S = 30.0


@workflow.defn(name="LedgerTestAgent")
class WaitsForApproval:
    """Waits for a signal that, for the terminated and timed-out runs, never comes."""

    def __init__(self) -> None:
        self.approved = False

    @workflow.run
    async def run(self) -> str:
        await workflow.wait_condition(lambda: self.approved)
        return "approved"

    @workflow.signal
    def approve(self) -> None:
        self.approved = True


def _tenant(name: str) -> TypedSearchAttributes:
    return TypedSearchAttributes([SearchAttributePair(TENANT, name)])


async def _start(
    client: Client, queue: str, label: str, *, tenant: str | None = "acme", **options
) -> WorkflowHandle[Any, Any]:
    return await client.start_workflow(
        WaitsForApproval.run,
        id=f"ledger-{label}-{uuid.uuid4().hex[:8]}",
        task_queue=queue,
        search_attributes=_tenant(tenant) if tenant else TypedSearchAttributes.empty,
        **options,
    )


async def _wait_until_closed_in_visibility(client: Client, query: str, count: int) -> None:
    # Visibility lags the close by about a second; reconcile reads visibility.
    deadline = time.monotonic() + VISIBILITY_WAIT_S
    while True:
        closed = await client.count_workflows(f"{CLOSED_QUERY} AND ({query})")
        if closed.count == count:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"visibility shows {closed.count} of {count} closed runs for {query}")
        await asyncio.sleep(0.2)


def _only(handles: list[WorkflowHandle[Any, Any]]) -> str:
    return " OR ".join(f"WorkflowId = '{h.id}'" for h in handles)


async def test_terminated_and_timed_out_workflows_get_task_rows_from_their_attempts(
    ledger: Ledger, temporal_client: Client
) -> None:
    queue = f"ledger-test-{uuid.uuid4().hex[:8]}"
    async with Worker(
        temporal_client,
        task_queue=queue,
        workflows=[WaitsForApproval],
        workflow_runner=UnsandboxedWorkflowRunner(),
    ):
        terminated = await _start(temporal_client, queue, "terminated")
        timed_out = await _start(
            temporal_client, queue, "timed-out", execution_timeout=timedelta(seconds=1)
        )
        completed = await _start(temporal_client, queue, "completed")
        not_kvflow = await _start(temporal_client, queue, "other", tenant=None)

        # The GPU worker billed the terminated run twice (one failure) and the timed-out once.
        spent = [
            attempt_record(terminated.id, run_id=terminated.result_run_id or "", activity_id="1"),
            attempt_record(
                terminated.id,
                run_id=terminated.result_run_id or "",
                activity_id="2",
                outcome=AttemptOutcome.FAILED,
                completion_tokens=0,
            ),
            attempt_record(
                timed_out.id,
                run_id=timed_out.result_run_id or "",
                outcome=AttemptOutcome.CANCELLED,
                pool="l4",
            ),
        ]
        for record in spent:
            ledger.record_attempt(record)

        await terminated.terminate(reason="operator stopped a stuck task")
        await completed.signal(WaitsForApproval.approve)
        await not_kvflow.signal(WaitsForApproval.approve)
        assert await completed.result() == "approved"
        await not_kvflow.result()
        with pytest.raises(WorkflowFailureError):
            await timed_out.result()
        # The completed workflow wrote its own task row, as kvflow workflows do.
        own_row = task_record(completed.id, run_id=completed.result_run_id or "")
        ledger.record_task(own_row)

    handles = [terminated, timed_out, completed, not_kvflow]
    await _wait_until_closed_in_visibility(temporal_client, _only(handles), len(handles))
    result = await reconcile(AsyncLedger(ledger), temporal_client, query=_only(handles))

    assert result.examined == 4
    assert (result.already_recorded, result.skipped) == (1, 1)
    assert sorted(t.workflow_id for t in result.written) == sorted([terminated.id, timed_out.id])

    row = ledger.task(terminated.id, terminated.result_run_id or "")
    assert row is not None
    assert row.outcome is TaskOutcome.TERMINATED
    assert (row.tenant, row.workflow_type, row.source) == ("acme", "LedgerTestAgent", "reconcile")
    assert (row.attempts, row.steps) == (2, 1)
    assert row.spend_micros == spent[0].cost_micros + spent[1].cost_micros == 3000 + 2000
    assert row.started_at <= row.closed_at
    late = ledger.task(timed_out.id, timed_out.result_run_id or "")
    assert late is not None
    assert (late.outcome, late.attempts, late.steps) == (TaskOutcome.TIMED_OUT, 1, 0)
    assert late.spend_micros == spent[2].cost_micros
    own = ledger.task(completed.id, completed.result_run_id or "")
    assert own is not None and own.as_written() == own_row
    assert ledger.task(not_kvflow.id, not_kvflow.result_run_id or "") is None

    # Now the report counts the terminated and timed-out spend as wasted, to the micro-dollar.
    report = ledger.report(ReportQuery.parse("", tenant="acme"))
    assert (report.totals.tasks, report.totals.succeeded) == (3, 1)
    assert report.totals.wasted_micros == sum(r.cost_micros for r in spent)

    again = await reconcile(AsyncLedger(ledger), temporal_client, query=_only(handles))
    assert (again.written, again.already_recorded, again.skipped) == ([], 3, 1)


async def test_reconcile_command_fills_the_row_of_a_terminated_workflow(
    ledger_url: str, ledger: Ledger, temporal_client: Client
) -> None:
    handle = await _start(temporal_client, f"no-worker-{uuid.uuid4().hex[:8]}", "cli")
    run_id = handle.result_run_id or ""
    ledger.record_attempt(attempt_record(handle.id, run_id=run_id, prompt_tokens=5000))
    await handle.terminate(reason="stuck")
    await _wait_until_closed_in_visibility(temporal_client, f"WorkflowId = '{handle.id}'", 1)
    address = temporal_client.service_client.config.target_host

    arguments = [
        "ledger",
        "reconcile",
        "--db",
        ledger_url,
        "--address",
        address,
        "--namespace",
        temporal_client.namespace,
        "--query",
        f"WorkflowId = '{handle.id}'",
    ]
    result = await asyncio.to_thread(CliRunner().invoke, app, arguments)

    assert result.exit_code == 0, result.output
    assert "1 task row(s) written" in result.stdout
    assert "terminated" in result.stdout
    row = ledger.task(handle.id, run_id)
    assert row is not None
    assert (row.outcome, row.spend_micros, row.source) == (
        TaskOutcome.TERMINATED,
        11000,
        "reconcile",
    )
    assert "moved after they closed" not in result.stdout

    # The terminated run's last call ends after the row: its GPU worker bills it now. The
    # next pass writes nothing and lists the task, with the difference.
    late = attempt_record(handle.id, run_id=run_id, activity_id="2", completion_tokens=50)
    ledger.record_attempt(late)
    again = await asyncio.to_thread(CliRunner().invoke, app, arguments)
    assert again.exit_code == 0, again.output
    assert "0 task row(s) written" in again.stdout
    assert "moved after they closed" in again.stdout
    assert f"+${format_usd(late.cost_micros)}" in again.stdout
    book = ledger.task(handle.id, run_id)
    assert book is not None and book.spend_micros == 11000 + late.cost_micros


async def test_reconcile_command_exits_2_when_the_ledger_is_missing(tmp_path) -> None:
    result = await asyncio.to_thread(
        CliRunner().invoke,
        app,
        ["ledger", "reconcile", "--db", f"sqlite:///{tmp_path}/none.db", "--address", "x:1"],
    )

    assert result.exit_code == 2
    assert "no ledger database" in result.stderr

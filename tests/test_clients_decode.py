"""Every client kvflow ships reads a task whose payloads are claim-checked.

A task whose input and answer are over 2 KB runs on the real Temporal dev server and the
simulated fleet; its history holds references into the stack's context store. Each client kvflow
ships is then pointed at that store and reads the task: `kvflow ledger reconcile`, the samples'
starters (`samples.starter.connect`) and the demo's client (`connect_local`). kvflow ships no
replayer of its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from typer.testing import CliRunner

from kvflow.activities.claim_check import is_claim_check
from kvflow.activities.inference import InferenceActivities, default_http_client
from kvflow.activities.wire import INLINE_LIMIT_BYTES
from kvflow.cli.main import app
from kvflow.scheduler.fleet import task_queue_for
from kvflow.workers.demo import connect_local
from kvflow.workers.plugin import KvflowPlugin, role_worker
from samples.starter import connect as sample_connect
from tests import agent_workflows as wf
from tests.fleets import unshared_binding
from tests.history import payloads_in
from tests.stacks import MODEL, PoolPlan, fleet_stack, task_spec

STARTED = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED
# The page that tells a user what to do when a client cannot read a payload.
SECURITY_PAGE = Path(__file__).resolve().parent.parent / "docs" / "operators" / "security.md"


@dataclass
class ClosedTask:
    """A closed task whose input and result are claim-checked, and where to read it."""

    workflow_id: str
    report: wf.Report
    context_dir: Path
    ledger_url: str
    address: str
    namespace: str


@pytest.fixture(scope="module")
async def closed_task(
    temporal_client: Client, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ClosedTask]:
    tmp_path = tmp_path_factory.mktemp("clients")
    pools = [PoolPlan("big", gpu="H200", max_model_len=16384)]
    # `plugins=[]`: the stack's clients carry KvflowPlugin on its context store.
    async with fleet_stack(temporal_client, tmp_path, pools, plugins=[]) as stack:
        brief = "Write the quarterly report on these findings. " + "finding " * 600
        task = wf.ReportInput(spec=task_spec(expected_steps=1), model=MODEL, brief=brief)
        handle = await stack.start(wf.LongReport.run, task)
        report = await handle.result()
        history = await handle.fetch_history()
        # What the clients below must decode: the input and the result are references.
        [started] = [e for e in history.events if e.event_type == STARTED]
        assert any(is_claim_check(p) for p in payloads_in(started))
        assert len(report.body) > INLINE_LIMIT_BYTES
        yield ClosedTask(
            workflow_id=handle.id,
            report=report,
            context_dir=stack.context_dir,
            ledger_url=stack.ledger_url,
            address=temporal_client.service_client.config.target_host,
            namespace=temporal_client.namespace,
        )


@pytest.mark.timeout(240)
async def test_ledger_reconcile_with_the_workers_context_dir_reads_a_claim_checked_task(
    closed_task: ClosedTask,
):
    arguments = [
        "ledger",
        "reconcile",
        "--db",
        closed_task.ledger_url,
        "--address",
        closed_task.address,
        "--namespace",
        closed_task.namespace,
        "--context-dir",
        str(closed_task.context_dir),
        "--query",
        f"WorkflowId = '{closed_task.workflow_id}'",
    ]
    result = await asyncio.to_thread(CliRunner().invoke, app, arguments)

    assert result.exit_code == 0, result.output
    # The task wrote its own row when it finished: reconcile finds it and writes nothing.
    assert "1 closed run(s) examined: 0 task row(s) written, 1 already recorded" in " ".join(
        result.output.split()
    )


@pytest.mark.timeout(240)
async def test_sample_starters_client_reads_the_claim_checked_answer(closed_task: ClosedTask):
    client = await sample_connect(closed_task.address, closed_task.context_dir)
    handle = client.get_workflow_handle(closed_task.workflow_id, result_type=wf.Report)

    assert await handle.result() == closed_task.report


@pytest.mark.timeout(240)
async def test_demo_client_on_the_stacks_context_dir_reads_the_claim_checked_answer(
    closed_task: ClosedTask,
):
    client = await connect_local(closed_task.address, closed_task.context_dir)
    handle = client.get_workflow_handle(closed_task.workflow_id, result_type=wf.Report)

    assert await handle.result() == closed_task.report


@pytest.mark.timeout(240)
async def test_a_client_without_kvflows_plugin_cannot_read_it_and_the_docs_say_why(
    closed_task: ClosedTask,
):
    plain = await Client.connect(closed_task.address, namespace=closed_task.namespace)
    handle = plain.get_workflow_handle(closed_task.workflow_id)

    with pytest.raises(KeyError, match="Unknown payload encoding kvflow/claim-check"):
        await handle.result()
    page = await asyncio.to_thread(SECURITY_PAGE.read_text, encoding="utf-8")
    assert "Unknown payload encoding kvflow/claim-check" in page
    assert f"plugins=[{KvflowPlugin.__name__}(context_dir=" in page


@pytest.mark.timeout(60)
async def test_a_worker_on_a_client_without_kvflows_plugin_warns_it_cannot_read_claim_checks(
    temporal_client: Client, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A worker takes its data converter from its client: KvflowPlugin on the worker alone
    # cannot read a claim-checked payload (a dead GPU worker's last heartbeat).
    with_plugin = Client(
        temporal_client.service_client,
        namespace=temporal_client.namespace,
        plugins=[KvflowPlugin(context_dir=tmp_path / "context")],
    )
    for client in (temporal_client, with_plugin):
        binding = unshared_binding()
        activities = InferenceActivities(binding, default_http_client(), None)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvflow.workers.plugin"):
            role_worker(
                client,
                KvflowPlugin(inference=activities, context_dir=tmp_path / "context"),
                task_queue=task_queue_for(binding.pool.name, binding.index),
            )
        warned = [
            r.getMessage() for r in caplog.records if "without KvflowPlugin" in r.getMessage()
        ]
        if client is temporal_client:
            assert warned and "plugins=[KvflowPlugin(" in warned[0]
        else:
            assert warned == []

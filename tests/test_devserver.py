"""The embedded Temporal server: it starts, runs workflows, knows kvflow's attributes, stops."""

from __future__ import annotations

import asyncio
import os
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.worker import Worker

from kvflow.workflows.search_attributes import OUTCOME, SPEND_MICROS, TENANT

# This file defines a workflow, so the sandbox re-imports it; pass the process code through.
with workflow.unsafe.imports_passed_through():
    from kvflow.workers.devserver import EmbeddedTemporal, PortInUse, free_port


@activity.defn
async def shout(text: str) -> str:
    return text.upper()


@workflow.defn
class ShoutWorkflow:
    @workflow.run
    async def run(self, text: str) -> str:
        result = await workflow.execute_activity(
            shout, text, start_to_close_timeout=timedelta(seconds=10)
        )
        workflow.upsert_search_attributes([SPEND_MICROS.value_set(1234), OUTCOME.value_set("ok")])
        return result


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); the server is reaped by stop(), so check /proc too.
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "State:\tZ" not in status.read_text()


async def test_embedded_server_runs_a_workflow_and_stops_without_leftovers(tmp_path: Path):
    server = EmbeddedTemporal(port=free_port(), ui_port=free_port(), state_dir=tmp_path)
    server.start()
    pid = server.pid
    assert pid is not None
    try:
        client = await Client.connect(server.address)
        queue = f"q-{uuid.uuid4()}"
        async with Worker(client, task_queue=queue, workflows=[ShoutWorkflow], activities=[shout]):
            handle = await client.start_workflow(
                ShoutWorkflow.run,
                "hello",
                id=f"wf-{uuid.uuid4()}",
                task_queue=queue,
                search_attributes=TypedSearchAttributes([SearchAttributePair(TENANT, "acme")]),
            )
            assert await handle.result() == "HELLO"

        # Visibility lags about a second behind the write.
        query = f"KvflowTenant = 'acme' AND KvflowSpendMicros = 1234 AND WorkflowId = '{handle.id}'"
        for _ in range(50):
            if (await client.count_workflows(query)).count == 1:
                break
            await asyncio.sleep(0.1)
        assert (await client.count_workflows(query)).count == 1
        assert (tmp_path / "temporal.db").exists()
    finally:
        server.stop()
    assert not _pid_alive(pid)
    # The ports are free again: a second server could take them.
    server.start()
    server.stop()


def test_second_server_on_a_taken_port_names_the_flag(tmp_path: Path):
    with EmbeddedTemporal(port=free_port(), ui_port=None, state_dir=tmp_path) as first:
        second = EmbeddedTemporal(port=first.port, ui_port=None, state_dir=tmp_path / "b")
        with pytest.raises(PortInUse) as caught:
            second.start()
    assert str(first.port) in str(caught.value)
    assert "--port" in str(caught.value)

"""The embedded Temporal server: it starts, runs workflows, knows kvflow's attributes, stops."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from temporalio import activity, workflow
from temporalio.api.workflowservice.v1 import GetSystemInfoRequest
from temporalio.client import Client
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.worker import Worker

from kvflow.workflows.search_attributes import OUTCOME, SPEND_MICROS, TENANT

# This file defines a workflow, so the sandbox re-imports it; pass the process code through.
with workflow.unsafe.imports_passed_through():
    from kvflow.ports import free_port, port_is_free
    from kvflow.workers.devserver import EmbeddedTemporal, PortInUse


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


@pytest.mark.timeout(30)
def test_the_command_line_asked_before_start_is_the_one_that_would_run(tmp_path: Path):
    # Headless, the server needs an HTTP port to be probed on; the command shown before
    # start (to log it, or run it by hand) names one, as the UI's command names the UI port.
    headless = EmbeddedTemporal(port=free_port(), ui_port=None, state_dir=tmp_path).command()
    port = headless[headless.index("--http-port") + 1]
    assert port.isdigit() and "--headless" in headless
    with_ui = EmbeddedTemporal(port=free_port(), ui_port=free_port(), state_dir=tmp_path)
    assert "--http-port" not in with_ui.command() and "--ui-port" in with_ui.command()


@pytest.mark.timeout(120)
async def test_a_headless_server_is_started_once_its_frontend_serves(tmp_path: Path):
    # Its gRPC port accepts connections a moment before the frontend serves them, and a
    # client connecting then fails ("Frontend is not healthy yet"); headless there is no UI
    # to probe, so the server's HTTP API is, and a client connects as soon as start returns.
    with EmbeddedTemporal(port=free_port(), ui_port=None, state_dir=tmp_path) as server:
        assert "--http-port" in server.command()
        client = await asyncio.wait_for(Client.connect(server.address), timeout=10)
        assert await client.workflow_service.get_system_info(GetSystemInfoRequest())


def test_second_server_on_a_taken_port_names_the_flag(tmp_path: Path):
    with EmbeddedTemporal(port=free_port(), ui_port=None, state_dir=tmp_path) as first:
        second = EmbeddedTemporal(port=first.port, ui_port=None, state_dir=tmp_path / "b")
        with pytest.raises(PortInUse) as caught:
            second.start()
    assert str(first.port) in str(caught.value)
    assert "--port" in str(caught.value)


def _tcp_states(port: int) -> set[str]:
    """The states (hex codes of /proc/net/tcp, 06 = TIME_WAIT) of sockets on local `port`."""
    states = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port:
            states.add(fields[3])
    return states


@pytest.mark.skipif(sys.platform != "linux", reason="reads TCP states from /proc/net/tcp")
def test_a_port_held_only_by_time_wait_is_free_and_a_listener_is_not(tmp_path: Path):
    # What a server leaves when it stops while clients are connected: it closes first, so its
    # side of each connection waits in TIME_WAIT on the server's port for a minute.
    listener = socket.socket()
    # As Temporal's listeners do (Go sets it on every listener); the TIME_WAIT sockets inherit
    # it, and Linux lets a new bind through only where both sides set it.
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    assert not port_is_free(port), "a live listener must make the port taken"
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()
    assert client.recv(1) == b""  # the server's FIN arrived; now the client closes
    client.close()
    listener.close()
    assert "06" in _tcp_states(port), "no TIME_WAIT socket was left on the port"
    assert port_is_free(port), "a port held only by TIME_WAIT sockets read as taken"
    # The embedded server's own check agrees: it starts there.
    with EmbeddedTemporal(port=port, ui_port=None, state_dir=tmp_path, db_filename=None) as server:
        assert server.pid is not None

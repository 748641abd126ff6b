"""The codec server's tenant boundary and its HTTP limits, on its real HTTP app.

Tasks are started on the session's Temporal dev server by a client with `KvflowPlugin` (their
large inputs are claim-checked into a context store), with the tenant in `KvflowTenant`; their
histories' references go to `POST /decode` as the Web UI sends them, with each tenant's token.
A workflow id used again by another tenant, a namespace named by the caller, and metadata the
caller rewrote open nothing of another tenant. Then what a request may be: its size (refused
from its headers), its type and `Host` (what a web page could send), what `/encode` may store,
and what namespaces made up by a caller cost.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from google.protobuf import json_format
from google.protobuf.duration_pb2 import Duration
from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import EventType, IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.api.workflowservice.v1 import RegisterNamespaceRequest
from temporalio.client import Client
from temporalio.common import SearchAttributePair, TypedSearchAttributes

from kvflow.activities.claim_check import is_claim_check
from kvflow.activities.context_store import DirectoryContextStore
from kvflow.workers import codec_server
from kvflow.workers.codec_server import (
    NOT_YOURS,
    CodecAccess,
    CodecServerThread,
    PayloadOpener,
    WorkflowTenants,
    codec_app,
    load_tokens,
)
from kvflow.workers.plugin import KvflowPlugin
from kvflow.workflows.search_attributes import TENANT

ACME, GLOBEX, OPS = "acme-" + "a" * 24, "globex-" + "g" * 24, "ops-" + "o" * 24


@dataclass
class Tenants:
    """A codec server with a token per tenant, the client that encodes, and its store."""

    url: str
    client: Client
    context_dir: Path
    lookup: WorkflowTenants


@pytest.fixture
async def tenants(temporal_client: Client, tmp_path: Path) -> AsyncIterator[Tenants]:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        f'[tokens.acme-support]\ntoken = "{ACME}"\ntenants = ["acme"]\n'
        f'[tokens.globex-support]\ntoken = "{GLOBEX}"\ntenants = ["globex"]\n'
        f'[tokens.ops]\ntoken = "{OPS}"\ntenants = ["*"]\n'
    )
    target = temporal_client.service_client.config.target_host
    client = await Client.connect(
        target,
        namespace=temporal_client.namespace,
        plugins=[KvflowPlugin(context_dir=tmp_path / "context")],
    )

    async def connect() -> Client:
        return await Client.connect(target)

    lookup = WorkflowTenants(connect)
    opener = PayloadOpener(DirectoryContextStore(tmp_path / "context"), tenant_of=lookup)
    server = CodecServerThread(codec_app(opener, load_tokens(tokens)))
    server.start()
    try:
        yield Tenants(server.url, client, tmp_path / "context", lookup)
    finally:
        server.stop()


async def _start_closed(
    client: Client, workflow_id: str, tenant: str, text: str
) -> list[dict[str, Any]]:
    """Start `workflow_id` for `tenant` with `text` (claim-checked), close it; its input as
    the UI reads it (the history's payloads, still encoded)."""
    handle = await client.start_workflow(
        "NobodyRunsThis",
        text,
        id=workflow_id,
        task_queue=f"nobody-polls-{workflow_id}",
        search_attributes=TypedSearchAttributes([SearchAttributePair(TENANT, tenant)]),
    )
    await handle.terminate("only its input matters")
    # The run's own history, read without any codec (the session client has none).
    history = await client.get_workflow_handle(
        workflow_id, run_id=handle.result_run_id
    ).fetch_history()
    [started] = [
        e.workflow_execution_started_event_attributes
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED
    ]
    assert all(is_claim_check(p) for p in started.input.payloads)
    return [json_format.MessageToDict(p) for p in started.input.payloads]


async def _visible(client: Client, query: str, count: int) -> None:
    """Wait until visibility lists `count` workflows for `query` (it lags about a second)."""
    for _ in range(100):
        if (await client.count_workflows(query)).count >= count:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"visibility never listed {count} workflows for {query}")


async def _decode(
    url: str, payloads: list[dict[str, Any]], token: str, namespace: str = "default"
) -> str:
    """What `POST /decode` gives `token` for `payloads`, as one text."""
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(
            f"{url}/decode",
            json={"payloads": payloads},
            headers={"Authorization": f"Bearer {token}", "X-Namespace": namespace},
        )
    assert response.status_code == 200, response.text
    return "".join(
        base64.b64decode(p.get("data", "")).decode("utf-8", "replace")
        for p in response.json()["payloads"]
    )


@pytest.mark.timeout(120)
async def test_reused_workflow_id_does_not_open_another_tenants_payload(tenants: Tenants):
    workflow_id = f"report-{uuid.uuid4().hex[:8]}"
    acme = await _start_closed(
        tenants.client, workflow_id, "acme", "ACME-PLANS " + "acme text " * 400
    )
    # Temporal lets any client of the namespace use a closed workflow id again.
    globex = await _start_closed(
        tenants.client, workflow_id, "globex", "GLOBEX-CONFIDENTIAL " + "merger terms " * 400
    )
    await _visible(tenants.client, f"WorkflowId = '{workflow_id}' AND KvflowTenant IS NOT NULL", 2)

    # Acme's token never opens globex's payload, though its run used the same id first.
    as_acme = await _decode(tenants.url, globex, ACME)
    assert "GLOBEX-CONFIDENTIAL" not in as_acme and NOT_YOURS in as_acme
    # The id's payloads belong to two tenants: neither is guessed, both are denied.
    as_globex = await _decode(tenants.url, globex, GLOBEX)
    assert "GLOBEX-CONFIDENTIAL" not in as_globex and NOT_YOURS in as_globex
    assert "ACME-PLANS" not in await _decode(tenants.url, acme, GLOBEX)
    # The holder of every tenant reads both.
    assert "GLOBEX-CONFIDENTIAL" in await _decode(tenants.url, globex, OPS)
    assert "ACME-PLANS" in await _decode(tenants.url, acme, OPS)


@pytest.mark.timeout(120)
async def test_a_tenant_reads_its_own_workflows_payload_and_not_another_tenants(
    tenants: Tenants,
):
    workflow_id = f"report-{uuid.uuid4().hex[:8]}"
    globex = await _start_closed(
        tenants.client, workflow_id, "globex", "GLOBEX-CONFIDENTIAL " + "merger terms " * 400
    )
    await _visible(tenants.client, f"WorkflowId = '{workflow_id}' AND KvflowTenant IS NOT NULL", 1)
    assert "GLOBEX-CONFIDENTIAL" in await _decode(tenants.url, globex, GLOBEX)
    assert "GLOBEX-CONFIDENTIAL" not in await _decode(tenants.url, globex, ACME)


@pytest.mark.timeout(120)
async def test_an_earlier_versions_reference_opens_for_its_workflows_tenant(tenants: Tenants):
    workflow_id = f"report-{uuid.uuid4().hex[:8]}"
    await _start_closed(tenants.client, workflow_id, "acme", "x " * 1500)
    # A payload as versions before namespaces stored it: under the workflow id's digest alone.
    scope = hashlib.sha256(workflow_id.encode()).hexdigest()[:32]
    original = Payload(metadata={"encoding": b"json/plain"}, data=b'"ACME-PLANS of old"')
    digest = DirectoryContextStore(tenants.context_dir).put_bytes(
        original.SerializeToString(), scope
    )
    reference = {
        "metadata": {
            "encoding": base64.b64encode(b"kvflow/claim-check").decode(),
            "kvflow-scope": base64.b64encode(scope.encode()).decode(),
        },
        "data": base64.b64encode(digest.encode()).decode(),
    }
    await _visible(tenants.client, f"WorkflowId = '{workflow_id}' AND KvflowTenant = 'acme'", 1)
    assert "ACME-PLANS of old" in await _decode(tenants.url, [reference], ACME)
    assert "ACME-PLANS of old" not in await _decode(tenants.url, [reference], GLOBEX)


async def _namespace_with_tenants(client: Client) -> str:
    """A new namespace on the dev server, with kvflow's `KvflowTenant` registered in it."""
    namespace = f"other-{uuid.uuid4().hex[:8]}"
    await client.workflow_service.register_namespace(
        RegisterNamespaceRequest(
            namespace=namespace, workflow_execution_retention_period=Duration(seconds=86400)
        )
    )
    for _ in range(150):  # the server's namespace cache takes a moment to know it
        try:
            await client.operator_service.add_search_attributes(
                AddSearchAttributesRequest(
                    namespace=namespace,
                    search_attributes={TENANT.name: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD},
                )
            )
            return namespace
        except Exception:
            await asyncio.sleep(0.1)
    raise AssertionError(f"namespace {namespace} never took KvflowTenant")


def _forged(payload: dict[str, Any], **metadata: str) -> dict[str, Any]:
    """`payload` with metadata keys set (a value "": removed), as a caller may send it."""
    forged: dict[str, Any] = json.loads(json.dumps(payload))
    for key, value in metadata.items():
        key = key.replace("_", "-")
        if value:
            forged["metadata"][key] = base64.b64encode(value.encode()).decode()
        else:
            forged["metadata"].pop(key, None)
    return forged


@pytest.mark.timeout(120)
async def test_a_payload_opens_for_no_tenant_of_another_namespace_or_forged_metadata(
    tenants: Tenants, temporal_client: Client
):
    workflow_id = f"report-{uuid.uuid4().hex[:8]}"
    globex = await _start_closed(
        tenants.client, workflow_id, "globex", "GLOBEX-CONFIDENTIAL " + "merger terms " * 400
    )
    # The same workflow id, in a namespace where it is acme's (any client of it can say so).
    other = await _namespace_with_tenants(temporal_client)
    elsewhere = Client(temporal_client.service_client, namespace=other)
    for _ in range(100):  # the new namespace reaches every service of the server in a moment
        try:
            await elsewhere.start_workflow(
                "NobodyRunsThis", "acme's own", id=workflow_id, task_queue="nobody-polls",
                search_attributes=TypedSearchAttributes([SearchAttributePair(TENANT, "acme")]),
            )  # fmt: skip
            break
        except Exception:
            await asyncio.sleep(0.1)
    await _visible(elsewhere, f"WorkflowId = '{workflow_id}' AND KvflowTenant = 'acme'", 1)
    await _visible(tenants.client, f"WorkflowId = '{workflow_id}' AND KvflowTenant IS NOT NULL", 1)
    acme_own = await _start_closed(
        tenants.client, f"acme-{uuid.uuid4().hex[:8]}", "acme", "ACME-PLANS " + "x " * 1500
    )

    [reference] = globex
    own = json_format.ParseDict(acme_own[0], Payload()).metadata
    forgeries = [
        reference,  # as it is, sent under the other namespace
        # Named as a payload of the other namespace, or of acme's own workflow.
        _forged(reference, kvflow_namespace=other),
        _forged(reference, kvflow_workflow=own["kvflow-workflow"].decode()),
        # With acme's own workflow's scope: no file of globex's is under it.
        _forged(
            reference,
            kvflow_workflow=own["kvflow-workflow"].decode(),
            kvflow_scope=own["kvflow-scope"].decode(),
        ),
        # As an earlier version's reference, which names its scope alone.
        _forged(reference, kvflow_namespace="", kvflow_workflow=""),
    ]
    for namespace in (other, "default"):
        for forged in forgeries:
            text = await _decode(tenants.url, [forged], ACME, namespace)
            assert "GLOBEX-CONFIDENTIAL" not in text, (namespace, forged["metadata"])
    # Untouched, in its own namespace, it opens for its tenant.
    assert "GLOBEX-CONFIDENTIAL" in await _decode(tenants.url, globex, GLOBEX)


# -- what a request may be -----------------------------------------------------------------


@contextmanager
def _open_server(context_dir: Path) -> Iterator[CodecServerThread]:
    """The codec server as `kvflow server` runs it: loopback, no tokens."""
    opener = PayloadOpener(DirectoryContextStore(context_dir))
    server = CodecServerThread(codec_app(opener, CodecAccess()))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _status_of_raw_request(server: CodecServerThread, head: str, body: bytes = b"") -> str:
    """Send a request's head and `body` (the rest never comes); the status line, or "no
    answer" when none came in 10 s."""
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(head.encode() + body)
        try:
            answer = sock.recv(4096)
        except TimeoutError:
            return "no answer"
    return answer.split(b"\r\n", 1)[0].decode()


@pytest.mark.timeout(60)
def test_an_oversized_body_is_refused_from_its_headers(tmp_path: Path):
    with _open_server(tmp_path / "context") as server:
        head = (
            f"POST /decode HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
            "Content-Type: application/json\r\nContent-Length: 2000000000\r\n\r\n"
        )
        assert _status_of_raw_request(server, head) == "HTTP/1.1 413 Request Entity Too Large"


@pytest.mark.timeout(60)
def test_a_chunked_body_is_refused_once_it_passes_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(codec_server, "MAX_BODY_BYTES", 4096)
    with _open_server(tmp_path / "context") as server:
        head = (
            f"POST /decode HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"400\r\n" + b" " * 1024 + b"\r\n"
        # Eight chunks of 1 KiB and no last chunk: the server must not wait for the end.
        status = _status_of_raw_request(server, head, chunk * 8)
        assert status == "HTTP/1.1 413 Request Entity Too Large"


def _large_payload() -> dict[str, Any]:
    text = json.dumps("LARGE " * 2000)
    return {
        "metadata": {"encoding": base64.b64encode(b"json/plain").decode()},
        "data": base64.b64encode(text.encode()).decode(),
    }


@pytest.mark.timeout(60)
def test_a_web_page_cannot_make_the_tokenless_server_store_anything(tmp_path: Path):
    body = json.dumps({"payloads": [_large_payload()]})
    with _open_server(tmp_path / "context") as server:
        # What any page can send across origins with no preflight: a text/plain POST.
        as_text = httpx.post(
            f"{server.url}/encode",
            content=body,
            headers={"Content-Type": "text/plain", "Origin": "https://attacker.example"},
            timeout=10,
        )
        assert as_text.status_code == 415, as_text.text
        assert "application/json" in as_text.json()["error"]
        # A page whose own domain resolves to 127.0.0.1 (DNS rebinding): its Host is its own.
        rebound = httpx.post(
            f"{server.url}/encode",
            content=body,
            headers={
                "Content-Type": "application/json",
                "Host": f"attacker.example:{server.port}",
            },
            timeout=10,
        )
        assert rebound.status_code == 403, rebound.text
        assert not [p for p in (tmp_path / "context").rglob("*") if p.is_file()]
        # The UI, at this server's address, still encodes.
        fine = httpx.post(f"{server.url}/encode", content=body,
                          headers={"Content-Type": "application/json"}, timeout=10)  # fmt: skip
        assert fine.status_code == 200, fine.text


@pytest.mark.timeout(60)
def test_encode_stores_no_more_than_a_callers_quota(tmp_path: Path):
    opener = PayloadOpener(DirectoryContextStore(tmp_path / "context"))
    quota = codec_server.EncodeQuota(max_bytes=30_000, window_s=3600)
    server = CodecServerThread(codec_app(opener, CodecAccess(), encode_quota=quota))
    server.start()
    try:
        statuses, errors = [], []
        for _ in range(4):  # about 12 KB each
            response = httpx.post(
                f"{server.url}/encode", json={"payloads": [_large_payload()]}, timeout=10
            )
            statuses.append(response.status_code)
            if response.status_code != 200:
                errors.append(response)
    finally:
        server.stop()
    assert statuses == [200, 200, 429, 429]
    assert "30000 bytes" in errors[0].json()["error"]
    assert "--encode-quota-mib" in errors[0].json()["error"]
    assert int(errors[0].headers["Retry-After"]) >= 1


@pytest.mark.timeout(60)
async def test_made_up_namespaces_cost_a_bounded_number_of_temporal_calls(
    tenants: Tenants,
):
    # Every call the lookup makes to Temporal, counted on the client it connects.
    calls: list[str] = []
    connect = tenants.lookup._connect

    async def counting() -> Client:
        client = await connect()
        service = client.service_client.workflow_service
        for name in (
            "list_workflow_executions",
            "describe_namespace",
            "describe_workflow_execution",
            "count_workflow_executions",
        ):
            original = getattr(service, name)

            async def counted(*args: Any, _original: Any = original, _name: str = name,
                              **kwargs: Any) -> Any:  # fmt: skip
                calls.append(_name)
                return await _original(*args, **kwargs)

            setattr(service, name, counted)
        return client

    tenants.lookup._connect = counting
    # A reference as earlier versions wrote it: its scope alone, looked up by namespace.
    reference = {
        "metadata": {
            "encoding": base64.b64encode(b"kvflow/claim-check").decode(),
            "kvflow-scope": base64.b64encode(b"0" * 32).decode(),
        },
        "data": base64.b64encode(b"0" * 64).decode(),
    }
    responses = []
    for i in range(60):
        async with httpx.AsyncClient(timeout=10) as http:  # one connection each: any answer
            responses.append(
                await http.post(
                    f"{tenants.url}/decode",
                    json={"payloads": [reference]},
                    headers={"Authorization": f"Bearer {ACME}", "X-Namespace": f"made-up-{i}"},
                )
            )
    # Within a minute (this test's own limit), at most 30 new namespaces are asked about.
    assert len(calls) <= 30, len(calls)
    for response in responses:
        assert response.status_code == 200, response.text
        assert NOT_YOURS in base64.b64decode(response.json()["payloads"][0]["data"]).decode()

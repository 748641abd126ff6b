"""The remote codec server, driven as the Temporal Web UI drives it.

A real task of tenant acme runs on the simulated fleet and the session's dev server and fails
(its spend cap refuses its second step); its history's payloads go to `POST /decode` after a
CORS preflight from the UI's origin, with the bearer token the UI forwards. And `kvflow
server` starts its UI with the codec endpoint set.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import json
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from google.protobuf import json_format
from temporalio.api.common.v1 import Payload, Payloads
from temporalio.client import Client, WorkflowFailureError
from temporalio.converter import DataConverter, WorkflowSerializationContext

from kvflow.activities.claim_check import CLAIM_CHECK_ENCODING, is_claim_check, with_claim_check
from kvflow.activities.context_store import DirectoryContextStore
from kvflow.ports import free_port
from kvflow.workers.codec_server import (
    NOT_YOURS,
    Caller,
    CodecConfigError,
    CodecServerThread,
    PayloadOpener,
    WorkflowTenants,
    codec_app,
    load_codec,
    load_tokens,
)
from kvflow.workers.plugin import KvflowPlugin
from tests import agent_workflows as wf
from tests.codecs import XOR_ENCODING, XorCodec
from tests.history import payloads_in
from tests.stacks import MODEL, PoolPlan, fleet_stack, task_spec

KVFLOW = Path(sys.executable).parent / "kvflow"
UI_ORIGIN = "http://localhost:8233"
ACME, GLOBEX, OPS = "acme-" + "a" * 24, "globex-" + "g" * 24, "ops-" + "o" * 24
MARKER = "MERGER-TERMS-7f3a"


@dataclass
class FailedTask:
    """A failed task of acme, as the UI reads it: its history's payloads, still encoded."""

    workflow_id: str
    payloads: list[dict[str, Any]]
    context_dir: Path


@pytest.fixture(scope="module")
async def failed_task(temporal_client: Client, tmp_path_factory: pytest.TempPathFactory):
    tmp_path = tmp_path_factory.mktemp("codec")
    client = await Client.connect(
        temporal_client.service_client.config.target_host,
        namespace=temporal_client.namespace,
        plugins=[KvflowPlugin(context_dir=tmp_path / "context")],
    )
    async with fleet_stack(client, tmp_path, [PoolPlan("solo")]) as s:
        task = wf.StepsInput(
            # The first step costs about $0.0008; the cap refuses the second.
            spec=task_spec(tenant="acme", expected_steps=2, budget_micros=800),
            model=MODEL,
            steps=2,
            max_tokens=600,
            context=f"{MARKER}: summarise the merger terms. " + "clause text " * 300,
        )
        handle = await s.start(wf.MultiStepAgent.run, task)
        with pytest.raises(WorkflowFailureError):
            await handle.result()
    # As the UI gets it: the server's history, payloads as encoded, not through any codec.
    history = await temporal_client.get_workflow_handle(handle.id).fetch_history()
    payloads = [
        json_format.MessageToDict(p) for event in history.events for p in payloads_in(event)
    ]
    query = f"WorkflowId = '{handle.id}' AND KvflowTenant = 'acme'"
    for _ in range(100):  # visibility lags the task by about a second
        if (await temporal_client.count_workflows(query)).count:
            break
        await asyncio.sleep(0.1)
    return FailedTask(handle.id, payloads, tmp_path / "context")


@pytest.fixture(scope="module")
async def codec_url(
    failed_task: FailedTask,
    temporal_client: Client,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[str]:
    tokens = tmp_path_factory.mktemp("tokens") / "tokens.toml"
    tokens.write_text(
        f'[tokens.acme-support]\ntoken = "{ACME}"\ntenants = ["acme"]\n'
        f'[tokens.globex-support]\ntoken = "{GLOBEX}"\ntenants = ["globex"]\n'
        f'[tokens.ops]\ntoken = "{OPS}"\ntenants = ["*"]\n'
    )
    target = temporal_client.service_client.config.target_host

    async def connect() -> Client:
        return await Client.connect(target)

    opener = PayloadOpener(
        DirectoryContextStore(failed_task.context_dir),
        tenant_of=WorkflowTenants(connect),
    )
    server = CodecServerThread(codec_app(opener, load_tokens(tokens), ui_origins=[UI_ORIGIN]))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def _as_ui(url: str, payloads: list[dict[str, Any]], token: str | None) -> httpx.Response:
    """A CORS preflight from the UI's origin, then `POST /decode` as the UI sends it."""
    preflight = httpx.options(
        f"{url}/decode",
        headers={
            "Origin": UI_ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type,x-namespace",
        },
        timeout=10,
    )
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == UI_ORIGIN
    assert preflight.headers["access-control-allow-credentials"] == "true"
    headers = {
        "Origin": UI_ORIGIN,
        "Content-Type": "application/json",
        "X-Namespace": "default",
    }
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    response = httpx.post(f"{url}/decode", json={"payloads": payloads}, headers=headers, timeout=30)
    assert response.headers["access-control-allow-origin"] == UI_ORIGIN
    return response


def _texts(response: httpx.Response) -> list[str]:
    """The decoded payloads' data, as text."""
    decoded = json_format.ParseDict(response.json(), Payloads())
    return [p.data.decode("utf-8", "replace") for p in decoded.payloads]


def _answers(texts: list[str]) -> Iterator[dict[str, Any]]:
    """The `text_ref` of each model call's result among decoded payloads."""
    for text in texts:
        if text.startswith("{") and '"text_ref"' in text:
            ref = json.loads(text).get("text_ref")
            if ref:
                yield ref


def _encoded_as_history_holds(failed_task: FailedTask) -> None:
    encodings = {
        json_format.ParseDict(p, Payload()).metadata.get("encoding") for p in failed_task.payloads
    }
    assert CLAIM_CHECK_ENCODING in encodings, "the task's input was not claim-checked"
    assert MARKER not in json.dumps(failed_task.payloads)


@pytest.mark.timeout(240)
async def test_the_ui_shows_a_failed_tasks_prompt_and_answer_as_text(
    failed_task: FailedTask, codec_url: str
):
    _encoded_as_history_holds(failed_task)
    response = await asyncio.to_thread(_as_ui, codec_url, failed_task.payloads, ACME)
    assert response.status_code == 200, response.text
    texts = _texts(response)
    assert len(texts) == len(failed_task.payloads)
    # The prompt: in the claim-checked input, and in the context the agent stored.
    assert sum(MARKER in text for text in texts) >= 2, texts
    [answer] = list(_answers(texts))
    assert len(answer["text"].encode()) == answer["size"] > 2048
    assert hashlib.sha256(answer["text"].encode()).hexdigest() == answer["digest"]
    assert NOT_YOURS not in "".join(texts)


@pytest.mark.timeout(240)
async def test_another_tenants_token_gets_placeholders_never_the_text(
    failed_task: FailedTask, codec_url: str
):
    response = await asyncio.to_thread(_as_ui, codec_url, failed_task.payloads, GLOBEX)
    assert response.status_code == 200, response.text
    texts = _texts(response)
    assert not any(MARKER in text for text in texts)
    assert sum(NOT_YOURS in text for text in texts) >= 3  # input, stored context, answer
    [answer] = list(_answers(texts))
    assert answer["text"] == NOT_YOURS
    # The holder of every tenant reads it all.
    ops = await asyncio.to_thread(_as_ui, codec_url, failed_task.payloads, OPS)
    assert sum(MARKER in text for text in _texts(ops)) >= 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("token", [None, "not-a-token-of-this-server", f"{ACME}x"])
async def test_a_missing_or_unknown_token_is_refused(
    failed_task: FailedTask, codec_url: str, token: str | None
):
    response = await asyncio.to_thread(_as_ui, codec_url, failed_task.payloads, token)
    assert response.status_code == 401
    assert MARKER not in response.text


@pytest.mark.timeout(120)
async def test_encode_then_decode_round_trips_a_large_payload(codec_url: str):
    text = json.dumps(f"{MARKER} " * 400)
    original = {
        "metadata": {"encoding": "anNvbi9wbGFpbg=="},
        "data": base64.b64encode(text.encode()).decode(),
    }
    headers = {"Authorization": f"Bearer {OPS}", "X-Namespace": "default"}
    async with httpx.AsyncClient(headers=headers, timeout=10) as http:
        encoded = await http.post(f"{codec_url}/default/encode", json={"payloads": [original]})
        assert encoded.status_code == 200, encoded.text
        [reference] = encoded.json()["payloads"]
        assert MARKER not in json.dumps(reference)  # stored, not inline
        decoded = await http.post(f"{codec_url}/decode", json=encoded.json())
    assert decoded.json() == {"payloads": [original]}


@pytest.mark.timeout(60)
def test_codec_serve_refuses_the_network_without_tokens(tmp_path: Path):
    result = subprocess.run(
        [
            str(KVFLOW),
            "codec",
            "serve",
            "--host",
            "0.0.0.0",
            "--context-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert result.returncode == 2
    assert "--tokens" in result.stderr and len(result.stderr.strip().splitlines()) <= 2


@pytest.mark.timeout(120)
def test_kvflow_server_starts_its_ui_with_the_codec_endpoint(tmp_path: Path):
    port, ui_port = free_port(), free_port()
    process = subprocess.Popen(
        [
            *(str(KVFLOW), "server", "--port", str(port), "--ui-port", str(ui_port)),
            *("--state-dir", str(tmp_path), "--in-memory"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout is not None
        seen = ""
        while "Codec server" not in seen and process.poll() is None:
            seen += process.stdout.readline()
        assert "Codec server" in seen, seen
        endpoint = seen.rsplit("Codec server", 1)[1].split(": ", 1)[1].split()[0]
        settings = httpx.get(f"http://127.0.0.1:{ui_port}/api/v1/settings", timeout=10).json()
        assert settings["Codec"]["Endpoint"] == endpoint
        # The UI's origin may call it, and it answers.
        origin = f"http://localhost:{ui_port}"
        response = httpx.post(
            f"{endpoint}/decode",
            json={"payloads": []},
            headers={"Origin": origin, "X-Namespace": "default"},
            timeout=10,
        )
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == origin
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)


async def test_the_deployments_own_codec_opens_after_the_claim_check(tmp_path: Path):
    # Payloads as a client with its own codec and KvflowPlugin writes them to history.
    store = DirectoryContextStore(tmp_path / "context")
    converter = with_claim_check(store)(
        dataclasses.replace(DataConverter.default, payload_codec=XorCodec())
    ).with_context(WorkflowSerializationContext(namespace="default", workflow_id="own-codec"))
    large, small = f"{MARKER} " * 400, f"{MARKER} in brief"
    payloads = await converter.encode([large, small])
    assert is_claim_check(payloads[0]) and payloads[1].metadata["encoding"] == XOR_ENCODING
    ops, acme = Caller("ops", frozenset({"*"})), Caller("acme-support", frozenset({"acme"}))

    # Without the deployment's codec the UI would get that codec's bytes back.
    restored, inline = await PayloadOpener(store).decode(payloads, ops, "default")
    assert restored.metadata["encoding"] == XOR_ENCODING and inline == payloads[1]

    opener = PayloadOpener(store, codec=XorCodec())
    opened = await opener.decode(payloads, ops, "default")
    assert [json.loads(p.data) for p in opened] == [large, small]
    # Neither names a tenant this caller may read: placeholders, never the text.
    refused = await opener.decode(payloads, acme, "default")
    assert [p.data.decode() for p in refused] == [json.dumps(NOT_YOURS)] * 2
    # What the server encodes (the UI's edits), it opens again: its codec, then the claim check.
    plain = opened[1]
    encoded = await opener.encode([plain])
    assert encoded[0].metadata["encoding"] == XOR_ENCODING
    assert await opener.decode(encoded, ops, "default") == [plain]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tests.codecs", "--codec takes MODULE:NAME"),
        ("tests.no_such_codecs:XorCodec", "cannot import 'tests.no_such_codecs'"),
        ("tests.codecs:RotCodec", "tests.codecs has no 'RotCodec'"),
        ("tests.codecs:XOR_ENCODING", "XOR_ENCODING is a bytes, not a"),
    ],
)
def test_a_codec_that_cannot_be_loaded_is_named(spec: str, message: str):
    assert isinstance(load_codec("tests.codecs:XorCodec"), XorCodec)
    with pytest.raises(CodecConfigError, match=re.escape(message)):
        load_codec(spec)


@pytest.mark.timeout(60)
def test_codec_serve_refuses_a_codec_it_cannot_load(tmp_path: Path):
    result = subprocess.run(
        [str(KVFLOW), "codec", "serve", "--context-dir", str(tmp_path), "--codec", "nope"],
        capture_output=True, text=True, timeout=50, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--codec takes MODULE:NAME" in result.stderr and "Traceback" not in result.stderr

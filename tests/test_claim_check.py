"""The claim-check codec: payloads over the offload threshold never enter history in full.

End to end on the real Temporal dev server and the simulated fleet, with a client connected
through `KvflowPlugin` on the same context store as the workers; and the codec alone. A
claim-checked payload opens in its own workflow only: not in another tenant's task through
`Agent.read`, the store's API or a reference copied into its history; and never damaged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import secrets
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.common.v1 import Payload, Payloads, WorkflowType
from temporalio.api.enums.v1 import EventType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import StartWorkflowExecutionRequest
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle, WorkflowHistory
from temporalio.contrib.pydantic import PydanticPayloadConverter, pydantic_data_converter
from temporalio.converter import DataConverter, WorkflowSerializationContext
from temporalio.exceptions import ApplicationError
from temporalio.worker import Replayer

from kvflow.activities.claim_check import (
    CLAIM_CHECK_ENCODING,
    REPLAY_NAMESPACE,
    SCOPE_METADATA,
    WORKFLOW_METADATA,
    ClaimCheckCodec,
    ClaimCheckMissing,
    ClaimCheckRefused,
    claim_check_of,
    is_claim_check,
)
from kvflow.activities.context_store import ContextNotFound, DirectoryContextStore
from kvflow.activities.wire import INLINE_LIMIT_BYTES, ContextRef, InferenceResult
from kvflow.workers.plugin import KvflowPlugin
from kvflow.workflows import errors
from tests import agent_workflows as wf
from tests.codecs import XOR_ENCODING, XorCodec
from tests.history import payloads_in
from tests.stacks import MODEL, PoolPlan, fleet_stack, task_spec


async def _client(
    temporal_client: Client, context_dir: Path, claim_check_bytes: int | None = INLINE_LIMIT_BYTES
) -> Client:
    """A client of the session's server configured by `KvflowPlugin` on `context_dir`."""
    return await Client.connect(
        temporal_client.service_client.config.target_host,
        namespace=temporal_client.namespace,
        plugins=[KvflowPlugin(context_dir=context_dir, claim_check_bytes=claim_check_bytes)],
    )


@pytest.mark.timeout(180)
async def test_large_prompt_and_structured_answer_stay_out_of_history(
    temporal_client: Client, tmp_path: Path
):
    client = await _client(temporal_client, tmp_path / "context")  # the stack's store
    brief = "Write the quarterly report on these findings. " + "finding " * 600
    assert len(brief.encode()) > INLINE_LIMIT_BYTES
    pools = [PoolPlan("big", gpu="H200", max_model_len=16384)]
    async with fleet_stack(client, tmp_path, pools) as s:
        task = wf.ReportInput(spec=task_spec(expected_steps=1), model=MODEL, brief=brief)
        handle = await s.start(wf.LongReport.run, task)
        report = await handle.result()
        history = await handle.fetch_history()

    # The right result: the answer the replica gave (in the context store), parsed.
    assert isinstance(report, wf.Report) and len(report.body) >= 3000
    [infer] = [
        e.event_id
        for e in history.events
        if e.activity_task_scheduled_event_attributes.activity_type.name == "kvflow.infer"
    ]
    [completed] = [
        e.activity_task_completed_event_attributes
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
        and e.activity_task_completed_event_attributes.scheduled_event_id == infer
    ]
    [answer] = await client.data_converter.decode(completed.result.payloads, [InferenceResult])
    assert isinstance(answer, InferenceResult) and answer.text_ref is not None
    stored = DirectoryContextStore(tmp_path / "context").get(answer.text_ref)
    assert wf.Report.model_validate_json(stored) == report

    # No payload of any event is over the threshold; the large ones are references (the
    # workflow input, the local-activity marker of the answer read back, the result).
    sizes, references = [], 0
    for event in history.events:
        for payload in payloads_in(event):
            sizes.append(payload.ByteSize())
            references += is_claim_check(payload)
    assert max(sizes) <= INLINE_LIMIT_BYTES, sorted(sizes)[-5:]
    markers = [e for e in history.events if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED]
    assert any(is_claim_check(p) for m in markers for p in payloads_in(m))
    assert references >= 3
    whole = history.to_json()
    assert "finding finding finding" not in whole and report.body[:200] not in whole

    # It replays with the same converter; `claim_check_bytes=None` turns the codec off.
    await Replayer(
        workflows=wf.ALL_WORKFLOWS, data_converter=client.data_converter
    ).replay_workflow(history)
    plain = await _client(temporal_client, tmp_path / "context", claim_check_bytes=None)
    assert plain.data_converter.payload_codec is None


def _payload(size: int) -> Payload:
    return pydantic_data_converter.payload_converter.to_payloads(["x" * size])[0]


async def test_codec_round_trips_and_offloads_only_large_payloads(tmp_path: Path):
    store = DirectoryContextStore(tmp_path / "context")
    codec = ClaimCheckCodec(store)
    small, large = _payload(100), _payload(INLINE_LIMIT_BYTES + 1)
    encoded = await codec.encode([small, large])
    assert encoded[0] == small
    reference = encoded[1]
    assert reference.metadata["encoding"] == CLAIM_CHECK_ENCODING
    assert reference.ByteSize() < 200
    assert store.get_bytes(reference.data.decode()) == large.SerializeToString()
    # Idempotent: a reference is never offloaded again, and the same content the same way.
    assert await codec.encode(encoded) == encoded
    assert await codec.encode([large]) == [reference]
    assert await codec.decode(encoded) == [small, large]
    assert await codec.decode([small]) == [small]


async def test_missing_blob_names_the_store(tmp_path: Path):
    writer = ClaimCheckCodec(DirectoryContextStore(tmp_path / "written"))
    [reference] = await writer.encode([_payload(10_000)])
    reader = ClaimCheckCodec(DirectoryContextStore(tmp_path / "elsewhere"))
    with pytest.raises(ClaimCheckMissing) as missing:
        await reader.decode([reference])
    message = str(missing.value)
    assert str(tmp_path / "elsewhere") in message
    assert "every process must use the same context store" in message


def _workflow(workflow_id: str) -> WorkflowSerializationContext:
    return WorkflowSerializationContext(namespace="default", workflow_id=workflow_id)


async def test_a_reference_opens_in_its_own_workflow_only(tmp_path: Path):
    codec = ClaimCheckCodec(DirectoryContextStore(tmp_path / "context"))
    large = _payload(10_000)
    [reference] = await codec.with_context(_workflow("globex-task")).encode([large])
    assert await codec.with_context(_workflow("globex-task")).decode([reference]) == [large]
    # Copied into another workflow's history, it is refused, and says why.
    with pytest.raises(ClaimCheckRefused, match="belongs to another workflow"):
        await codec.with_context(_workflow("acme-task")).decode([reference])
    # Without the scope it names, it names nothing: the payload is not among unscoped ones.
    unscoped = Payload(metadata={"encoding": CLAIM_CHECK_ENCODING}, data=reference.data)
    with pytest.raises(ClaimCheckMissing, match="is not in"):
        await codec.with_context(_workflow("acme-task")).decode([unscoped])
    # A tool outside any workflow (a fetched history's reader) follows the scope it names.
    assert await codec.decode([reference]) == [large]


async def test_a_payload_damaged_on_disk_is_refused_not_decoded(tmp_path: Path):
    store = DirectoryContextStore(tmp_path / "context")
    codec = ClaimCheckCodec(store).with_context(_workflow("task-1"))
    [reference] = await codec.encode([_payload(10_000)])
    digest = reference.data.decode()
    [path] = (tmp_path / "context").rglob(digest)
    # One character of the JSON changed: still a well-formed payload, no longer the one stored.
    path.write_bytes(path.read_bytes().replace(b"xxxx", b"xxyx", 1))
    with pytest.raises(ContextNotFound, match=f"content {digest[:12]}… in .* is corrupt"):
        store.get_bytes(digest, codec.scope)
    with pytest.raises(ClaimCheckMissing, match="is corrupt"):
        await codec.decode([reference])


async def _failure(handle: WorkflowHandle[Any, Any]) -> ApplicationError:
    try:
        await handle.result()
    except WorkflowFailureError as failure:
        assert isinstance(failure.cause, ApplicationError), failure.cause
        return failure.cause
    raise AssertionError(f"{handle.id} did not fail")


async def _history_once(
    client: Client, workflow_id: str, event: EventType.ValueType
) -> WorkflowHistory:
    """The workflow's history as soon as it holds an `event` (bounded: 20 s)."""
    for _ in range(200):
        history = await client.get_workflow_handle(workflow_id).fetch_history()
        if any(e.event_type == event for e in history.events):
            return history
        await asyncio.sleep(0.1)
    raise AssertionError(f"{workflow_id} never recorded {EventType.Name(event)}")


def _stored_as_text(task: wf.StepsInput) -> wf.StepsInput:
    """`task`, padded until its serialized payload is valid UTF-8, as a payload of some sizes
    is: read as text, what the store keeps would then come back whole, not fail to decode."""
    while True:
        [payload] = pydantic_data_converter.payload_converter.to_payloads([task])
        try:
            payload.SerializeToString().decode("utf-8")
        except UnicodeDecodeError:
            task = task.model_copy(update={"context": task.context + " "})
        else:
            return task


@pytest.mark.timeout(180)
async def test_a_tenants_claim_checked_input_opens_for_no_other_tenant(
    temporal_client: Client, tmp_path: Path
):
    client = await _client(temporal_client, tmp_path / "context")  # the stack's store
    marker = f"globex-private-{secrets.token_hex(8)}"
    async with fleet_stack(client, tmp_path, [PoolPlan("solo")]) as s:
        secret = wf.StepsInput(
            spec=task_spec(tenant="globex", expected_steps=1),
            model=MODEL,
            steps=0,  # no model call: the input is what matters
            context=f"{marker} merger terms " * 370,
        )
        globex = await s.start(wf.MultiStepAgent.run, _stored_as_text(secret))
        await globex.result()
        # What anyone who sees globex's history sees: a reference to the task's input.
        [started] = [
            e.workflow_execution_started_event_attributes
            for e in (await globex.fetch_history()).events
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED
        ]
        [reference] = started.input.payloads
        assert is_claim_check(reference) and SCOPE_METADATA in reference.metadata
        digest = reference.data.decode()
        refs = [ContextRef(digest=digest, size=1, tenant=t) for t in (None, "globex", "acme")]

        # The store's API: no reference made of the digest opens it for acme.
        store = DirectoryContextStore(tmp_path / "context")
        for ref in refs:
            with pytest.raises(ContextNotFound):
                store.get(ref, tenant="acme")
        with pytest.raises(ContextNotFound):
            store.get_bytes(digest)

        # `Agent.read` in acme's tasks, through the workflow worker's context-get activity.
        reads = [
            await s.start(
                wf.ReadContext.run,
                wf.ReadInput(spec=task_spec(tenant="acme", expected_steps=1), ref=ref),
            )
            for ref in refs
        ]
        causes = [await _failure(handle) for handle in reads]
        assert all(c.type == errors.TaskErrorType.CONTEXT_NOT_FOUND for c in causes), causes

        # The reference itself, put in acme's own task as its input (by a client that sends
        # payloads as they are): the workflow worker's codec refuses to open it.
        forged = f"task-{uuid.uuid4()}"
        await temporal_client.workflow_service.start_workflow_execution(
            StartWorkflowExecutionRequest(
                namespace=temporal_client.namespace,
                workflow_id=forged,
                workflow_type=WorkflowType(name="MultiStepAgent"),
                task_queue=TaskQueue(name=s.task_queue),
                input=Payloads(payloads=[reference]),
                request_id=str(uuid.uuid4()),
            )
        )
        refused = await _history_once(
            temporal_client, forged, EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
        )
        await temporal_client.get_workflow_handle(forged).terminate("refused input")
        histories = [(await h.fetch_history()).to_json() for h in reads]

    [task_failed] = [
        e.workflow_task_failed_event_attributes
        for e in refused.events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
    ][:1]
    assert "belongs to another workflow" in task_failed.failure.message
    for history in [*histories, refused.to_json()]:
        assert marker not in history


@pytest.mark.timeout(60)
async def test_a_clients_own_codec_is_kept_and_the_claim_check_stores_what_it_made(
    temporal_client: Client, tmp_path: Path
):
    client = await Client.connect(
        temporal_client.service_client.config.target_host,
        namespace=temporal_client.namespace,
        data_converter=dataclasses.replace(DataConverter.default, payload_codec=XorCodec()),
        plugins=[KvflowPlugin(context_dir=tmp_path / "context")],
    )
    # kvflow's records need pydantic's payload converter; the user's codec stays, first.
    assert client.data_converter.payload_converter_class is PydanticPayloadConverter
    claim_check = claim_check_of(client.data_converter)
    assert claim_check is not None and claim_check.store.location == str(tmp_path / "context")

    large, small = "secret finding " * 400, "a small secret"
    workflow_id = f"own-codec-{uuid.uuid4().hex[:8]}"
    handle = await client.start_workflow(
        "NobodyRunsThis", args=[large, small], id=workflow_id,
        task_queue=f"nobody-polls-{workflow_id}",
    )  # fmt: skip
    try:
        # History as the server keeps it, read without any codec.
        raw = await temporal_client.get_workflow_handle(workflow_id).fetch_history()
        started = raw.events[0].workflow_execution_started_event_attributes
        reference, inline = started.input.payloads
        # The small one went through the user's codec only; the large one through the
        # user's codec, then into the store, and history holds the reference.
        assert inline.metadata["encoding"] == XOR_ENCODING
        assert is_claim_check(reference)
        stored = DirectoryContextStore(tmp_path / "context").get_bytes(
            reference.data.decode(), reference.metadata[SCOPE_METADATA].decode()
        )
        assert Payload.FromString(stored).metadata["encoding"] == XOR_ENCODING
        assert b"secret" not in stored and b"secret" not in raw.to_json().encode()
        # The client reads both back: the claim check opened first, then the user's codec.
        converter = client.data_converter.with_context(
            WorkflowSerializationContext(namespace=client.namespace, workflow_id=workflow_id)
        )
        assert await converter.decode([reference, inline], [str, str]) == [large, small]
    finally:
        await handle.terminate()


async def test_a_reference_opens_in_no_other_namespace_but_under_the_replayer(tmp_path: Path):
    codec = ClaimCheckCodec(DirectoryContextStore(tmp_path / "context"))
    large = _payload(10_000)
    in_a = WorkflowSerializationContext(namespace="team-a", workflow_id="report-1")
    [reference] = await codec.with_context(in_a).encode([large])
    # The same workflow id in another namespace is another workflow.
    in_b = WorkflowSerializationContext(namespace="team-b", workflow_id="report-1")
    with pytest.raises(ClaimCheckRefused, match="belongs to another workflow"):
        await codec.with_context(in_b).decode([reference])
    # The Replayer decodes a fetched history under a namespace of its own.
    replay = WorkflowSerializationContext(namespace=REPLAY_NAMESPACE, workflow_id="report-1")
    assert await codec.with_context(replay).decode([reference]) == [large]
    other = WorkflowSerializationContext(namespace=REPLAY_NAMESPACE, workflow_id="report-2")
    with pytest.raises(ClaimCheckRefused):
        await codec.with_context(other).decode([reference])


async def test_a_reference_whose_scope_is_not_its_workflows_opens_nothing(tmp_path: Path):
    codec = ClaimCheckCodec(DirectoryContextStore(tmp_path / "context"))
    [reference] = await codec.with_context(_workflow("globex-task")).encode([_payload(10_000)])
    forged = Payload()
    forged.CopyFrom(reference)
    forged.metadata[WORKFLOW_METADATA] = b"acme-task"  # claimed for acme's own workflow
    for reader in (codec, codec.with_context(_workflow("acme-task"))):
        with pytest.raises(ClaimCheckMissing, match="not that of the workflow it names"):
            await reader.decode([forged])


async def test_an_earlier_versions_reference_still_opens_in_its_workflow(tmp_path: Path):
    store = DirectoryContextStore(tmp_path / "context")
    large = _payload(10_000)
    # As versions before namespaces wrote it: the scope of the workflow id alone, named alone.
    scope = hashlib.sha256(b"globex-task").hexdigest()[:32]
    digest = store.put_bytes(large.SerializeToString(), scope)
    reference = Payload(
        metadata={"encoding": CLAIM_CHECK_ENCODING, SCOPE_METADATA: scope.encode()},
        data=digest.encode(),
    )
    codec = ClaimCheckCodec(store)
    assert await codec.with_context(_workflow("globex-task")).decode([reference]) == [large]
    assert await codec.decode([reference]) == [large]
    with pytest.raises(ClaimCheckRefused):
        await codec.with_context(_workflow("acme-task")).decode([reference])

"""The claim-check codec: payloads over the offload threshold never enter history in full.

End to end on the real Temporal dev server and the simulated fleet, with a client connected
through `KvflowPlugin` on the same context store as the workers; and the codec alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from kvflow.activities.claim_check import (
    CLAIM_CHECK_ENCODING,
    ClaimCheckCodec,
    ClaimCheckMissing,
    is_claim_check,
)
from kvflow.activities.context_store import DirectoryContextStore
from kvflow.activities.wire import INLINE_LIMIT_BYTES, InferenceResult
from kvflow.workers.plugin import KvflowPlugin
from tests import agent_workflows as wf
from tests.history import payloads_in
from tests.test_workflows import MODEL, PoolPlan, _spec, stack


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
    async with stack(client, tmp_path, pools) as s:
        task = wf.ReportInput(spec=_spec(expected_steps=1), model=MODEL, brief=brief)
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

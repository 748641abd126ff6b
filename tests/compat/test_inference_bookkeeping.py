"""The inference activity's bookkeeping, against the simulator and real vLLM.

A finished answer survives a slow or unavailable ledger, and a cut-and-resumed call keeps its
output text out of history.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client
from temporalio.worker import Worker

from kvflow.activities.inference import ReplicaBinding
from kvflow.activities.wire import (
    INLINE_LIMIT_BYTES,
    AttemptProgress,
    ContextRef,
    Sampling,
)
from kvflow.ledger import AsyncLedger, AttemptRecord, LedgerUnavailable, open_ledger
from kvflow.workers.gpu_worker import GpuWorker
from tests.compat.test_inference_activity import (
    PRICES,
    Call,
    CallOnce,
    CallOutcome,
    _chat,
    _pool,
)
from tests.faulty_proxy import Fault, FaultyProxy
from tests.history import payloads_in
from tests.servers import ServedModel

QUEUE = f"bookkeeping-tests-{uuid.uuid4()}"
CALL_TIMEOUT_S = 90


@pytest.fixture(scope="module")
async def workflows(temporal_client: Client) -> AsyncIterator[None]:
    async with Worker(temporal_client, task_queue=QUEUE, workflows=[CallOnce]):
        yield


async def _call(
    client: Client,
    worker: GpuWorker,
    request: Any,
    workflow_id: str | None = None,
    *,
    heartbeat_timeout_s: float = 2.0,
) -> CallOutcome:
    return await asyncio.wait_for(
        client.execute_workflow(
            CallOnce.run,
            Call(
                request=request,
                task_queue=worker.task_queue,
                heartbeat_timeout_s=heartbeat_timeout_s,
            ),
            id=workflow_id or f"call-{uuid.uuid4()}",
            task_queue=QUEUE,
        ),
        CALL_TIMEOUT_S,
    )


async def _run_id(client: Client, workflow_id: str) -> str:
    return (await client.get_workflow_handle(workflow_id).describe()).run_id


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[AsyncLedger]:
    opened = AsyncLedger(open_ledger(f"sqlite:///{tmp_path}/ledger.db", migrate=True))
    yield opened
    opened.ledger.close()


def _gpu_worker(
    client: Client, server: ServedModel, base_url: str, ledger: Any, tmp_path: Path
) -> GpuWorker:
    binding = ReplicaBinding(pool=_pool(server.model), index=0, base_url=base_url)
    return GpuWorker(
        client,
        binding,
        ledger=ledger,
        spool_dir=tmp_path / "spool",
        heartbeat_interval_s=0.2,
        graceful_shutdown_s=1,
    )


@pytest.mark.timeout(120)
async def test_finished_answer_survives_a_ledger_write_slower_than_the_heartbeat_timeout(
    temporal_client: Client,
    openai_server: ServedModel,
    workflows: None,
    ledger: AsyncLedger,
    tmp_path: Path,
) -> None:
    # Another process holds the SQLite write lock for 4 s: the worker's write waits (busy
    # timeout), past the 2 s heartbeat timeout of the call.
    blocker = sqlite3.connect(
        tmp_path / "ledger.db", isolation_level=None, timeout=0, check_same_thread=False
    )
    blocker.execute("BEGIN IMMEDIATE")
    release = threading.Timer(4.0, lambda: blocker.execute("COMMIT"))
    worker = _gpu_worker(temporal_client, openai_server, openai_server.base_url, ledger, tmp_path)
    try:
        release.start()
        async with worker:
            workflow_id = f"slow-ledger-{uuid.uuid4()}"
            outcome = await _call(
                temporal_client,
                worker,
                _chat(openai_server, "Plan a trip.", 16),
                workflow_id,
            )
    finally:
        release.join()
        blocker.close()
    result = outcome.result
    assert result is not None, outcome
    assert result.usage.completion_tokens == 16
    (row,) = await ledger.attempts_for(workflow_id, await _run_id(temporal_client, workflow_id))
    assert row.outcome == "ok" and row.cost_micros == result.cost_micros
    assert row.cost_micros == PRICES.cost_micros(
        result.usage.prompt_tokens, result.usage.cached_tokens, 16
    )


class LedgerOutage:
    """A real ledger that is down (refuses every write) while `down` is set."""

    def __init__(self, ledger: AsyncLedger) -> None:
        self.ledger = ledger
        self.down = True

    async def record_attempt(self, record: AttemptRecord) -> bool:
        if self.down:
            raise LedgerUnavailable("ledger: connection refused")
        return await self.ledger.record_attempt(record)


@pytest.mark.timeout(120)
async def test_attempt_billed_while_the_ledger_is_down_is_written_when_it_is_back(
    temporal_client: Client,
    openai_server: ServedModel,
    workflows: None,
    ledger: AsyncLedger,
    tmp_path: Path,
) -> None:
    outage = LedgerOutage(ledger)
    worker = _gpu_worker(temporal_client, openai_server, openai_server.base_url, outage, tmp_path)
    workflow_id = f"ledger-down-{uuid.uuid4()}"
    async with worker:
        outcome = await _call(
            temporal_client,
            worker,
            _chat(openai_server, "Plan a trip.", 8),
            workflow_id,
        )
    assert outcome.result is not None, outcome
    run_id = await _run_id(temporal_client, workflow_id)
    assert await ledger.attempts_for(workflow_id, run_id) == []

    # The ledger is back; the GPU worker for the same replica starts again and replays.
    outage.down = False
    restarted = GpuWorker(
        temporal_client,
        worker.binding,
        ledger=outage,
        spool_dir=tmp_path / "spool",
        heartbeat_interval_s=0.2,
    )
    async with restarted:
        (row,) = await ledger.attempts_for(workflow_id, run_id)
    assert row.outcome == "ok" and row.cost_micros == outcome.result.cost_micros


# ---- history stays small ---------------------------------------------------------------------


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


async def _longest_text_in_history(client: Client, workflow_id: str) -> int:
    """The longest string (in UTF-8 bytes) that any payload of the workflow's history holds."""
    longest = 0
    async for event in client.get_workflow_handle(workflow_id).fetch_history_events():
        for payload in payloads_in(event):
            try:
                decoded = json.loads(payload.data)
            except ValueError:
                decoded = payload.data.decode("utf-8", "replace")
            for text in _strings(decoded):
                longest = max(longest, len(text.encode("utf-8")))
    return longest


@pytest.mark.timeout(180)
async def test_cut_and_resumed_call_keeps_its_output_text_out_of_history(
    temporal_client: Client, openai_server: ServedModel, workflows: None, tmp_path: Path
) -> None:
    proxy = FaultyProxy(openai_server.base_url).start()
    try:
        cut_worker = _gpu_worker(temporal_client, openai_server, proxy.base_url, None, tmp_path)
        worker = _gpu_worker(temporal_client, openai_server, openai_server.base_url, None, tmp_path)
        request = _chat(openai_server, "Write a long answer about durable agents.", 900)
        # Sampled, not greedy: the tiny random model's greedy output repeats two-byte tokens.
        request.sampling = Sampling(temperature=1.0, seed=7, ignore_eos=True)
        proxy.fault = Fault(cut_after_chunks=800)
        async with cut_worker, worker:
            cut_id, resumed_id = f"cut-{uuid.uuid4()}", f"resumed-{uuid.uuid4()}"
            # A long stream on a busy CPU: a 2 s heartbeat timeout could end it before the cut.
            cut = await _call(temporal_client, cut_worker, request, cut_id, heartbeat_timeout_s=20)
            assert cut.error_type == "StreamCut", cut
            progress = AttemptProgress.from_details([cut.details], source="StreamCut details")
            assert progress is not None
            partial = progress.resumable()
            assert partial is not None
            # The partial output was over the threshold, so it travelled as a reference.
            assert isinstance(partial.text, ContextRef), partial
            assert partial.text.size > INLINE_LIMIT_BYTES
            resumed = await _call(
                temporal_client,
                worker,
                request.model_copy(update={"checkpoint": partial}),
                resumed_id,
                heartbeat_timeout_s=20,
            )
    finally:
        proxy.stop()
    result = resumed.result
    assert result is not None, resumed
    assert result.text_ref is not None and result.reused_tokens == partial.completion_tokens
    for workflow_id in (cut_id, resumed_id):
        assert await _longest_text_in_history(temporal_client, workflow_id) <= INLINE_LIMIT_BYTES

"""The inference activity and the GPU worker, against the simulator and against real vLLM.

Each test runs the real activity in a real GPU worker on the Temporal dev server; a workflow
dispatches the call to the worker's task queue, exactly as the step API does.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from decimal import Decimal
from typing import Any

from pydantic import BaseModel
from temporalio import workflow
from temporalio.client import Client
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.worker import Worker

from tests.waiting import eventually

# This module defines a workflow, so the sandbox imports it again: pass the rest through.
with workflow.unsafe.imports_passed_through():
    import httpx
    import pytest

    from kvflow.activities.inference import INFER_ACTIVITY, ReplicaBinding
    from kvflow.activities.wire import (
        AttemptProgress,
        ChatMessage,
        InferenceRequest,
        InferenceResult,
        Sampling,
        ToolSpec,
    )
    from kvflow.ledger.records import AttemptRecord
    from kvflow.scheduler.fleet import Pool, TokenPrices
    from kvflow.workers.gpu_worker import GpuWorker
    from kvflow.workers.replica import GpuWorkerError, check_endpoint
    from tests.faulty_proxy import Fault, FaultyProxy
    from tests.servers import ServedModel


class Call(BaseModel):
    request: InferenceRequest
    task_queue: str
    cancel_after_s: float | None = None
    heartbeat_timeout_s: float = 2.0
    """Short, for the tests of cancellation and slow bookkeeping; longer where a loaded
    machine's late heartbeat would fail a test about something else."""


class CallOutcome(BaseModel):
    result: InferenceResult | None = None
    error_type: str | None = None
    non_retryable: bool | None = None
    message: str | None = None
    details: dict[str, Any] | None = None


@workflow.defn
class CallOnce:
    @workflow.run
    async def run(self, call: Call) -> CallOutcome:
        handle = workflow.start_activity(
            INFER_ACTIVITY,
            call.request,
            result_type=InferenceResult,
            task_queue=call.task_queue,
            start_to_close_timeout=timedelta(seconds=120),
            heartbeat_timeout=timedelta(seconds=call.heartbeat_timeout_s),
            retry_policy=RetryPolicy(maximum_attempts=1),
            cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        )
        if call.cancel_after_s is not None:
            await workflow.sleep(call.cancel_after_s)
            handle.cancel()
        try:
            return CallOutcome(result=await handle)
        except ActivityError as err:
            cause = err.cause
            if isinstance(cause, ApplicationError):
                details = cause.details[0] if cause.details else None
                return CallOutcome(
                    error_type=cause.type,
                    non_retryable=cause.non_retryable,
                    message=cause.message,
                    details=details if isinstance(details, dict) else None,
                )
            return CallOutcome(error_type=type(cause).__name__, message=str(cause))


PRICES = TokenPrices(
    input_per_mtok_usd=Decimal("0.20"),
    cached_input_per_mtok_usd=Decimal("0.02"),
    output_per_mtok_usd=Decimal("0.60"),
)


class RecordedAttempts:
    """Collects the attempt reports the worker writes (the ledger has its own tests)."""

    def __init__(self) -> None:
        self.reports: list[AttemptRecord] = []

    async def record_attempt(self, record: AttemptRecord) -> bool:
        self.reports.append(record)
        return True


def _pool(model: str) -> Pool:
    return Pool(
        name=f"t{uuid.uuid4().hex[:12]}",
        gpu="H100",
        replicas=1,
        price_per_gpu_hour_usd=Decimal("2.00"),
        token_prices=PRICES,
        warm_models=[model],
        max_concurrency=8,
    )


FILLER = "the quick brown fox jumps over the lazy dog while agents plan and draft"


async def _prompt_of(server: ServedModel, tokens: int) -> str:
    """A prompt of about `tokens` tokens for this server's tokenizer."""
    words = FILLER.split()
    text = ""
    async with httpx.AsyncClient() as http:
        for n in range(tokens // 4, tokens * 4, max(1, tokens // 8)):
            text = " ".join(words[i % len(words)] for i in range(n))
            answer = await http.post(
                f"{server.base_url}/tokenize", json={"model": server.model, "prompt": text}
            )
            if answer.json()["count"] >= tokens:
                return text
    return text


class Replica:
    """A GPU worker in front of a served model (optionally through a faulty proxy)."""

    def __init__(self, client: Client, server: ServedModel, base_url: str) -> None:
        self.client = client
        self.server = server
        self.attempts = RecordedAttempts()
        binding = ReplicaBinding(pool=_pool(server.model), index=0, base_url=base_url)
        self.worker = GpuWorker(
            client, binding, ledger=self.attempts, heartbeat_interval_s=0.2, graceful_shutdown_s=1
        )

    async def call(
        self, request: InferenceRequest, cancel_after_s: float | None = None
    ) -> CallOutcome:
        return await self.client.execute_workflow(
            CallOnce.run,
            Call(request=request, task_queue=self.worker.task_queue, cancel_after_s=cancel_after_s),
            id=f"call-{uuid.uuid4()}",
            task_queue=WORKFLOW_QUEUE,
        )


WORKFLOW_QUEUE = f"activity-tests-{uuid.uuid4()}"


@pytest.fixture(scope="module")
async def workflow_worker(temporal_client: Client) -> AsyncIterator[None]:
    async with Worker(temporal_client, task_queue=WORKFLOW_QUEUE, workflows=[CallOnce]):
        yield


@pytest.fixture
async def proxy(openai_server: ServedModel) -> AsyncIterator[FaultyProxy]:
    faulty = FaultyProxy(openai_server.base_url).start()
    try:
        yield faulty
    finally:
        faulty.stop()


@pytest.fixture
async def replica(
    temporal_client: Client, openai_server: ServedModel, workflow_worker: None
) -> AsyncIterator[Replica]:
    direct = Replica(temporal_client, openai_server, openai_server.base_url)
    async with direct.worker:
        yield direct


@pytest.fixture
async def proxied(
    temporal_client: Client, openai_server: ServedModel, proxy: FaultyProxy, workflow_worker: None
) -> AsyncIterator[Replica]:
    behind = Replica(temporal_client, openai_server, proxy.base_url)
    async with behind.worker:
        yield behind


def _chat(server: ServedModel, text: str, max_tokens: int, **kwargs: Any) -> InferenceRequest:
    return InferenceRequest(
        model=server.model,
        messages=[ChatMessage(role="user", content=text)],
        max_tokens=max_tokens,
        sampling=Sampling(ignore_eos=True, seed=7),
        tenant="acme",
        step="test",
        **kwargs,
    )


async def test_streamed_call_returns_usage_timings_and_its_cost(replica: Replica):
    server = replica.server
    outcome = await replica.call(_chat(server, "Plan a three step research task.", 24))
    result = outcome.result
    assert result is not None, outcome
    assert result.usage.completion_tokens == 24
    assert result.usage.prompt_tokens > 0
    assert result.text
    assert result.finish_reason == "length"
    assert result.timings.ttft_s is not None and 0 < result.timings.ttft_s <= result.timings.total_s
    assert result.cost_micros == PRICES.cost_micros(
        result.usage.prompt_tokens, result.usage.cached_tokens, 24
    )
    [report] = replica.attempts.reports
    assert report.outcome == "ok" and report.cost_micros == result.cost_micros
    assert report.replica == replica.worker.binding.name


async def test_tool_call_streams_back_as_tool_calls_and_is_billed(replica: Replica):
    server = replica.server
    weather = ToolSpec(
        name="get_weather",
        parameters={
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    )
    request = _chat(server, "What is the weather in Lisbon?", 60).model_copy(
        update={"tools": [weather], "tool_choice": "required", "sampling": Sampling(seed=7)}
    )
    outcome = await replica.call(request)
    result = outcome.result
    assert result is not None, outcome
    # vLLM streams the call as deltas: a first one with its id and name, then the arguments
    # in pieces; kvflow hands them back whole. (The tiny random model behind the real server
    # writes arguments that may not end within max_tokens; the simulator's always validate.)
    (call,) = result.tool_calls
    assert call.name == "get_weather" and call.id and call.arguments
    assert result.text == ""
    # Tools are part of the prompt the engine counted, and what it counted is what is billed.
    assert result.usage.prompt_tokens > 0 and result.usage.completion_tokens > 0
    [report] = replica.attempts.reports
    assert report.outcome == "ok" and report.cost_micros == result.cost_micros
    assert result.cost_micros == PRICES.cost_micros(
        result.usage.prompt_tokens, result.usage.cached_tokens, result.usage.completion_tokens
    )


async def test_repeated_prompt_reports_cached_tokens_in_whole_blocks(replica: Replica):
    server = replica.server
    prompt = await _prompt_of(server, 3 * server.block_size + 20)
    first = (await replica.call(_chat(server, prompt, 4))).result
    second = (await replica.call(_chat(server, prompt, 4))).result
    assert first is not None and second is not None
    assert second.usage.cached_tokens >= server.block_size
    assert second.usage.cached_tokens % server.block_size == 0
    assert second.cost_micros < first.cost_micros


async def test_cut_stream_resumes_elsewhere_with_partial_plus_continuation(
    replica: Replica, proxied: Replica, proxy: FaultyProxy
):
    server = replica.server
    request = _chat(server, "Write a long answer about durable agents.", 40)
    proxy.fault = Fault(cut_after_chunks=10)
    cut = await proxied.call(request)
    assert cut.error_type == "StreamCut" and cut.non_retryable is False, cut
    # The failure's details are the typed record of the attempt: its partial output, to
    # resume from, and its bill, for the workflow's spend meter.
    progress = AttemptProgress.from_details([cut.details], source="StreamCut details")
    assert progress is not None
    partial = progress.resumable()
    assert partial is not None and 0 < partial.completion_tokens < 40
    # The failed attempt is billed for what it processed, the same in details and ledger.
    [failed] = proxied.attempts.reports
    assert failed.outcome == "failed" and failed.prompt_tokens > 0
    assert failed.error_type == "StreamCut"
    assert progress.replica == proxied.worker.binding.name
    assert progress.usage.prompt_tokens == failed.prompt_tokens
    assert progress.usage.completion_tokens == failed.completion_tokens == partial.completion_tokens
    assert progress.cost_micros == failed.cost_micros > 0

    resumed = (await replica.call(request.model_copy(update={"checkpoint": partial}))).result
    assert resumed is not None
    assert isinstance(partial.text, str)  # 40 tokens travel inline
    # A chat resume continues the partial without its trailing whitespace (what the model saw).
    seen = partial.text.rstrip()
    assert resumed.text.startswith(seen) and len(resumed.text) > len(seen)
    assert resumed.reused_tokens == partial.completion_tokens
    # Only the remaining tokens were decoded again.
    assert resumed.usage.completion_tokens == 40 - partial.completion_tokens


async def test_prompt_over_the_context_length_is_not_retryable(replica: Replica):
    server = replica.server
    prompt = await _prompt_of(server, server.max_model_len + 50)
    outcome = await replica.call(_chat(server, prompt, 8))
    assert outcome.error_type == "ContextLengthExceeded", outcome
    assert outcome.non_retryable is True
    assert replica.worker.binding.name in (outcome.message or "")


async def test_unknown_model_is_not_retryable(replica: Replica):
    request = _chat(replica.server, "hello", 4).model_copy(update={"model": "no-such-model"})
    outcome = await replica.call(request)
    assert outcome.error_type == "UnknownModel" and outcome.non_retryable is True, outcome
    assert "404" in (outcome.message or "")


@pytest.mark.parametrize(
    ("status", "error_type"), [(503, "ReplicaServerError"), (429, "ReplicaOverloaded")]
)
async def test_overloaded_or_failing_replica_is_retryable(
    proxied: Replica, proxy: FaultyProxy, status: int, error_type: str
):
    proxy.fault = Fault(status=status)
    outcome = await proxied.call(_chat(proxied.server, "hello", 4))
    assert outcome.error_type == error_type and outcome.non_retryable is False, outcome
    assert str(status) in (outcome.message or "")


async def test_replica_that_vanishes_is_retryable_unreachable(proxied: Replica, proxy: FaultyProxy):
    proxy.stop()
    outcome = await proxied.call(_chat(proxied.server, "hello", 4))
    assert outcome.error_type == "ReplicaUnreachable" and outcome.non_retryable is False, outcome


async def test_cancelled_call_closes_its_stream_at_a_heartbeat_long_before_its_end(
    proxied: Replica, proxy: FaultyProxy
):
    server = proxied.server
    # A stream of 135 s (900 tokens 0.15 s apart) that the cancellation must cut short.
    chunk_delay_s, max_tokens = 0.15, 900
    proxy.fault = Fault(chunk_delay_s=chunk_delay_s)
    request = _chat(server, "Tell a very long story.", max_tokens)
    # The SDK sends heartbeats at most every 0.8 x the timeout, so a send later than 0.2 x the
    # timeout times the call out instead of cancelling it: 20 s leaves a loaded machine 4 s
    # (5 s left it 1 s, which the suite's two processes beside vLLM overran once).
    heartbeat_timeout = timedelta(seconds=20)
    handle = await proxied.client.start_workflow(
        CallOnce.run,
        Call(
            request=request,
            task_queue=proxied.worker.task_queue,
            heartbeat_timeout_s=heartbeat_timeout.total_seconds(),
        ),
        id=f"cancel-{uuid.uuid4()}",
        task_queue=WORKFLOW_QUEUE,
    )

    async def heartbeated() -> bool:
        pending = (await handle.describe()).raw_description.pending_activities
        return bool(pending) and pending[0].HasField("heartbeat_details")

    await eventually(heartbeated, within=10, what="the call heartbeats its progress")
    await handle.cancel()
    outcome = await handle.result()
    assert outcome.result is None and outcome.error_type == "CancelledError", outcome
    [report] = proxied.attempts.reports
    assert report.outcome == "cancelled"
    # The cancellation reaches the call with its next heartbeat, at most 0.8 x the heartbeat
    # timeout (16 s, some 110 tokens here) after it was asked, and the call closes the stream
    # (the proxy saw its client go away). A call that did not heartbeat while streaming, or
    # did not close the stream when cancelled, would run to its end. Judged by the stream's
    # own progress with a margin of four heartbeat intervals, not by the clock.
    assert proxy.streams_closed_early >= 1
    assert report.completion_tokens < max_tokens / 2, report.completion_tokens


async def test_gpu_worker_refuses_to_start_when_vllm_is_down(openai_server: ServedModel):
    from kvflow.ports import free_port

    binding = ReplicaBinding(
        pool=_pool(openai_server.model), index=0, base_url=f"http://127.0.0.1:{free_port()}"
    )
    async with httpx.AsyncClient() as http:
        with pytest.raises(GpuWorkerError, match="not answering"):
            await check_endpoint(binding, http)

"""One trace per task, and each model call in OpenTelemetry's GenAI semantic conventions.

The stack is real: a Temporal dev server, a client connected with `KvflowPlugin` (its
converter and tracing), a workflow worker, a GPU worker over a simulated vLLM replica, and a
SQLite ledger. Spans go to an in-memory exporter on the global tracer provider (installed
once: OpenTelemetry refuses a second); metrics to an in-memory reader given to the activity.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from temporalio import workflow
from temporalio.client import Client, WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

with workflow.unsafe.imports_passed_through():
    from kvflow.activities.gen_ai_telemetry import SCOPE_NAME
    from kvflow.activities.inference import (
        INFER_ACTIVITY,
        InferenceActivities,
        ReplicaBinding,
        default_http_client,
    )
    from kvflow.activities.wire import ChatMessage, InferenceRequest, InferenceResult, Sampling
    from kvflow.ledger import AsyncLedger, AttemptOutcome, AttemptRecord, open_ledger
    from kvflow.scheduler.fleet import Pool, TokenPrices, task_queue_for
    from kvflow.simulator import SimServer
    from kvflow.simulator.faults import FaultSpec
    from kvflow.workers.plugin import KvflowPlugin, role_worker
    from tests.servers import ServedModel

pytestmark = pytest.mark.timeout(120)


@workflow.defn
class OneCall:
    @workflow.run
    async def run(self, request: InferenceRequest, queue: str) -> InferenceResult:
        result: InferenceResult = await workflow.execute_activity(
            INFER_ACTIVITY,
            request,
            result_type=InferenceResult,
            task_queue=queue,
            start_to_close_timeout=timedelta(seconds=60),
            heartbeat_timeout=timedelta(seconds=2),
            retry_policy=RetryPolicy(maximum_attempts=1),
        )
        return result


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def _pool(model: str) -> Pool:
    return Pool(
        name="traced",
        gpu="H100",
        replicas=1,
        price_per_gpu_hour_usd=Decimal("2"),
        token_prices=TokenPrices(
            input_per_mtok_usd=Decimal("0.20"),
            cached_input_per_mtok_usd=Decimal("0.02"),
            output_per_mtok_usd=Decimal("0.60"),
        ),
        warm_models=[model],
    )


class Stack:
    """One model call through the whole stack, and what it left in the ledger and metrics."""

    def __init__(self, temporal_env: WorkflowEnvironment, tmp_path: Path, base_url: str) -> None:
        self.temporal_env = temporal_env
        self.tmp_path = tmp_path
        self.base_url = base_url
        self.ledger = AsyncLedger(open_ledger(f"sqlite:///{tmp_path}/ledger.db", migrate=True))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])

    async def call(self, request: InferenceRequest) -> tuple[str, InferenceResult | None]:
        """Run `request` in a workflow; its workflow id, and its result (None if it failed)."""
        client = await Client.connect(
            self.temporal_env.client.service_client.config.target_host,
            plugins=[KvflowPlugin(context_dir=self.tmp_path / "context")],
        )
        binding = ReplicaBinding(pool=_pool(request.model), index=0, base_url=self.base_url)
        activities = InferenceActivities(
            binding,
            default_http_client(),
            self.ledger,
            meter=self.meter_provider.get_meter(SCOPE_NAME),
        )
        gpu_queue = task_queue_for("traced", 0)
        queue = f"traced-{uuid.uuid4()}"
        workflow_id = f"t-{uuid.uuid4()}"
        async with (
            role_worker(client, KvflowPlugin(inference=activities), task_queue=gpu_queue),
            Worker(client, task_queue=queue, workflows=[OneCall]),
        ):
            try:
                result = await client.execute_workflow(
                    OneCall.run, args=[request, gpu_queue], id=workflow_id, task_queue=queue
                )
            except WorkflowFailureError:
                return workflow_id, None
            finally:
                await activities.http.aclose()
        return workflow_id, result

    async def attempt(self, workflow_id: str) -> AttemptRecord:
        """The ledger's one attempt row of the workflow's model call."""
        handle = self.temporal_env.client.get_workflow_handle(workflow_id)
        run_id = (await handle.describe()).run_id
        (row,) = await self.ledger.attempts_for(workflow_id, run_id)
        return row

    def histogram(self, name: str) -> list[Recorded]:
        """The data points of the histogram `name`, one per set of attributes."""
        data = self.reader.get_metrics_data()
        assert data is not None
        return [
            Recorded(dict(point.attributes or {}), point.count, point.sum)
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name == name
            for point in metric.data.data_points
            if isinstance(point, HistogramDataPoint)
        ]


@dataclass(frozen=True)
class Recorded:
    """One histogram data point."""

    attributes: dict[str, Any]
    count: int
    sum: float


@pytest.fixture
async def stack(temporal_env: WorkflowEnvironment, sim_server: ServedModel, tmp_path: Path):
    made = Stack(temporal_env, tmp_path, sim_server.base_url)
    yield made
    await made.ledger.close()


def _span_of(spans: InMemorySpanExporter, workflow_id: str, name: str) -> ReadableSpan:
    """The span called `name` in the trace of the workflow `workflow_id`."""
    finished = spans.get_finished_spans()
    start = next(
        s
        for s in finished
        if s.name == "StartWorkflow:OneCall"
        and (s.attributes or {}).get("temporalWorkflowID") == workflow_id
    )
    assert start.context is not None
    matches = [
        s
        for s in finished
        if s.name == name and s.context is not None and s.context.trace_id == start.context.trace_id
    ]
    assert len(matches) == 1, [s.name for s in finished]
    return matches[0]


def _request(model: str, **overrides: Any) -> InferenceRequest:
    values: dict[str, Any] = {
        "model": model,
        "messages": [ChatMessage(role="user", content="hi")],
        "max_tokens": 8,
        "sampling": Sampling(ignore_eos=True, temperature=0.5, seed=11),
        "tenant": "acme",
        "step": "greet",
    }
    values.update(overrides)
    return InferenceRequest(**values)


LONG_QUESTION = "Summarise the plot of Hamlet in one line, naming every character who dies. " * 4
"""Several KV blocks long, so that the second call finds its prefix cached."""


async def test_model_call_span_speaks_genai_with_the_ledgers_token_counts(
    stack: Stack, spans: InMemorySpanExporter, sim_server: ServedModel
):
    request = _request(sim_server.model, messages=[ChatMessage(role="user", content=LONG_QUESTION)])
    first_id, _ = await stack.call(request)
    workflow_id, result = await stack.call(request)
    assert result is not None
    first, row = await stack.attempt(first_id), await stack.attempt(workflow_id)
    assert row.outcome is AttemptOutcome.OK and row.completion_tokens == 8
    assert 0 < row.cached_tokens < row.prompt_tokens

    infer = _span_of(spans, workflow_id, f"chat {sim_server.model}")
    run_activity = _span_of(spans, workflow_id, f"RunActivity:{INFER_ACTIVITY}")
    # A child of the GPU worker's activity span, in the trace the client started.
    assert infer.parent is not None and run_activity.context is not None
    assert infer.parent.span_id == run_activity.context.span_id
    assert infer.kind is SpanKind.CLIENT
    attributes = dict(infer.attributes or {})
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.provider.name"] == "vllm"
    assert attributes["gen_ai.request.model"] == sim_server.model
    assert attributes["gen_ai.response.model"] == sim_server.model
    assert attributes["gen_ai.request.max_tokens"] == 8
    assert attributes["gen_ai.request.temperature"] == 0.5
    assert attributes["gen_ai.request.seed"] == 11
    assert tuple(attributes["gen_ai.response.finish_reasons"]) == ("length",)  # type: ignore[arg-type]
    assert str(attributes["gen_ai.response.id"])
    # Exactly what the ledger bills for this attempt; input tokens include the cached ones.
    assert attributes["gen_ai.usage.input_tokens"] == row.prompt_tokens
    assert attributes["gen_ai.usage.cache_read.input_tokens"] == row.cached_tokens
    assert attributes["gen_ai.usage.output_tokens"] == row.completion_tokens
    assert attributes["kvflow.cost_micros"] == row.cost_micros == result.cost_micros
    assert attributes["kvflow.replica"] == "traced/0"
    assert attributes["kvflow.pool"] == "traced"
    assert attributes["kvflow.tenant"] == "acme"
    assert attributes["kvflow.outcome"] == "ok"
    ttft = attributes["gen_ai.response.time_to_first_chunk"]
    assert isinstance(ttft, float) and ttft > 0
    assert "error.type" not in attributes
    # The old names are gone: a backend sees one name per fact.
    assert not {"kvflow.model", "kvflow.prompt_tokens", "kvflow.completion_tokens"} & set(
        attributes
    )

    # Both calls, as the ledger bills them.
    tokens = {
        p.attributes["gen_ai.token.type"]: p for p in stack.histogram("gen_ai.client.token.usage")
    }
    assert (tokens["input"].count, tokens["input"].sum) == (
        2,
        first.prompt_tokens + row.prompt_tokens,
    )
    assert (tokens["output"].count, tokens["output"].sum) == (2, 16)
    for point in tokens.values():
        assert point.attributes["gen_ai.operation.name"] == "chat"
        assert point.attributes["gen_ai.provider.name"] == "vllm"
        assert point.attributes["gen_ai.request.model"] == sim_server.model
        assert point.attributes["server.port"] == int(sim_server.base_url.rsplit(":", 1)[1])
    (duration,) = stack.histogram("gen_ai.client.operation.duration")
    assert duration.count == 2 and 0 < duration.sum < 120
    assert "error.type" not in duration.attributes
    assert duration.attributes["gen_ai.response.model"] == sim_server.model


async def test_a_call_cut_mid_stream_reports_its_error_and_billed_tokens(
    temporal_env: WorkflowEnvironment,
    spans: InMemorySpanExporter,
    sim_server_factory: Callable[..., SimServer],
    tmp_path: Path,
):
    server = sim_server_factory(faults=FaultSpec(disconnect_after=3))
    stack = Stack(temporal_env, tmp_path, server.base_url)
    try:
        workflow_id, result = await stack.call(
            _request(server.model, prompt="once upon a time", messages=None, max_tokens=32)
        )
        assert result is None
        row = await stack.attempt(workflow_id)
    finally:
        await stack.ledger.close()
    assert row.outcome is AttemptOutcome.FAILED and row.completion_tokens > 0

    infer = _span_of(spans, workflow_id, f"text_completion {server.model}")
    attributes = dict(infer.attributes or {})
    assert attributes["gen_ai.operation.name"] == "text_completion"
    assert attributes["error.type"] == row.error_type
    assert attributes["kvflow.outcome"] == "failed"
    assert attributes["gen_ai.usage.input_tokens"] == row.prompt_tokens
    assert attributes["gen_ai.usage.output_tokens"] == row.completion_tokens
    tokens = {
        p.attributes["gen_ai.token.type"]: p.sum
        for p in stack.histogram("gen_ai.client.token.usage")
    }
    assert tokens == {"input": row.prompt_tokens, "output": row.completion_tokens}
    (duration,) = stack.histogram("gen_ai.client.operation.duration")
    assert duration.attributes["error.type"] == row.error_type

"""One trace per task: the workflow, its activity, and the inference span inside it."""

from __future__ import annotations

import uuid
from datetime import timedelta
from decimal import Decimal

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from temporalio import workflow
from temporalio.client import Client
from temporalio.common import RetryPolicy
from temporalio.contrib.opentelemetry import TracingInterceptor
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

with workflow.unsafe.imports_passed_through():
    from kvflow.activities.inference import INFER_ACTIVITY, ReplicaBinding
    from kvflow.activities.wire import ChatMessage, InferenceRequest, InferenceResult, Sampling
    from kvflow.scheduler.fleet import Pool, TokenPrices
    from kvflow.workers.gpu_worker import GpuWorker
    from tests.servers import ServedModel


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


async def test_inference_span_is_a_child_of_the_tasks_trace_with_tokens_and_cost(
    temporal_env: WorkflowEnvironment, sim_server: ServedModel
):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    client = await Client.connect(
        temporal_env.client.service_client.config.target_host,
        data_converter=temporal_env.client.data_converter,
        interceptors=[TracingInterceptor()],
    )
    pool = Pool(
        name="traced",
        gpu="H100",
        replicas=1,
        price_per_gpu_hour_usd=Decimal("2"),
        token_prices=TokenPrices(
            input_per_mtok_usd=Decimal("0.20"),
            cached_input_per_mtok_usd=Decimal("0.02"),
            output_per_mtok_usd=Decimal("0.60"),
        ),
        warm_models=[sim_server.model],
    )
    binding = ReplicaBinding(pool=pool, index=0, base_url=sim_server.base_url)
    queue = f"traced-{uuid.uuid4()}"
    request = InferenceRequest(
        model=sim_server.model,
        messages=[ChatMessage(role="user", content="hi")],
        max_tokens=8,
        sampling=Sampling(ignore_eos=True),
        tenant="acme",
        step="greet",
    )
    async with GpuWorker(client, binding), Worker(client, task_queue=queue, workflows=[OneCall]):
        result = await client.execute_workflow(
            OneCall.run,
            args=[request, "kvflow.gpu.traced.0"],
            id=f"t-{uuid.uuid4()}",
            task_queue=queue,
        )
    provider.force_flush()
    spans = {span.name: span for span in exporter.get_finished_spans()}
    infer = spans["kvflow.infer"]
    run_activity = spans[f"RunActivity:{INFER_ACTIVITY}"]
    start_workflow = spans["StartWorkflow:OneCall"]
    assert infer.parent is not None and infer.parent.span_id == run_activity.context.span_id
    assert infer.context.trace_id == start_workflow.context.trace_id
    attributes = infer.attributes or {}
    assert attributes["kvflow.replica"] == "traced/0"
    assert attributes["kvflow.model"] == sim_server.model
    assert attributes["kvflow.completion_tokens"] == 8
    assert attributes["kvflow.prompt_tokens"] == result.usage.prompt_tokens
    assert attributes["kvflow.cached_tokens"] == result.usage.cached_tokens
    assert attributes["kvflow.cost_micros"] == result.cost_micros
    ttft = attributes["kvflow.ttft_s"]
    assert isinstance(ttft, float) and ttft > 0

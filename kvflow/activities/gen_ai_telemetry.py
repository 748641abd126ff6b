"""One model call in OpenTelemetry's GenAI semantic conventions: its span and two histograms.

LLM-aware backends (Langfuse, Phoenix, Datadog, Grafana) read these names, so a model call
shows there as what it is: its span is named `"{gen_ai.operation.name} {gen_ai.request.model}"`
(`chat llama-70b`), of kind CLIENT, and carries

- `gen_ai.operation.name` (`chat` or `text_completion`), `gen_ai.provider.name` (`vllm`),
  `gen_ai.request.model`, `gen_ai.request.max_tokens`, `gen_ai.request.temperature`,
  `gen_ai.request.top_p`, `gen_ai.request.seed`, `gen_ai.request.stop_sequences`,
  `gen_ai.output.type`, `server.address`, `server.port`;
- when the attempt ends: `gen_ai.response.model` and `gen_ai.response.id` (as the server
  sent them), `gen_ai.response.finish_reasons`, `gen_ai.usage.input_tokens` (the whole prompt,
  cached tokens included), `gen_ai.usage.cache_read.input_tokens`,
  `gen_ai.usage.output_tokens` (decoded by this attempt), `gen_ai.response.time_to_first_chunk`
  and, for a failed attempt, `error.type`.

The token counts are the ones the attempt's ledger row bills. What the conventions have no
name for keeps a `kvflow.` one: `kvflow.replica`, `kvflow.pool`, `kvflow.tenant`,
`kvflow.step`, `kvflow.cost_micros`, `kvflow.outcome` and `kvflow.reused_tokens` (output
carried over from a cut attempt, not decoded again).

The metrics are the conventions' client histograms, with their bucket boundaries:
`gen_ai.client.token.usage` (`{token}`, one record per `gen_ai.token.type`, `input` and
`output`) and `gen_ai.client.operation.duration` (seconds, with `error.type` when it failed),
both by operation, provider, request and response model, and server address and port.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import httpx
from opentelemetry import metrics
from opentelemetry.metrics import Meter
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.semconv._incubating.metrics import gen_ai_metrics
from opentelemetry.semconv.attributes import error_attributes, server_attributes
from opentelemetry.util.types import AttributeValue

from kvflow.activities.wire import InferenceRequest, Usage

SCOPE_NAME = "kvflow.inference"
"""The instrumentation scope of the model call span and of the GenAI client histograms."""

PROVIDER = "vllm"
"""`gen_ai.provider.name`: kvflow's replicas are vLLM servers (or the simulator of one)."""

TOKEN_BUCKETS: tuple[float, ...] = tuple(float(4**power) for power in range(14))
"""The conventions' advised boundaries for `gen_ai.client.token.usage`: 1, 4, 16 … 4^13."""

DURATION_BUCKETS_S: tuple[float, ...] = tuple(0.01 * 2**power for power in range(14))
"""The conventions' advised boundaries for `gen_ai.client.operation.duration`: 0.01 … 81.92."""

Attributes = dict[str, AttributeValue]


def operation_name(request: InferenceRequest) -> str:
    """`chat` for a call with messages, `text_completion` for a call with a prompt."""
    if request.messages is not None:
        return gen_ai.GenAiOperationNameValues.CHAT.value
    return gen_ai.GenAiOperationNameValues.TEXT_COMPLETION.value


def span_name(request: InferenceRequest) -> str:
    """`"{operation} {model}"`, as the conventions name a model call's span."""
    return f"{operation_name(request)} {request.model}"


@dataclass(frozen=True)
class Server:
    """Where the calls go: `server.address` and `server.port` of a replica's base URL."""

    address: str
    port: int

    @classmethod
    def of(cls, base_url: str) -> Server:
        """The host and port of `base_url`, the scheme's default port when it names none."""
        url = httpx.URL(base_url)
        port = url.port or (443 if url.scheme == "https" else 80)
        return cls(address=url.host, port=port)


def request_attributes(
    request: InferenceRequest, server: Server, *, replica: str, pool: str
) -> Attributes:
    """The span's attributes known before the call is sent."""
    sampling = request.sampling
    attributes: Attributes = {
        gen_ai.GEN_AI_OPERATION_NAME: operation_name(request),
        gen_ai.GEN_AI_PROVIDER_NAME: PROVIDER,
        gen_ai.GEN_AI_REQUEST_MODEL: request.model,
        gen_ai.GEN_AI_REQUEST_MAX_TOKENS: request.max_tokens,
        gen_ai.GEN_AI_OUTPUT_TYPE: (
            gen_ai.GenAiOutputTypeValues.JSON.value
            if request.json_schema is not None
            else gen_ai.GenAiOutputTypeValues.TEXT.value
        ),
        server_attributes.SERVER_ADDRESS: server.address,
        server_attributes.SERVER_PORT: server.port,
        "kvflow.replica": replica,
        "kvflow.pool": pool,
        "kvflow.tenant": request.tenant,
        "kvflow.step": request.step,
    }
    # Unset sampling stays unset: the engine's default applied, and a 0 would say otherwise.
    if sampling.temperature is not None:
        attributes[gen_ai.GEN_AI_REQUEST_TEMPERATURE] = sampling.temperature
    if sampling.top_p is not None:
        attributes[gen_ai.GEN_AI_REQUEST_TOP_P] = sampling.top_p
    if sampling.seed is not None:
        attributes[gen_ai.GEN_AI_REQUEST_SEED] = sampling.seed
    if sampling.stop:
        attributes[gen_ai.GEN_AI_REQUEST_STOP_SEQUENCES] = list(sampling.stop)
    return attributes


@dataclass(frozen=True)
class AttemptEnd:
    """How one attempt ended, as its span and metrics report it."""

    usage: Usage
    """The tokens its ledger row bills."""
    response_model: str
    response_id: str | None
    finish_reason: str | None
    reused_tokens: int
    cost_micros: int
    outcome: str
    error_type: str | None
    ttft_s: float | None


def end_attributes(end: AttemptEnd) -> Attributes:
    """The span's attributes known when the attempt has ended."""
    attributes: Attributes = {
        gen_ai.GEN_AI_RESPONSE_MODEL: end.response_model,
        gen_ai.GEN_AI_USAGE_INPUT_TOKENS: end.usage.prompt_tokens,
        gen_ai.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: end.usage.cached_tokens,
        gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS: end.usage.completion_tokens,
        "kvflow.reused_tokens": end.reused_tokens,
        "kvflow.cost_micros": end.cost_micros,
        "kvflow.outcome": end.outcome,
    }
    if end.response_id is not None:
        attributes[gen_ai.GEN_AI_RESPONSE_ID] = end.response_id
    if end.finish_reason is not None:
        attributes[gen_ai.GEN_AI_RESPONSE_FINISH_REASONS] = [end.finish_reason]
    if end.ttft_s is not None:
        attributes[gen_ai.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] = end.ttft_s
    if end.error_type is not None:
        attributes[error_attributes.ERROR_TYPE] = end.error_type
    return attributes


class GenAiClientMetrics:
    """The conventions' two client histograms on one `Meter` (the global provider's by default)."""

    def __init__(self, meter: Meter | None = None) -> None:
        meter = meter or metrics.get_meter(SCOPE_NAME)
        self._tokens = meter.create_histogram(
            gen_ai_metrics.GEN_AI_CLIENT_TOKEN_USAGE,
            unit="{token}",
            description="Number of input and output tokens used.",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS,
        )
        self._duration = meter.create_histogram(
            gen_ai_metrics.GEN_AI_CLIENT_OPERATION_DURATION,
            unit="s",
            description="GenAI operation duration.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_S,
        )

    def record(
        self,
        request: InferenceRequest,
        server: Server,
        end: AttemptEnd,
        *,
        duration_s: float,
    ) -> None:
        """Record one attempt: its duration, and its tokens when the engine processed any.

        A failed attempt's tokens are recorded too: they were processed and are billed.
        """
        common: Attributes = {
            gen_ai.GEN_AI_OPERATION_NAME: operation_name(request),
            gen_ai.GEN_AI_PROVIDER_NAME: PROVIDER,
            gen_ai.GEN_AI_REQUEST_MODEL: request.model,
            gen_ai.GEN_AI_RESPONSE_MODEL: end.response_model,
            server_attributes.SERVER_ADDRESS: server.address,
            server_attributes.SERVER_PORT: server.port,
        }
        if end.usage.prompt_tokens or end.usage.completion_tokens:
            for token_type, count in _by_token_type(end.usage).items():
                self._tokens.record(count, {**common, gen_ai.GEN_AI_TOKEN_TYPE: token_type})
        failed: Mapping[str, AttributeValue] = (
            {error_attributes.ERROR_TYPE: end.error_type} if end.error_type is not None else {}
        )
        self._duration.record(duration_s, {**common, **failed})


def _by_token_type(usage: Usage) -> dict[str, int]:
    return {
        gen_ai.GenAiTokenTypeValues.INPUT.value: usage.prompt_tokens,
        gen_ai.GenAiTokenTypeValues.OUTPUT.value: usage.completion_tokens,
    }

"""The inference activity: one model call, streamed from one vLLM replica.

A GPU worker binds `InferenceActivities` to its replica and registers `infer` on the replica's
task queue, so the queue a workflow dispatches to decides where the call runs. The activity
streams (SSE) so that it can heartbeat its partial output; a call that dies mid-stream carries
that output in its error details (and last heartbeat), and the next attempt, on any replica,
continues from it instead of decoding it again: chat calls send the partial answer as the last
assistant message with `continue_final_message`, completion calls append it to the prompt.

Calls with a JSON schema never resume: guided decoding restarts its grammar at the start of the
continuation, so a partial JSON document cannot be continued safely; they start over.

Each call also carries what the endpoint in front of the engine takes to order it
(`engine_hints`): its engine priority for vLLM with priority scheduling, `nvext.agent_hints` and
a session header for an NVIDIA Dynamo frontend, InferenceObjective and fairness headers for an
llm-d gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ClassVar, Protocol, TypeVar
from urllib.parse import quote

import httpx
from opentelemetry import trace
from opentelemetry.metrics import Meter
from opentelemetry.trace import SpanKind
from temporalio import activity
from temporalio.exceptions import ApplicationError

from kvflow.activities.context_store import ContextStore, DirectoryContextStore
from kvflow.activities.errors import (
    NOTHING_SENT,
    ContextStoreFailed,
    InferenceError,
    InvalidUsage,
    MalformedResponse,
    ReplicaShuttingDown,
    SentText,
    StreamCut,
    capped,
    error_of,
    from_error_body,
    from_status,
    from_transport,
)
from kvflow.activities.gen_ai_telemetry import (
    SCOPE_NAME,
    AttemptEnd,
    GenAiClientMetrics,
    Server,
    end_attributes,
    request_attributes,
    span_name,
)
from kvflow.activities.wire import (
    CONVERSATION,
    INLINE_LIMIT_BYTES,
    AttemptProgress,
    ChatMessage,
    Checkpoint,
    ContextRef,
    InferenceRequest,
    InferenceResult,
    Timings,
    ToolCall,
    Usage,
    needs_store,
)
from kvflow.ledger.records import AttemptOutcome, AttemptRecord
from kvflow.scheduler.blocks import call_cache_salt
from kvflow.scheduler.builtin_tokenizer import Tokenizer as BuiltinTokenizer
from kvflow.scheduler.engine_http import engine_limits
from kvflow.scheduler.fleet import TIERS, Pool, replica_name
from kvflow.scheduler.placement import TIER_PRIORITY_SPAN

log = logging.getLogger(__name__)
tracer = trace.get_tracer(SCOPE_NAME)

_T = TypeVar("_T")

INFER_ACTIVITY = "kvflow.infer"
"""The activity name every GPU worker registers; the task queue picks the replica."""


@dataclass
class Progress:
    """What the current attempt has produced so far, updated chunk by chunk as it streams."""

    text: str = ""
    """The answer so far, including text reused from a checkpoint."""
    reused_tokens: int = 0
    """Output tokens taken from a checkpoint."""
    completion_tokens: int = 0
    """Output tokens this attempt decoded."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    first_token_at: float | None = None
    finish_reason: str | None = None
    chunks: int = 0
    """Well-formed answer chunks received: once one has arrived, the prompt was processed."""
    reported: Usage | None = None
    """The engine's last valid usage report; None while it has sent none."""
    resumable: bool = True
    """False once the output must not be continued (its engine miscounted tokens)."""
    tool_calls: dict[int, dict[str, str]] = field(default_factory=dict)
    """The tool calls streamed so far, by their index: `id`, `name` and `arguments` text."""
    response_model: str | None = None
    """The model the server says answered (its chunks' `model`), for the span."""
    response_id: str | None = None
    """The server's id of the completion (its chunks' `id`), for the span."""

    def finished_tool_calls(self) -> list[ToolCall]:
        """The tool calls of a finished answer, in the order the model wrote them."""
        calls = []
        for index in sorted(self.tool_calls):
            call = self.tool_calls[index]
            calls.append(
                ToolCall(
                    id=call.get("id") or f"call_{index}",
                    name=call.get("name", ""),
                    arguments=call.get("arguments") or "{}",
                )
            )
        return calls

    def usage(self) -> Usage:
        """Tokens of the current attempt so far."""
        return Usage(
            prompt_tokens=self.prompt_tokens,
            cached_tokens=min(self.cached_tokens, self.prompt_tokens),
            completion_tokens=self.completion_tokens,
        )

    def checkpoint(self) -> Checkpoint:
        """The partial output, to continue from (none when it is not `resumable`).

        A call cut while it wrote a tool call starts over: the API continues a message's text,
        not a tool call's arguments.
        """
        if not self.resumable or self.tool_calls:
            return Checkpoint()
        return Checkpoint(
            text=self.text, completion_tokens=self.reused_tokens + self.completion_tokens
        )


class PartialOutput:
    """The partial output as heartbeats and failure details carry it: small, whatever its size.

    Up to `INLINE_LIMIT_BYTES` the text travels inline. Above it, it is stored in the context
    store (for the call's tenant) and travels as a `ContextRef`, because Temporal writes
    failure details and the next attempt's input to history. A failure stores the exact text
    once. Heartbeats, every fraction of a second, store a new copy only when the text has
    grown by a quarter (and at least `INLINE_LIMIT_BYTES`) since the last: the copies of one
    stream add up to about five times its final size, and a worker that dies mid-stream
    leaves a checkpoint at most a quarter behind (that much is decoded again).
    """

    GROWTH = 0.25

    def __init__(self, store: ContextStore, tenant: str) -> None:
        self.store = store
        self.tenant = tenant
        self._stored: Checkpoint | None = None
        self._stored_bytes = 0

    async def checkpoint(self, progress: Progress, *, exact: bool) -> Checkpoint:
        """The output so far; with `exact=False` possibly the last stored, shorter one."""
        current = progress.checkpoint()
        assert isinstance(current.text, str)
        size = len(current.text.encode("utf-8"))
        if size <= INLINE_LIMIT_BYTES:
            return current
        grown = size - self._stored_bytes
        enough = max(INLINE_LIMIT_BYTES, self.GROWTH * self._stored_bytes)
        if self._stored is not None and not exact and grown < enough:
            return self._stored
        ref = await self.store.aput(current.text, self.tenant)
        self._stored = current.model_copy(update={"text": ref})
        self._stored_bytes = size
        return self._stored

    def last_stored(self) -> Checkpoint:
        """The last checkpoint stored (possibly shorter than the output), or an empty one."""
        return self._stored or Checkpoint()


YIELD_EVERY_CHUNKS = 32
"""The stream hands the event loop to other tasks (heartbeats) at least this often."""


async def _finish(work: Awaitable[_T]) -> _T:
    """Await `work` to its end even if the activity is cancelled meanwhile, then re-raise.

    Bookkeeping of an attempt that has ended (its ledger row, its stored answer) must complete:
    a cancellation that arrives during it would otherwise leave the attempt unbilled.
    """
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise


class AttemptSink(Protocol):
    """Receives one record per attempt, success or failure (`ledger.AsyncLedger` is one)."""

    async def record_attempt(self, record: AttemptRecord) -> bool:
        """Store the attempt; idempotent on (workflow, run, activity, attempt)."""
        ...


@dataclass(frozen=True)
class ReplicaBinding:
    """The replica a GPU worker serves: its pool (prices, GPU), index and vLLM base URL."""

    pool: Pool
    index: int
    base_url: str
    shared_prefixes: frozenset[str] = frozenset()
    """The fleet's `[cache] shared_prefixes`: calls that start with one go unsalted."""

    @property
    def name(self) -> str:
        """`pool/index`."""
        return replica_name(self.pool.name, self.index)


def default_http_client(stall_timeout_s: float = 30.0) -> httpx.AsyncClient:
    """The worker's one pooled client: timeouts set, no client-side retries.

    The read timeout is the longest silence tolerated between two streamed chunks, so a
    stalled replica becomes a retryable `ReplicaTimeout` instead of a hung call. Idle
    connections are dropped before the engine would close them (`engine_http`).
    """
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=5.0, read=stall_timeout_s, write=10.0, pool=10.0),
        # The limits go to the transport: httpx ignores a client's own `limits` when it is
        # given a transport.
        transport=httpx.AsyncHTTPTransport(
            retries=0, limits=engine_limits(max_connections=512, max_keepalive_connections=128)
        ),
    )


class InferenceActivities:
    """The inference activity bound to one replica."""

    def __init__(
        self,
        replica: ReplicaBinding,
        http: httpx.AsyncClient,
        ledger: AttemptSink | None = None,
        store: ContextStore | None = None,
        heartbeat_interval_s: float = 0.5,
        meter: Meter | None = None,
    ) -> None:
        self.replica = replica
        self.http = http
        self.ledger = ledger
        self.store = store or DirectoryContextStore()
        self.heartbeat_interval_s = heartbeat_interval_s
        self.server = Server.of(replica.base_url)
        self.metrics = GenAiClientMetrics(meter)
        """`gen_ai.client.*` histograms (on the global `MeterProvider` unless `meter` is given)."""

    @activity.defn(name=INFER_ACTIVITY)
    async def infer(self, request: InferenceRequest) -> InferenceResult:
        """Run one model call on this replica, streaming, heartbeating and billing it.

        Heartbeats run from the start until the activity returns: through the stream, and
        through the context-store and ledger writes after it, so a slow write (SQLite busy,
        PostgreSQL reconnecting) never lets the heartbeat timeout throw a finished answer
        away. The ledger write never fails the call (see `SpooledAttemptWriter`). A context
        store that cannot take the answer fails the attempt, retryably, before it is billed
        as `ok`; every failure carries the attempt's bill in its details, as its row has it.
        """
        info = activity.info()
        checkpoint = request.checkpoint or _checkpoint_from_heartbeat(info)
        if request.json_schema is not None:
            checkpoint = None
        resumed = await self._resumed_text(request, checkpoint)
        started_at = datetime.now(UTC)
        queue_wait = max(
            0.0, (info.started_time - info.current_attempt_scheduled_time).total_seconds()
        )
        reused = checkpoint.completion_tokens if checkpoint else 0
        progress = Progress(text=resumed, reused_tokens=reused)
        partial = PartialOutput(self.store, request.tenant)
        heartbeats = asyncio.create_task(self._heartbeat(progress, partial))
        try:
            return await self._run(
                request, resumed, progress, partial, started_at=started_at, queue_wait=queue_wait
            )
        finally:
            heartbeats.cancel()

    async def _run(
        self,
        request: InferenceRequest,
        resumed: str,
        progress: Progress,
        partial: PartialOutput,
        *,
        started_at: datetime,
        queue_wait: float,
    ) -> InferenceResult:
        info = activity.info()
        sent = time.monotonic()
        outcome = AttemptOutcome.FAILED
        error_type: str | None = None
        text_ref: ContextRef | None = None
        with tracer.start_as_current_span(
            span_name(request),
            kind=SpanKind.CLIENT,
            attributes=request_attributes(
                request, self.server, replica=self.replica.name, pool=self.replica.pool.name
            ),
        ) as span:
            try:
                await self._stream(request, resumed, progress)
                # Stored before the row is written: an answer the store refused is a failed
                # attempt in the ledger as in the workflow, and is placed again.
                text_ref = await self._store_answer(progress.text, request.tenant)
                outcome = AttemptOutcome.OK
            except asyncio.CancelledError:
                if not activity.is_worker_shutdown():
                    outcome = AttemptOutcome.CANCELLED
                    raise
                # The GPU worker is going away: hand the call back with what it produced, so
                # the workflow re-places it and continues instead of decoding it again.
                handed_back = ReplicaShuttingDown(
                    "the GPU worker shut down before the call finished",
                    replica=self.replica.name,
                    details=await self._report(progress, partial, final=True),
                )
                error_type = handed_back.error_type
                raise handed_back.to_application_error() from None
            except InferenceError as exc:
                error_type = exc.error_type
                span.record_exception(exc)
                # The workflow's spend meter bills the failed attempt from these details, and
                # the next attempt continues from their text.
                exc.details = await self._report(progress, partial, final=True)
                raise exc.to_application_error() from exc
            except Exception as exc:
                # Unforeseen (content missing from the store, a bug): typed by its class as
                # Temporal would type it, and still carrying the bill its row holds.
                error_type = type(exc).__name__
                span.record_exception(exc)
                report = await self._report(progress, partial, final=True)
                # The message is capped and the cause left out: Temporal records both in
                # history, and an unforeseen error's text may quote the request.
                raise ApplicationError(
                    capped(str(exc)), report.model_dump(mode="json"), type=error_type
                ) from None
            finally:
                usage = progress.usage()
                cost = self._cost(usage)
                ttft = (progress.first_token_at - sent) if progress.first_token_at else None
                end = AttemptEnd(
                    usage=usage,
                    response_model=progress.response_model or request.model,
                    response_id=progress.response_id,
                    finish_reason=progress.finish_reason,
                    reused_tokens=progress.reused_tokens,
                    cost_micros=cost,
                    outcome=outcome.value,
                    # A cancelled call is no success either: backends count it with the errors.
                    error_type=error_type
                    or ("cancelled" if outcome is AttemptOutcome.CANCELLED else None),
                    ttft_s=ttft,
                )
                span.set_attributes(end_attributes(end))
                self.metrics.record(request, self.server, end, duration_s=time.monotonic() - sent)
                await _finish(
                    self._record(
                        AttemptRecord(
                            workflow_id=info.workflow_id or "-",
                            run_id=info.workflow_run_id or "-",
                            activity_id=info.activity_id,
                            attempt=info.attempt,
                            step=request.step,
                            tenant=request.tenant,
                            workflow_type=info.workflow_type or "-",
                            model=request.model,
                            pool=self.replica.pool.name,
                            replica=self.replica.name,
                            gpu=self.replica.pool.gpu.value,
                            started_at=started_at,
                            ended_at=datetime.now(UTC),
                            outcome=outcome,
                            prompt_tokens=usage.prompt_tokens,
                            cached_tokens=usage.cached_tokens,
                            completion_tokens=usage.completion_tokens,
                            reused_tokens=progress.reused_tokens,
                            prices=self.replica.pool.token_prices,
                            cost_micros=cost,
                            error_type=error_type,
                        )
                    )
                )
        return InferenceResult(
            text=progress.text if text_ref is None else text_ref.preview,
            text_ref=text_ref,
            finish_reason=progress.finish_reason or "stop",
            usage=usage,
            timings=Timings(queue_wait_s=queue_wait, ttft_s=ttft, total_s=time.monotonic() - sent),
            model=request.model,
            replica=self.replica.name,
            pool=self.replica.pool.name,
            gpu=self.replica.pool.gpu.value,
            cost_micros=cost,
            reused_tokens=progress.reused_tokens,
            tool_calls=progress.finished_tool_calls(),
        )

    async def _resumed_text(self, request: InferenceRequest, checkpoint: Checkpoint | None) -> str:
        """The partial output this attempt continues, exactly as the model will see it.

        Chat templates that trim message content (Llama 3's `| trim`) drop the partial's
        trailing whitespace when it is the final, continued message, so the model continues
        after the trimmed text. Sending it trimmed makes every template see the same text, and
        the answer is exactly that text plus what the model generates: no doubled or lost
        space at the seam. The trimmed whitespace's tokens stay counted as reused (they were
        decoded and billed by the earlier attempt).
        """
        if checkpoint is None:
            return ""
        text = checkpoint.text
        if isinstance(text, ContextRef):
            text = await self.store.aget(text, request.tenant)
        return text.rstrip() if request.messages is not None else text

    async def _record(self, record: AttemptRecord) -> None:
        if self.ledger is None:
            return
        try:
            await self.ledger.record_attempt(record)
        except Exception:
            # Billing must not turn a good answer into a failure. A `SpooledAttemptWriter`
            # (what the GPU workers use) has retried and spooled before it gets here; the
            # workflow's spend meter still counts this attempt.
            log.exception("could not record attempt %s", record.key)

    def _cost(self, usage: Usage) -> int:
        return self.replica.pool.token_prices.cost_micros(
            usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens
        )

    async def _store_answer(self, text: str, tenant: str) -> ContextRef | None:
        """Store an answer too large to travel inline; None when it travels inline.

        A store that cannot take it (disk full, read-only, unreachable volume) is this GPU
        worker's fault, not the request's: `ContextStoreFailed`, retryable, so the workflow
        places the call again and bills this attempt from the error's details.
        """
        if not needs_store(text):
            return None
        try:
            return await _finish(self.store.aput(text, tenant))
        except OSError as exc:
            raise ContextStoreFailed(
                f"the GPU worker could not store the answer ({len(text.encode('utf-8'))} "
                f"bytes) in the context store {self.store.location}: {exc}",
                replica=self.replica.name,
            ) from exc

    async def _report(
        self, progress: Progress, partial: PartialOutput, *, final: bool
    ) -> AttemptProgress:
        """The attempt so far, as heartbeats and failures carry it to the workflow.

        The bill is always there: when the output cannot be stored, the report carries the
        last checkpoint stored (or none, so the next attempt starts over) instead of failing,
        so a failed call keeps its typed error and the workflow still bills the attempt.
        """
        usage = progress.usage()
        try:
            checkpoint = await partial.checkpoint(progress, exact=final)
        except Exception:
            log.warning(
                "could not store the partial output of %s", self.replica.name, exc_info=True
            )
            checkpoint = partial.last_stored()
        return AttemptProgress(
            **checkpoint.model_dump(),
            replica=self.replica.name,
            usage=usage,
            cost_micros=self._cost(usage),
        )

    async def _heartbeat(self, progress: Progress, partial: PartialOutput) -> None:
        # Heartbeats deliver cancellation too, so they run even before the first token.
        while True:
            # A store that fails does not stop them: the report then carries the bill alone.
            report = await self._report(progress, partial, final=False)
            # Plain JSON, so any payload converter encodes it; read by `from_details`.
            activity.heartbeat(report.model_dump(mode="json"))
            await asyncio.sleep(self.heartbeat_interval_s)

    async def _stream(self, request: InferenceRequest, resumed: str, progress: Progress) -> None:
        """Stream the call into `progress`; every way the answer can be wrong is typed.

        What is billed when the engine's counts are missing or wrong: its last valid report;
        without one, the prompt (estimated) once an answer chunk arrived, and the output
        chunks received. An answer whose counts cannot be trusted is not continued.
        """
        resolved = await self._resolve(request)
        url, body = _request_body(
            resolved,
            resumed,
            progress.reused_tokens,
            cache_salt=call_cache_salt(
                activity.info().namespace,
                request.tenant,
                _first_message_text(resolved),
                self.replica.shared_prefixes,
            ),
        )
        hints = engine_hints(
            self.replica.pool,
            request,
            max_tokens=body["max_tokens"],
            session_id=activity.info().workflow_id or None,
        )
        body.update(hints.body)
        replica = self.replica.name
        bounds = UsageBounds.of(body)
        sent = SentText(body)  # what an engine's error text must not quote
        try:
            async with self.http.stream(
                "POST", self.replica.base_url + url, json=body, headers=hints.headers
            ) as response:
                if response.status_code >= 400:
                    raw = await _read_capped(response)
                    raise from_status(response.status_code, raw, replica=replica, sent=sent)
                media_type = response.headers.get("content-type", "").split(";")[0].strip()
                if media_type and media_type != "text/event-stream":
                    raise _not_a_stream(
                        await _read_capped(response), media_type, progress, bounds, replica, sent
                    )
                since_yield = 0
                async for chunk in _sse_chunks(response, replica, sent):
                    _apply_chunk(
                        chunk,
                        progress,
                        chat=request.messages is not None,
                        bounds=bounds,
                        replica=replica,
                    )
                    since_yield += 1
                    if since_yield == YIELD_EVERY_CHUNKS:
                        # Chunks already buffered are read without a pause: a fast engine
                        # would starve the heartbeat task, and the call would time out for
                        # heartbeats while it streams.
                        since_yield = 0
                        await asyncio.sleep(0)
        except httpx.TransportError as exc:
            raise from_transport(exc, replica=replica, sent=sent) from exc
        except InvalidUsage:
            progress.resumable = False
            raise
        finally:
            if progress.reported is None and progress.chunks:
                # The engine answered, so it processed the prompt, but never said how long
                # it was: bill the built-in tokenizer's count of what was sent.
                progress.prompt_tokens = _estimated_prompt_tokens(body)
        if progress.finish_reason is None:
            raise StreamCut(
                f"stream ended after {progress.completion_tokens} tokens without a finish reason",
                replica=replica,
            )
        if progress.reported is None:
            progress.resumable = False
            raise InvalidUsage(
                "the answer came without usage, so it cannot be billed exactly: kvflow asks "
                "for stream_options.include_usage, which vLLM supports; is this a vLLM server?",
                replica=replica,
            )

    async def _resolve(self, request: InferenceRequest) -> InferenceRequest:
        """The request with every `ContextRef` replaced by the content it names."""
        tenant = request.tenant
        if isinstance(request.prompt, ContextRef):
            prompt = await self.store.aget(request.prompt, tenant)
            return request.model_copy(update={"prompt": prompt})
        if request.messages is None:
            return request
        messages = list(request.messages)
        if request.earlier_messages is not None:
            earlier = await self.store.aget(request.earlier_messages, tenant)
            messages = [*CONVERSATION.validate_json(earlier), *messages]
        resolved = [
            m.model_copy(update={"content": await self.store.aget(m.content, tenant)})
            if isinstance(m.content, ContextRef)
            else m
            for m in messages
        ]
        return request.model_copy(update={"messages": resolved, "earlier_messages": None})


def _checkpoint_from_heartbeat(info: activity.Info) -> Checkpoint | None:
    """The output an earlier attempt of this activity heartbeated, to continue from."""
    source = f"the last heartbeat details of activity {info.activity_id}"
    last = AttemptProgress.from_details(info.heartbeat_details, source=source)
    return last.resumable() if last else None


def _message_body(message: ChatMessage) -> dict[str, Any]:
    assert isinstance(message.content, str), "context references are resolved before this"
    return message.to_api(message.content)


def _first_message_text(request: InferenceRequest) -> str | None:
    """The text of a resolved chat call's first message; None for a completion call."""
    if not request.messages:
        return None
    content = request.messages[0].content
    return content if isinstance(content, str) else None


def _request_body(
    request: InferenceRequest, resumed: str, reused: int, *, cache_salt: str | None = None
) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "model": request.model,
        "max_tokens": max(1, request.max_tokens - reused),
        "stream": True,
        # Usage in every chunk, so a cut stream still knows what was processed (and billed).
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "temperature": request.sampling.temperature,
        "top_p": request.sampling.top_p,
    }
    if cache_salt is not None:
        # vLLM hashes it into the prompt's first block: other tenants' prompts share nothing.
        body["cache_salt"] = cache_salt
    if request.sampling.seed is not None:
        body["seed"] = request.sampling.seed
    if request.sampling.stop:
        body["stop"] = request.sampling.stop
    if request.sampling.ignore_eos:
        body["ignore_eos"] = True
    if request.json_schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": request.json_schema},
        }
    if request.tools:
        body["tools"] = [tool.to_api() for tool in request.tools]
    if request.tool_choice is not None:
        body["tool_choice"] = (
            request.tool_choice
            if request.tool_choice in ("auto", "required", "none")
            else {"type": "function", "function": {"name": request.tool_choice}}
        )
    if request.messages is not None:
        messages = [_message_body(m) for m in request.messages]
        if resumed:
            messages.append({"role": "assistant", "content": resumed})
            # vLLM refuses continue_final_message unless add_generation_prompt is off.
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        body["messages"] = messages
        return "/v1/chat/completions", body
    assert isinstance(request.prompt, str), "context references are resolved before this"
    body["prompt"] = request.prompt + resumed
    return "/v1/completions", body


# ---- what the endpoint in front of the engine takes --------------------------------------------


@dataclass(frozen=True)
class EngineHints:
    """What a call adds for its endpoint's scheduler: top-level body fields and headers."""

    body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)


TASK_XARG = "kvflow_task"
"""`vllm_xargs` key naming a call's task (`kvflow_vllm.scheduler.TASK_KEY`)."""

DYNAMO_SESSION_HEADER = "x-dynamo-session-id"
"""The session a Dynamo request belongs to (Dynamo's docs/agents/session-ids.md; the constant
`HEADER_DYNAMO_SESSION_ID` of lib/llm/src/protocols/agents.rs). Dynamo takes session identity
from headers only: `nvext` has no session field (docs/components/frontend/nvext.md)."""

LLMD_OBJECTIVE_HEADER = "x-gateway-inference-objective"
"""The InferenceObjective a request is served under, whose `priority` orders flow control
(`ObjectiveKey` in pkg/epp/metadata/consts.go of llm-d/llm-d-inference-scheduler, and of
pkg/lwepp/metadata/consts.go in kubernetes-sigs/gateway-api-inference-extension)."""

LLMD_FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
"""The flow that flow control shares capacity fairly between, within one priority
(`FlowFairnessIDKey`, same files as `LLMD_OBJECTIVE_HEADER`)."""

_U32_MAX = 2**32 - 1


def engine_hints(
    pool: Pool, request: InferenceRequest, *, max_tokens: int, session_id: str | None
) -> EngineHints:
    """What the call tells the endpoint of `pool` about its urgency, size and session.

    `request.priority` is kvflow's engine priority (`Placement.engine_priority`: tier · 10¹³ +
    the task's start in milliseconds, lower first); `max_tokens` is what this attempt asks for;
    `session_id` is the task's (its workflow id). Per `Pool.endpoint_kind`:

    - "vllm": with `priority_scheduling`, the body's `priority`, as it is. vLLM's priority
      scheduler orders waiting requests by (priority, arrival), lower first, and takes any
      int64 (`priority` of vllm/entrypoints/openai/chat_completion/protocol.py;
      vllm/v1/core/sched/request_queue.py). Without it nothing is sent: vLLM's API reference
      says a non-zero priority is refused unless the engine schedules by priority (0.32
      accepts it and ignores it, as tests/test_vllm_priority.py pins), and to an fcfs engine
      it means nothing either way.
    - "dynamo": `nvext.agent_hints` {"priority", "strict_priority", "osl"} and the session in
      the `x-dynamo-session-id` header (Dynamo's docs/components/frontend/nvext.md, "Agent
      Hints"; `AgentHints` in lib/llm/src/protocols/openai/nvext.rs). Dynamo's priority is
      the other way round (higher first) and an i32, so the tier becomes 5 for tier 1 down to
      1 for tier 5, as `priority` (router scoring, and the engine's priority, which Dynamo
      turns into vLLM's polarity itself) and as `strict_priority` (the router queue's tier,
      compared first). `osl`, the expected output length, is `max_tokens`: kvflow has no
      better estimate. Within a tier Dynamo orders by arrival, not by the task's start.
    - "llm-d": the tenant in `x-gateway-inference-fairness-id`, and the tier's
      InferenceObjective (`Pool.inference_objectives`) in `x-gateway-inference-objective`;
      with `priority_scheduling` the body's `priority` as well, which the gateway passes on
      to vLLM. No session header: llm-d's `x-session-token` is a token its session-affinity
      scorer issues (the serving pod's name, base64), not an id a client chooses
      (pkg/epp/framework/plugins/scheduling/scorer/sessionaffinity/session_affinity.go).

    With `deadline_pause` (vllm and llm-d endpoints), a call with a step objective
    (`request.step_deadline`) also sends `vllm_xargs` {"kvflow_deadline": POSIX seconds,
    "kvflow_priority_span": 10¹³}, which vLLM hands its scheduler as `extra_args`:
    `kvflow_vllm.scheduler.DeadlinePauseScheduler` pauses lower tiers while the call would miss
    it. The engine compares the deadline with its own clock.

    With `task_end_release` (vllm endpoints), every call of a task also sends `vllm_xargs`
    {"kvflow_task": its workflow id}: `kvflow_vllm.scheduler.TaskEndScheduler` notes the task's
    KV blocks, to reuse them first once the control plane says the task ended.

    A call placed without a priority (`request.priority` None) carries no priority, tier or
    objective; the endpoint then applies its default.
    """
    hints = EngineHints()
    priority = request.priority
    kind = pool.endpoint_kind
    xargs: dict[str, str | float | int] = {}
    if kind in ("vllm", "llm-d") and pool.priority_scheduling and priority is not None:
        hints.body["priority"] = priority
        if pool.deadline_pause and request.step_deadline is not None:
            xargs["kvflow_deadline"] = request.step_deadline.timestamp()
            xargs["kvflow_priority_span"] = TIER_PRIORITY_SPAN
    if kind == "vllm" and pool.task_end_release and session_id:
        xargs[TASK_XARG] = session_id
    if xargs:
        hints.body["vllm_xargs"] = xargs
    if kind == "dynamo":
        agent_hints: dict[str, int] = {}
        if priority is not None:
            urgency = TIERS + 1 - tier_of(priority)
            agent_hints["priority"] = urgency
            agent_hints["strict_priority"] = urgency
        agent_hints["osl"] = min(max_tokens, _U32_MAX)
        hints.body["nvext"] = {"agent_hints": agent_hints}
        if session_id:
            hints.headers[DYNAMO_SESSION_HEADER] = header_value(session_id)
    elif kind == "llm-d":
        if priority is not None:
            objective = pool.inference_objectives[tier_of(priority) - 1]
            hints.headers[LLMD_OBJECTIVE_HEADER] = objective
        hints.headers[LLMD_FAIRNESS_HEADER] = header_value(request.tenant)
    return hints


def tier_of(priority: int) -> int:
    """The tenant tier (1 to `TIERS`) an engine priority stands for; out of range, the nearest."""
    return min(TIERS, max(1, priority // TIER_PRIORITY_SPAN))


def header_value(text: str) -> str:
    """`text` as an HTTP header value: as it is when it is printable ASCII, else %-encoded.

    Workflow ids and tenant names may hold any character, and a header value that HTTP does not
    allow (a line break, non-ASCII) would fail the call before it is sent. The encoding is the
    same for the same text, so a session id stays one session.
    """
    if text.isascii() and text.isprintable() and text == text.strip():
        return text
    return quote(text, safe="")


ERROR_BODY_LIMIT = 64 * 1024
"""Bytes of an error or non-stream body read: enough for any message, bounded for a broken one."""

_SSE_LINE = re.compile(r"[A-Za-z_-]*(?::.*)?")
"""A line the event-stream format allows: blank, a `:` comment, or a field (`data: ...`)."""


async def _read_capped(response: httpx.Response) -> bytes:
    """Up to `ERROR_BODY_LIMIT` bytes of the body; what arrived if the connection drops."""
    parts: list[bytes] = []
    size = 0
    try:
        async for piece in response.aiter_bytes():
            parts.append(piece)
            size += len(piece)
            if size >= ERROR_BODY_LIMIT:
                break
    except httpx.TransportError:
        pass  # the status already says what went wrong; the body only adds a message
    return b"".join(parts)[:ERROR_BODY_LIMIT]


def _not_a_stream(
    raw: bytes,
    media_type: str,
    progress: Progress,
    bounds: UsageBounds,
    replica: str,
    sent: SentText,
) -> InferenceError:
    """The error a 200 answer that is not an event stream means.

    An error body (vLLM's JSON error with status 200) is that error. Anything else is a
    `MalformedResponse`; a complete JSON answer (a server that ignored `stream`) still bills
    the usage it reports, since the engine did the work.
    """
    text = raw.decode("utf-8", "replace")
    try:
        document = json.loads(text)
    except ValueError:
        return MalformedResponse(
            f"answered 200 with {media_type or 'a body'} that is not an event stream: "
            f"{_snippet(text, sent)}",
            replica=replica,
        )
    error = error_of(document)
    if error is not None:
        return from_error_body(error, replica=replica, sent=sent)
    if isinstance(document, dict) and document.get("usage") is not None:
        # Already failing: a report that cannot be trusted is simply not billed.
        with contextlib.suppress(InvalidUsage):
            _apply_usage(document["usage"], progress, bounds, replica)
    return MalformedResponse(
        f"answered 200 with JSON, not an event stream (does it honour stream=true?): "
        f"{_snippet(text, sent)}",
        replica=replica,
    )


def _snippet(text: str, sent: SentText = NOTHING_SENT) -> str:
    """The start of a body an engine should not have sent, unless it quotes the request."""
    text = text.strip()
    if not text:
        return "(empty body)"
    snippet = text[:200] + ("..." if len(text) > 200 else "")
    return repr(snippet) if not sent.quoted_in(snippet) else sent.kept(snippet)


async def _sse_chunks(
    response: httpx.Response, replica: str, sent: SentText
) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of an OpenAI event stream, up to `[DONE]`; errors in it are raised."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            if _SSE_LINE.fullmatch(line) is None:
                # Not the event-stream format: an error body, or a proxy's page.
                error = error_of(_json_or_none(line))
                if error is not None:
                    raise from_error_body(error, replica=replica, sent=sent)
                raise MalformedResponse(
                    f"a line of the stream is not an event: {_snippet(line, sent)}",
                    replica=replica,
                )
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        chunk = _json_or_none(data)
        if not isinstance(chunk, dict):
            raise MalformedResponse(
                f"an event's data is not a JSON object: {_snippet(data, sent)}", replica=replica
            )
        error = error_of(chunk)
        if error is not None:
            raise from_error_body(error, replica=replica, sent=sent)
        yield chunk


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _apply_chunk(
    chunk: dict[str, Any], progress: Progress, *, chat: bool, bounds: UsageBounds, replica: str
) -> None:
    """Add one chunk to `progress`; a chunk of the wrong shape or wrong usage raises."""
    pieces, finish = _chunk_parts(chunk, chat=chat, replica=replica)
    calls = _tool_call_deltas(chunk, replica=replica) if chat else []
    usage = chunk.get("usage")
    # `{}` and null say nothing: some servers send them on every chunk before the real one.
    reported = _apply_usage(usage, progress, bounds, replica) if usage else False
    progress.chunks += 1
    if isinstance(chunk.get("model"), str):
        progress.response_model = chunk["model"]
    if isinstance(chunk.get("id"), str):
        progress.response_id = chunk["id"]
    for piece in pieces:
        if progress.first_token_at is None:
            progress.first_token_at = time.monotonic()
        progress.text += piece
        if not reported:
            progress.completion_tokens += 1
    for index, delta in calls:
        if progress.first_token_at is None:
            progress.first_token_at = time.monotonic()
        call = progress.tool_calls.setdefault(index, {})
        for key in ("id", "name"):
            if delta.get(key):
                call[key] = delta[key]
        call["arguments"] = call.get("arguments", "") + delta.get("arguments", "")
        if not reported:
            progress.completion_tokens += 1
    if finish:
        progress.finish_reason = finish


def _tool_call_deltas(chunk: dict[str, Any], *, replica: str) -> list[tuple[int, dict[str, str]]]:
    """The tool-call pieces of a chat chunk, as (index, {id, name, arguments}) in order.

    vLLM streams a call as a first delta with its `id` and function `name`, then pieces of
    its `arguments` JSON, all under the call's `index`.
    """
    found: list[tuple[int, dict[str, str]]] = []
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        calls = delta.get("tool_calls") if isinstance(delta, dict) else None
        if not calls:
            continue
        if not isinstance(calls, list):
            raise MalformedResponse(
                f"a chunk's tool_calls are not a list: {_snippet(json.dumps(chunk))}",
                replica=replica,
            )
        for position, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            index = call.get("index", position) if isinstance(call, dict) else None
            if not isinstance(index, int) or (
                function is not None and not isinstance(function, dict)
            ):
                raise MalformedResponse(
                    f"a chunk's tool call has no index or function: {_snippet(json.dumps(chunk))}",
                    replica=replica,
                )
            piece: dict[str, str] = {}
            for key, value in (
                ("id", call.get("id")),
                ("name", (function or {}).get("name")),
                ("arguments", (function or {}).get("arguments")),
            ):
                if value is None:
                    continue
                if not isinstance(value, str):
                    raise MalformedResponse(
                        f"a chunk's tool call {key} is not a string: {_snippet(json.dumps(chunk))}",
                        replica=replica,
                    )
                piece[key] = value
            found.append((index, piece))
    return found


def _chunk_parts(
    chunk: dict[str, Any], *, chat: bool, replica: str
) -> tuple[list[str], str | None]:
    """The text pieces and the finish reason of a chunk, checked for the shape vLLM sends."""

    def malformed(what: str) -> MalformedResponse:
        return MalformedResponse(
            f"a chunk's {what}: {_snippet(json.dumps(chunk))}", replica=replica
        )

    choices = chunk.get("choices") or []
    if not isinstance(choices, list):
        raise malformed("choices are not a list")
    pieces: list[str] = []
    finish: str | None = None
    for choice in choices:
        if not isinstance(choice, dict):
            raise malformed("choice is not an object")
        holder = (choice.get("delta") or {}) if chat else choice
        if not isinstance(holder, dict):
            raise malformed("delta is not an object")
        piece = holder.get("content" if chat else "text")
        if piece is not None and not isinstance(piece, str):
            raise malformed("text is not a string")
        reason = choice.get("finish_reason")
        if reason is not None and not isinstance(reason, str):
            raise malformed("finish_reason is not a string")
        if piece:
            pieces.append(piece)
        finish = reason or finish
    return pieces, finish


@dataclass(frozen=True)
class UsageBounds:
    """What a truthful usage report can say about one request, from what was sent.

    A token of the tokenizers vLLM serves (byte-level BPE, SentencePiece with byte fallback)
    stands for at least one byte of text and at most `MAX_TOKEN_BYTES`, so the UTF-8 size of
    what was sent bounds the prompt's tokens both ways, once the chat template's own tokens
    (`TEMPLATE_TOKENS`, plus `MESSAGE_TOKENS` a message) are allowed for. The bounds are wide
    on purpose: they catch an engine that counts another prompt, a truncated one or garbage,
    never a tokenizer that merely differs.
    """

    MAX_TOKEN_BYTES: ClassVar[int] = 256
    TEMPLATE_TOKENS: ClassVar[int] = 2048
    MESSAGE_TOKENS: ClassVar[int] = 64

    min_prompt: int
    max_prompt: int
    max_completion: int

    @classmethod
    def of(cls, body: dict[str, Any]) -> UsageBounds:
        """The bounds of the request `body` as it is sent (`_request_body`)."""
        messages = body.get("messages")
        if messages is not None:
            texts = [str(m.get("content") or "") for m in messages]
            # Tools and earlier tool calls are rendered into the prompt too.
            texts += [json.dumps(m["tool_calls"]) for m in messages if m.get("tool_calls")]
            texts += [json.dumps(tool) for tool in body.get("tools") or ()]
            overhead = cls.TEMPLATE_TOKENS + cls.MESSAGE_TOKENS * len(messages)
        else:
            texts = [str(body.get("prompt") or "")]
            overhead = cls.TEMPLATE_TOKENS
        size = sum(len(t.encode("utf-8")) for t in texts)
        return cls(
            min_prompt=max(1, size // cls.MAX_TOKEN_BYTES),
            max_prompt=size + overhead,
            max_completion=int(body["max_tokens"]),
        )

    def problem(self, usage: Usage, previous: Usage | None) -> str | None:
        """What makes `usage` impossible for this request, after `previous`; None if nothing."""
        if not self.min_prompt <= usage.prompt_tokens <= self.max_prompt:
            return (
                f"prompt_tokens {usage.prompt_tokens} for a prompt that must have "
                f"{self.min_prompt} to {self.max_prompt} tokens"
            )
        if usage.cached_tokens > usage.prompt_tokens:
            return f"cached_tokens {usage.cached_tokens} > prompt_tokens {usage.prompt_tokens}"
        if usage.completion_tokens > self.max_completion:
            return (
                f"completion_tokens {usage.completion_tokens} > the {self.max_completion} "
                "max_tokens asked for"
            )
        if previous is not None and usage.prompt_tokens != previous.prompt_tokens:
            return (
                f"prompt_tokens changed from {previous.prompt_tokens} to {usage.prompt_tokens} "
                "within one stream"
            )
        if previous is not None and usage.completion_tokens < previous.completion_tokens:
            return (
                f"completion_tokens fell from {previous.completion_tokens} to "
                f"{usage.completion_tokens} within one stream"
            )
        return None


def _apply_usage(raw: Any, progress: Progress, bounds: UsageBounds, replica: str) -> bool:
    """Check a usage report and take its counts into `progress`; `InvalidUsage` if wrong.

    vLLM sends `prompt_tokens` and `completion_tokens` in every report, and the cached
    tokens (`prompt_tokens_details.cached_tokens`) in the last one only: a report without
    them keeps the cached count already known.
    """
    if not isinstance(raw, dict):
        raise InvalidUsage(f"usage is not an object: {_snippet(json.dumps(raw))}", replica=replica)
    details = raw.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else details
    fields = {
        "prompt_tokens": raw.get("prompt_tokens"),
        "completion_tokens": raw.get("completion_tokens"),
        "cached_tokens": progress.cached_tokens if cached is None else cached,
    }
    counts: dict[str, int] = {}
    for name, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidUsage(
                f"{name} is {json.dumps(value)[:40]}, not a count of tokens", replica=replica
            )
        counts[name] = value
    usage = Usage(**counts)
    problem = bounds.problem(usage, progress.reported)
    if problem is not None:
        raise InvalidUsage(problem, replica=replica)
    progress.prompt_tokens = usage.prompt_tokens
    progress.completion_tokens = usage.completion_tokens
    progress.cached_tokens = usage.cached_tokens
    progress.reported = usage
    return True


def _estimated_prompt_tokens(body: dict[str, Any]) -> int:
    """The prompt's tokens, tools included, by the built-in tokenizer (exact for the simulator)."""
    tokenizer = BuiltinTokenizer()
    messages = body.get("messages")
    if messages is not None:
        return len(
            tokenizer.encode_chat(
                messages,
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                continue_final_message=bool(body.get("continue_final_message", False)),
                tools=body.get("tools"),
            )
        )
    return len(tokenizer.encode(str(body.get("prompt") or "")))

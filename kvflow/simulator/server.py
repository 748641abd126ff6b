"""The simulated vLLM server: vLLM's OpenAI-compatible HTTP API over the engine core.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (streaming as server-sent
events ending in `data: [DONE]`, `stream_options.include_usage` for a last chunk with
`usage`; function calling and `logprobs`, below), `GET /v1/models`, `GET /health`,
`GET /version`, `GET /load`, `POST /tokenize`, `POST /detokenize` and `GET /metrics` (see
`kvflow.simulator.metrics`). Request and response JSON, error bodies and status codes follow
vLLM (`kvflow.simulator.protocol`); faults come from the server's settings and the
`x-kvflow-fault` header (`kvflow.simulator.faults`).

Function calling answers as vLLM started with `--enable-auto-tool-choice --tool-call-parser`
does. `tools` are rendered into the prompt (the built-in tokenizer's `encode_chat`), so
they are prompt tokens; whether the answer is a tool call follows `generation.calls_tool`. A
tool call's arguments are an instance of the tool's `parameters` schema, made like a
`response_format` document and generated token by token, so they are the completion tokens
(a real model also writes its parser's wrapper, e.g. hermes' `<tool_call>{"name": ...,
"arguments": ...}</tool_call>`, about 30 more tokens, which the simulator leaves out). The answer
has `message.tool_calls = [{"id": "chatcmpl-tool-<hex>", "type": "function", "function":
{"name", "arguments"}}]` and `content` null (`"auto"`) or empty (`"required"`, named), and
`finish_reason` `"tool_calls"`, except `"stop"` for a named function, as vLLM and OpenAI answer
(`"length"` when `max_tokens` cut the arguments short). A stream sends, as vLLM 0.32 with the
`hermes` parser does, the role chunk, a chunk naming the call (`delta.tool_calls = [{"index":
0, "id", "type": "function", "function": {"name"}}]`), one chunk per step with the next piece
of the arguments (`[{"index": 0, "function": {"arguments"}}]`), and a last chunk with an empty
`delta` and the finish reason. `logprobs` with `top_logprobs` (0 to 20)
adds `choices[0].logprobs.content` (one entry per output token, end of sequence included, from
`generation.TokenLogprobs`), per chunk when streaming.

kvflow's engine scheduler for vLLM is built in: a call whose `vllm_xargs` names its task
(`kvflow_task`) notes its prompt's blocks under it, and a request carrying `kvflow_release`
puts the blocks only that task asked for at the head of the eviction order before it runs
(`kvflow_vllm.scheduler.TaskEndScheduler`; `kvcache.TaskBlocks`). Other requests see plain
vLLM.

Time: the engine runs on a clock that advances `time_scale` simulated seconds per real second,
so a step the performance model prices at 20 ms takes 20 ms at `time_scale` 1 and 2 ms at
`time_scale` 10. Reported times (metrics) are simulated seconds. Very large time scales are
limited by the host's speed.

Three ways to run it:

- `kvflow sim serve ...` (one process, exits with status 70 on a crash fault);
- `SimServer` runs one in a background thread of this process (tests, demos): `base_url`,
  `start()`/`stop()`, a context manager;
- `SimProcess` runs `kvflow sim serve` as a child process (needed to see a real crash).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import logging
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self, TypeVar

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvflow.ports import free_port
from kvflow.scheduler.builtin_tokenizer import Tokenizer
from kvflow.scheduler.fleet import ModelSpec
from kvflow.scheduler.gpus import GpuGeneration
from kvflow.scheduler.tokens import message_text
from kvflow.simulator.engine import EngineConfig, EngineCore, SimReplica, SimRequest
from kvflow.simulator.faults import (
    CRASH_EXIT_CODE,
    FAULT_HEADER,
    FaultDice,
    FaultHeaderError,
    FaultSpec,
    parse_fault_header,
)
from kvflow.simulator.generation import (
    SchemaError,
    TextSampler,
    TokenLogprobs,
    ToolChoice,
    calls_tool,
    context_hash,
    json_for_schema,
    pick_tool,
    splitmix64,
)
from kvflow.simulator.kv_events import ZmqEventPublisher
from kvflow.simulator.kvcache import GIVEN_OUT_PER_BLOCK, TaskBlocks
from kvflow.simulator.metrics import CONTENT_TYPE, VllmMetrics
from kvflow.simulator.protocol import (
    MAX_TOP_LOGPROBS,
    ApiError,
    ChatBody,
    ChatTool,
    CompletionBody,
    DetokenizeBody,
    ParameterError,
    SamplingBody,
    TokenizeBody,
    template_tools,
    validation_error,
)

logger = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"
"""The vLLM version whose API the simulator follows (answered by `/version`)."""
FINGERPRINT = f"vllm-{VLLM_VERSION}-kvflow-sim"
"""`system_fingerprint` of responses (vLLM puts its version and build there)."""


class ServerSettings(BaseModel):
    """Everything one simulated server needs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu: GpuGeneration = GpuGeneration.H100
    models: list[ModelSpec] = Field(min_length=1, description="warm models it serves")
    cold_models: list[ModelSpec] = Field(
        default_factory=list, description="models it serves after a load on first use"
    )
    engine: EngineConfig = EngineConfig()
    time_scale: float = Field(default=1.0, gt=0, description="simulated seconds per second")
    seed: int = 0
    faults: FaultSpec = FaultSpec()
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    enable_prompt_tokens_details: bool = True
    replica_name: str = "sim"


class ConnectionDrop(BaseException):
    """Raised inside a handler to drop the client's connection (a fault or a crash).

    A BaseException, so that no framework layer turns it into a 500 response.
    """


def _is_drop(exc: BaseException) -> bool:
    if isinstance(exc, ConnectionDrop):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return all(_is_drop(e) for e in exc.exceptions)
    return False


@dataclass
class _StepItem:
    tokens: list[int]
    finish_reason: str | None


_CRASH = _StepItem([], "crash")


@dataclass(frozen=True)
class _ToolRequest:
    """A chat request whose answer is a tool call: how it chose, and the tools it may call."""

    choice: ToolChoice
    tools: list[ChatTool]


@dataclass(frozen=True)
class _ToolCall:
    """The tool call an answer makes; its arguments are the answer's text."""

    id: str
    name: str
    choice: ToolChoice

    def finish_reason(self, reason: str | None) -> str | None:
        """vLLM's: an ended call is `tool_calls`, except a named function's (`stop`)."""
        if reason == "stop" and self.choice != "named":
            return "tool_calls"
        return reason

    def message(self, arguments: str) -> dict[str, Any]:
        """The call in `message.tool_calls`."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": arguments},
        }

    def header(self) -> dict[str, Any]:
        """The stream's first `delta.tool_calls` entry: the call's id and function name."""
        return {"index": 0, "id": self.id, "type": "function", "function": {"name": self.name}}

    def piece(self, arguments: str) -> dict[str, Any]:
        """A later `delta.tool_calls` entry: the next piece of the arguments."""
        return {"index": 0, "function": {"arguments": arguments}}


@dataclass
class _Job:
    """One HTTP request's generation: its engine request and the tokens it has not sent."""

    request: SimRequest
    model: str
    engine: EngineCore
    faults: FaultSpec
    stop: list[str]
    queue: asyncio.Queue[_StepItem] = field(default_factory=asyncio.Queue)
    delivered: int = 0
    last_token_time: float | None = None
    done: bool = False
    tool_call: _ToolCall | None = None
    logprobs: TokenLogprobs | None = None

    def finish_reason(self, reason: str | None) -> str | None:
        """The finish reason the client sees (a tool call's, see `_ToolCall`)."""
        return reason if self.tool_call is None else self.tool_call.finish_reason(reason)

    def logprobs_body(self, token_ids: list[int]) -> dict[str, Any] | None:
        """`choices[0].logprobs` for the next `token_ids` of the answer (None: not asked)."""
        if self.logprobs is None:
            return None
        return {"content": self.logprobs.entries(token_ids)}


@dataclass
class _Delta:
    text: str
    finish_reason: str | None = None
    stop_reason: str | None = None
    tokens: int = 0
    """Output tokens sent so far, this delta's included."""
    token_ids: list[int] = field(default_factory=list)
    """The output tokens this delta covers (those since the last delta)."""


class _EngineLoop:
    """Runs the replica's steps in real time (scaled) inside the server's event loop."""

    def __init__(self, server: SimulatedVllm) -> None:
        self.server = server
        self.replica = server.replica
        self.scale = server.settings.time_scale
        self._t0 = time.monotonic()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def now(self) -> float:
        """Simulated seconds since the server started."""
        return (time.monotonic() - self._t0) * self.scale

    def _real(self, simulated: float) -> float:
        return self._t0 + simulated / self.scale

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def wake(self) -> None:
        self._wakeup.set()

    async def _run(self) -> None:
        replica = self.replica
        while True:
            now = self.now()
            duration = replica.begin_step(now)
            if duration is None:
                wake = replica.next_wake_time()
                self._wakeup.clear()
                timeout = None if wake is None else max(0.0, (wake - now) / self.scale)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), timeout)
                continue
            delay = self._real(now + duration) - time.monotonic()
            await asyncio.sleep(max(delay, 0.0))
            try:
                result = replica.end_step()
                self.server._dispatch(result.outputs, result.finished, result.kv_events)
            except Exception:  # the loop must survive anything, or every request hangs
                logger.exception("simulated engine step failed")


class SimulatedVllm:
    """One simulated vLLM server: engines, HTTP app, metrics, KV events and faults.

    `asgi` is the application to serve; `crash` is called by a crash fault (default: drop
    every connection and call `on_crash`).
    """

    def __init__(
        self,
        settings: ServerSettings,
        *,
        crash: Callable[[], None] | None = None,
        on_crash: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        publish = settings.kv_events_endpoint is not None
        config = settings.engine.model_copy(
            update={"enable_kv_events": publish, "slowdown": settings.faults.slowdown}
        )
        self.replica = SimReplica(
            settings.gpu,
            settings.models,
            config,
            cold_models=settings.cold_models,
            name=settings.replica_name,
        )
        self.tokenizer = Tokenizer()
        self.metrics = VllmMetrics(list(self.replica.engines.values()))
        self.dice = FaultDice(settings.seed)
        self._keys = random.Random(splitmix64(settings.seed))
        self._crash_hook = crash
        self._on_crash = on_crash
        self.crashed = False
        self._jobs: dict[str, _Job] = {}
        self._task_blocks: dict[str, TaskBlocks] = {}
        """Model → the blocks each task's calls asked for there (`kvflow_task`)."""
        self.released_blocks = 0
        """Blocks `kvflow_release` requests moved to the head of the eviction order."""
        self._loop: _EngineLoop | None = None
        self.publisher: ZmqEventPublisher | None = None
        self.created = int(time.time())
        self.app = self._build_app()
        self.asgi: ASGIApp = _DropBoundary(self.app, self)

    # -- lifecycle ----------------------------------------------------------------------

    async def startup(self) -> None:
        """Start the engine loop and the KV-event publisher."""
        settings = self.settings
        if settings.kv_events_endpoint is not None:
            self.publisher = ZmqEventPublisher(
                settings.kv_events_endpoint,
                settings.kv_events_replay_endpoint,
                topic=settings.kv_events_topic,
            )
        self._loop = _EngineLoop(self)
        self._loop.start()

    async def shutdown(self) -> None:
        """Stop the loop, drop what is in flight, close the publisher."""
        self.drop_all()
        if self._loop is not None:
            await self._loop.stop()
        if self.publisher is not None:
            self.publisher.shutdown()
            self.publisher = None

    def drop_all(self) -> None:
        """Drop every in-flight request's connection (used by a crash and by `stop`)."""
        for job in list(self._jobs.values()):
            job.queue.put_nowait(_CRASH)

    def crash(self) -> None:
        """The crash fault: the process exits, or (in-process) every connection drops."""
        if self.crashed:
            return
        self.crashed = True
        logger.warning("crash fault: the simulated server %s dies", self.settings.replica_name)
        if self._crash_hook is not None:
            self._crash_hook()
        self.drop_all()
        if self._on_crash is not None:
            self._on_crash()

    # -- engine side --------------------------------------------------------------------

    def _dispatch(
        self, outputs: Sequence[SimRequest], finished: Sequence[SimRequest], events: list[Any]
    ) -> None:
        ended = {r.request_id for r in finished}
        for request in outputs:
            job = self._jobs.get(request.request_id)
            if job is None:
                continue
            tokens = request.output_token_ids[job.delivered :]
            job.delivered += len(tokens)
            self.metrics.observe_token(job.model, request, job.last_token_time)
            job.last_token_time = request.last_token_time
            reason = request.finish_reason if request.request_id in ended else None
            job.queue.put_nowait(_StepItem(tokens, reason))
        for request in finished:
            job = self._jobs.get(request.request_id)
            if job is not None:
                job.done = True
                self.metrics.observe_finished(job.model, request)
        if events and self.publisher is not None:
            self.publisher.publish(events)

    def _submit(self, job: _Job) -> None:
        assert self._loop is not None
        self._jobs[job.request.request_id] = job
        self.replica.add_request(job.model, job.request, self._loop.now())
        self._loop.wake()

    def _release(self, job: _Job) -> None:
        self._jobs.pop(job.request.request_id, None)
        if not job.done and self._loop is not None:
            if job.engine.abort_request(job.request.request_id, self._loop.now()):
                self.metrics.observe_finished(job.model, job.request)
            job.done = True

    # -- HTTP side ----------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            await self.startup()
            try:
                yield
            finally:
                await self.shutdown()

        app = FastAPI(
            title="kvflow simulated vLLM",
            version=VLLM_VERSION,
            lifespan=lifespan,
            docs_url=None,
            redoc_url=None,
            openapi_url=None,
        )

        @app.exception_handler(ApiError)
        async def api_error(request: Request, exc: ApiError) -> JSONResponse:
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.exception_handler(Exception)
        async def unexpected(request: Request, exc: Exception) -> JSONResponse:
            logger.exception("unexpected error in %s", request.url.path)
            error = ApiError(f"Internal server error: {type(exc).__name__}", 500)
            return JSONResponse(error.body(), status_code=500)

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/ping")
        async def ping() -> Response:
            return Response(status_code=200)

        @app.get("/version")
        async def version() -> dict[str, str]:
            return {"version": VLLM_VERSION}

        @app.get("/load")
        async def load() -> dict[str, int]:
            return {"server_load": self.replica.num_running + self.replica.num_waiting}

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(self.metrics.render(), media_type=CONTENT_TYPE)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [self._model_card(e) for e in self._engines()]}

        @app.post("/tokenize")
        async def tokenize(request: Request) -> dict[str, Any]:
            body = _parse(TokenizeBody, await _json(request))
            engine = self._engine(body.model)
            if body.messages is not None:
                self._check_chat_flags(body.add_generation_prompt, body.continue_final_message)
                # The template writes <|bos|> itself: add_special_tokens adds no second one.
                try:
                    ids = self.tokenizer.encode_chat(
                        body.messages,
                        add_generation_prompt=body.add_generation_prompt,
                        continue_final_message=body.continue_final_message,
                        tools=template_tools(body.tools),
                    )
                except ValueError as exc:
                    raise ApiError(str(exc), param="messages") from None
            elif body.prompt is not None:
                add = True if body.add_special_tokens is None else body.add_special_tokens
                ids = self.tokenizer.encode(body.prompt, add_special_tokens=add)
            else:
                raise ApiError("give `prompt` or `messages`")
            return {
                "count": len(ids),
                "max_model_len": engine.max_model_len,
                "tokens": ids,
                "token_strs": [self.tokenizer.token_str(i) for i in ids]
                if body.return_token_strs
                else None,
            }

        @app.post("/detokenize")
        async def detokenize(request: Request) -> dict[str, str]:
            body = _parse(DetokenizeBody, await _json(request))
            self._engine(body.model)
            try:
                return {"prompt": self.tokenizer.decode(body.tokens, skip_special_tokens=False)}
            except ValueError as exc:
                raise ApiError(str(exc), param="tokens") from None

        @app.post("/v1/completions", response_model=None)
        async def completions(request: Request) -> Response:
            body = _parse(CompletionBody, await _json(request))
            return await self._completion(request, body)

        @app.post("/v1/chat/completions", response_model=None)
        async def chat(request: Request) -> Response:
            body = _parse(ChatBody, await _json(request))
            return await self._chat(request, body)

        return app

    def _engines(self) -> list[EngineCore]:
        return list(self.replica.engines.values())

    def _engine(self, model: str | None) -> EngineCore:
        if model is None:
            return self._engines()[0]
        engine = self.replica.engines.get(model)
        if engine is None:
            aliases = ", ".join(self.replica.engines)
            raise ApiError(
                f"The model `{model}` does not exist. Valid aliases: {aliases}.", 404, param="model"
            )
        return engine

    def _model_card(self, engine: EngineCore) -> dict[str, Any]:
        name = engine.model.name
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": name,
            "parent": None,
            "max_model_len": engine.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{uuid.uuid5(uuid.NAMESPACE_URL, name).hex}",
                    "object": "model_permission",
                    "created": self.created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }

    @staticmethod
    def _check_chat_flags(add_generation_prompt: bool, continue_final_message: bool) -> None:
        if add_generation_prompt and continue_final_message:
            raise ApiError(
                "continue_final_message and add_generation_prompt are not compatible. Use "
                "continue_final_message when you want the model to continue the final "
                "message, and add_generation_prompt when you want to add a header that will "
                "prompt it to start a new assistant message instead."
            )

    def _faults(self, request: Request) -> FaultSpec:
        header = request.headers.get(FAULT_HEADER)
        try:
            override = parse_fault_header(header) if header else None
        except FaultHeaderError as exc:
            raise ApiError(str(exc), param=FAULT_HEADER) from None
        return self.settings.faults.merged(override)

    async def _chat(self, http: Request, body: ChatBody) -> Response:
        engine = self._engine(body.model)
        self._check_chat_flags(body.add_generation_prompt, body.continue_final_message)
        for index, message in enumerate(body.messages):
            # vLLM's message types all require a string role.
            if not isinstance(message.get("role"), str):
                raise ApiError(
                    f"messages[{index}] needs a `role` string, got {message.get('role')!r}",
                    param="messages",
                )
        tools = template_tools(body.tools)
        try:
            prompt_ids = self.tokenizer.encode_chat(
                body.messages,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                tools=tools,
            )
        except ValueError as exc:
            raise ApiError(str(exc), param="messages") from None
        # A resumed structured answer continues the document the original prompt would get.
        base_ids, partial = prompt_ids, ""
        if body.continue_final_message and body.messages:
            last = body.messages[-1]
            if last.get("role") == "assistant":
                partial = message_text(last.get("content"))
                base_ids = self.tokenizer.encode_chat(body.messages[:-1], tools=tools)
        # `is None`, not `or`: a max_completion_tokens of 0 is refused, not ignored.
        max_tokens = (
            body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        )
        return await self._generate(
            http,
            body,
            engine,
            prompt_ids,
            max_tokens,
            chat=True,
            base_ids=base_ids,
            partial=partial,
            tool=self._tool_request(body),
            top_logprobs=body.top_logprobs if body.logprobs else None,
        )

    @staticmethod
    def _tool_request(body: ChatBody) -> _ToolRequest | None:
        """The tools the answer calls one of, or None for a text answer (`calls_tool`)."""
        choice: ToolChoice
        named = body.named_tool
        if named is not None:
            choice, tools = "named", [named]
        elif body.tools and body.tool_choice == "auto":
            choice, tools = "auto", body.tools
        elif body.tools and body.tool_choice == "required":
            choice, tools = "required", body.tools
        else:
            return None
        last_role = body.messages[-1].get("role") if body.messages else None
        if not calls_tool(choice, last_role, body.continue_final_message):
            return None
        return _ToolRequest(choice, tools)

    async def _completion(self, http: Request, body: CompletionBody) -> Response:
        engine = self._engine(body.model)
        prompt: Any = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError("the simulator serves one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = [int(t) for t in prompt]
            if not prompt_ids:
                raise ApiError("prompt is empty", param="prompt")
            for token in prompt_ids:
                if not 0 <= token < self.tokenizer.vocab_size:
                    raise ApiError(f"Token id {token} is out of vocabulary")
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        return await self._generate(
            http, body, engine, prompt_ids, max_tokens, chat=False, base_ids=prompt_ids, partial=""
        )

    def _schema(self, body: SamplingBody) -> tuple[bool, dict[str, Any] | None]:
        """Whether the output is structured, and its JSON schema (None: any JSON object)."""
        fmt = body.response_format
        raw: Any = None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ApiError(
                    "response_format json_schema needs json_schema.schema", param="response_format"
                )
            raw = fmt.json_schema.schema_
        elif fmt is not None and fmt.type == "json_object":
            return True, None
        elif body.structured_outputs is not None and body.structured_outputs.json_ is not None:
            raw = body.structured_outputs.json_
        elif body.guided_json is not None:
            raw = body.guided_json
        else:
            return False, None
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ApiError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ApiError("a JSON schema must be an object", param="response_format")
        return True, raw

    def _validate(
        self, body: SamplingBody, engine: EngineCore, prompt_len: int, max_tokens: int | None
    ) -> int:
        if body.n != 1:
            raise ApiError("the simulator generates one choice per request (n=1)", param="n")
        salt = body.cache_salt
        if salt is not None and (
            not salt or len(salt) > MAX_CACHE_SALT_LENGTH or any(c in "@/\\\x00" for c in salt)
        ):
            # vLLM's check of the parameter, and its message.
            raise ApiError(
                "Parameter 'cache_salt' must be a non-empty string of at most "
                f"{MAX_CACHE_SALT_LENGTH} characters without '@', '/', '\\' or NUL.",
                param="cache_salt",
            )
        if body.temperature is not None and not math.isfinite(body.temperature):
            # JSON's NaN and Infinity parse as floats; no sampler can use them.
            raise _param_error(
                f"temperature must be a finite number, got {body.temperature}.",
                "temperature",
                body.temperature,
            )
        if body.seed is not None and not _INT64_MIN <= body.seed <= _INT64_MAX:
            # vLLM seeds a 64-bit generator and refuses seeds outside its range.
            raise _param_error(
                "seed must be a 64-bit integer, between -2**63 and 2**63 - 1.", "seed", body.seed
            )
        if body.temperature is not None and body.temperature < 0:
            raise _param_error(
                f"temperature must be non-negative, got {float(body.temperature)}.",
                "temperature",
                float(body.temperature),
            )
        if body.top_p is not None and not 0 < body.top_p <= 1:
            raise _param_error(f"top_p must be in (0, 1], got {body.top_p}.", "top_p", body.top_p)
        if max_tokens is not None and max_tokens < 1:
            raise _param_error(
                f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens
            )
        if body.min_tokens < 0:
            raise _param_error(
                f"min_tokens must be greater than or equal to 0, got {body.min_tokens}.",
                "min_tokens",
                body.min_tokens,
            )
        if max_tokens is not None and body.min_tokens > max_tokens:
            raise _param_error(
                f"min_tokens must be less than or equal to max_tokens={max_tokens}, got "
                f"{body.min_tokens}.",
                "min_tokens",
                body.min_tokens,
            )
        limit = engine.max_model_len
        if max_tokens is not None and max_tokens > limit:
            raise _param_error(
                f"max_tokens={max_tokens} cannot be greater than max_model_len={limit}. "
                "Please request fewer output tokens.",
                "max_tokens",
                max_tokens,
            )
        if prompt_len >= limit:
            # vLLM counts the prompt only up to one token past the limit.
            seen = min(prompt_len, limit + 1)
            raise _param_error(
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"contains at least {seen} input tokens, which exceeds this limit even without "
                "any output tokens. Please reduce the length of the input prompt.",
                "input_tokens",
                seen,
            )
        # Like vLLM 0.32, a max_tokens that does not fit after the prompt is capped, not refused.
        room = limit - prompt_len
        return room if max_tokens is None else min(max_tokens, room)

    def _sampling_key(self, body: SamplingBody) -> int:
        if body.temperature == 0:
            return 0
        if body.seed is not None:
            return body.seed
        return self._keys.getrandbits(64)

    async def _generate(
        self,
        http: Request,
        body: SamplingBody,
        engine: EngineCore,
        prompt_ids: list[int],
        max_tokens: int | None,
        *,
        chat: bool,
        base_ids: list[int],
        partial: str,
        tool: _ToolRequest | None = None,
        top_logprobs: int | None = None,
    ) -> Response:
        faults = self._faults(http)
        if faults.error is not None:
            raise ApiError(_fault_message(faults.error), faults.error)
        if faults.error_rate > 0 and self.dice.fails(faults.error_rate):
            raise ApiError(_fault_message(faults.error_code), faults.error_code)
        limit = self._validate(body, engine, len(prompt_ids), max_tokens)
        if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            # vLLM's engine check; -1 (the whole vocabulary) is over the cap too.
            asked = self.tokenizer.vocab_size if top_logprobs == -1 else top_logprobs
            raise _param_error(
                f"Requested sample logprobs of {asked}, which is greater than max allowed: "
                f"{MAX_TOP_LOGPROBS}",
                "logprobs",
                asked,
            )
        key = self._sampling_key(body)
        # The document (structured output or a tool call's arguments) is drawn from this seed.
        seed = splitmix64(context_hash(base_ids) ^ key)
        document: str | None = None
        tool_call: _ToolCall | None = None
        if tool is not None:
            chosen = tool.tools[pick_tool(len(tool.tools), seed)].function
            # A function without parameters takes an empty object, as OpenAI's do.
            parameters = chosen.parameters or {"type": "object", "properties": {}}
            document = self._document(parameters, seed, engine, param="tools")
            tool_call = _ToolCall(f"chatcmpl-tool-{uuid.uuid4().hex}", chosen.name, tool.choice)
        else:
            structured, schema = self._schema(body)
            if structured:
                document = self._document(schema, seed, engine, param="response_format")
        forced: list[int] | None = None
        if document is not None:
            rest = (
                document[len(partial) :] if partial and document.startswith(partial) else document
            )
            forced = self.tokenizer.encode(rest, add_special_tokens=False)
        sampler = TextSampler(prompt_ids, key, ignore_eos=body.ignore_eos, forced=forced)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        job = _Job(
            request=SimRequest(
                request_id,
                max_tokens=limit,
                prompt_token_ids=prompt_ids,
                sampler=sampler,
                ignore_eos=body.ignore_eos,
                cache_salt=body.cache_salt,
            ),
            model=engine.model.name,
            engine=engine,
            faults=faults,
            stop=[s for s in stops if s],
            tool_call=tool_call,
            logprobs=None if top_logprobs is None else TokenLogprobs(prompt_ids, key, top_logprobs),
        )
        if faults.latency_ms > 0:
            await asyncio.sleep(faults.latency_ms / 1000)
        if self.crashed:
            raise ConnectionDrop
        task, released = _task_xargs(body)
        if released is not None:
            # As TaskEndScheduler does on the release's arrival, before the request runs. The
            # client names the pool's first model, whichever model the task used: every
            # engine of this replica drops the task's own blocks.
            for model, blocks in self._task_blocks.items():
                ended = blocks.end(released)
                self.released_blocks += self.replica.engines[model].evict_first(ended)
        self._submit(job)
        if task is not None and job.request.block_hashes:
            tracked = self._task_blocks.get(engine.model.name)
            if tracked is None:
                limit = GIVEN_OUT_PER_BLOCK * engine.pool.num_blocks
                tracked = self._task_blocks[engine.model.name] = TaskBlocks(max_shared=limit)
            tracked.note(task, job.request.block_hashes)
        created = int(time.time())
        if body.stream:
            options = body.stream_options
            include_usage = bool(options and options.include_usage)
            # As in vLLM, per-chunk usage needs include_usage too.
            continuous = include_usage and bool(options and options.continuous_usage_stats)
            return StreamingResponse(
                self._sse(job, body.model or job.model, created, chat, include_usage, continuous),
                media_type="text/event-stream; charset=utf-8",
            )
        try:
            text: list[str] = []
            token_ids: list[int] = []
            last = _Delta("")
            async for delta in self._deltas(job):
                text.append(delta.text)
                token_ids += delta.token_ids
                last = delta
        finally:
            self._release(job)
        return JSONResponse(
            self._final_body(
                job, body.model or job.model, created, chat, "".join(text), last, token_ids
            )
        )

    def _document(
        self, schema: dict[str, Any] | None, seed: int, engine: EngineCore, *, param: str
    ) -> str:
        """The JSON document for a schema (`json_for_schema`); a schema it cannot serve is a 400.

        `param` names the request field the schema came from (`response_format`, `tools`).
        """
        size = _smallest_document(schema, engine.max_model_len, param)
        if size > _DOCUMENT_CONTEXTS * engine.max_model_len:
            # The document is built whole before it streams: one far larger than the
            # context would block the server (vLLM would stream it until max_tokens).
            raise ApiError(
                "the JSON schema cannot be used: its smallest document has over "
                f"{_DOCUMENT_CONTEXTS * engine.max_model_len} elements (items, properties, "
                f"16-character runs), far more than {engine.max_model_len} tokens of context "
                "can hold",
                param=param,
            )
        try:
            return json_for_schema(schema, seed)
        except Exception as exc:
            # The generator computes on the request's schema alone, so whatever stops it
            # (minItems "x", multipleOf 0.5 for an integer, nesting too deep) is the
            # request's fault: a 400 that says what, never a 500.
            detail = str(exc) if isinstance(exc, SchemaError) else f"{type(exc).__name__}: {exc}"
            raise ApiError(f"the JSON schema cannot be used: {detail}", param=param) from None

    async def _deltas(self, job: _Job) -> AsyncIterator[_Delta]:
        """The request's text as it is generated, with faults and stop strings applied."""
        faults = job.faults
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        tokenizer = self.tokenizer
        stops = job.stop
        hold = max((len(s) for s in stops), default=1) - 1
        text = ""
        emitted = 0
        sent = 0
        stalled = False
        pending: list[int] = []

        def taken() -> list[int]:
            # The tokens since the last delta go with the next one (logprobs follow them).
            nonlocal pending
            tokens, pending = pending, []
            return tokens

        while True:
            item = await job.queue.get()
            if item is _CRASH:
                raise ConnectionDrop
            tokens = item.tokens
            for position, token in enumerate(tokens):
                if faults.disconnect_after is not None and sent >= faults.disconnect_after:
                    raise ConnectionDrop
                if faults.crash_after is not None and sent >= faults.crash_after:
                    self.crash()
                    raise ConnectionDrop
                if faults.stall_after is not None and sent >= faults.stall_after and not stalled:
                    stalled = True
                    await _stall(faults.stall_ms)
                    if self.crashed:
                        raise ConnectionDrop
                sent += 1
                pending.append(token)
                if not tokenizer.is_special(token):
                    text += decoder.decode(tokenizer.token_bytes(token))
                last_token = position == len(tokens) - 1
                if stops:
                    found = _find_stop(text, stops, max(0, emitted - hold))
                    if found is not None:
                        index, stop = found
                        text = text[:index]
                        yield _Delta(text[emitted:], "stop", stop, sent, taken())
                        return
                finish = item.finish_reason if last_token else None
                if finish is not None:
                    text += decoder.decode(b"", final=True)
                    yield _Delta(text[emitted:], finish, tokens=sent, token_ids=taken())
                    return
                safe = len(text) - hold if stops else len(text)
                if safe > emitted:
                    yield _Delta(text[emitted:safe], tokens=sent, token_ids=taken())
                    emitted = safe
            if not tokens and item.finish_reason is not None:
                yield _Delta(text[emitted:], item.finish_reason, tokens=sent, token_ids=taken())
                return

    def _usage(self, job: _Job, *, streamed: bool = False) -> dict[str, Any]:
        request = job.request
        prompt = request.num_prompt_tokens
        completion = request.num_output_tokens
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
        }
        if self.settings.enable_prompt_tokens_details:
            cached = max(request.num_cached_tokens, 0)
            # vLLM's last stream chunk carries the short form of the details.
            usage["prompt_tokens_details"] = (
                {"cached_tokens": cached}
                if streamed
                else {
                    "cached_tokens": cached,
                    "created_cache_tokens": None,
                    "multimodal_tokens": None,
                }
            )
        if not streamed:
            usage["completion_tokens_details"] = None
        return usage

    def _final_body(
        self,
        job: _Job,
        model: str,
        created: int,
        chat: bool,
        text: str,
        last: _Delta,
        token_ids: list[int],
    ) -> dict[str, Any]:
        request_id = job.request.request_id
        usage = self._usage(job)
        common = {"service_tier": None, "system_fingerprint": FINGERPRINT, "usage": usage}
        if chat:
            message: dict[str, Any] = {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
            }
            call = job.tool_call
            if call is not None:
                # vLLM: the auto parser finds no text before the call; forced paths give "".
                message["content"] = None if call.choice == "auto" else ""
                message["tool_calls"] = [call.message(text)]
            message["reasoning"] = None
            return {
                "id": request_id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "logprobs": job.logprobs_body(token_ids),
                        "finish_reason": job.finish_reason(last.finish_reason),
                        "stop_reason": last.stop_reason,
                        "token_ids": None,
                        "routed_experts": None,
                    }
                ],
                **common,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "prompt_text": None,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": None,
            }
        return {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": last.finish_reason,
                    "stop_reason": last.stop_reason,
                    "token_ids": None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": None,
                    "routed_experts": None,
                }
            ],
            **common,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    async def _sse(
        self,
        job: _Job,
        model: str,
        created: int,
        chat: bool,
        include_usage: bool,
        continuous: bool,
    ) -> AsyncIterator[str]:
        request_id = job.request.request_id
        kind = "chat.completion.chunk" if chat else "text_completion"

        prompt_tokens = job.request.num_prompt_tokens

        def running_usage(sent: int) -> dict[str, Any] | None:
            if not continuous:
                return None
            return {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + sent,
                "completion_tokens": sent,
                "completion_tokens_details": None,
            }

        def chunk(
            choices: list[dict[str, Any]],
            usage: dict[str, Any] | None = None,
            **extra: Any,
        ) -> str:
            body: dict[str, Any] = {
                "id": request_id,
                "object": kind,
                "created": created,
                "model": model,
                "choices": choices,
            }
            if usage is not None:
                body["usage"] = usage
            body.update(extra)
            return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

        call = job.tool_call

        def choice(delta: _Delta) -> dict[str, Any]:
            if chat:
                message: dict[str, Any] = {"content": delta.text}
                if call is not None:
                    # The last delta (end of sequence) has no text: an empty delta, as vLLM's.
                    message = {"tool_calls": [call.piece(delta.text)]} if delta.text else {}
                item: dict[str, Any] = {
                    "index": 0,
                    "delta": message,
                    "logprobs": job.logprobs_body(delta.token_ids),
                    "finish_reason": job.finish_reason(delta.finish_reason),
                }
                if delta.finish_reason is not None:
                    item["stop_reason"] = delta.stop_reason
                item["token_ids"] = None
                return item
            return {
                "index": 0,
                "text": delta.text,
                "logprobs": None,
                "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason,
                "prompt_token_ids": None,
                "token_ids": None,
            }

        try:
            if chat:
                yield chunk(
                    [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    running_usage(0),
                    prompt_token_ids=None,
                    prompt_text=None,
                )
            named = call is None
            async for delta in self._deltas(job):
                if not named:
                    # Before the first piece of the arguments, a chunk that names the call
                    # (vLLM's parsers send it once they have read the function's name).
                    named = True
                    assert call is not None
                    header = {"index": 0, "delta": {"tool_calls": [call.header()]}}
                    yield chunk(
                        [{**header, "logprobs": None, "finish_reason": None}], running_usage(0)
                    )
                yield chunk([choice(delta)], running_usage(delta.tokens))
            if include_usage:
                yield chunk([], self._usage(job, streamed=True), system_fingerprint=FINGERPRINT)
            yield "data: [DONE]\n\n"
        finally:
            self._release(job)


def _task_xargs(body: SamplingBody) -> tuple[str | None, str | None]:
    """The task a call names (`kvflow_task`) and the task it releases (`kvflow_release`)."""
    xargs = (body.model_extra or {}).get("vllm_xargs")
    if not isinstance(xargs, dict):
        return None, None
    task, released = xargs.get("kvflow_task"), xargs.get("kvflow_release")
    return (
        task if isinstance(task, str) and task else None,
        released if isinstance(released, str) and released else None,
    )


async def _json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except RecursionError:
        raise ApiError(
            "the request body is JSON nested too deeply to read", error_type="Bad Request"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(
            f"1 validation error:\n  {{'type': 'json_invalid', 'loc': 'body.0', "
            f"'msg': 'JSON decode error', 'ctx': {{'error': {str(exc)!r}}}}}",
            param="body.0",
            error_type="Bad Request",
        ) from None


_Body = TypeVar("_Body", bound=BaseModel)


def _parse(model: type[_Body], data: Any) -> _Body:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    except ParameterError as exc:
        raise exc.api_error() from None


def _param_error(message: str, param: str, value: object) -> ApiError:
    # vLLM's parameter checks end their message with the parameter and the value.
    return ApiError(f"{message} (parameter={param}, value={value})", param=param)


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

MAX_CACHE_SALT_LENGTH = 128
"""The longest `cache_salt` vLLM takes."""

_DOCUMENT_CONTEXTS = 4
"""How many contexts' worth of elements a schema's smallest document may have."""

_SCHEMA_KEYS = ("items", "additionalProperties", "contains", "not", "if", "then", "else")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas")
_SIZE_KEYWORDS = (("minItems", 1), ("minProperties", 1), ("minLength", 16))
"""Keywords that force a size, and how many of their units make one element."""


def _smallest_document(schema: dict[str, Any] | None, limit: int, param: str) -> int:
    """A rough lower bound on the elements of a schema's smallest document.

    Sizes multiply down the nesting (`minItems` of an item with `minItems`) and through
    `$ref`s, each counted once. A size keyword that is not a whole number raises `ApiError`
    naming `param`, the request field the schema came from.
    """
    sizes: dict[str, int] = {}
    ceiling = (limit + 1) * _DOCUMENT_CONTEXTS

    def size(node: Any, depth: int) -> int:
        if not isinstance(node, dict) or depth > 64:
            return 1
        own = 1
        for keyword, per in _SIZE_KEYWORDS:
            value = node.get(keyword)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ApiError(
                    f"the JSON schema cannot be used: {keyword} must be a whole number, got "
                    f"{value!r}",
                    param=param,
                )
            own = max(own, value // per)
        inner = 1
        children: list[Any] = [node.get(k) for k in _SCHEMA_KEYS]
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                children += node[key]
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                children += node[key].values()
        for child in children:
            inner = max(inner, size(child, depth + 1))
        ref = node.get("$ref")
        if isinstance(ref, str):
            if ref not in sizes:
                sizes[ref] = 1  # a ref that loops back counts once
                sizes[ref] = size(_ref_target(schema, ref), depth + 1)
            inner = max(inner, sizes[ref])
        # Capped, so a deep schema of large sizes stays a small integer to compare.
        return min(own * inner, ceiling)

    return size(schema, 0)


def _ref_target(root: Any, ref: str) -> Any:
    """What a local `$ref` points at, or None (the generator reports a bad one)."""
    target = root
    for part in ref.lstrip("#").split("/"):
        if part:
            if not isinstance(target, dict):
                return None
            target = target.get(part.replace("~1", "/").replace("~0", "~"))
    return target


def _fault_message(status: int) -> str:
    return f"simulated fault: the server answered {status} ({FAULT_HEADER} or --fault-* flags)"


def _find_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, start)
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop)
    return best


async def _stall(milliseconds: float | None) -> None:
    if milliseconds is None:
        await asyncio.Event().wait()  # until the client gives up (the task is cancelled)
    else:
        await asyncio.sleep(milliseconds / 1000)


class _DropBoundary:
    """The outermost ASGI layer: turns `ConnectionDrop` into a cut connection, not a 500."""

    def __init__(self, app: ASGIApp, server: SimulatedVllm) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            if self.server.crashed:
                raise ConnectionDrop
            await self.app(scope, receive, tracking_send)
        except BaseException as exc:
            if not _is_drop(exc):
                raise
            if not started:
                # ASGI cannot close a socket; a status line and a cut body is what clients see.
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [(b"content-type", b"application/json")],
                    }
                )
            # Returning without the last body message makes uvicorn close the connection.


class _QuietIncomplete(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "without completing response" not in record.getMessage()


logging.getLogger("uvicorn.error").addFilter(_QuietIncomplete())


def _bound_socket(host: str, port: int) -> socket.socket:
    # Name the protocol: asyncio sets TCP_NODELAY on accepted connections only when the
    # socket says IPPROTO_TCP, and without it small responses wait for delayed ACKs (40 ms).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


class SimServer:
    """A simulated vLLM server on a background thread of this process.

    Port 0 (the default) takes a free port; `base_url` says which. A crash fault drops every
    connection and stops the server (the process survives); `SimProcess` exits for real.
    """

    def __init__(self, settings: ServerSettings, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.settings = settings
        self.host = host
        self._requested_port = port
        self.port = port
        self.sim: SimulatedVllm | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def base_url(self) -> str:
        """e.g. `http://127.0.0.1:41234` (no `/v1`)."""
        return f"http://{self.host}:{self.port}"

    @property
    def model(self) -> str:
        """The first model it serves."""
        return self.settings.models[0].name

    @property
    def block_size(self) -> int:
        """KV block size in tokens."""
        return self.settings.engine.block_size

    @property
    def max_model_len(self) -> int:
        """Context length of the first model."""
        return self.settings.engine.max_model_len or self.settings.models[0].context_length

    @property
    def running(self) -> bool:
        """Whether the server still listens (false once stopped or crashed and gone)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def crashed(self) -> bool:
        """Whether a crash fault hit it."""
        return self.sim is not None and self.sim.crashed

    def start(self, timeout: float = 15.0) -> Self:
        """Start serving; returns once the server accepts connections."""
        sock = _bound_socket(self.host, self._requested_port)
        self.port = sock.getsockname()[1]
        self.sim = SimulatedVllm(self.settings, on_crash=self._on_crash)
        config = uvicorn.Config(
            self.sim.asgi,
            lifespan="on",
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(config)
        server = self._server

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(server.serve(sockets=[sock]))
            finally:
                loop.close()
                sock.close()

        self._thread = threading.Thread(target=run, name=f"sim-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the simulated server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def _on_crash(self) -> None:
        loop = self._loop
        server = self._server
        if loop is not None and server is not None:
            # Let the dropped connections close before the listener goes.
            loop.call_later(0.05, setattr, server, "should_exit", True)

    def stop(self, timeout: float = 10.0) -> None:
        """Drop in-flight requests and stop the server (idempotent)."""
        server, loop, thread = self._server, self._loop, self._thread
        if server is not None and loop is not None and self.sim is not None and thread:
            if thread.is_alive():
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(self.sim.drop_all)
            server.should_exit = True
        if thread is not None:
            thread.join(timeout)
        self._thread = None

    def __enter__(self) -> Self:
        """Start serving, or take charge of the server `start()` already started."""
        return self if self.running else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


START_TRIES = 3
"""Starts of `kvflow sim serve` on a port `SimProcess` picked, before it gives up."""


class SimProcess:
    """`kvflow sim serve` as a child process (its own Python), for crash faults and demos.

    `args` are the CLI's options after `serve`, e.g. `["--gpu", "H100", "--model",
    "llama-3.2-1b"]`; `--port` is added. `preexec_fn` runs in the child before it execs
    (the embedded fleet uses it so that simulators die with the process that started them).
    `start()` launches and waits for `/health`; `spawn()` and `wait_ready()` split the two,
    so that several can be launched from one thread and waited for in others.
    """

    def __init__(
        self,
        args: Iterable[str],
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
        preexec_fn: Callable[[], None] | None = None,
    ) -> None:
        self.args = list(args)
        self.host = host
        self._picked_port = not port
        self.port = port or free_port(host)
        self.log_path = log_path
        self.env = env
        self.preexec_fn = preexec_fn
        self.process: subprocess.Popen[bytes] | None = None
        # Guards `process` between a restart on another port (in `wait_ready`, often on another
        # thread) and `stop()`: a process started after a stop would be nobody's to end.
        self._lock = threading.Lock()
        self._stopped = False

    @property
    def base_url(self) -> str:
        """e.g. `http://127.0.0.1:41234`."""
        return f"http://{self.host}:{self.port}"

    @property
    def returncode(self) -> int | None:
        """The exit status once the process ended (70 after a crash fault)."""
        return None if self.process is None else self.process.poll()

    def start(self, timeout: float = 30.0) -> Self:
        """Start the process and wait until `/health` answers."""
        return self.spawn().wait_ready(timeout)

    def spawn(self) -> Self:
        """Start the process without waiting for it to serve.

        Refused while the process this started is still running: the new one would take its
        place here, and the old one would outlive every `stop()`.
        """
        with self._lock:
            if self.process is not None and self.process.poll() is None:
                raise RuntimeError(
                    f"kvflow sim serve is already running on port {self.port} "
                    f"(pid {self.process.pid}); stop() it before starting it again"
                )
            self._stopped = False
            self._launch()
        return self

    def _launch(self) -> None:
        """Start `kvflow sim serve` on `self.port` (the caller holds `_lock`)."""
        command = [
            sys.executable,
            "-m",
            "kvflow.cli.sim",
            "serve",
            *self.args,
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]
        output = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.process = subprocess.Popen(
                command,
                stdout=output,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(self.env or {})},
                preexec_fn=self.preexec_fn,
            )
        finally:
            if self.log_path:
                output.close()  # type: ignore[union-attr]

    def wait_ready(self, timeout: float = 30.0) -> Self:
        """Wait until `/health` answers; stop the process if it does not within `timeout`.

        Where this picked the port, a process that exits at start is started again on another
        (`START_TRIES` in all): a port free when picked can be taken before the child binds
        it, by any socket of the machine (an outgoing connection's ephemeral port). Once
        `stop()` was called, nothing is started again: it raises instead.
        """
        for tries in range(1, START_TRIES + 1):
            code = self._wait_ready_once(timeout)
            if code is None:
                return self
            with self._lock:
                if self._stopped:
                    raise RuntimeError(f"kvflow sim serve was stopped (status {code}) at start")
                if not self._picked_port or tries == START_TRIES:
                    raise RuntimeError(
                        f"kvflow sim serve exited with status {code} at start"
                        + (f" ({tries} ports tried)" if self._picked_port else "")
                    )
                self.port = free_port(self.host)
                self._launch()
        raise AssertionError("unreachable")  # the loop returns or raises

    def _wait_ready_once(self, timeout: float) -> int | None:
        """None once `/health` answers; the exit status if the process ended first."""
        assert self.process is not None, "spawn() the process first"
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=1.0) as client:
            while True:
                code = self.process.poll()
                if code is not None:
                    return code
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return None
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"kvflow sim serve was not ready within {timeout:.0f} s")
                time.sleep(0.05)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the process to end; its exit status."""
        assert self.process is not None
        return self.process.wait(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` (idempotent).

        A `wait_ready` under way, on another thread, starts no other process after it.
        """
        with self._lock:
            self._stopped = True
            process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> Self:
        """Start the process, or take charge of the one `start()` or `spawn()` started.

        `with SimProcess(...).start() as sim:` is one process, stopped when the block ends.
        """
        if self.process is not None and self.process.poll() is None:
            return self.wait_ready()
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def crash_process() -> None:
    """The crash of `kvflow sim serve`: exit at once with status 70, no cleanup."""
    logging.shutdown()
    os._exit(CRASH_EXIT_CODE)

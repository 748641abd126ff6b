"""Engine answers that are wrong: each reaches the workflow as a typed error, billed right.

A small scripted server stands in for a broken vLLM replica: it answers
`/v1/chat/completions` with exactly the bytes a test gives it (a non-JSON page, a stream cut
mid-answer, usage that cannot be true, an error body with status 200...). A real GPU worker
serves the replica on the session's Temporal server, and a workflow calls it once, as the step
API does, so each test sees the error type, its retryability and its details where a workflow
sees them, and the attempt row the worker bills.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import timedelta
from decimal import Decimal
from typing import Any

from pydantic import BaseModel
from temporalio import workflow
from temporalio.client import Client
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.worker import Worker

with workflow.unsafe.imports_passed_through():
    import pytest
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    from kvflow.activities.errors import RETRYABLE_TYPES
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
    from kvflow.ports import free_port
    from kvflow.scheduler.builtin_tokenizer import Tokenizer as BuiltinTokenizer
    from kvflow.scheduler.fleet import Pool, TokenPrices
    from kvflow.workers.gpu_worker import GpuWorker

MODEL = "broken-engine-1b"
PROMPT = "Plan a three step research task."
PROMPT_TOKENS = 14
"""What the scripted engine says the prompt was (any count the prompt's size allows)."""
MAX_TOKENS = 16

# Prices high enough that a few tokens cost whole micro-dollars, so every bill is visible.
PRICES = TokenPrices(
    input_per_mtok_usd=Decimal("10"),
    cached_input_per_mtok_usd=Decimal("1"),
    output_per_mtok_usd=Decimal("30"),
)

# ---- the scripted engine ----------------------------------------------------------------------

Script = Callable[[], Response]
"""What the engine answers the next chat completion with."""


class CutStream(Exception):
    """Raised inside a streamed body: uvicorn drops the connection mid-response."""


class ScriptedEngine:
    """An OpenAI-compatible server whose chat answer is whatever `script` builds."""

    def __init__(self) -> None:
        self.script: Script = lambda: sse(*answer("ok"))
        self.bodies: list[dict[str, Any]] = []
        """The request bodies received, newest last."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        app = Starlette(
            routes=[
                Route("/health", lambda _: Response(status_code=200)),
                Route("/metrics", lambda _: PlainTextResponse("")),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
            ]
        )
        # A cut stream is an exception inside the app: keep uvicorn's traceback of it quiet.
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    async def _chat(self, request: Request) -> Response:
        self.bodies.append(json.loads(await request.body()))
        return self.script()

    def start(self) -> ScriptedEngine:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the scripted engine did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


def chunk(
    text: str | None = None, *, finish: str | None = None, usage: Any = None, role: bool = False
) -> dict[str, Any]:
    """One chunk of a streamed chat answer, as vLLM writes it."""
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text}
    body: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if usage is not None:
        body["usage"] = usage
    return body


def usage(prompt: Any = PROMPT_TOKENS, completion: Any = 0, cached: Any = None) -> dict[str, Any]:
    """A usage report; `cached` adds the details vLLM puts in the last one."""
    report: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion}
    if cached is not None:
        report["prompt_tokens_details"] = {"cached_tokens": cached}
    return report


def answer(*words: str, per_chunk_usage: bool = True, final: Any = "default") -> list[Any]:
    """A whole streamed answer of `words` (one token each), ending with `length`.

    With `per_chunk_usage` every chunk carries the running usage (`continuous_usage_stats`);
    `final` is the last chunk's usage ("default": the true one; None: no last chunk).
    """
    n = len(words)
    events: list[Any] = [chunk(role=True, usage=usage() if per_chunk_usage else None)]
    for i, word in enumerate(words, start=1):
        events.append(
            chunk(
                word,
                finish="length" if i == n else None,
                usage=usage(completion=i) if per_chunk_usage else None,
            )
        )
    if final == "default":
        final = usage(completion=n, cached=0)
    if final is not None:
        events.append({"id": "chatcmpl-1", "choices": [], "usage": final})
    return [*events, "[DONE]"]


def sse(*events: Any, cut: bool = False) -> StreamingResponse:
    """An event stream of `events` (dicts as JSON, strings as they are); `cut` drops it after."""

    async def body() -> AsyncIterator[bytes]:
        for event in events:
            data = event if isinstance(event, str) else json.dumps(event)
            yield f"data: {data}\n\n".encode()
        if cut:
            raise CutStream

    return StreamingResponse(body(), media_type="text/event-stream")


# ---- a workflow that calls the replica once ---------------------------------------------------


class Call(BaseModel):
    request: InferenceRequest
    task_queue: str


class CallOutcome(BaseModel):
    result: InferenceResult | None = None
    error_type: str | None = None
    non_retryable: bool | None = None
    message: str | None = None
    details: dict[str, Any] | None = None


@workflow.defn
class CallBrokenEngine:
    @workflow.run
    async def run(self, call: Call) -> CallOutcome:
        try:
            result = await workflow.execute_activity(
                INFER_ACTIVITY,
                call.request,
                result_type=InferenceResult,
                task_queue=call.task_queue,
                start_to_close_timeout=timedelta(seconds=60),
                heartbeat_timeout=timedelta(seconds=5),
                retry_policy=RetryPolicy(maximum_attempts=1),
            )
        except ActivityError as err:
            cause = err.cause
            if not isinstance(cause, ApplicationError):
                return CallOutcome(error_type=type(cause).__name__, message=str(cause))
            details = cause.details[0] if cause.details else None
            return CallOutcome(
                error_type=cause.type,
                non_retryable=cause.non_retryable,
                message=cause.message,
                details=details if isinstance(details, dict) else None,
            )
        return CallOutcome(result=result)


class RecordedAttempts:
    """The attempt rows the GPU worker writes (the ledger has its own tests)."""

    def __init__(self) -> None:
        self.rows: list[AttemptRecord] = []

    async def record_attempt(self, record: AttemptRecord) -> bool:
        self.rows.append(record)
        return True


WORKFLOW_QUEUE = f"engine-responses-{uuid.uuid4()}"


class BrokenReplica:
    """A GPU worker in front of the scripted engine, and the one call a test makes."""

    def __init__(self, client: Client, engine: ScriptedEngine) -> None:
        self.client = client
        self.engine = engine
        self.attempts = RecordedAttempts()
        pool = Pool(
            name=f"t{uuid.uuid4().hex[:12]}",
            gpu="H100",
            replicas=1,
            price_per_gpu_hour_usd=Decimal("2.00"),
            token_prices=PRICES,
            warm_models=[MODEL],
            max_concurrency=4,
        )
        binding = ReplicaBinding(pool=pool, index=0, base_url=engine.base_url)
        self.worker = GpuWorker(
            client, binding, ledger=self.attempts, heartbeat_interval_s=0.2, spool_dir=None
        )

    async def call(self, script: Script, *, tools: list[ToolSpec] | None = None) -> CallOutcome:
        self.engine.script = script
        request = InferenceRequest(
            model=MODEL,
            messages=[ChatMessage(role="user", content=PROMPT)],
            max_tokens=MAX_TOKENS,
            sampling=Sampling(seed=7),
            tools=tools,
            tenant="acme",
            step="test",
        )
        return await self.client.execute_workflow(
            CallBrokenEngine.run,
            Call(request=request, task_queue=self.worker.task_queue),
            id=f"broken-{uuid.uuid4()}",
            task_queue=WORKFLOW_QUEUE,
        )

    def estimated_prompt_tokens(self) -> int:
        """The built-in tokenizer's count of the prompt the engine was sent, tools included."""
        sent = self.engine.bodies[-1]
        return len(BuiltinTokenizer().encode_chat(sent["messages"], tools=sent.get("tools")))


@pytest.fixture(scope="module")
def engine() -> Iterator[ScriptedEngine]:
    scripted = ScriptedEngine().start()
    try:
        yield scripted
    finally:
        scripted.stop()


@pytest.fixture(scope="module")
async def workflow_worker(temporal_client: Client) -> AsyncIterator[None]:
    async with Worker(temporal_client, task_queue=WORKFLOW_QUEUE, workflows=[CallBrokenEngine]):
        yield


@pytest.fixture
async def replica(
    temporal_client: Client, engine: ScriptedEngine, workflow_worker: None
) -> AsyncIterator[BrokenReplica]:
    broken = BrokenReplica(temporal_client, engine)
    async with broken.worker:
        yield broken


def billed(
    replica: BrokenReplica,
    outcome: CallOutcome,
    *,
    error_type: str,
    prompt: int,
    completion: int,
    cached: int = 0,
) -> AttemptProgress:
    """Check the failure the workflow saw and the row the worker wrote; the failure's details.

    The failure's type and its retryability are what the step API acts on: retryable types
    are re-placed on another replica, the rest end the task.
    """
    assert outcome.error_type == error_type, outcome
    assert outcome.non_retryable is (error_type not in RETRYABLE_TYPES), outcome
    assert replica.worker.binding.name in (outcome.message or "")
    [row] = replica.attempts.rows
    assert row.outcome == "failed" and row.error_type == error_type
    assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (
        prompt,
        cached,
        completion,
    )
    assert row.cost_micros == PRICES.cost_micros(prompt, cached, completion)
    # The workflow's spend meter bills the attempt from the details: the same as the row.
    progress = AttemptProgress.from_details([outcome.details], source=error_type)
    assert progress is not None
    assert progress.usage.prompt_tokens == prompt
    assert progress.usage.completion_tokens == completion
    assert progress.cost_micros == row.cost_micros
    return progress


# ---- the tests --------------------------------------------------------------------------------


async def test_well_formed_stream_is_billed_its_reported_usage(replica: BrokenReplica):
    outcome = await replica.call(lambda: sse(*answer("Step", " one", ".")))
    result = outcome.result
    assert result is not None, outcome
    assert result.text == "Step one." and result.finish_reason == "length"
    assert result.usage.prompt_tokens == PROMPT_TOKENS and result.usage.completion_tokens == 3
    [row] = replica.attempts.rows
    assert row.outcome == "ok" and row.cost_micros == PRICES.cost_micros(PROMPT_TOKENS, 0, 3)
    # The engine was asked for usage in every chunk: what a cut stream bills from.
    options = replica.engine.bodies[-1]["stream_options"]
    assert options == {"include_usage": True, "continuous_usage_stats": True}


async def test_html_page_with_status_200_is_a_retryable_malformed_response(
    replica: BrokenReplica,
):
    page = "<html><body><h1>Welcome to nginx!</h1></body></html>"
    outcome = await replica.call(lambda: Response(page, media_type="text/html"))
    progress = billed(replica, outcome, error_type="MalformedResponse", prompt=0, completion=0)
    assert "text/html" in (outcome.message or "") and "nginx" in (outcome.message or "")
    assert progress.resumable() is None


async def test_plain_text_in_an_event_stream_is_a_malformed_response(replica: BrokenReplica):
    def garbage() -> Response:
        return Response("Internal Server Error\n", media_type="text/event-stream")

    outcome = await replica.call(garbage)
    billed(replica, outcome, error_type="MalformedResponse", prompt=0, completion=0)
    assert "Internal Server Error" in (outcome.message or "")


async def test_whole_json_answer_instead_of_a_stream_is_malformed_but_billed(
    replica: BrokenReplica,
):
    # A server that ignored stream=true did the work: bill what it reports, refuse the answer
    # (kvflow needs the stream to heartbeat and to resume).
    completion = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Step one."}}],
        "usage": usage(completion=3, cached=0),
    }
    outcome = await replica.call(lambda: JSONResponse(completion))
    billed(replica, outcome, error_type="MalformedResponse", prompt=PROMPT_TOKENS, completion=3)
    assert "stream" in (outcome.message or "")


@pytest.mark.parametrize(
    ("error", "error_type"),
    [
        # vLLM's body for a request that fails validation: retrying cannot help.
        (
            {
                "error": {
                    "message": "max_tokens must be at least 1",
                    "type": "BadRequestError",
                    "param": "max_tokens",
                    "code": 400,
                }
            },
            "InvalidRequest",
        ),
        # The older top-level form, and a code that is only a type name.
        (
            {
                "object": "error",
                "message": "This model's maximum context length is 1024 tokens",
                "type": "BadRequestError",
                "code": None,
            },
            "ContextLengthExceeded",
        ),
        (
            {"error": {"message": "engine dead", "type": "InternalServerError"}},
            "ReplicaServerError",
        ),
        ({"error": {"message": "too many requests", "code": "429"}}, "ReplicaOverloaded"),
        ({"error": "something broke"}, "ReplicaServerError"),
    ],
)
async def test_error_body_with_status_200_is_the_error_it_names(
    replica: BrokenReplica, error: dict[str, Any], error_type: str
):
    outcome = await replica.call(lambda: JSONResponse(error, status_code=200))
    billed(replica, outcome, error_type=error_type, prompt=0, completion=0)
    assert "200 answer" in (outcome.message or "")


async def test_error_event_mid_stream_keeps_the_partial_output_and_its_bill(
    replica: BrokenReplica,
):
    events = answer("Step", " one", " two")[:3]  # the role chunk and two words, no finish
    failure = {"error": {"message": "CUDA error: an illegal memory access", "code": 500}}
    outcome = await replica.call(lambda: sse(*events, failure))
    progress = billed(
        replica, outcome, error_type="ReplicaServerError", prompt=PROMPT_TOKENS, completion=2
    )
    checkpoint = progress.resumable()
    assert checkpoint is not None and checkpoint.text == "Step one"


async def test_event_with_invalid_json_is_malformed_and_resumable(replica: BrokenReplica):
    events = answer("Step", " one", " two")[:3]
    outcome = await replica.call(lambda: sse(*events, '{"choices": [{"delta": {"cont'))
    progress = billed(
        replica, outcome, error_type="MalformedResponse", prompt=PROMPT_TOKENS, completion=2
    )
    assert "not a JSON object" in (outcome.message or "")
    checkpoint = progress.resumable()
    assert checkpoint is not None and checkpoint.text == "Step one"


@pytest.mark.parametrize(
    "bad_chunk",
    [
        "[1, 2, 3]",
        {"choices": {"delta": "x"}},
        {"choices": ["x"]},
        {"choices": [{"delta": ["x"]}]},
        {"choices": [{"delta": {"content": 42}}]},
        {"choices": [{"delta": {"content": "x"}, "finish_reason": 1}]},
    ],
)
async def test_chunk_of_the_wrong_shape_is_malformed(replica: BrokenReplica, bad_chunk: Any):
    events = answer("Step", " one")[:2]
    outcome = await replica.call(lambda: sse(*events, bad_chunk))
    billed(replica, outcome, error_type="MalformedResponse", prompt=PROMPT_TOKENS, completion=1)


async def test_stream_cut_mid_answer_bills_the_last_usage_and_resumes(replica: BrokenReplica):
    events = answer("Step", " one", " two", " three")[:4]
    outcome = await replica.call(lambda: sse(*events, cut=True))
    progress = billed(replica, outcome, error_type="StreamCut", prompt=PROMPT_TOKENS, completion=3)
    checkpoint = progress.resumable()
    assert checkpoint is not None and checkpoint.text == "Step one two"
    assert checkpoint.completion_tokens == 3


async def test_stream_cut_without_any_usage_bills_the_prompt_it_answered(replica: BrokenReplica):
    # An engine that reports usage only at the end, cut before it: the prompt was processed
    # (a token came back) and its size is estimated; the output is the chunks received.
    events = answer("Step", " one", " two", per_chunk_usage=False)[:3]
    outcome = await replica.call(lambda: sse(*events, cut=True))
    billed(
        replica,
        outcome,
        error_type="StreamCut",
        prompt=replica.estimated_prompt_tokens(),
        completion=2,
    )


async def test_a_prompt_whose_size_is_estimated_counts_its_tools(replica: BrokenReplica):
    # The engine renders the tools into the prompt, so they are billed as prompt tokens.
    tools = [
        ToolSpec(
            name="read_file",
            description="Read a file of the project.",
            parameters={"type": "object", "properties": {"path": {"type": "string"}}},
        )
    ]
    events = answer("Step", " one", " two", per_chunk_usage=False)[:3]
    outcome = await replica.call(lambda: sse(*events, cut=True), tools=tools)
    sent = replica.engine.bodies[-1]
    assert sent["tools"] == [tool.to_api() for tool in tools]
    estimated = replica.estimated_prompt_tokens()
    assert estimated > len(BuiltinTokenizer().encode_chat(sent["messages"])) + 10
    billed(replica, outcome, error_type="StreamCut", prompt=estimated, completion=2)


async def test_stream_cut_before_any_chunk_bills_nothing(replica: BrokenReplica):
    outcome = await replica.call(lambda: sse(cut=True))
    billed(replica, outcome, error_type="StreamCut", prompt=0, completion=0)


async def test_answer_without_usage_is_invalid_billed_from_the_stream_and_not_resumed(
    replica: BrokenReplica,
):
    events = answer("Step", " one", ".", per_chunk_usage=False, final=None)
    outcome = await replica.call(lambda: sse(*events))
    progress = billed(
        replica,
        outcome,
        error_type="InvalidUsage",
        prompt=replica.estimated_prompt_tokens(),
        completion=3,
    )
    assert "without usage" in (outcome.message or "")
    # An answer that cannot be billed is decoded again elsewhere, not continued.
    assert progress.resumable() is None


@pytest.mark.parametrize(
    ("final", "problem"),
    [
        (usage(prompt=-5, completion=3), "prompt_tokens is -5"),
        (usage(completion=3.5), "completion_tokens is 3.5"),
        (usage(prompt="14", completion=3), 'prompt_tokens is "14"'),
        (usage(prompt=True, completion=3), "prompt_tokens is true"),
        ({"completion_tokens": 3}, "prompt_tokens is null"),
        ([14, 3], "usage is not an object"),
        (usage(completion=3, cached=-1), "cached_tokens is -1"),
        (usage(completion=3, cached=PROMPT_TOKENS + 1), "cached_tokens 15 > prompt_tokens 14"),
        (usage(completion=MAX_TOKENS + 1), "> the 16 max_tokens"),
        # Far more tokens than the bytes sent, or far fewer: another (or a cut) prompt.
        (usage(prompt=10**9, completion=3), "prompt_tokens 1000000000 for a prompt"),
        (usage(prompt=0, completion=3), "prompt_tokens 0 for a prompt"),
    ],
)
async def test_usage_that_cannot_be_true_is_invalid_and_billed_from_the_stream(
    replica: BrokenReplica, final: Any, problem: str
):
    events = answer("Step", " one", ".", per_chunk_usage=False, final=final)
    outcome = await replica.call(lambda: sse(*events))
    progress = billed(
        replica,
        outcome,
        error_type="InvalidUsage",
        prompt=replica.estimated_prompt_tokens(),
        completion=3,
    )
    assert problem in (outcome.message or ""), outcome.message
    assert progress.resumable() is None


async def test_prompt_count_that_changes_mid_stream_keeps_the_last_valid_report(
    replica: BrokenReplica,
):
    # The running reports agreed; the last one claims another prompt. Billed: what the
    # engine reported while it could be believed.
    events = answer("Step", " one", ".", final=usage(prompt=PROMPT_TOKENS * 3, completion=3))
    outcome = await replica.call(lambda: sse(*events))
    billed(replica, outcome, error_type="InvalidUsage", prompt=PROMPT_TOKENS, completion=3)
    assert "prompt_tokens changed from 14 to 42" in (outcome.message or "")


@pytest.mark.parametrize(
    ("status", "body", "error_type"),
    [
        (408, {"error": {"message": "request timed out", "code": 408}}, "ReplicaTimeout"),
        (429, {"error": {"message": "rate limited", "code": 429}}, "ReplicaOverloaded"),
        (500, {"error": {"message": "internal error", "code": 500}}, "ReplicaServerError"),
        (502, "<html>502 Bad Gateway</html>", "ReplicaServerError"),
        (503, "", "ReplicaServerError"),
        (400, {"error": {"message": "temperature must be >= 0", "code": 400}}, "InvalidRequest"),
    ],
)
async def test_http_error_status_is_typed_and_bills_nothing(
    replica: BrokenReplica, status: int, body: Any, error_type: str
):
    def answer_with_status() -> Response:
        if isinstance(body, str):
            return Response(body, status_code=status, media_type="text/html")
        return JSONResponse(body, status_code=status)

    outcome = await replica.call(answer_with_status)
    billed(replica, outcome, error_type=error_type, prompt=0, completion=0)
    assert f"HTTP {status}" in (outcome.message or "")


async def test_huge_error_body_is_read_only_in_part(replica: BrokenReplica):
    # A broken proxy may answer megabytes; the worker reads a bounded prefix for the message.
    page = "x" * (8 * 1024 * 1024)
    outcome = await replica.call(lambda: Response(page, status_code=502, media_type="text/plain"))
    billed(replica, outcome, error_type="ReplicaServerError", prompt=0, completion=0)
    assert len(outcome.message or "") < 1000

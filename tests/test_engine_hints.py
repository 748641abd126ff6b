"""What a call tells the endpoint in front of the engine: vLLM, NVIDIA Dynamo or llm-d.

A small OpenAI-compatible server records every request it gets (path, headers, body) and answers
with a well-formed stream, and the inference activity calls it as a GPU worker does, once per
kind of endpoint. Each test pins the exact body and the scheduling headers that went over the
wire: the engine priority for vLLM with priority scheduling and nothing for vLLM without it,
`nvext.agent_hints` and the session header for Dynamo, the InferenceObjective and fairness
headers for llm-d. The fleet file's side (what each kind accepts) is checked at the end.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from temporalio.testing import ActivityEnvironment

from kvflow.activities.context_store import DirectoryContextStore
from kvflow.activities.inference import InferenceActivities, ReplicaBinding
from kvflow.activities.wire import (
    ChatMessage,
    Checkpoint,
    InferenceRequest,
    InferenceResult,
)
from kvflow.ports import free_port
from kvflow.scheduler.blocks import tenant_cache_salt
from kvflow.scheduler.fleet import Fleet, Pool, TokenPrices
from kvflow.scheduler.placement import (
    TIER_PRIORITY_SPAN,
    Placement,
    PlacementRequest,
    engine_priority,
)
from kvflow.scheduler.task_end import ReleaseTarget, TaskEndRelease
from kvflow.workers.config import FleetConfigError, load_fleet
from kvflow.workers.control_plane import ControlPlane
from tests.fleets import one_pool_fleet

pytestmark = pytest.mark.timeout(60)

MODEL = "hinted-1b"
PROMPT = "Plan a three step research task."
MAX_TOKENS = 16
WORKFLOW_ID = "research-42"
STARTED_AT = 1_765_000_000.25
"""When the call's task began (POSIX seconds): part of its engine priority."""
PRIORITY = engine_priority(2, STARTED_AT)
"""A tier-2 call's engine priority, as the scheduler computes it: 2·10¹³ + start in ms."""
HINT_HEADERS = ("x-dynamo-", "x-gateway-", "x-session-")
"""Prefixes of every header a kind of endpoint reads for scheduling."""

BASE_BODY: dict[str, Any] = {
    "model": MODEL,
    "max_tokens": MAX_TOKENS,
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "temperature": 0.0,
    "top_p": 1.0,
    "messages": [{"role": "user", "content": PROMPT}],
    "cache_salt": tenant_cache_salt("default", "acme"),
}
"""The body every kind gets, before what the kind adds (the salt of acme's prefix cache)."""


# ---- a server that records what it is sent ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Received:
    """One request as the server got it."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]

    def hint_headers(self) -> dict[str, str]:
        """The headers an endpoint's scheduler reads (lower-case names)."""
        return {k: v for k, v in self.headers.items() if k.startswith(HINT_HEADERS)}


class RecordingEngine:
    """An OpenAI-compatible server that answers every chat call "ok" and keeps the request."""

    def __init__(self) -> None:
        self.received: list[Received] = []
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/completions", self._completion, methods=["POST"]),
            ]
        )
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    async def _record(self, request: Request) -> None:
        self.received.append(
            Received(
                path=request.url.path,
                headers={k.lower(): v for k, v in request.headers.items()},
                body=json.loads(await request.body()),
            )
        )

    async def _chat(self, request: Request) -> Response:
        await self._record(request)
        return StreamingResponse(_answer(), media_type="text/event-stream")

    async def _completion(self, request: Request) -> Response:
        await self._record(request)
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        answer = {"id": "r1", "choices": [{"index": 0, "text": "o"}], "usage": usage}
        return Response(json.dumps(answer), media_type="application/json")

    def start(self) -> RecordingEngine:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the recording engine did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


async def _answer() -> AsyncIterator[bytes]:
    """A two-token streamed answer with usage in the last chunk, as vLLM writes it."""
    chunks: list[Any] = [
        {"id": "c1", "model": MODEL, "choices": [{"index": 0, "delta": {"content": "o"}}]},
        {
            "id": "c1",
            "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": "k"}, "finish_reason": "stop"}],
        },
        {"id": "c1", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}},
        "[DONE]",
    ]
    for event in chunks:
        data = event if isinstance(event, str) else json.dumps(event)
        yield f"data: {data}\n\n".encode()


@pytest.fixture(scope="module")
def engine() -> Iterator[RecordingEngine]:
    recording = RecordingEngine().start()
    try:
        yield recording
    finally:
        recording.stop()


def pool(**settings: Any) -> Pool:
    """A one-replica pool of `MODEL` with the endpoint `settings` under test."""
    return Pool(
        name="hinted",
        gpu="H100",
        replicas=1,
        price_per_gpu_hour_usd=Decimal("2.00"),
        token_prices=TokenPrices.per_mtok("0.20", "0.02", "0.60"),
        warm_models=[MODEL],
        **settings,
    )


def request(**changes: Any) -> InferenceRequest:
    """A tier-2 chat call of tenant acme, with `changes`."""
    fields: dict[str, Any] = {
        "model": MODEL,
        "messages": [ChatMessage(role="user", content=PROMPT)],
        "max_tokens": MAX_TOKENS,
        "tenant": "acme",
        "priority": PRIORITY,
    }
    return InferenceRequest(**(fields | changes))


async def sent(
    engine: RecordingEngine,
    endpoint: Pool,
    call: InferenceRequest,
    tmp_path: Path,
    *,
    workflow_id: str | None = WORKFLOW_ID,
) -> Received:
    """What the inference activity sent `engine` for `call` on a replica of `endpoint`."""
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, workflow_id=workflow_id)
    binding = ReplicaBinding(pool=endpoint, index=0, base_url=engine.base_url)
    before = len(engine.received)
    async with httpx.AsyncClient(timeout=10) as http:
        activities = InferenceActivities(
            binding, http, store=DirectoryContextStore(tmp_path / "context")
        )
        result = await env.run(activities.infer, call)
    assert isinstance(result, InferenceResult) and result.text.endswith("ok")
    [received] = engine.received[before:]
    assert received.path == "/v1/chat/completions"
    return received


# ---- what each kind of endpoint gets ----------------------------------------------------------


async def test_plain_vllm_gets_no_priority(engine: RecordingEngine, tmp_path: Path) -> None:
    # vLLM without `--scheduling-policy priority` has no use for it (and is documented to
    # refuse it), so the default pool sends exactly the OpenAI body and no scheduling header.
    received = await sent(engine, pool(), request(), tmp_path)
    assert received.body == BASE_BODY
    assert "priority" not in received.body
    assert received.hint_headers() == {}


async def test_vllm_with_priority_scheduling_gets_the_engine_priority(
    engine: RecordingEngine, tmp_path: Path
) -> None:
    received = await sent(engine, pool(priority_scheduling=True), request(), tmp_path)
    assert received.body == {**BASE_BODY, "priority": 2 * 10**13 + 1_765_000_000_250}
    assert received.hint_headers() == {}


async def test_vllm_with_priority_scheduling_leaves_out_a_missing_priority(
    engine: RecordingEngine, tmp_path: Path
) -> None:
    # A call placed without a priority sends none: vLLM's default 0 then applies.
    received = await sent(engine, pool(priority_scheduling=True), request(priority=None), tmp_path)
    assert received.body == BASE_BODY


@pytest.mark.parametrize("kind", ["vllm", "llm-d"])
async def test_deadline_pause_sends_the_steps_deadline_for_kvflows_vllm_scheduler(
    kind: str, engine: RecordingEngine, tmp_path: Path
) -> None:
    # What kvflow_vllm.scheduler.DeadlinePauseScheduler reads from SamplingParams.extra_args.
    step_deadline = datetime(2026, 1, 2, 3, 4, 5, 250_000, tzinfo=UTC)
    endpoint = pool(endpoint_kind=kind, priority_scheduling=True, deadline_pause=True)
    received = await sent(engine, endpoint, request(step_deadline=step_deadline), tmp_path)
    assert received.body["priority"] == PRIORITY
    assert received.body["vllm_xargs"] == {
        "kvflow_deadline": step_deadline.timestamp(),
        "kvflow_priority_span": TIER_PRIORITY_SPAN,
    }
    # A call without a step objective, or a pool whose engines do not pause, sends none.
    plain = await sent(engine, endpoint, request(), tmp_path)
    assert "vllm_xargs" not in plain.body
    unpaused = pool(endpoint_kind=kind, priority_scheduling=True)
    assert (
        "vllm_xargs"
        not in (await sent(engine, unpaused, request(step_deadline=step_deadline), tmp_path)).body
    )


async def test_task_end_release_names_the_task_in_every_call(
    engine: RecordingEngine, tmp_path: Path
) -> None:
    # What kvflow_vllm.scheduler.TaskEndScheduler reads to note the task's KV blocks.
    releasing = pool(task_end_release=True)
    received = await sent(engine, releasing, request(), tmp_path)
    assert received.body == {**BASE_BODY, "vllm_xargs": {"kvflow_task": WORKFLOW_ID}}
    # Beside a step's deadline, in the same object; a pool without it names no task.
    step_deadline = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    both = pool(task_end_release=True, priority_scheduling=True, deadline_pause=True)
    received = await sent(engine, both, request(step_deadline=step_deadline), tmp_path)
    assert received.body["vllm_xargs"] == {
        "kvflow_deadline": step_deadline.timestamp(),
        "kvflow_priority_span": TIER_PRIORITY_SPAN,
        "kvflow_task": WORKFLOW_ID,
    }
    assert "vllm_xargs" not in (await sent(engine, pool(), request(), tmp_path)).body


async def _no_scrape() -> None:
    """The recording engines serve no metrics; placement needs none."""


def releasing_control_plane(endpoints: dict[str, str]) -> ControlPlane:
    """A control plane over one pool of `endpoints` with `task_end_release`, never scraping."""
    fleet = one_pool_fleet(MODEL, replicas=len(endpoints)).model_dump()
    fleet["pools"][0]["task_end_release"] = True
    control = ControlPlane(Fleet.model_validate(fleet), endpoints=endpoints)
    control.scraper.scrape_once = _no_scrape  # type: ignore[method-assign,assignment]
    return control


def place_task(control: ControlPlane, workflow_id: str, exclude: list[str] | None = None) -> str:
    """Place one call of the task `workflow_id`; the replica it went to."""
    call = PlacementRequest(
        model=MODEL,
        prompt_tokens=100,
        max_output_tokens=10,
        tenant="acme",
        workflow_id=workflow_id,
        exclude=exclude or [],
    )
    placed = control.scheduler.place(call)
    assert isinstance(placed, Placement), placed
    return placed.replica


async def test_a_tasks_end_is_released_on_the_engine_of_its_last_call(
    engine: RecordingEngine,
) -> None:
    """The control plane's `end_task` sends the release to the replica that served the task."""
    other = RecordingEngine().start()
    try:
        control = releasing_control_plane({"cpu/0": other.base_url, "cpu/1": engine.base_url})
        async with control:
            assert place_task(control, WORKFLOW_ID, exclude=["cpu/0"]) == "cpu/1"
            before = len(engine.received)
            await control.activities.end_task(WORKFLOW_ID)
            # A task this scheduler never placed is no one's to release.
            await control.activities.end_task("never-placed")
            await control.releases.drain()
            [release] = engine.received[before:]
            assert release.path == "/v1/completions"
            assert release.body == {
                "model": MODEL,
                "prompt": [0],
                "max_tokens": 1,
                "vllm_xargs": {"kvflow_release": WORKFLOW_ID},
            }
            assert other.received == []
            assert (control.releases.sent, control.releases.failed) == (1, 0)
    finally:
        other.stop()


async def test_a_task_whose_replica_is_down_sends_no_release(engine: RecordingEngine) -> None:
    """A replica marked down lost its cache with it: there is nothing left to release."""
    control = releasing_control_plane({"cpu/0": engine.base_url})
    async with control:
        for workflow_id in ("ends-while-down", "ends-when-back"):
            place_task(control, workflow_id)
        before = len(engine.received)
        control.scheduler.set_replica_up("cpu/0", False)
        await control.activities.end_task("ends-while-down")
        await control.releases.drain()
        assert engine.received[before:] == []
        control.scheduler.set_replica_up("cpu/0", True)
        await control.activities.end_task("ends-when-back")
        await control.releases.drain()
        assert len(engine.received[before:]) == 1
        assert (control.releases.sent, control.releases.failed) == (1, 0)


async def test_a_release_the_engine_cannot_take_is_logged_and_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An engine that is down costs the release, not the task: one warning, no exception."""
    releases = TaskEndRelease({"cpu/0": ReleaseTarget(f"http://127.0.0.1:{free_port()}", MODEL)})
    assert releases.release(WORKFLOW_ID, "cpu/0")
    assert not releases.release(WORKFLOW_ID, "cpu/9")  # takes no releases
    await releases.aclose()
    assert (releases.sent, releases.failed) == (0, 1)
    assert f"could not tell cpu/0 that task {WORKFLOW_ID} ended" in caplog.text


def test_a_pool_without_task_end_release_sends_nothing_at_a_tasks_end() -> None:
    control = ControlPlane(one_pool_fleet(MODEL), endpoints={"cpu/0": "http://127.0.0.1:9"})
    assert control.releases.targets == {}
    assert control.activities.on_task_end is None


async def test_dynamo_gets_agent_hints_and_the_session_header(
    engine: RecordingEngine, tmp_path: Path
) -> None:
    received = await sent(engine, pool(endpoint_kind="dynamo"), request(), tmp_path)
    # Dynamo's priority is higher-first: tier 2 of 5 is 4, for the router's soft priority and
    # for its strict queue tier; osl is the output the call asks for.
    hints = {"priority": 4, "strict_priority": 4, "osl": MAX_TOKENS}
    assert received.body == {**BASE_BODY, "nvext": {"agent_hints": hints}}
    assert received.hint_headers() == {"x-dynamo-session-id": WORKFLOW_ID}


@pytest.mark.parametrize(("tier", "urgency"), [(1, 5), (3, 3), (5, 1)])
async def test_dynamo_priority_runs_from_5_for_tier_1_to_1_for_tier_5(
    engine: RecordingEngine, tmp_path: Path, tier: int, urgency: int
) -> None:
    call = request(priority=engine_priority(tier, STARTED_AT))
    received = await sent(engine, pool(endpoint_kind="dynamo"), call, tmp_path)
    hints = received.body["nvext"]["agent_hints"]
    assert (hints["priority"], hints["strict_priority"]) == (urgency, urgency)


async def test_dynamo_osl_is_what_a_resumed_call_still_asks_for(
    engine: RecordingEngine, tmp_path: Path
) -> None:
    # A call resumed after 5 tokens asks for the 11 it still needs, and expects that many.
    call = request(checkpoint=Checkpoint(text="Step one:", completion_tokens=5), priority=None)
    received = await sent(engine, pool(endpoint_kind="dynamo"), call, tmp_path)
    assert received.body["max_tokens"] == MAX_TOKENS - 5
    assert received.body["nvext"] == {"agent_hints": {"osl": MAX_TOKENS - 5}}


async def test_dynamo_gets_no_session_outside_a_workflow(
    engine: RecordingEngine, tmp_path: Path
) -> None:
    received = await sent(
        engine, pool(endpoint_kind="dynamo"), request(), tmp_path, workflow_id=None
    )
    assert received.hint_headers() == {}


async def test_a_session_id_http_cannot_carry_is_percent_encoded(
    engine: RecordingEngine, tmp_path: Path
) -> None:
    # A workflow id may hold anything; a header value may not (a line break would fail the
    # call before it is sent). The same id always encodes the same way.
    odd = "résumé\nrun 7"
    received = await sent(
        engine, pool(endpoint_kind="dynamo"), request(), tmp_path, workflow_id=odd
    )
    assert received.hint_headers() == {"x-dynamo-session-id": "r%C3%A9sum%C3%A9%0Arun%207"}


async def test_llm_d_gets_the_tier_objective_and_the_tenant_as_fairness_id(
    engine: RecordingEngine, tmp_path: Path
) -> None:
    received = await sent(engine, pool(endpoint_kind="llm-d"), request(), tmp_path)
    assert received.body == BASE_BODY
    assert received.hint_headers() == {
        "x-gateway-inference-objective": "kvflow-tier-2",
        "x-gateway-inference-fairness-id": "acme",
    }


async def test_llm_d_objectives_are_the_pools_and_vllm_behind_it_may_get_the_priority(
    engine: RecordingEngine, tmp_path: Path
) -> None:
    objectives = ["critical", "interactive", "standard", "batch", "sheddable"]
    endpoint = pool(
        endpoint_kind="llm-d", inference_objectives=objectives, priority_scheduling=True
    )
    received = await sent(engine, endpoint, request(tenant="globex"), tmp_path)
    globex_salt = tenant_cache_salt("default", "globex")
    assert received.body == {**BASE_BODY, "priority": PRIORITY, "cache_salt": globex_salt}
    assert received.hint_headers() == {
        "x-gateway-inference-objective": "interactive",
        "x-gateway-inference-fairness-id": "globex",
    }


async def test_llm_d_without_a_priority_names_no_objective(
    engine: RecordingEngine, tmp_path: Path
) -> None:
    # The gateway then serves the call under its default objective (priority 0).
    received = await sent(engine, pool(endpoint_kind="llm-d"), request(priority=None), tmp_path)
    assert received.hint_headers() == {"x-gateway-inference-fairness-id": "acme"}


# ---- the fleet file ---------------------------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parent.parent / "fleet.toml"
H100 = 'name = "h100"\n'


def fleet_with(h100_settings: str, tmp_path: Path) -> Pool:
    """The example fleet's h100 pool with `h100_settings` (TOML lines) added."""
    text = EXAMPLE.read_text()
    assert H100 in text
    path = tmp_path / "fleet.toml"
    path.write_text(text.replace(H100, H100 + h100_settings, 1))
    return load_fleet(path).pool("h100")


def test_a_pool_is_plain_vllm_unless_the_file_says_otherwise(tmp_path: Path) -> None:
    h100 = fleet_with("", tmp_path)
    assert (h100.endpoint_kind, h100.priority_scheduling) == ("vllm", False)
    assert h100.inference_objectives == [f"kvflow-tier-{t}" for t in range(1, 6)]


def test_the_fleet_file_names_the_endpoint_kind_and_what_it_takes(tmp_path: Path) -> None:
    llm_d = fleet_with(
        'endpoint_kind = "llm-d"\npriority_scheduling = true\n'
        'inference_objectives = ["a", "b", "c", "d", "e.f"]\n',
        tmp_path,
    )
    assert (llm_d.endpoint_kind, llm_d.priority_scheduling) == ("llm-d", True)
    assert llm_d.inference_objectives == ["a", "b", "c", "d", "e.f"]
    assert fleet_with('endpoint_kind = "dynamo"\n', tmp_path).endpoint_kind == "dynamo"


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ('endpoint_kind = "sglang"\n', "'vllm', 'dynamo' or 'llm-d'"),
        ('endpoint_kind = "dynamo"\npriority_scheduling = true\n', "Dynamo takes the priority"),
        ("deadline_pause = true\n", "deadline_pause needs vLLM engines scheduling by priority"),
        (
            'endpoint_kind = "dynamo"\ndeadline_pause = true\n',
            "set priority_scheduling = true",
        ),
        ('inference_objectives = ["a", "b", "c", "d", "e"]\n', "only to an llm-d gateway"),
        (
            'endpoint_kind = "llm-d"\ntask_end_release = true\n',
            "task_end_release needs each replica's own vLLM server",
        ),
        (
            'endpoint_kind = "llm-d"\ninference_objectives = ["a", "b"]\n',
            "at least 5 items",
        ),
        (
            'endpoint_kind = "llm-d"\ninference_objectives = ["a", "b", "c", "d", "Tier 5"]\n',
            "should match pattern",
        ),
    ],
)
def test_settings_an_endpoint_kind_does_not_take_are_refused(
    settings: str, words: str, tmp_path: Path
) -> None:
    with pytest.raises(FleetConfigError) as caught:
        fleet_with(settings, tmp_path)
    messages = [str(p) for p in caught.value.problems]
    assert any(words in m and "pools[1]" in m for m in messages), messages

"""Real vLLM honours the engine priority kvflow sends, and only under priority scheduling.

Two real vLLM CPU servers run side by side, each admitting one request at a time
(`--max-num-seqs 1`): one with `--scheduling-policy priority`, one with vLLM's default fcfs.
On each, the engine is paused (vLLM's `/pause?mode=keep`, served in its dev mode), three tier-3
calls and then one tier-1 call are sent through the inference activity (kvflow's own wire) so
that they queue in that order, and the engine is resumed: it then takes them one by one, each
to its end. The order it took them in is read from the engine itself, from its KV-cache events
(the first block of each call's prompt is stored when the call is admitted), so neither this
process's pace nor the shared machine's load can reorder what is observed.

What vLLM 0.32 does, as pinned here: under priority scheduling the tier-1 call, sent last, runs
first, and the tier-3 calls follow oldest task first: vLLM orders its queue by
(priority, arrival), lower first, and kvflow's priorities (tier · 10¹³ + the task's start in
milliseconds) are fine for it. Under fcfs vLLM accepts the very same `priority` field (HTTP
200, although its API reference says a non-zero priority is refused without priority
scheduling) and ignores it: the calls run in arrival order. kvflow sends the field only to
pools that say their engines schedule by priority (`Pool.priority_scheduling`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
import zmq
import zmq.asyncio
from temporalio.testing import ActivityEnvironment

from kvflow.activities.context_store import DirectoryContextStore
from kvflow.activities.inference import InferenceActivities, ReplicaBinding
from kvflow.activities.wire import ChatMessage, InferenceRequest, InferenceResult, Sampling
from kvflow.scheduler.fleet import Pool, TokenPrices
from kvflow.scheduler.kv_events import END_OF_REPLAY, decode_event_batch
from kvflow.scheduler.placement import engine_priority
from kvflow.scheduler.prefix_index import BlockStored
from tests.fixtures_vllm import (
    BLOCK_SIZE,
    SERVED_MODEL_NAME,
    VllmServedModel,
    early_vllm,
    served_model,
    tiny_server,
    vllm_servers,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

ONE_AT_A_TIME = ["--max-num-seqs", "1"]
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}
"""Serves `/pause` and `/resume`."""
OUTPUT_TOKENS = 40
SEND_GAP_S = 0.5
"""Between two queued calls: the paused server, idle otherwise, takes each in within it, so the
calls arrive in the order they are sent."""
TASK_START = 1_765_000_000.0
"""When the calls' tasks began (POSIX seconds); each later call's task began a bit later."""
FILLER = " ".join(f"Section {k} covers topic {7 * k} in depth." for k in range(30))
"""Makes each queued call's prompt longer than a KV block, so admitting it stores a block."""
CALL_NAME = re.compile(r"Write the (\S+) report\.")


SCHEDULING = {
    "priority": ["--scheduling-policy", "priority", *ONE_AT_A_TIME],
    "fcfs": ["--scheduling-policy", "fcfs", *ONE_AT_A_TIME],
}
SERVERS = early_vllm(
    __name__,
    "vllm-priority",
    lambda install, log_dir: {
        name: tiny_server(install, log_dir / name, extra_args=args, extra_env=DEV_MODE)
        for name, args in SCHEDULING.items()
    },
)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmServedModel]]:
    """Two real vLLM servers that run one request at a time: priority and fcfs scheduling."""
    with vllm_servers(tmp_path_factory, SERVERS) as started:
        yield {name: served_model(server) for name, server in started.items()}


def priority_pool() -> Pool:
    """A pool that says its engine schedules by priority, so kvflow sends the priority."""
    return Pool(
        name="cpu",
        gpu="L4",
        replicas=1,
        price_per_gpu_hour_usd=Decimal("0.5"),
        token_prices=TokenPrices.per_mtok("0.1", "0.01", "0.3"),
        warm_models=[SERVED_MODEL_NAME],
        priority_scheduling=True,
    )


def call(name: str, *, tier: int, started_at: float) -> InferenceRequest:
    """A call of `OUTPUT_TOKENS` (all of them: EOS ignored) from a task of `tier`."""
    return InferenceRequest(
        model=SERVED_MODEL_NAME,
        messages=[ChatMessage(role="user", content=f"Write the {name} report. {FILLER}")],
        max_tokens=OUTPUT_TOKENS,
        sampling=Sampling(ignore_eos=True, seed=1),
        tenant=f"tier-{tier}",
        priority=engine_priority(tier, started_at),
    )


def queued_calls() -> list[tuple[str, InferenceRequest]]:
    """The tier-3 calls, oldest task first, then the tier-1 call of the newest task."""
    lows = [(f"low-{i}", call(f"low-{i}", tier=3, started_at=TASK_START + i)) for i in range(3)]
    return [*lows, ("high", call("high", tier=1, started_at=TASK_START + 10))]


async def first_block(
    http: httpx.AsyncClient, server: VllmServedModel, request: InferenceRequest
) -> tuple[int, ...]:
    """The token ids of the first KV block of `request`'s prompt, as vLLM tokenizes it."""
    assert request.messages is not None
    messages = [m.to_api(str(m.content)) for m in request.messages]
    answer = await http.post(
        f"{server.base_url}/tokenize",
        json={"model": SERVED_MODEL_NAME, "messages": messages, "add_generation_prompt": True},
    )
    tokens = tuple(answer.json()["tokens"])
    assert len(tokens) > BLOCK_SIZE, f"the prompt has {len(tokens)} tokens: lengthen FILLER"
    return tokens[:BLOCK_SIZE]


async def admission_order(server: VllmServedModel, blocks: dict[str, tuple[int, ...]]) -> list[str]:
    """The calls in the order the engine stored their prompt's first block: admitted them.

    Read from the server's KV-event replay socket, which returns every batch it published, in
    sequence, from number 0.
    """
    order: list[str] = []
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    try:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(server.kv_replay_endpoint)
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            assert await dealer.poll(timeout=10_000), "the replay socket did not answer"
            # vLLM 0.32 answers `[b"", topic, sequence, batch]`, and an empty batch with
            # sequence -1 after the last.
            *_, sequence, batch = await dealer.recv_multipart()
            if int.from_bytes(sequence, "big", signed=True) == END_OF_REPLAY:
                return order
            for event in decode_event_batch(batch)[1]:
                if not isinstance(event, BlockStored) or event.parent_block_hash is not None:
                    continue
                order += [
                    name
                    for name, block in blocks.items()
                    if event.token_ids[:BLOCK_SIZE] == block and name not in order
                ]
    finally:
        dealer.close(linger=0)
        context.term()


@dataclasses.dataclass
class Race:
    """What one server did with the queued calls, and what kvflow sent it."""

    admitted: list[str]
    """The queued calls by name, in the order the engine took them in."""
    priorities: dict[str, int | None]
    """The `priority` of each call's body as kvflow sent it, by the call's name."""


async def race(server: VllmServedModel, tmp_path: Path) -> Race:
    """The tier-3 calls, then the tier-1 call, queued in a paused engine; then it resumes."""
    priorities: dict[str, int | None] = {}

    async def record(request: httpx.Request) -> None:
        if request.url.path == "/v1/chat/completions":
            body = json.loads(request.content)
            found = CALL_NAME.match(body["messages"][0]["content"])
            assert found is not None
            priorities[found.group(1)] = body.get("priority")

    binding = ReplicaBinding(pool=priority_pool(), index=0, base_url=server.base_url)
    store = DirectoryContextStore(tmp_path / "context")
    queued = queued_calls()
    async with httpx.AsyncClient(timeout=60, event_hooks={"request": [record]}) as http:
        activities = InferenceActivities(binding, http, store=store)
        blocks = {name: await first_block(http, server, request) for name, request in queued}

        async def run(name: str, request: InferenceRequest) -> None:
            env = ActivityEnvironment()
            env.info = dataclasses.replace(env.info, workflow_id=f"priority-{name}")
            result = await env.run(activities.infer, request)
            assert isinstance(result, InferenceResult)
            assert result.usage.completion_tokens == OUTPUT_TOKENS, result.usage

        paused = await http.post(f"{server.base_url}/pause", params={"mode": "keep"})
        assert paused.status_code == 200, paused.text
        tasks = []
        try:
            for name, request in queued:
                tasks.append(asyncio.create_task(run(name, request)))
                await asyncio.sleep(SEND_GAP_S)
        finally:
            resumed = await http.post(f"{server.base_url}/resume")
        assert resumed.status_code == 200, resumed.text
        await asyncio.gather(*tasks)
    return Race(admitted=await admission_order(server, blocks), priorities=priorities)


async def test_under_priority_scheduling_the_urgent_call_overtakes_the_queue(
    servers: dict[str, VllmServedModel], tmp_path: Path
) -> None:
    seen = await race(servers["priority"], tmp_path)
    assert seen.admitted == ["high", "low-0", "low-1", "low-2"]
    # kvflow's own priorities went over the wire: tier 1 sorts before tier 3 by 2·10¹³.
    assert seen.priorities == {
        "low-0": engine_priority(3, TASK_START),
        "low-1": engine_priority(3, TASK_START + 1),
        "low-2": engine_priority(3, TASK_START + 2),
        "high": engine_priority(1, TASK_START + 10),
    }


async def test_under_fcfs_vllm_accepts_the_priority_and_ignores_it(
    servers: dict[str, VllmServedModel], tmp_path: Path
) -> None:
    seen = await race(servers["fcfs"], tmp_path)
    # Every call succeeded with its priority in the body (no 400), in arrival order.
    assert seen.admitted == ["low-0", "low-1", "low-2", "high"]
    assert seen.priorities["high"] == engine_priority(1, TASK_START + 10)
    assert all(seen.priorities[name] is not None for name, _ in queued_calls())

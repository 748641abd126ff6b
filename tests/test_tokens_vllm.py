"""The model's own tokenizer against a real vLLM server: the same ids, the same cached blocks.

The decisive checks: the ids `HfTokenizer` computes from the model folder vLLM serves equal
the ids vLLM's `/tokenize` returns for the same chat messages, and a chat prompt placed with
them is matched, through vLLM's own KV events, to exactly the tokens vLLM then reports cached.
With the built-in tokenizer instead, the second check finds nothing cached. A chat with tools
and an earlier tool call is counted as vLLM counts it, by the tiny model's own template (which
ignores tools) and by a template that renders them.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import httpx
import pytest

from kvflow.activities.control_plane import ControlPlaneActivities
from kvflow.activities.tokenize import VllmTokenize
from kvflow.activities.wire import PlaceInput
from kvflow.scheduler.core import Scheduler
from kvflow.scheduler.fleet import Fleet
from kvflow.scheduler.kv_events import KvEventSubscriber
from kvflow.scheduler.placement import PlacementRequest
from kvflow.scheduler.prefix_index import BlockStored, KvEvent
from kvflow.scheduler.tokens import HfTokenizer, render_tools
from tests.fixtures_vllm import (
    VllmServedModel,
    early_vllm,
    served_model,
    tiny_server,
    vllm_install,
    vllm_servers,
)
from tests.fleets import one_pool_fleet
from tests.servers import ServedModel
from tests.test_tokens import TOOL_CHAT, TOOL_SPECS, TOOLS_TEMPLATE, tool_chat_api
from tests.waiting import eventually

pytestmark = pytest.mark.vllm

SYSTEM = {"role": "system", "content": "You plan tool calls; answer in JSON."}
CASES: list[tuple[list[dict[str, Any]], bool, bool]] = [
    # (messages, add_generation_prompt, continue_final_message)
    ([SYSTEM, {"role": "user", "content": "Read a.txt, then b.txt."}], True, False),
    (
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Ünïcode  spaces\tand 12345 digits"},
                    {"type": "text", "text": 'second part {"k": [1, 2]}'},
                ],
            }
        ],
        True,
        False,
    ),
    (
        [SYSTEM, {"role": "user", "content": "go"}, {"role": "assistant", "content": '{"step'}],
        False,
        True,
    ),
    ([SYSTEM, {"role": "user", "content": "no generation prompt"}], False, False),
]


@pytest.fixture(scope="module")
def model_tokenizer() -> HfTokenizer:
    return HfTokenizer.from_path(vllm_install().model_dir)


def fleet_for(server: ServedModel, tokenizer: str) -> Fleet:
    fleet = one_pool_fleet(
        server.model, endpoints=[server.base_url], context_length=server.max_model_len
    )
    data = fleet.model_dump(mode="json")
    data["models"][0]["tokenizer"] = tokenizer
    return Fleet.model_validate(data)


async def test_the_model_tokenizer_gives_the_ids_vllm_tokenizes(
    vllm_server: VllmServedModel, model_tokenizer: HfTokenizer
) -> None:
    remote = VllmTokenize([vllm_server.base_url], vllm_server.model)
    try:
        async with httpx.AsyncClient(base_url=vllm_server.base_url, timeout=60.0) as client:
            for messages, generation, continued in CASES:
                response = await client.post(
                    "/tokenize",
                    json={
                        "model": vllm_server.model,
                        "messages": messages,
                        "add_generation_prompt": generation,
                        "continue_final_message": continued,
                    },
                )
                response.raise_for_status()
                vllm_ids = response.json()["tokens"]
                ids = model_tokenizer.encode_chat(
                    messages, add_generation_prompt=generation, continue_final_message=continued
                )
                assert ids == vllm_ids, messages
                assert (
                    await remote.encode_chat(
                        messages, add_generation_prompt=generation, continue_final_message=continued
                    )
                    == vllm_ids
                )
            text = "Plain completion prompt: 3 tools, 2 files."
            response = await client.post(
                "/tokenize", json={"model": vllm_server.model, "prompt": text}
            )
            assert model_tokenizer.encode(text) == response.json()["tokens"]
            assert await remote.encode(text) == response.json()["tokens"]
    finally:
        await remote.aclose()


def _long_conversation() -> list[dict[str, str]]:
    # Unique per run, so nothing of it is cached before the test sends it.
    text = f"[{uuid.uuid4().hex}] " + " ".join(f"step{i % 13} tool{i % 5}" for i in range(120))
    return [SYSTEM, {"role": "user", "content": text}]


class StoreCountingScheduler(Scheduler):
    """A scheduler that keeps the token ids of every block the engine reported it cached.

    The subscriber replays the shared server's earlier batches too, so a count of stored
    tokens would be reached by other tests' blocks: the test waits for its own blocks' ids.
    """

    def __init__(self, fleet: Fleet) -> None:
        super().__init__(fleet)
        self.stored_blocks: set[tuple[int, ...]] = set()

    def apply_kv_events(
        self, replica: str, events: Iterable[KvEvent], model: str | None = None
    ) -> None:
        events = list(events)
        for event in events:
            if isinstance(event, BlockStored):
                # One event may store several blocks: their ids come one after the other.
                ids, size = event.token_ids, event.block_size
                self.stored_blocks.update(
                    tuple(ids[i : i + size]) for i in range(0, len(ids), size)
                )
        super().apply_kv_events(replica, events, model)


async def _placed_and_cached(server: VllmServedModel, tokenizer: str) -> tuple[int, int, int]:
    """Send a long chat prompt, then place it again: (prompt ids, expected, vLLM's cached)."""
    fleet = fleet_for(server, tokenizer)
    scheduler = StoreCountingScheduler(fleet)
    activities = ControlPlaneActivities(scheduler, fleet=fleet, block_size=scheduler.block_size)
    subscriber = KvEventSubscriber(
        scheduler,
        "cpu/0",
        server.kv_events_endpoint,
        topic=server.kv_topic,
        replay_endpoint=server.kv_replay_endpoint,
    )
    task = asyncio.create_task(subscriber.run())
    messages = _long_conversation()
    place = PlaceInput.model_validate(
        {
            "request": PlacementRequest(
                model=server.model,
                prompt_tokens=0,
                max_output_tokens=2,
                tenant="acme",
                workflow_id="wf-tokens",
            ),
            "messages": messages,
        }
    )
    try:
        await subscriber.wait_ready()
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60.0) as client:

            async def chat() -> tuple[int, int]:
                """(prompt tokens, of which cached), as vLLM counts them."""
                response = await client.post(
                    "/v1/chat/completions",
                    json={
                        "model": server.model,
                        "messages": messages,
                        "max_tokens": 2,
                        "ignore_eos": True,
                        # The tenant's salt, as the GPU worker sends the call.
                        "cache_salt": await activities.cache_salt(place),
                    },
                )
                response.raise_for_status()
                usage = response.json()["usage"]
                return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

            prompt_tokens, cached = await chat()
            assert cached == 0
            # The engine publishes its KV events shortly after the step: wait for every full
            # block of this prompt, by its ids as vLLM tokenizes it.
            tokenized = await client.post(
                "/tokenize",
                json={"model": server.model, "messages": messages, "add_generation_prompt": True},
            )
            ids = tokenized.json()["tokens"]
            assert len(ids) == prompt_tokens
            size = server.block_size
            blocks = [tuple(ids[i : i + size]) for i in range(0, len(ids) - size + 1, size)]
            await eventually(
                lambda: all(block in scheduler.stored_blocks for block in blocks),
                within=20,
                what=f"vLLM's KV events report the prompt's {len(blocks)} full blocks",
            )
            answer = await activities.place(place)
            assert answer.placement is not None
            _, cached = await chat()
            return answer.prompt_tokens, answer.placement.expected_cached_tokens, cached
    finally:
        subscriber.stop()
        await asyncio.wait_for(task, timeout=5)
        await activities.tokenizers.aclose()


async def test_a_chat_prompt_placed_with_the_model_tokenizer_matches_vllms_cached_blocks(
    vllm_server: VllmServedModel,
) -> None:
    model_dir = str(vllm_install().model_dir)
    prompt_tokens, expected, cached = await _placed_and_cached(vllm_server, model_dir)
    assert prompt_tokens > 2 * vllm_server.block_size
    # Whole blocks of the prompt; vLLM always recomputes the last token.
    whole = (prompt_tokens - 1) // vllm_server.block_size * vllm_server.block_size
    assert expected == cached == whole

    # The built-in tokenizer cuts the same messages differently: its hashes match nothing.
    _, expected, cached = await _placed_and_cached(vllm_server, "builtin")
    assert expected == 0 and cached > 0


async def test_tokenize_time_per_prompt(
    vllm_server: VllmServedModel, model_tokenizer: HfTokenizer
) -> None:
    """Figures for the record (printed with -s): tokenizer.json, /tokenize, and the cache."""
    conversations = [_long_conversation() for _ in range(20)]
    model_tokenizer.encode_chat(conversations[0])  # warm
    started = time.perf_counter()
    sizes = [len(model_tokenizer.encode_chat(m)) for m in conversations]
    local_ms = (time.perf_counter() - started) * 1000 / len(conversations)
    remote = VllmTokenize([vllm_server.base_url], vllm_server.model)
    try:
        await remote.encode_chat(conversations[0])  # connect
        started = time.perf_counter()
        for messages in conversations[1:]:
            await remote.encode_chat(messages)
        remote_ms = (time.perf_counter() - started) * 1000 / (len(conversations) - 1)
        asked = remote.requests
        started = time.perf_counter()
        await remote.encode_chat(conversations[1])
        cached_ms = (time.perf_counter() - started) * 1000
        assert remote.requests == asked  # answered from the cache
    finally:
        await remote.aclose()
    print(
        f"\n{sum(sizes) // len(sizes)}-token chat prompt: tokenizer.json {local_ms:.2f} ms, "
        f"vLLM /tokenize {remote_ms:.2f} ms, cached {cached_ms:.3f} ms"
    )
    # No bound on the times themselves: this machine's two cores are shared with other work.
    assert min(sizes) > 2 * vllm_server.block_size


TOOLS_SERVER = early_vllm(
    __name__,
    "vllm-tools",
    lambda install, log_dir: {"tools": tiny_server(install, log_dir, chat_template=TOOLS_TEMPLATE)},
)


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServedModel]:
    """Real vLLM serving the tiny model with a template that renders tools and tool calls."""
    with vllm_servers(tmp_path_factory, TOOLS_SERVER) as servers:
        yield served_model(servers["tools"])


SERVER_OF_TEMPLATE = {"own": "vllm_server", "renders_tools": "tools_server"}
"""The tiny model's own template writes role and content only; the other renders tools."""


@pytest.mark.parametrize("template", sorted(SERVER_OF_TEMPLATE))
async def test_a_chat_with_tools_and_a_tool_call_is_counted_as_vllm_counts_it(
    request: pytest.FixtureRequest, template: str
) -> None:
    server: VllmServedModel = request.getfixturevalue(SERVER_OF_TEMPLATE[template])
    model_dir = server.model_dir
    messages, tools = tool_chat_api()
    resumed = [*messages, {"role": "assistant", "content": "First read"}]
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60.0) as client:
        # What the GPU worker sends for the call.
        response = await client.post(
            "/v1/chat/completions",
            json={"model": server.model, "messages": messages, "tools": tools, "max_tokens": 1},
        )
        response.raise_for_status()
        engine_count = response.json()["usage"]["prompt_tokens"]
        response = await client.post(
            "/tokenize", json={"model": server.model, "messages": messages, "tools": tools}
        )
        response.raise_for_status()
        engine_ids = response.json()["tokens"]
        response = await client.post(
            "/tokenize",
            json={"model": server.model, "messages": resumed, "tools": tools, **continued},
        )
        response.raise_for_status()
        resumed_ids = response.json()["tokens"]
    assert len(engine_ids) == engine_count

    model_tokenizer = HfTokenizer.from_path(model_dir)
    assert model_tokenizer.encode_chat(messages, tools=tools) == engine_ids
    assert model_tokenizer.encode_chat(resumed, tools=tools, **continued) == resumed_ids
    remote = VllmTokenize([server.base_url], server.model)
    try:
        assert await remote.encode_chat(messages, tools=tools) == engine_ids
        assert await remote.encode_chat(resumed, tools=tools, **continued) == resumed_ids
    finally:
        await remote.aclose()

    # The place activity sizes the call as vLLM does, with either tokenizer setting.
    for setting in (str(model_dir), "vllm"):
        fleet = fleet_for(server, setting)
        activities = ControlPlaneActivities(
            Scheduler(fleet), fleet=fleet, block_size=server.block_size
        )
        place = PlaceInput(
            request=PlacementRequest(
                model=server.model,
                prompt_tokens=0,
                max_output_tokens=2,
                tenant="acme",
                workflow_id="wf-tools",
            ),
            messages=TOOL_CHAT,
            tools=TOOL_SPECS,
        )
        try:
            answer = await activities.place(place)
            assert answer.prompt_tokens == engine_count, setting
            resume = place.model_copy(update={"checkpoint_text": "First read"})
            assert await activities.prompt_tokens(resume) == resumed_ids, setting
        finally:
            await activities.tokenizers.aclose()

    # For the record (printed with -s): the simulator's text rendering, which placements
    # used for every model, against what vLLM counts.
    as_text = [{"role": m["role"], "content": m["content"]} for m in render_tools(messages, tools)]
    try:
        simulator_count = str(len(model_tokenizer.encode_chat(as_text)))
    except Exception as exc:  # a template that needs the tool fields refuses the text
        simulator_count = f"none ({type(exc).__name__})"
    print(
        f"\n{template} template: vLLM counts {engine_count} prompt tokens, "
        f"the simulator's rendering {simulator_count}"
    )

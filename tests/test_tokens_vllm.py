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
from collections.abc import Iterator
from pathlib import Path
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
from kvflow.scheduler.tokens import HfTokenizer, render_tools
from kvflow.workers.vllm_server import VllmServer, VllmServerError
from tests.fixtures_vllm import (
    MAX_MODEL_LEN,
    SERVED_MODEL_NAME,
    VllmServedModel,
    skip_or_fail,
    vllm_install,
)
from tests.fleets import one_pool_fleet
from tests.servers import ServedModel
from tests.test_tokens import TOOL_CHAT, TOOL_SPECS, TOOLS_TEMPLATE, tool_chat_api

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


async def _placed_and_cached(server: VllmServedModel, tokenizer: str) -> tuple[int, int, int]:
    """Send a long chat prompt, then place it again: (prompt ids, expected, vLLM's cached)."""
    fleet = fleet_for(server, tokenizer)
    scheduler = Scheduler(fleet)
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

            async def chat() -> int:
                response = await client.post(
                    "/v1/chat/completions",
                    json={
                        "model": server.model,
                        "messages": messages,
                        "max_tokens": 2,
                        "ignore_eos": True,
                    },
                )
                response.raise_for_status()
                usage = response.json()["usage"]
                cached: int = usage["prompt_tokens_details"]["cached_tokens"]
                return cached

            assert await chat() == 0
            before = subscriber.events
            for _ in range(400):  # the engine publishes its events shortly after the step
                if scheduler.status()[0].precise and subscriber.events > before:
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)  # the rest of the step's batch
            answer = await activities.place(place)
            assert answer.placement is not None
            return answer.prompt_tokens, answer.placement.expected_cached_tokens, await chat()
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


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServedModel, Path]]:
    """Real vLLM serving the tiny model with a template that renders tools and tool calls."""
    install = vllm_install()
    missing = install.missing()
    if missing is not None:
        skip_or_fail(missing)
    model_dir = tmp_path_factory.mktemp("tools-model")
    for file in install.model_dir.iterdir():
        if file.name != "chat_template.jinja":
            (model_dir / file.name).symlink_to(file)
    (model_dir / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    server = VllmServer(
        install,
        log_path=model_dir.parent / "vllm-tools.log",
        model_dir=model_dir,
        served_model_names=[SERVED_MODEL_NAME],
        max_model_len=MAX_MODEL_LEN,
    )
    try:
        with server:
            served = ServedModel(
                kind="vllm",
                base_url=server.base_url,
                model=SERVED_MODEL_NAME,
                block_size=128,
                max_model_len=MAX_MODEL_LEN,
            )
            yield served, model_dir
    except VllmServerError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.mark.parametrize("template", ["own", "renders_tools"])
async def test_a_chat_with_tools_and_a_tool_call_is_counted_as_vllm_counts_it(
    request: pytest.FixtureRequest, template: str
) -> None:
    server: ServedModel
    if template == "own":  # the tiny model's template writes role and content only
        server, model_dir = request.getfixturevalue("vllm_server"), vllm_install().model_dir
    else:
        server, model_dir = request.getfixturevalue("tools_server")
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

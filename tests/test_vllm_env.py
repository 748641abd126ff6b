"""The real vLLM CPU server of the tests behaves as kvflow relies on (see fixtures_vllm)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures_vllm import VllmServedModel

pytestmark = pytest.mark.vllm

WORDS = ["agent", "tool", "plan", "cache", "block", "prefix", "prompt", "reply", "worker"]


def long_prompt(words: int) -> str:
    """A prompt no other test sends: a unique head, then `words` words."""
    body = " ".join(WORDS[i % len(WORDS)] + str(i % 7) for i in range(words))
    return f"[{uuid.uuid4().hex}] {body}"


def prompt_of_tokens(client: httpx.Client, server: VllmServedModel, low: int, high: int) -> str:
    """A fresh prompt whose length in the server's tokens lies in `[low, high]`."""
    words = low // 2
    for _ in range(8):
        prompt = long_prompt(words)
        count = len(tokenize(client, server, prompt=prompt))
        if low <= count <= high:
            return prompt
        words = max(1, words * (low + high) // 2 // count)
    raise AssertionError(f"could not make a prompt of {low}..{high} tokens")


def client_for(server: VllmServedModel) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=60.0)


def tokenize(client: httpx.Client, server: VllmServedModel, **body: Any) -> list[int]:
    response = client.post("/tokenize", json={"model": server.model, **body})
    response.raise_for_status()
    tokens: list[int] = response.json()["tokens"]
    return tokens


def test_streamed_chat_carries_usage_in_its_last_chunk(vllm_server: VllmServedModel) -> None:
    body = {
        "model": vllm_server.model,
        "messages": [{"role": "user", "content": "Plan the next step."}],
        "max_tokens": 12,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks: list[dict[str, Any]] = []
    with (
        client_for(vllm_server) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                break
            chunks.append(json.loads(data))
    text = "".join(
        choice["delta"].get("content") or "" for chunk in chunks for choice in chunk["choices"]
    )
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["completion_tokens"] == 12
    assert usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + 12
    assert text, "the stream carried no text"


def test_repeated_prompt_reports_cached_tokens_in_whole_blocks(
    vllm_server: VllmServedModel,
) -> None:
    with client_for(vllm_server) as client:
        # About 600 tokens: four whole blocks and part of a fifth.
        prompt = prompt_of_tokens(client, vllm_server, 580, 620)
        prompt_tokens = len(tokenize(client, vllm_server, prompt=prompt))
        cached: list[int] = []
        for _ in range(2):
            response = client.post(
                "/v1/completions",
                json={
                    "model": vllm_server.model,
                    "prompt": prompt,
                    "max_tokens": 2,
                    "ignore_eos": True,
                },
            )
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]
            assert usage["prompt_tokens"] == prompt_tokens
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
    assert cached[0] == 0
    # Only whole blocks are cached, and vLLM always recomputes the prompt's last token.
    assert cached[1] == (prompt_tokens - 1) // vllm_server.block_size * vllm_server.block_size
    assert cached[1] > 0


def test_metrics_expose_kv_cache_usage_and_block_size(vllm_server: VllmServedModel) -> None:
    with client_for(vllm_server) as client:
        response = client.get("/metrics")
    assert response.status_code == 200
    samples = {
        sample.name: sample
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }
    usage = samples["vllm:kv_cache_usage_perc"]
    assert 0.0 <= usage.value <= 1.0
    cache_config = next(
        s for name, s in samples.items() if name.startswith("vllm:cache_config_info")
    )
    assert cache_config.labels["block_size"] == str(vllm_server.block_size)
    assert "vllm:num_requests_running" in samples
    assert "vllm:num_requests_waiting" in samples


def test_partial_assistant_answer_is_continued_without_an_end_marker(
    vllm_server: VllmServedModel,
) -> None:
    partial = "The plan has three steps: first"
    messages = [
        {"role": "user", "content": "Write the plan."},
        {"role": "assistant", "content": partial},
    ]
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    with client_for(vllm_server) as client:
        open_turn = tokenize(client, vllm_server, messages=messages, **flags)
        closed_turn = tokenize(client, vllm_server, messages=messages, add_generation_prompt=False)
        response = client.post(
            "/v1/chat/completions",
            json={
                "model": vllm_server.model,
                "messages": messages,
                "max_tokens": 8,
                "ignore_eos": True,
                **flags,
            },
        )
    # The resumed prompt is the conversation up to the partial text, left open.
    assert closed_turn[: len(open_turn)] == open_turn
    assert len(closed_turn) > len(open_turn)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] == len(open_turn)
    assert usage["completion_tokens"] == 8


def test_stored_blocks_are_announced_on_the_kv_events_socket(
    vllm_server: VllmServedModel,
) -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.LINGER, 0)
    subscriber.setsockopt(zmq.SUBSCRIBE, vllm_server.kv_topic.encode())
    subscriber.connect(vllm_server.kv_events_endpoint)
    try:
        with client_for(vllm_server) as client:
            wait_until_subscribed(subscriber, client, vllm_server)
            # Two whole blocks and part of a third.
            prompt = prompt_of_tokens(client, vllm_server, 300, 360)
            first_block = tokenize(client, vllm_server, prompt=prompt)[: vllm_server.block_size]
            complete(client, vllm_server, prompt)
        stored = receive_block_stored(subscriber, first_block, timeout_s=30.0)
    finally:
        subscriber.close()
    assert stored["block_size"] == vllm_server.block_size
    assert stored["parent_block_hash"] is None
    assert len(stored["block_hashes"]) == 2
    assert len(stored["token_ids"]) == 2 * vllm_server.block_size
    assert all(isinstance(h, int) for h in stored["block_hashes"])


def complete(client: httpx.Client, server: VllmServedModel, prompt: str) -> None:
    response = client.post(
        "/v1/completions",
        json={"model": server.model, "prompt": prompt, "max_tokens": 1, "ignore_eos": True},
    )
    assert response.status_code == 200, response.text


def wait_until_subscribed(
    subscriber: zmq.Socket[bytes], client: httpx.Client, server: VllmServedModel
) -> None:
    """Send throwaway prompts until an event arrives: from then on nothing is missed.

    A SUB socket misses what is published before its subscription reaches the publisher.
    """
    for _ in range(30):
        complete(client, server, prompt_of_tokens(client, server, 140, 200))
        if subscriber.poll(timeout=1000):
            while subscriber.poll(timeout=200):
                subscriber.recv_multipart()
            return
    pytest.fail(f"no KV event arrived on {server.kv_events_endpoint}")


def receive_block_stored(
    subscriber: zmq.Socket[bytes], first_block: list[int], timeout_s: float
) -> dict[str, Any]:
    """The `BlockStored` event whose tokens start with `first_block`."""
    deadline = time.monotonic() + timeout_s
    seen: list[str] = []
    while time.monotonic() < deadline:
        if not subscriber.poll(timeout=500):
            continue
        topic, sequence, payload = subscriber.recv_multipart()
        assert topic == b"kv"
        assert len(sequence) == 8
        batch = msgspec.msgpack.decode(payload)
        for event in batch_events(batch):
            seen.append(str(event.get("type")))
            if event.get("type") == "BlockStored" and event["token_ids"][: len(first_block)] == (
                first_block
            ):
                return event
    pytest.fail(f"no BlockStored event for the prompt within {timeout_s} s (saw {seen})")


def batch_events(batch: Any) -> list[dict[str, Any]]:
    """The events of a decoded batch: `[timestamp, events, data-parallel rank]`."""
    assert isinstance(batch, list), batch
    events: list[dict[str, Any]] = batch[1]
    return events

"""The same client code gets the same shapes from the simulator and from real vLLM.

Every test runs against both (`openai_server`); assertions are about fields, types, framing
and rules that real vLLM also follows, never about the text a model writes.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.servers import ServedModel

TIMEOUT = httpx.Timeout(60.0)


@pytest.fixture
def client(openai_server: ServedModel) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=openai_server.base_url, timeout=TIMEOUT) as http:
        yield http


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of a server-sent-event stream, checking its framing."""
    assert response.headers["content-type"].startswith("text/event-stream")
    text = response.read().decode()
    assert text.endswith("\n\n"), "every event ends with a blank line"
    events = [e for e in text.split("\n\n") if e]
    payloads = []
    for event in events:
        assert event.startswith("data: "), f"unexpected SSE event {event!r}"
        payloads.append(event.removeprefix("data: "))
    assert payloads[-1] == "[DONE]"
    return payloads[:-1]


def cached_tokens(usage: dict[str, Any]) -> int:
    details = usage.get("prompt_tokens_details") or {}
    value = details.get("cached_tokens") or 0
    assert isinstance(value, int)
    return value


def tokenize(client: httpx.Client, server: ServedModel, **body: Any) -> dict[str, Any]:
    response = client.post("/tokenize", json={"model": server.model, **body})
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def long_prompt(client: httpx.Client, server: ServedModel, min_tokens: int) -> tuple[str, int]:
    """A unique prompt of at least `min_tokens` tokens (measured by the server's tokenizer)."""
    words = f"session {uuid.uuid4().hex} " + "the plan is to review the draft and call a tool " * 8
    while True:
        count = tokenize(client, server, prompt=words)["count"]
        if count >= min_tokens:
            return words, count
        words += "then check the answer against the report and the customer order "


def assert_usage(usage: dict[str, Any], prompt_tokens: int, completion_tokens: int) -> None:
    assert usage["prompt_tokens"] == prompt_tokens
    assert usage["completion_tokens"] == completion_tokens
    assert usage["total_tokens"] == prompt_tokens + completion_tokens


def assert_error_body(response: httpx.Response, status: int, error_type: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == error_type
    assert error["code"] == status
    assert "param" in error
    detail: dict[str, Any] = error
    return detail


def test_models_endpoint_lists_the_served_model(
    client: httpx.Client, openai_server: ServedModel
) -> None:
    response = client.get("/v1/models")
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list"
    card = next(m for m in body["data"] if m["id"] == openai_server.model)
    assert card["object"] == "model"
    assert isinstance(card["created"], int)
    assert isinstance(card["owned_by"], str)
    assert card["max_model_len"] == openai_server.max_model_len


def test_health_and_version_answer(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    version = client.get("/version")
    assert version.status_code == 200
    assert isinstance(version.json()["version"], str)


def test_tokenize_counts_prompt_and_chat_tokens(
    client: httpx.Client, openai_server: ServedModel
) -> None:
    plain = tokenize(client, openai_server, prompt="review the draft and answer")
    assert plain["count"] == len(plain["tokens"]) > 0
    assert all(isinstance(t, int) for t in plain["tokens"])
    assert plain["max_model_len"] == openai_server.max_model_len
    chat = tokenize(
        client, openai_server, messages=[{"role": "user", "content": "review the draft"}]
    )
    assert chat["count"] == len(chat["tokens"]) > 0


def test_completion_has_openai_fields_and_exact_usage(
    client: httpx.Client, openai_server: ServedModel
) -> None:
    prompt = "the plan is to review the draft"
    prompt_tokens = tokenize(client, openai_server, prompt=prompt)["count"]
    response = client.post(
        "/v1/completions",
        json={
            "model": openai_server.model,
            "prompt": prompt,
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert isinstance(body["id"], str)
    assert body["object"] == "text_completion"
    assert isinstance(body["created"], int)
    assert body["model"] == openai_server.model
    (choice,) = body["choices"]
    assert choice["index"] == 0
    assert isinstance(choice["text"], str)
    assert choice["finish_reason"] == "length"
    assert_usage(body["usage"], prompt_tokens, 5)


def test_chat_completion_has_openai_fields_and_exact_usage(
    client: httpx.Client, openai_server: ServedModel
) -> None:
    messages = [{"role": "user", "content": "review the draft and answer"}]
    prompt_tokens = tokenize(client, openai_server, messages=messages)["count"]
    response = client.post(
        "/v1/chat/completions",
        json={
            "model": openai_server.model,
            "messages": messages,
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion"
    assert isinstance(body["id"], str) and isinstance(body["created"], int)
    assert body["model"] == openai_server.model
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length"
    assert_usage(body["usage"], prompt_tokens, 6)


def test_streamed_chat_is_sse_with_role_first_and_usage_last(
    client: httpx.Client, openai_server: ServedModel
) -> None:
    messages = [{"role": "user", "content": "draft the summary"}]
    prompt_tokens = tokenize(client, openai_server, messages=messages)["count"]
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "model": openai_server.model,
            "messages": messages,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as response:
        assert response.status_code == 200
        chunks = [json.loads(p) for p in sse_events(response)]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    first = chunks[0]["choices"][0]
    assert first["delta"]["role"] == "assistant"
    *content_chunks, usage_chunk = chunks
    finishes = [c["choices"][0]["finish_reason"] for c in content_chunks if c["choices"]]
    assert finishes[-1] == "length"
    assert all(f is None for f in finishes[:-1])
    assert all(isinstance(c["choices"][0]["delta"].get("content", ""), str) for c in content_chunks)
    assert usage_chunk["choices"] == []
    assert_usage(usage_chunk["usage"], prompt_tokens, 8)
    assert all(c.get("usage") is None for c in content_chunks)


def test_streamed_completion_puts_usage_in_the_last_chunk(
    client: httpx.Client, openai_server: ServedModel
) -> None:
    prompt = "call the tool and report"
    prompt_tokens = tokenize(client, openai_server, prompt=prompt)["count"]
    with client.stream(
        "POST",
        "/v1/completions",
        json={
            "model": openai_server.model,
            "prompt": prompt,
            "max_tokens": 7,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as response:
        assert response.status_code == 200
        chunks = [json.loads(p) for p in sse_events(response)]
    assert all(c["object"] == "text_completion" for c in chunks)
    *content_chunks, usage_chunk = chunks
    assert all(isinstance(c["choices"][0]["text"], str) for c in content_chunks)
    assert content_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == []
    assert_usage(usage_chunk["usage"], prompt_tokens, 7)


def test_stream_without_include_usage_sends_no_usage_chunk(
    client: httpx.Client, openai_server: ServedModel
) -> None:
    with client.stream(
        "POST",
        "/v1/completions",
        json={
            "model": openai_server.model,
            "prompt": "answer the customer",
            "max_tokens": 3,
            "ignore_eos": True,
            "stream": True,
        },
    ) as response:
        chunks = [json.loads(p) for p in sse_events(response)]
    assert all(c["choices"] for c in chunks)
    assert all(c.get("usage") is None for c in chunks)


def test_repeated_prompt_reports_cached_tokens_in_whole_blocks(
    client: httpx.Client, openai_server: ServedModel
) -> None:
    block = openai_server.block_size
    prompt, prompt_tokens = long_prompt(client, openai_server, 2 * block + block // 2 + 1)
    assert prompt_tokens + 4 <= openai_server.max_model_len
    body = {
        "model": openai_server.model,
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    first = client.post("/v1/completions", json=body)
    second = client.post("/v1/completions", json=body)
    assert first.status_code == second.status_code == 200
    assert cached_tokens(first.json()["usage"]) == 0
    usage = second.json()["usage"]
    assert usage["prompt_tokens"] == prompt_tokens
    cached = cached_tokens(usage)
    assert cached > 0
    assert cached % block == 0
    assert cached <= prompt_tokens - 1


def test_prompt_over_the_context_length_is_a_400_bad_request(
    client: httpx.Client, openai_server: ServedModel
) -> None:
    prompt, _ = long_prompt(client, openai_server, openai_server.max_model_len + 10)
    response = client.post(
        "/v1/completions", json={"model": openai_server.model, "prompt": prompt, "max_tokens": 4}
    )
    error = assert_error_body(response, 400, "BadRequestError")
    assert "context length" in error["message"]
    assert error["param"] == "input_tokens"


def test_chat_over_the_context_length_is_a_400_bad_request(
    client: httpx.Client, openai_server: ServedModel
) -> None:
    prompt, _ = long_prompt(client, openai_server, openai_server.max_model_len + 10)
    response = client.post(
        "/v1/chat/completions",
        json={
            "model": openai_server.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 4,
        },
    )
    error = assert_error_body(response, 400, "BadRequestError")
    assert error["param"] == "input_tokens"


def test_unknown_model_is_a_404_not_found(client: httpx.Client) -> None:
    response = client.post(
        "/v1/chat/completions",
        json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
    )
    error = assert_error_body(response, 404, "NotFoundError")
    assert "no-such-model" in error["message"]
    assert error["param"] == "model"


def test_max_tokens_below_one_is_a_400(client: httpx.Client, openai_server: ServedModel) -> None:
    response = client.post(
        "/v1/completions",
        json={"model": openai_server.model, "prompt": "hello", "max_tokens": 0},
    )
    error = assert_error_body(response, 400, "BadRequestError")
    assert error["param"] == "max_tokens"


def test_max_tokens_above_the_context_length_is_a_400(
    client: httpx.Client, openai_server: ServedModel
) -> None:
    too_many = openai_server.max_model_len + 1
    response = client.post(
        "/v1/completions",
        json={"model": openai_server.model, "prompt": "hello", "max_tokens": too_many},
    )
    error = assert_error_body(response, 400, "BadRequestError")
    assert error["param"] == "max_tokens"


def test_max_tokens_past_the_remaining_context_is_capped_to_it(
    client: httpx.Client, openai_server: ServedModel
) -> None:
    prompt, prompt_tokens = long_prompt(client, openai_server, openai_server.max_model_len - 40)
    response = client.post(
        "/v1/completions",
        json={
            "model": openai_server.model,
            "prompt": prompt,
            "max_tokens": 100,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert_usage(body["usage"], prompt_tokens, openai_server.max_model_len - prompt_tokens)


def test_a_body_that_fails_validation_is_a_400_naming_the_field(
    client: httpx.Client, openai_server: ServedModel
) -> None:
    response = client.post(
        "/v1/completions",
        json={"model": openai_server.model, "prompt": "hello", "max_tokens": "many"},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == 400
    assert error["param"] == "body.max_tokens"
    assert "max_tokens" in error["message"]


def test_a_body_that_is_not_json_is_a_400(client: httpx.Client) -> None:
    response = client.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == 400


def test_continue_final_message_needs_add_generation_prompt_false(
    client: httpx.Client, openai_server: ServedModel
) -> None:
    response = client.post(
        "/v1/chat/completions",
        json={
            "model": openai_server.model,
            "messages": [
                {"role": "user", "content": "write the plan"},
                {"role": "assistant", "content": "the plan is"},
            ],
            "max_tokens": 3,
            "continue_final_message": True,
        },
    )
    assert_error_body(response, 400, "BadRequestError")


def test_resumed_chat_prompt_is_the_conversation_with_the_partial_answer(
    client: httpx.Client, openai_server: ServedModel
) -> None:
    messages = [
        {"role": "user", "content": "write the plan"},
        {"role": "assistant", "content": "the plan is to review"},
    ]
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    expected = tokenize(client, openai_server, messages=messages, **flags)["count"]
    response = client.post(
        "/v1/chat/completions",
        json={
            "model": openai_server.model,
            "messages": messages,
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
            **flags,
        },
    )
    assert response.status_code == 200, response.text
    assert_usage(response.json()["usage"], expected, 4)


def test_metrics_use_vllm_names_and_types(client: httpx.Client, openai_server: ServedModel) -> None:
    # One request first, so that the histograms have samples.
    client.post(
        "/v1/completions",
        json={"model": openai_server.model, "prompt": "hello", "max_tokens": 2, "ignore_eos": True},
    )
    response = client.get("/metrics")
    assert response.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:cache_config_info": "gauge",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
    }
    for name, kind in expected.items():
        assert name in families, f"{name} missing from /metrics"
        assert families[name].type == kind, f"{name} is a {families[name].type}, not a {kind}"
    usage = [s.value for s in families["vllm:kv_cache_usage_perc"].samples]
    assert all(0.0 <= v <= 1.0 for v in usage)
    (info,) = families["vllm:cache_config_info"].samples[:1]
    assert int(info.labels["block_size"]) == openai_server.block_size
    assert int(info.labels["num_gpu_blocks"]) > 0
    ttft_count = [
        s.value
        for s in families["vllm:time_to_first_token_seconds"].samples
        if s.name.endswith("_count")
    ]
    assert sum(ttft_count) >= 1

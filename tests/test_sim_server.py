"""The simulated server over HTTP.

Deterministic text, resume, structured output, faults, KV events over ZMQ, and errors that
are always vLLM's JSON bodies.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from kvflow.scheduler.blocks import block_hashes
from kvflow.simulator import SimRequest, SimServer
from kvflow.simulator.kv_events import END_SEQ, KV_EVENT_DECODER, BlockStored
from tests.servers import ServedModel

Factory = Callable[..., SimServer]


@pytest.fixture
def client(sim_server: ServedModel) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sim_server.base_url, timeout=30) as http:
        yield http


def chat_body(model: str, content: str = "write the plan", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def stream_chunks(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line.removeprefix("data: "))


def test_same_request_gives_the_same_text_on_two_servers(
    client: httpx.Client, sim_server: ServedModel, sim_server_factory: Factory
) -> None:
    body = chat_body(sim_server.model, max_tokens=30, seed=42)
    other = sim_server_factory(seed=999)
    first = client.post("/v1/chat/completions", json=body).json()
    second = httpx.post(f"{other.base_url}/v1/chat/completions", json=body, timeout=30).json()
    text = first["choices"][0]["message"]["content"]
    assert text and text == second["choices"][0]["message"]["content"]
    body["seed"] = 43
    third = client.post("/v1/chat/completions", json=body).json()
    assert third["choices"][0]["message"]["content"] != text


def test_cut_answer_resumed_with_continue_final_message_matches_the_uncut_one(
    client: httpx.Client, sim_server: ServedModel
) -> None:
    body = chat_body(sim_server.model, max_tokens=30, temperature=0, ignore_eos=True)
    full = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        pieces = [c["choices"][0]["delta"].get("content", "") for c in stream_chunks(response)]
    partial = "".join(pieces[:11])  # the role chunk and 10 tokens, as if the stream was cut
    resumed = client.post(
        "/v1/chat/completions",
        json={
            **body,
            "messages": [*body["messages"], {"role": "assistant", "content": partial}],
            "continue_final_message": True,
            "add_generation_prompt": False,
            "max_tokens": 20,
        },
    ).json()
    assert partial + resumed["choices"][0]["message"]["content"] == full["content"]
    assert resumed["usage"]["completion_tokens"] == 20


def test_completion_resumed_with_prompt_plus_partial_text_matches_the_uncut_one(
    client: httpx.Client, sim_server: ServedModel
) -> None:
    body = {"model": sim_server.model, "prompt": "the plan", "temperature": 0, "ignore_eos": True}
    full = client.post("/v1/completions", json={**body, "max_tokens": 24}).json()
    partial = client.post("/v1/completions", json={**body, "max_tokens": 9}).json()
    text = partial["choices"][0]["text"]
    rest = client.post(
        "/v1/completions", json={**body, "prompt": "the plan" + text, "max_tokens": 15}
    ).json()
    assert text + rest["choices"][0]["text"] == full["choices"][0]["text"]


class Finding(BaseModel):
    title: str
    severity: int = Field(ge=1, le=5)
    lines: list[int]


class Review(BaseModel):
    summary: str
    findings: list[Finding]
    approve: bool


def test_json_schema_response_format_gives_a_valid_instance(
    client: httpx.Client, sim_server: ServedModel
) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "review", "schema": Review.model_json_schema()},
    }
    body = chat_body(sim_server.model, max_tokens=500, response_format=response_format)
    answer = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert answer["finish_reason"] == "stop"
    Review.model_validate_json(answer["message"]["content"])
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        streamed = "".join(
            c["choices"][0]["delta"].get("content", "")
            for c in stream_chunks(response)
            if c["choices"]
        )
    Review.model_validate_json(streamed)


def test_structured_outputs_and_json_object_formats_give_json(
    client: httpx.Client, sim_server: ServedModel
) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    body = {"model": sim_server.model, "prompt": "count", "max_tokens": 100}
    guided = client.post("/v1/completions", json={**body, "structured_outputs": {"json": schema}})
    assert isinstance(json.loads(guided.json()["choices"][0]["text"])["n"], int)
    loose = client.post(
        "/v1/completions", json={**body, "response_format": {"type": "json_object"}}
    )
    assert isinstance(json.loads(loose.json()["choices"][0]["text"]), dict)


def test_resumed_structured_answer_completes_the_same_document(
    client: httpx.Client, sim_server: ServedModel
) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "review", "schema": Review.model_json_schema()},
    }
    body = chat_body(sim_server.model, max_tokens=500, response_format=response_format, seed=1)
    document = client.post("/v1/chat/completions", json=body).json()
    full = document["choices"][0]["message"]["content"]
    partial = full[: len(full) // 2]
    resumed = client.post(
        "/v1/chat/completions",
        json={
            **body,
            "messages": [*body["messages"], {"role": "assistant", "content": partial}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    ).json()
    Review.model_validate_json(partial + resumed["choices"][0]["message"]["content"])


def test_stop_string_ends_the_text_before_it(client: httpx.Client, sim_server: ServedModel) -> None:
    body = {"model": sim_server.model, "prompt": "go", "max_tokens": 40, "temperature": 0}
    body["ignore_eos"] = True
    text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = text.split()[5]
    expected = text[: text.index(" " + stop)] + " "
    for stream in (False, True):
        request = {**body, "stop": [stop], "stream": stream}
        if stream:
            with client.stream("POST", "/v1/completions", json=request) as response:
                chunks = list(stream_chunks(response))
            got = "".join(c["choices"][0]["text"] for c in chunks)
            last = chunks[-1]["choices"][0]
        else:
            last = client.post("/v1/completions", json=request).json()["choices"][0]
            got = last["text"]
        assert got == expected
        assert last["finish_reason"] == "stop" and last["stop_reason"] == stop


def test_continuous_usage_stats_count_tokens_in_every_chunk(
    client: httpx.Client, sim_server: ServedModel
) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = chat_body(
        sim_server.model, max_tokens=5, ignore_eos=True, stream=True, stream_options=options
    )
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        chunks = list(stream_chunks(response))
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == [0, 1, 2, 3, 4, 5, 5]


def test_metrics_count_cached_tokens_and_finished_requests(
    sim_server_factory: Factory,
) -> None:
    server = sim_server_factory()
    prompt = "the plan is to review the draft " * 20
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        for _ in range(2):
            body = {"prompt": prompt, "max_tokens": 3, "ignore_eos": True}
            http.post("/v1/completions", json=body)
        metrics = http.get("/metrics").text
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm:") and "{" in line and "_bucket" not in line
    }
    assert values["vllm:prefix_cache_hits_total"] > 0
    assert values["vllm:prefix_cache_hits_total"] % server.block_size == 0
    assert values["vllm:generation_tokens_total"] == 6
    assert values["vllm:e2e_request_latency_seconds_count"] == 2
    success = [
        sample
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "vllm:request_success_total"
    ]
    assert {s.labels["finished_reason"]: s.value for s in success}["length"] == 2


@pytest.mark.parametrize(
    ("header", "status", "error_type"),
    [
        ("error=503", 503, "ServiceUnavailableError"),
        ("error=500", 500, "InternalServerError"),
        ("error=429", 429, "RateLimitError"),
    ],
)
def test_error_fault_answers_with_the_status_and_vllm_error_body(
    client: httpx.Client, sim_server: ServedModel, header: str, status: int, error_type: str
) -> None:
    response = client.post(
        "/v1/chat/completions",
        json=chat_body(sim_server.model, max_tokens=3),
        headers={"x-kvflow-fault": header},
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert error["type"] == error_type and error["code"] == status


def test_error_rate_is_deterministic_for_a_seed(sim_server_factory: Factory) -> None:
    def statuses(server: SimServer) -> list[int]:
        with httpx.Client(base_url=server.base_url, timeout=30) as http:
            return [
                http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code
                for _ in range(16)
            ]

    faults = {"error_rate": 0.5, "error_code": 500}
    first = statuses(sim_server_factory(seed=3, faults=faults))
    second = statuses(sim_server_factory(seed=3, faults=faults))
    assert first == second
    assert set(first) == {200, 500}


def test_latency_fault_delays_the_answer(client: httpx.Client, sim_server: ServedModel) -> None:
    started = time.monotonic()
    response = client.post(
        "/v1/completions",
        json={"model": sim_server.model, "prompt": "x", "max_tokens": 1},
        headers={"x-kvflow-fault": "latency_ms=300"},
    )
    assert response.status_code == 200
    assert time.monotonic() - started >= 0.3


def test_disconnect_fault_cuts_the_stream_after_n_tokens(
    client: httpx.Client, sim_server: ServedModel
) -> None:
    body = chat_body(sim_server.model, max_tokens=50, ignore_eos=True, stream=True)
    received: list[dict[str, Any]] = []
    with (
        pytest.raises(httpx.RemoteProtocolError),
        client.stream(
            "POST",
            "/v1/chat/completions",
            json=body,
            headers={"x-kvflow-fault": "disconnect_after=7"},
        ) as response,
    ):
        received.extend(stream_chunks(response))
    content = [c for c in received if c["choices"][0]["delta"].get("content")]
    assert len(content) == 7
    assert client.get("/health").status_code == 200


def test_disconnect_fault_on_a_plain_request_is_a_transport_error(
    client: httpx.Client, sim_server: ServedModel
) -> None:
    with pytest.raises(httpx.RemoteProtocolError):
        client.post(
            "/v1/completions",
            json={"model": sim_server.model, "prompt": "x", "max_tokens": 20, "ignore_eos": True},
            headers={"x-kvflow-fault": "disconnect_after=3"},
        )


def test_stall_fault_stops_the_stream_until_the_client_gives_up(
    sim_server: ServedModel,
) -> None:
    body = chat_body(sim_server.model, max_tokens=50, ignore_eos=True, stream=True)
    timeout = httpx.Timeout(30.0, read=0.5)
    received: list[dict[str, Any]] = []
    with httpx.Client(base_url=sim_server.base_url, timeout=timeout) as http:
        with (
            pytest.raises(httpx.ReadTimeout),
            http.stream(
                "POST",
                "/v1/chat/completions",
                json=body,
                headers={"x-kvflow-fault": "stall_after=4"},
            ) as response,
        ):
            received.extend(stream_chunks(response))
        assert len([c for c in received if c["choices"][0]["delta"].get("content")]) == 4
        assert http.get("/health").status_code == 200


def test_stall_with_a_duration_resumes_and_finishes(
    client: httpx.Client, sim_server: ServedModel
) -> None:
    body = chat_body(sim_server.model, max_tokens=6, ignore_eos=True, stream=True)
    headers = {"x-kvflow-fault": "stall_after=2; stall_ms=200"}
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        chunks = list(stream_chunks(response))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_crash_fault_drops_every_connection_and_stops_listening(
    sim_server_factory: Factory,
) -> None:
    server = sim_server_factory()
    body = {"prompt": "x", "max_tokens": 50, "ignore_eos": True, "stream": True}
    headers = {"x-kvflow-fault": "crash_after=5"}
    with httpx.Client(base_url=server.base_url, timeout=10) as http:
        with (
            pytest.raises(httpx.RemoteProtocolError),
            http.stream("POST", "/v1/completions", json=body, headers=headers) as response,
        ):
            for _ in response.iter_lines():
                pass
        deadline = time.monotonic() + 5
        while server.running and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(httpx.ConnectError):
            http.get("/health")


def test_slow_replica_fault_makes_every_step_slower(sim_server_factory: Factory) -> None:
    normal = sim_server_factory()
    slow = sim_server_factory(faults={"slowdown": 5})
    assert normal.sim is not None and slow.sim is not None
    fast_engine = next(iter(normal.sim.replica.engines.values()))
    slow_engine = next(iter(slow.sim.replica.engines.values()))
    for engine in (fast_engine, slow_engine):
        engine.add_request(SimRequest("probe", max_tokens=1, prompt_token_ids=[1] * 64), 0.0)
    assert slow_engine.step(0.0).duration == pytest.approx(5 * fast_engine.step(0.0).duration)


@pytest.mark.parametrize(
    ("path", "body", "headers"),
    [
        ("/v1/chat/completions", {"model": "llama-3.2-1b"}, {}),
        ("/v1/chat/completions", {"messages": "hello"}, {}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, {}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
            {},
        ),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, {}),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, {}),
        ("/v1/completions", {"prompt": "x", "n": 2}, {}),
        ("/v1/completions", {"prompt": [], "max_tokens": 1}, {}),
        ("/v1/completions", {"prompt": [99999999], "max_tokens": 1}, {}),
        ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema"}}, {}),
        ("/v1/completions", {"prompt": "x", "guided_json": "{not json"}, {}),
        ("/v1/completions", {"prompt": "x", "guided_json": {"$ref": "http://x"}}, {}),
        ("/v1/completions", {"prompt": "x", "response_format": {"type": "xml"}}, {}),
        ("/v1/completions", {"prompt": "x"}, {"x-kvflow-fault": "explode=1"}),
        ("/tokenize", {}, {}),
        ("/detokenize", {"tokens": [-5]}, {}),
    ],
)
def test_bad_requests_get_a_vllm_400_body_never_a_500(
    client: httpx.Client, path: str, body: dict[str, Any], headers: dict[str, str]
) -> None:
    response = client.post(path, json=body, headers=headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == 400 and error["message"]


def test_kv_events_are_published_over_zmq_and_replayed(sim_server_factory: Factory) -> None:
    folder = Path(tempfile.mkdtemp(prefix="kvflow-sim-"))
    endpoint, replay = f"ipc://{folder}/events.sock", f"ipc://{folder}/replay.sock"
    server = sim_server_factory(
        kv_events_endpoint=endpoint, kv_events_replay_endpoint=replay, kv_events_topic="kv"
    )
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv")
    subscriber.setsockopt(zmq.RCVTIMEO, 5000)
    subscriber.connect(endpoint)
    requester = context.socket(zmq.DEALER)
    requester.setsockopt(zmq.RCVTIMEO, 5000)
    requester.connect(replay)
    try:
        time.sleep(0.2)  # a SUB socket misses what is sent before it is connected
        prompt = "the plan is to review the draft and call a tool " * 6
        with httpx.Client(base_url=server.base_url, timeout=30) as http:
            http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            tokens = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
        topic, sequence, payload = subscriber.recv_multipart()
        assert topic == b"kv" and len(sequence) == 8
        raw = msgspec.msgpack.decode(payload)
        assert set(raw) >= {"ts", "events", "data_parallel_rank"}
        assert raw["events"][0]["type"] == "BlockStored"
        batch = KV_EVENT_DECODER.decode(payload)
        stored = [e for e in batch.events if isinstance(e, BlockStored)]
        assert stored[0].block_hashes == block_hashes(tokens, server.block_size)
        assert stored[0].token_ids == tokens[: len(stored[0].block_hashes) * server.block_size]
        requester.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            _, seq, data = requester.recv_multipart()
            if seq == END_SEQ:
                break
            replayed.append((int.from_bytes(seq, "big"), data))
        assert replayed[0] == (int.from_bytes(sequence, "big"), payload)
    finally:
        subscriber.close(0)
        requester.close(0)
        context.term()

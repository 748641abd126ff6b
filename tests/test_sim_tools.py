"""Function calling and logprobs on the simulated server, through the official `openai` client.

The simulator answers `tools` as vLLM started with `--enable-auto-tool-choice
--tool-call-parser ...` does: `"required"` and a named function always call a tool, `"auto"`
calls one after the user's message and answers in text after a tool result, `"none"` answers
in text. Arguments are checked against the pydantic models the tools' schemas came from.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionMessage,
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageParam,
)
from pydantic import BaseModel, ConfigDict, Field

from tests.servers import ServedModel


class WeatherQuery(BaseModel):
    """Arguments of `get_weather`."""

    model_config = ConfigDict(extra="forbid")

    location: str
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=7)


class OrderLookup(BaseModel):
    """Arguments of `lookup_order`."""

    model_config = ConfigDict(extra="forbid")

    order_id: str = Field(min_length=8)
    include_items: bool
    tags: list[str] = Field(max_length=3)


ARGUMENTS: dict[str, type[BaseModel]] = {"get_weather": WeatherQuery, "lookup_order": OrderLookup}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": model.__doc__,
            "parameters": model.model_json_schema(),
        },
    }
    for name, model in ARGUMENTS.items()
]
QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You help customers."},
    {"role": "user", "content": "what is the weather where my order goes"},
]


def named(name: str) -> Any:
    return {"type": "function", "function": {"name": name}}


@pytest.fixture
def client(sim_server: ServedModel) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{sim_server.base_url}/v1", api_key="unused", max_retries=0) as api:
        yield api


@pytest.fixture
def http(sim_server: ServedModel) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sim_server.base_url, timeout=30) as plain:
        yield plain


def ask(client: OpenAI, server: ServedModel, **extra: Any) -> ChatCompletion:
    body: dict[str, Any] = {"model": server.model, "messages": QUESTION, "seed": 11, **extra}
    answer = client.chat.completions.create(**body)
    assert isinstance(answer, ChatCompletion)
    return answer


def the_call(message: ChatCompletionMessage) -> ChatCompletionMessageFunctionToolCall:
    """The one function call of an answer."""
    calls = message.tool_calls
    assert calls is not None and len(calls) == 1
    assert isinstance(calls[0], ChatCompletionMessageFunctionToolCall)
    return calls[0]


def token_count(http: httpx.Client, server: ServedModel, **body: Any) -> int:
    response = http.post("/tokenize", json={"model": server.model, **body})
    assert response.status_code == 200, response.text
    count: int = response.json()["count"]
    return count


def test_required_tool_choice_answers_with_a_call_whose_arguments_fit_the_schema(
    client: OpenAI, http: httpx.Client, sim_server: ServedModel
) -> None:
    called = set()
    for seed in range(8):
        answer = ask(client, sim_server, tools=TOOLS, tool_choice="required", seed=seed)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == ""
        call = the_call(choice.message)
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        ARGUMENTS[call.function.name].model_validate_json(call.function.arguments)
        called.add(call.function.name)
        # The arguments are the completion: their tokens and the end of sequence.
        argument_tokens = token_count(
            http, sim_server, prompt=call.function.arguments, add_special_tokens=False
        )
        assert answer.usage is not None
        assert answer.usage.completion_tokens == argument_tokens + 1
    assert called == set(ARGUMENTS), "the seed picks among the tools"


def test_the_same_seed_gives_the_same_call_and_another_seed_other_arguments(
    client: OpenAI, sim_server: ServedModel
) -> None:
    def arguments(seed: int) -> str:
        answer = ask(client, sim_server, tools=TOOLS, tool_choice=named("lookup_order"), seed=seed)
        return the_call(answer.choices[0].message).function.arguments

    assert arguments(5) == arguments(5)
    assert arguments(5) != arguments(6)


def test_named_tool_choice_calls_that_function_and_finishes_with_stop_as_vllm_does(
    client: OpenAI, sim_server: ServedModel
) -> None:
    for name, model in ARGUMENTS.items():
        answer = ask(client, sim_server, tools=TOOLS, tool_choice=named(name))
        choice = answer.choices[0]
        # vLLM, like OpenAI, finishes a named call with "stop" and a required one with "tool_calls".
        assert choice.finish_reason == "stop"
        assert choice.message.content == ""
        call = the_call(choice.message)
        assert call.function.name == name
        model.model_validate_json(call.function.arguments)


def test_auto_tool_loop_calls_a_tool_then_answers_the_tool_result_in_text(
    client: OpenAI, http: httpx.Client, sim_server: ServedModel
) -> None:
    first = ask(client, sim_server, tools=TOOLS, tool_choice="auto")
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    call = the_call(choice.message)
    ARGUMENTS[call.function.name].model_validate_json(call.function.arguments)

    # What an agent sends back: the assistant's call, then the tool's result.
    conversation: list[ChatCompletionMessageParam] = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny, 21 C"}'},
    ]
    second = client.chat.completions.create(
        model=sim_server.model, messages=conversation, tools=TOOLS, seed=11, max_tokens=40
    )
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length")
    assert answer.message.tool_calls is None
    assert answer.message.content

    # The call and the result are prompt tokens, exactly as /tokenize renders them.
    assert second.usage is not None and first.usage is not None
    messages: list[Any] = conversation
    assert second.usage.prompt_tokens == token_count(
        http, sim_server, messages=messages, tools=TOOLS
    )
    without_call = token_count(
        http, sim_server, messages=[*messages[:2], {**messages[2], "tool_calls": None}], tools=TOOLS
    )
    assert second.usage.prompt_tokens > without_call
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


def test_tool_choice_none_answers_in_text_with_the_tools_in_the_prompt(
    client: OpenAI, http: httpx.Client, sim_server: ServedModel
) -> None:
    with_tools = ask(client, sim_server, tools=TOOLS, tool_choice="none", max_tokens=20)
    plain = ask(client, sim_server, max_tokens=20)
    choice = with_tools.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert with_tools.usage is not None and plain.usage is not None
    messages: list[Any] = QUESTION
    assert with_tools.usage.prompt_tokens == token_count(
        http, sim_server, messages=messages, tools=TOOLS
    )
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens


@pytest.mark.parametrize("tool_choice", ["required", "auto", "lookup_order"])
def test_streamed_tool_call_assembles_to_the_answer_without_streaming(
    client: OpenAI, sim_server: ServedModel, tool_choice: str
) -> None:
    choice_param: Any = named(tool_choice) if tool_choice in ARGUMENTS else tool_choice
    whole = ask(client, sim_server, tools=TOOLS, tool_choice=choice_param)
    stream = client.chat.completions.create(
        model=sim_server.model,
        messages=QUESTION,
        seed=11,
        tools=TOOLS,
        tool_choice=choice_param,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [
        delta_calls
        for c in chunks
        if c.choices and (delta_calls := c.choices[0].delta.tool_calls) is not None
    ]
    # As vLLM's hermes parser streams: a piece naming the call, then the arguments piece by piece.
    head = pieces[0][0]
    assert head.index == 0 and head.type == "function"
    assert head.id is not None and head.id.startswith("chatcmpl-tool-")
    assert head.function is not None and head.function.name is not None
    assert head.function.arguments is None
    arguments = ""
    for piece in pieces[1:]:
        assert len(piece) == 1 and piece[0].index == 0 and piece[0].id is None
        function = piece[0].function
        assert function is not None and function.name is None and function.arguments
        arguments += function.arguments
    ends = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(ends) == 1 and ends[0] is chunks[-2].choices[0]
    assert ends[0].delta.tool_calls is None and ends[0].delta.content is None

    call = the_call(whole.choices[0].message)
    assert (head.function.name, arguments) == (call.function.name, call.function.arguments)
    assert ends[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_a_tool_call_cut_by_max_tokens_finishes_with_length(
    client: OpenAI, sim_server: ServedModel
) -> None:
    answer = ask(client, sim_server, tools=TOOLS, tool_choice="required", max_tokens=3)
    choice = answer.choices[0]
    assert choice.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(the_call(choice.message).function.arguments)
    assert answer.usage is not None and answer.usage.completion_tokens == 3


def test_logprobs_give_every_output_token_and_its_top_alternatives(
    client: OpenAI, sim_server: ServedModel
) -> None:
    answer = ask(client, sim_server, max_tokens=30, logprobs=True, top_logprobs=3)
    again = ask(client, sim_server, max_tokens=30, logprobs=True, top_logprobs=3)
    choice = answer.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert answer.usage is not None and len(entries) == answer.usage.completion_tokens
    for entry in entries:
        assert entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == (
            entry.token,
            entry.logprob,
        )
        values = [top.logprob for top in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and len(set(values)) == 3
    text = "".join(e.token for e in entries if e.token != "<|eos|>")
    assert text == choice.message.content
    assert again.choices[0].logprobs == choice.logprobs, "the seed fixes the logprobs"

    zero = ask(client, sim_server, max_tokens=5, logprobs=True, top_logprobs=0)
    assert zero.choices[0].logprobs is not None and zero.choices[0].logprobs.content
    assert all(e.top_logprobs == [] for e in zero.choices[0].logprobs.content)
    assert ask(client, sim_server, max_tokens=5).choices[0].logprobs is None


def test_streamed_logprobs_come_with_each_delta_and_match_the_whole_answer(
    client: OpenAI, sim_server: ServedModel
) -> None:
    whole = ask(client, sim_server, max_tokens=30, logprobs=True, top_logprobs=2)
    stream = client.chat.completions.create(
        model=sim_server.model,
        messages=QUESTION,
        seed=11,
        max_tokens=30,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    streamed = []
    for chunk in stream:
        choice = chunk.choices[0]
        if choice.delta.role is not None:
            continue  # the role chunk comes before any token
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert "".join(e.token for e in choice.logprobs.content).startswith(
            choice.delta.content or ""
        )
        streamed += choice.logprobs.content
    assert whole.choices[0].logprobs is not None
    assert streamed == whole.choices[0].logprobs.content


def bad_request(client: OpenAI, server: ServedModel, **extra: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, server, max_tokens=4, **extra)
    body: dict[str, Any] = caught.value.response.json()
    error: dict[str, Any] = body["error"]
    assert error["code"] == 400 and error["message"]
    return error


REFUSED: list[Any] = [
    pytest.param({"tools": TOOLS, "tool_choice": named("cancel_order")}, "tool_choice", id="name"),
    pytest.param({"tool_choice": "required"}, "tool_choice", id="no-tools"),
    pytest.param({"tool_choice": named("get_weather")}, "tool_choice", id="named-no-tools"),
    pytest.param({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", id="choice"),
    pytest.param(
        {"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function", id="function"
    ),
    pytest.param({"tools": []}, "tools", id="empty-tools"),
    pytest.param({"logprobs": True, "top_logprobs": -2}, "top_logprobs", id="negative-top"),
    pytest.param({"top_logprobs": 2}, "top_logprobs", id="top-without-logprobs"),
    pytest.param({"logprobs": True, "top_logprobs": 21}, "logprobs", id="top-over-20"),
]
SERVERS = ["sim_server", pytest.param("vllm_server", marks=pytest.mark.vllm)]


@pytest.fixture(params=SERVERS)
def any_client(request: pytest.FixtureRequest) -> Iterator[tuple[OpenAI, ServedModel]]:
    """A client of the simulator, then of real vLLM (tests/fixtures_vllm.py)."""
    server: ServedModel = request.getfixturevalue(request.param)
    with OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as api:
        yield api, server


@pytest.mark.parametrize(("extra", "param"), REFUSED)
def test_tool_and_logprobs_parameters_vllm_refuses_are_a_bad_request_naming_them(
    any_client: tuple[OpenAI, ServedModel], extra: dict[str, Any], param: str
) -> None:
    error = bad_request(*any_client, **extra)
    assert error["type"] == "BadRequestError"
    assert error["param"] == param
    assert f"(parameter={param}" in error["message"]


def test_logprobs_have_the_shape_real_vllm_gives_them(
    any_client: tuple[OpenAI, ServedModel],
) -> None:
    client, server = any_client
    answer = ask(client, server, max_tokens=6, logprobs=True, top_logprobs=2)
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert answer.usage is not None and len(logprobs.content) == answer.usage.completion_tokens
    for entry in logprobs.content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token

    stream = client.chat.completions.create(
        model=server.model,
        messages=QUESTION,
        seed=11,
        max_tokens=6,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    streamed = 0
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        if chunk.choices and (chunk_logprobs := chunk.choices[0].logprobs) is not None:
            streamed += len(chunk_logprobs.content or [])
    assert usage is not None and streamed == usage.completion_tokens


def test_tools_with_tool_choice_none_are_accepted_and_answered_in_text(
    any_client: tuple[OpenAI, ServedModel],
) -> None:
    client, server = any_client
    choice = ask(client, server, tools=TOOLS, tool_choice="none", max_tokens=6).choices[0]
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")


def test_a_tool_schema_the_simulator_cannot_fill_is_a_bad_request_naming_tools(
    client: OpenAI, sim_server: ServedModel
) -> None:
    impossible = {
        "type": "function",
        "function": {
            "name": "count",
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}},
                "required": ["n"],
            },
        },
    }
    error = bad_request(client, sim_server, tools=[impossible], tool_choice="required")
    assert error["type"] == "BadRequestError" and error["param"] == "tools"

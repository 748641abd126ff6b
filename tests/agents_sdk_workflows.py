"""Workflows of `tests/test_contrib_openai_agents.py`: OpenAI Agents SDK agents on kvflow.

They live apart from the tests so that the workflow sandbox, which imports a workflow's module
for every run, imports only what they need.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any, Literal

import agents
from agents import (
    GuardrailFunctionOutput,
    ModelSettings,
    RunContextWrapper,
    Runner,
    function_tool,
    input_guardrail,
    output_guardrail,
)
from pydantic import BaseModel, Field
from temporalio import activity, workflow
from temporalio.exceptions import ApplicationError
from temporalio.openai_agents.workflow import activity_as_tool

import samples.openai_agents_travel as travel
from kvflow import Agent, ChatMessage, TaskSpec, ToolSpec
from kvflow.activities.wire import Sampling

MODEL = "llama-3.2-1b"

WRITER = "Write a short paragraph about the sea."


class OneAgentInput(BaseModel):
    spec: TaskSpec
    model: str = MODEL
    kvflow_block: bool = True


class RunOutput(BaseModel):
    final_output: str
    requests: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    tool_outputs: list[str] = Field(default_factory=list)


def _output(result: agents.RunResult) -> RunOutput:
    usage = result.context_wrapper.usage
    return RunOutput(
        final_output=str(result.final_output),
        requests=usage.requests,
        input_tokens=usage.input_tokens,
        cached_tokens=usage.input_tokens_details.cached_tokens,
        output_tokens=usage.output_tokens,
        tool_outputs=[
            str(item.output)
            for item in result.new_items
            if isinstance(item, agents.ToolCallOutputItem)
        ],
    )


@workflow.defn
class Writer:
    """One agent, no tools, a long text answer: what a cut replica interrupts."""

    @workflow.run
    async def run(self, task: OneAgentInput) -> RunOutput:
        writer = agents.Agent(
            name="writer",
            instructions="You write about the sea.",
            model=task.model,
            model_settings=ModelSettings(max_tokens=60, extra_args={"ignore_eos": True}),
        )
        if not task.kvflow_block:
            return _output(await Runner.run(writer, WRITER))
        async with Agent(task.spec):
            return _output(await Runner.run(writer, WRITER))


WEATHER_QUESTION = "What will the weather be like in Lisbon on Friday?"


@workflow.defn
class SdkWeather:
    """The travel agent's weather turn, through the Agents SDK."""

    @workflow.run
    async def run(self, task: OneAgentInput) -> RunOutput:
        weather_agent = agents.Agent(
            name="weather-agent",
            instructions=travel.workflow.INSTRUCTIONS,
            model=task.model,
            tools=[travel.workflow.get_weather],
            # Greedy, as DirectWeather's `Sampling()`: the same tokens, hence the same bill.
            model_settings=ModelSettings(tool_choice="required", max_tokens=80, temperature=0),
        )
        async with Agent(task.spec):
            return _output(await Runner.run(weather_agent, WEATHER_QUESTION))


@workflow.defn
class DirectWeather:
    """The same turn through `Agent.infer`: call the tool the model asks for, ask again."""

    @workflow.run
    async def run(self, task: OneAgentInput) -> RunOutput:
        tool = travel.workflow.get_weather
        spec = ToolSpec(
            name=tool.name,
            description=tool.description,
            parameters=tool.params_json_schema,
            strict=tool.strict_json_schema,
        )
        chat = [
            ChatMessage(role="system", content=travel.workflow.INSTRUCTIONS),
            ChatMessage(role="user", content=WEATHER_QUESTION),
        ]
        choice: str | None = "required"
        agent = Agent(task.spec)
        async with agent:
            while True:
                result = await agent.infer(
                    chat,
                    model=task.model,
                    max_tokens=80,
                    tools=[spec],
                    tool_choice=choice,
                    sampling=Sampling(),
                    step="weather-agent",
                )
                if not result.tool_calls:
                    return RunOutput(
                        final_output=result.text,
                        requests=0,
                        input_tokens=0,
                        cached_tokens=0,
                        output_tokens=0,
                    )
                chat.append(
                    ChatMessage(role="assistant", content=result.text, tool_calls=result.tool_calls)
                )
                for call in result.tool_calls:
                    answer = travel.workflow.forecast(**json.loads(call.arguments))
                    chat.append(ChatMessage(role="tool", tool_call_id=call.id, content=answer))
                choice = None  # what the SDK's reset_tool_choice does after a tool call


@activity.defn
async def book_hotel(city: str) -> str:
    """Book a hotel in `city`.

    Args:
        city: where to book.

    """
    raise ApplicationError(f"no rooms left in {city}", non_retryable=True)


@function_tool
async def check_visa(country: str) -> str:
    """Whether a visa is needed for `country`.

    Args:
        country: the country to check.

    """
    raise ValueError(f"the visa service does not know {country!r}")


class ToolFailureInput(BaseModel):
    spec: TaskSpec
    activity_tool: bool


@workflow.defn
class FailingTool:
    """An agent whose only tool fails: an activity tool, or a function tool."""

    @workflow.run
    async def run(self, task: ToolFailureInput) -> RunOutput:
        tool = (
            activity_as_tool(book_hotel, start_to_close_timeout=timedelta(seconds=5))
            if task.activity_tool
            else check_visa
        )
        agent = agents.Agent(
            name="booking-agent",
            instructions="Use your tool, then answer.",
            model=MODEL,
            tools=[tool],
            model_settings=ModelSettings(tool_choice="required", max_tokens=40),
        )
        async with Agent(task.spec):
            return _output(await Runner.run(agent, "Plan my stay in Oslo."))


@workflow.defn
class Triage:
    """A triage agent that hands the traveller off to a flight agent, which answers."""

    @workflow.run
    async def run(self, task: OneAgentInput) -> RunOutput:
        flights = agents.Agent(
            name="flight-agent",
            instructions="Recommend a flight.",
            model=task.model,
            model_settings=ModelSettings(max_tokens=40),
        )
        triage = agents.Agent(
            name="triage-agent",
            instructions="Hand the traveller to the right agent.",
            model=task.model,
            handoffs=[flights],
            model_settings=ModelSettings(tool_choice="transfer_to_flight_agent", max_tokens=40),
        )
        async with Agent(task.spec):
            result = await Runner.run(triage, "I need a flight to Oslo.")
        out = _output(result)
        out.final_output = f"{result.last_agent.name}: {out.final_output}"
        return out


class SettingsInput(BaseModel):
    spec: TaskSpec
    settings: dict[str, Any] = Field(default_factory=dict)
    """The writer's `ModelSettings` besides its output bound."""


@workflow.defn
class ConfiguredWriter:
    """The writer, with the model settings the test gives."""

    @workflow.run
    async def run(self, task: SettingsInput) -> RunOutput:
        writer = agents.Agent(
            name="writer",
            instructions="You write about the sea.",
            model=MODEL,
            model_settings=ModelSettings(**{"max_tokens": 30, **task.settings}),
        )
        async with Agent(task.spec):
            return _output(await Runner.run(writer, WRITER))


@input_guardrail(run_in_parallel=False)
async def no_questions(
    context: RunContextWrapper[Any], agent: agents.Agent[Any], input: Any
) -> GuardrailFunctionOutput:
    """Trips on any input."""
    return GuardrailFunctionOutput(output_info="a question", tripwire_triggered=True)


@output_guardrail
async def no_answers(
    context: RunContextWrapper[Any], agent: agents.Agent[Any], output: Any
) -> GuardrailFunctionOutput:
    """Trips on any output."""
    return GuardrailFunctionOutput(output_info="an answer", tripwire_triggered=True)


class Forecast(BaseModel):
    city: str
    sky: str
    temperature_c: int


SdkError = Literal["max_turns", "input_guardrail", "output_guardrail", "cut_output", "timeout"]


class SdkErrorInput(BaseModel):
    spec: TaskSpec
    error: SdkError


@workflow.defn
class EndsInSdkError:
    """A run the Agents SDK ends with one of its own errors (`SdkErrorInput.error`)."""

    @workflow.run
    async def run(self, task: SdkErrorInput) -> RunOutput:
        settings = ModelSettings(max_tokens=40)
        agent = agents.Agent(name="weather-agent", model=MODEL, model_settings=settings)
        max_turns = 10
        if task.error == "max_turns":
            # A tool call, then the answer: two turns.
            agent = agent.clone(
                tools=[travel.workflow.get_weather],
                model_settings=ModelSettings(tool_choice="required", max_tokens=80),
            )
            max_turns = 1
        elif task.error == "input_guardrail":
            agent = agent.clone(input_guardrails=[no_questions])
        elif task.error == "output_guardrail":
            agent = agent.clone(output_guardrails=[no_answers])
        elif task.error == "cut_output":
            # Structured output cut short by its output bound: JSON the SDK cannot parse.
            agent = agent.clone(output_type=Forecast, model_settings=ModelSettings(max_tokens=3))
        elif task.error == "timeout":
            agent = agent.clone(model_settings=ModelSettings(max_tokens=40, timeout=1.0))
        async with Agent(task.spec):
            return _output(await Runner.run(agent, WEATHER_QUESTION, max_turns=max_turns))


Refusal = Literal["previous_response_id", "conversation_id", "prompt", "no_model", "streamed"]


class RefusalInput(BaseModel):
    spec: TaskSpec
    refusal: Refusal


@workflow.defn
class RefusedRun:
    """A run that asks for what kvflow does not offer (`RefusalInput.refusal`)."""

    @workflow.run
    async def run(self, task: RefusalInput) -> RunOutput:
        writer = agents.Agent(
            name="writer", model=MODEL, model_settings=ModelSettings(max_tokens=20)
        )
        async with Agent(task.spec):
            if task.refusal == "previous_response_id":
                result = await Runner.run(writer, WRITER, previous_response_id="resp_123")
            elif task.refusal == "conversation_id":
                result = await Runner.run(writer, WRITER, conversation_id="conv_123")
            elif task.refusal == "prompt":
                stored = writer.clone(prompt={"id": "pmpt_123"})
                result = await Runner.run(stored, WRITER)
            elif task.refusal == "no_model":
                result = await Runner.run(writer.clone(model=None), WRITER)
            else:
                streamed = Runner.run_streamed(writer, WRITER)
                async for _ in streamed.stream_events():
                    pass
                return RunOutput(
                    final_output=str(streamed.final_output),
                    requests=0,
                    input_tokens=0,
                    cached_tokens=0,
                    output_tokens=0,
                )
        return _output(result)


WORKFLOWS = [
    travel.WORKFLOW,
    Writer,
    SdkWeather,
    DirectWeather,
    FailingTool,
    Triage,
    ConfiguredWriter,
    EndsInSdkError,
    RefusedRun,
]
ACTIVITIES = [*travel.ACTIVITIES, book_hotel]

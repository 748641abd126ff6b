"""Travel agent: an OpenAI Agents SDK agent, two tools, kvflow placing and billing its calls.

The agent is written as for Temporal's OpenAI Agents integration: `agents.Agent`, a
`function_tool` that runs in the workflow (`get_weather`) and an activity given to it with
`activity_as_tool` (`find_flights`). Two turns of one conversation: the first looks up the
weather and answers, the second (the first's items, then the traveller's next question) looks
up flights and recommends one. Each turn is a tool call and an answer: four model calls.

What kvflow adds is the `Agent(task.spec)` block: every model call inside it is a step of the
task, named after the agent, placed on a GPU worker by KV-cache affinity (the second turn
repeats the first, so it stays where that prefix is cached), resumed elsewhere if a replica
fails mid-answer, and billed in the ledger.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta

import agents
from agents import ModelSettings, Runner, ToolCallItem, function_tool
from pydantic import BaseModel, Field
from temporalio import workflow
from temporalio.openai_agents.workflow import activity_as_tool

from kvflow import Agent, TaskSpec

with workflow.unsafe.imports_passed_through():
    from .activities import find_flights

MODEL = "llama-3.2-1b"
INSTRUCTIONS = (
    "You are a travel agent. Look up the weather with get_weather and flights with "
    "find_flights, then answer the traveller in two or three sentences."
)
_SKIES = ["sunny", "partly cloudy", "overcast", "light rain", "windy", "clear"]


def forecast(city: str, day: str) -> str:
    """A deterministic stand-in for a weather service's forecast for `city` on `day`."""
    # The tool runs inside the workflow: it must answer the same when the workflow replays.
    seed = hashlib.sha256(f"{city}|{day}".lower().encode()).digest()
    return f"{city} on {day}: {_SKIES[seed[0] % len(_SKIES)]}, {8 + seed[1] % 22} °C"


@function_tool
async def get_weather(city: str, day: str) -> str:
    """The weather forecast for `city` on `day`.

    Args:
        city: the city to forecast.
        day: the day of the forecast, e.g. "Friday".

    """
    return forecast(city, day)


class TravelTask(BaseModel):
    """A trip to plan: where from, where to, when."""

    spec: TaskSpec
    origin: str = Field(min_length=1)
    destination: str = Field(min_length=1)
    day: str = Field(min_length=1)
    model: str = Field(default=MODEL, description="a model of the kvflow fleet")
    name_tools: bool = Field(
        default=True,
        description="each turn names the tool it starts with; off, the model chooses (auto)",
    )


class TravelPlan(BaseModel):
    """The agent's two answers and what the SDK counted for them."""

    weather: str
    answer: str
    tools_called: list[str]
    model_calls: int
    input_tokens: int
    output_tokens: int


@workflow.defn
class TravelAgent:
    """Ask about the weather, then about flights: one agent, two tools, four model calls."""

    @workflow.run
    async def run(self, task: TravelTask) -> TravelPlan:
        """Plan the trip; the `kvflow_spend` query shows every model call's cost."""
        travel_agent = agents.Agent(
            name="travel-agent",
            instructions=INSTRUCTIONS,
            model=task.model,
            tools=[
                get_weather,
                activity_as_tool(find_flights, start_to_close_timeout=timedelta(seconds=10)),
            ],
            # Each turn starts with the lookup it is about; the SDK then lets the model answer.
            # (The simulated fleet's model calls a tool only when told; a real one decides.)
            model_settings=ModelSettings(
                tool_choice="get_weather" if task.name_tools else "auto", max_tokens=160
            ),
        )
        async with Agent(task.spec):
            weather = await Runner.run(
                travel_agent,
                f"I fly from {task.origin} to {task.destination} on {task.day}. "
                "What will the weather be like there?",
            )
            flights = await Runner.run(
                travel_agent.clone(
                    model_settings=ModelSettings(
                        tool_choice="find_flights" if task.name_tools else "auto", max_tokens=160
                    )
                ),
                [
                    *weather.to_input_list(),
                    {"role": "user", "content": "Which flight should I take?"},
                ],
            )
        runs = [weather, flights]
        usage = [run.context_wrapper.usage for run in runs]
        return TravelPlan(
            weather=str(weather.final_output),
            answer=str(flights.final_output),
            tools_called=[
                str(getattr(item.raw_item, "name", ""))
                for run in runs
                for item in run.new_items
                if isinstance(item, ToolCallItem)
            ],
            model_calls=sum(u.requests for u in usage),
            input_tokens=sum(u.input_tokens for u in usage),
            output_tokens=sum(u.output_tokens for u in usage),
        )

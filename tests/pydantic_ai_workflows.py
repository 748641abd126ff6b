"""Workflows and agents the `kvflow.contrib.pydantic_ai` tests run (a real worker runs them)."""

from __future__ import annotations

import json

from pydantic import BaseModel
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from pydantic_ai import Agent as PydanticAgent
    from pydantic_ai import ModelRetry
    from pydantic_ai.durable_exec.temporal import TemporalDurability
    from pydantic_ai.models.test import TestModel

    from kvflow import Agent, ChatMessage, TaskSpec, ToolSpec
    from kvflow.activities.wire import Sampling
    from kvflow.contrib.pydantic_ai import KvflowDurability, KvflowModel
    from samples.pydantic_ai_support.workflow import (
        INSTRUCTIONS,
        MODEL,
        SupportReply,
        SupportTask,
        lookup_order,
        support,
    )


class Question(BaseModel):
    spec: TaskSpec
    question: str


brief = PydanticAgent(
    KvflowModel(MODEL),
    name="brief",
    instructions="You are a careful research agent. Answer in full.",
    model_settings={"max_tokens": 60, "temperature": 0.0},
    capabilities=[KvflowDurability()],
)
"""A text answer and no tools: the call a crashing replica cuts."""


@workflow.defn
class BriefAnswer:
    __pydantic_ai_agents__ = (brief,)

    @workflow.run
    async def run(self, task: Question) -> str:
        async with Agent(task.spec):
            return (await brief.run(task.question)).output


picky = PydanticAgent(
    KvflowModel(MODEL),
    name="picky",
    model_settings={"max_tokens": 40, "temperature": 0.0},
    capabilities=[KvflowDurability()],
)
"""An agent whose tool always asks the model to try again (`ModelRetry`)."""


@picky.tool_plain
async def find_invoice(invoice_id: str) -> str:
    """Find an invoice by its id."""
    raise ModelRetry(f"no invoice {invoice_id!r}: invoice ids look like INV-2024-0001")


@workflow.defn
class PickyLookup:
    __pydantic_ai_agents__ = (picky,)

    @workflow.run
    async def run(self, task: Question) -> list[str]:
        async with Agent(task.spec):
            result = await picky.run(task.question)
        # What each model request received: the tool's retry prompt comes back to the model.
        return [message.kind for message in result.all_messages()] + [result.output]


mixed = PydanticAgent(
    KvflowModel(MODEL),
    name="mixed",
    model_settings={"max_tokens": 20, "temperature": 0.0},
    capabilities=[KvflowDurability(models={"offline": TestModel(custom_output_text="offline")})],
)
"""On the fleet by default; a registered model of another provider on request."""


@workflow.defn
class MixedModels:
    __pydantic_ai_agents__ = (mixed,)

    @workflow.run
    async def run(self, task: Question) -> list[str]:
        async with Agent(task.spec):
            on_fleet = await mixed.run(task.question)
            offline = await mixed.run(task.question, model="offline")
        return [on_fleet.output, offline.output]


bypassing = PydanticAgent(KvflowModel(MODEL), name="bypassing", capabilities=[TemporalDurability()])
"""A fleet model under Pydantic AI's own durability: its calls would go to an activity."""


@workflow.defn
class Bypassing:
    __pydantic_ai_agents__ = (bypassing,)

    @workflow.run
    async def run(self, task: Question) -> str:
        async with Agent(task.spec):
            return (await bypassing.run(task.question)).output


@workflow.defn
class Unbracketed:
    """Runs the sample's agent without `async with Agent(spec):`: nothing would bill it."""

    __pydantic_ai_agents__ = (support,)

    @workflow.run
    async def run(self, task: SupportTask) -> str:
        return (await support.run(task.question)).output.reply


@workflow.defn
class StreamedSupport:
    """Streams the sample's agent, which kvflow refuses with the fix."""

    __pydantic_ai_agents__ = (support,)

    @workflow.run
    async def run(self, task: SupportTask) -> str:
        async with Agent(task.spec), support.run_stream(task.question) as streamed:
            return (await streamed.get_output()).reply


LOOKUP = ToolSpec(
    name="lookup_order",
    description="Look an order up by its id: where it is and when it is due.",
    parameters={
        "additionalProperties": False,
        "properties": {"order_id": {"type": "string"}},
        "required": ["order_id"],
        "type": "object",
    },
)
"""The sample's tool as a hand-written `ToolSpec`."""
REPLY_SCHEMA = {
    "properties": {
        "reply": {"description": "what to tell the customer", "maxLength": 300, "type": "string"},
        "escalate": {
            "description": "whether a person should follow the case up",
            "type": "boolean",
        },
    },
    "required": ["reply", "escalate"],
    "title": "SupportReply",
    "type": "object",
}
"""`SupportReply`'s schema as the native output asks for it."""


@workflow.defn
class DirectSupport:
    """The sample's conversation written against `Agent.infer`, without Pydantic AI."""

    @workflow.run
    async def run(self, task: SupportTask) -> SupportReply:
        async with Agent(task.spec) as agent:
            chat = [
                ChatMessage(role="system", content=INSTRUCTIONS),
                ChatMessage(role="user", content=task.question),
            ]
            while True:
                result = await agent.infer(
                    chat,
                    model=MODEL,
                    max_tokens=200,
                    tools=[LOOKUP],
                    tool_choice="auto",
                    json_schema=REPLY_SCHEMA,
                    sampling=Sampling(temperature=0.0, top_p=None),  # as the agent sets them
                    step="support",
                )
                if not result.tool_calls:
                    return SupportReply.model_validate_json(await agent.text_of(result))
                chat.append(
                    ChatMessage(role="assistant", content=result.text, tool_calls=result.tool_calls)
                )
                for call in result.tool_calls:
                    answer = await lookup_order(**json.loads(call.arguments))
                    chat.append(ChatMessage(role="tool", tool_call_id=call.id, content=answer))


ALL_WORKFLOWS: list[type] = [
    BriefAnswer,
    PickyLookup,
    MixedModels,
    Unbracketed,
    StreamedSupport,
    DirectSupport,
]

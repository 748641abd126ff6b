"""A support agent written with Pydantic AI, durable with Temporal, its model calls on kvflow.

The agent is plain Pydantic AI: instructions, one tool (`lookup_order`), structured output
(`SupportReply`). What makes it kvflow's is its model (`KvflowModel`, a model of the fleet) and
its durability capability (`KvflowDurability` in place of `TemporalDurability`): the tool still
runs as an activity, and each model call is placed, streamed, resumed and billed by kvflow.
The workflow runs the agent inside `async with Agent(task.spec):`, the task's bracket that
records its outcome and spend in the ledger.
"""

from __future__ import annotations

from pydantic import BaseModel, Field
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from pydantic_ai import Agent as PydanticAgent
    from pydantic_ai import NativeOutput

    from kvflow import Agent, TaskSpec
    from kvflow.contrib.pydantic_ai import KvflowDurability, KvflowModel

MODEL = "llama-3.2-1b"
INSTRUCTIONS = (
    "You are the support desk of an online shop. Look the customer's order up before you "
    "answer, answer in two sentences, and escalate when the order is late or missing."
)


class SupportReply(BaseModel):
    """The agent's structured answer."""

    # Two sentences fit; the engine's JSON grammar holds the model to it as well.
    reply: str = Field(description="what to tell the customer", max_length=300)
    escalate: bool = Field(description="whether a person should follow the case up")


ORDERS = {
    "A-1001": "shipped on 3 March with ParcelCo, tracking PC-88231, due 6 March",
    "A-1002": "packed, waiting for the carrier; due 9 March",
    "A-1003": "delivered on 2 March, signed for by J. Smith",
}
"""The shop's orders, as the order desk would report them."""


support = PydanticAgent(
    KvflowModel(MODEL),
    name="support",
    instructions=INSTRUCTIONS,
    output_type=NativeOutput(SupportReply),
    model_settings={"max_tokens": 200, "temperature": 0.0},
    capabilities=[KvflowDurability()],
)
"""Built at import, outside any workflow, so the worker can register its tool's activity."""


@support.tool_plain
async def lookup_order(order_id: str) -> str:
    """Look an order up by its id: where it is and when it is due."""
    status = ORDERS.get(order_id.strip().upper())
    if status is None:
        return f"No order {order_id!r} is on file. Known ids look like A-1001."
    return f"Order {order_id.strip().upper()}: {status}."


class SupportTask(BaseModel):
    """The workflow's input: the task's budgets and the customer's question."""

    spec: TaskSpec
    question: str


class SupportAnswer(BaseModel):
    """The workflow's result: the agent's answer and what the run took."""

    reply: SupportReply
    model_requests: int
    tool_calls: int


@workflow.defn
class PydanticAISupport:
    """Answer one customer question with the Pydantic AI support agent."""

    # PydanticAIPlugin (and KvflowPydanticAIPlugin) register these agents' tool activities.
    __pydantic_ai_agents__ = (support,)

    @workflow.run
    async def run(self, task: SupportTask) -> SupportAnswer:
        """Run the agent in the task's bracket: its calls are billed to `task.spec.tenant`."""
        async with Agent(task.spec):
            result = await support.run(task.question)
        usage = result.usage
        return SupportAnswer(
            reply=result.output, model_requests=usage.requests, tool_calls=usage.tool_calls
        )

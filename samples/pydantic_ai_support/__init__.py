"""Pydantic AI sample: a support agent with a lookup tool and structured output, on kvflow."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from temporalio.plugin import SimplePlugin
from temporalio.workflow import unsafe

from .workflow import ORDERS, PydanticAISupport, SupportAnswer, SupportReply, SupportTask

with unsafe.imports_passed_through():
    # The workflow's sandbox imports this package too: share these modules with it.
    from kvflow import TaskSpec

WORKFLOW = PydanticAISupport
"""The workflow class to register on the workflow worker (with `KvflowPydanticAIPlugin`)."""
TASK_QUEUE = "kvflow.pydantic-ai-support"
"""The queue this sample's worker polls: its own, so other workflow workers never see it."""
ACTIVITIES: list[Callable[..., Any]] = []
"""None of its own: the plugin registers the agent's tool activity from the workflow."""


def client_plugins() -> list[SimplePlugin]:
    """The plugins the workflow worker's client needs after `KvflowPlugin` (`kvflow demo`)."""
    from kvflow.contrib.pydantic_ai import KvflowPydanticAIPlugin

    return [KvflowPydanticAIPlugin()]


_QUESTIONS = [
    "Where is my order {order}? I was told it would arrive this week.",
    "Can you check order {order} for me? The tracking page shows nothing.",
    "My order {order} says delivered but I have not received it.",
]


def example_input(rng: random.Random, tenant: str) -> SupportTask:
    """A customer question about one of the shop's orders, the same for the same `rng` state."""
    question = rng.choice(_QUESTIONS).format(order=rng.choice(sorted(ORDERS)))
    return SupportTask(
        # look the order up, then answer: two model calls and one tool call.
        spec=TaskSpec(tenant=tenant, latency_budget_s=60.0, retry_budget=2, expected_steps=2),
        question=question,
    )


__all__ = [
    "ACTIVITIES",
    "TASK_QUEUE",
    "WORKFLOW",
    "PydanticAISupport",
    "SupportAnswer",
    "SupportReply",
    "SupportTask",
    "client_plugins",
    "example_input",
]

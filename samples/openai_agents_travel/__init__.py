"""Travel agent sample: an OpenAI Agents SDK agent on Temporal, its model calls run by kvflow."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from temporalio.plugin import SimplePlugin
from temporalio.workflow import unsafe

from .workflow import TravelAgent, TravelPlan, TravelTask

with unsafe.imports_passed_through():
    # The workflow's sandbox imports this package too: share these modules with it.
    from kvflow import TaskSpec

    from . import activities

WORKFLOW = TravelAgent
"""The workflow class to register on the workflow worker (with `KvflowAgentsPlugin`)."""
ACTIVITIES: list[Callable[..., Any]] = list(activities.ALL)
"""The agent's activity tool, to register on the workflow worker."""
TASK_QUEUE = "kvflow.openai-agents-travel"
"""This sample's own queue: a workflow worker without `KvflowAgentsPlugin` must not take it."""


def client_plugins() -> list[SimplePlugin]:
    """The plugins the workflow worker's client needs after `KvflowPlugin` (`kvflow demo`)."""
    from kvflow.contrib.openai_agents import KvflowAgentsPlugin

    return [KvflowAgentsPlugin()]


_CITIES = ["Lisbon", "Oslo", "Vienna", "Seville", "Krakow", "Edinburgh", "Porto", "Lyon"]
_DAYS = ["Monday", "Wednesday", "Friday", "Saturday"]


def example_input(rng: random.Random, tenant: str) -> TravelTask:
    """A trip for `tenant` to plan, the same for the same `rng` state."""
    origin, destination = rng.sample(_CITIES, 2)
    return TravelTask(
        # Two turns of a tool call and an answer: four model calls.
        spec=TaskSpec(tenant=tenant, latency_budget_s=120.0, retry_budget=3, expected_steps=4),
        origin=origin,
        destination=destination,
        day=rng.choice(_DAYS),
    )


__all__ = [
    "ACTIVITIES",
    "TASK_QUEUE",
    "WORKFLOW",
    "TravelAgent",
    "TravelPlan",
    "TravelTask",
    "client_plugins",
    "example_input",
]

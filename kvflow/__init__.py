"""kvflow: a Temporal plugin for agentic LLM pipelines.

Each agent task is a Temporal workflow whose model calls are activities, placed on GPU workers
by KV-cache affinity, tenant priority and remaining latency budget, and metered so that finance
can report the cost per successful task. Everything a user's program needs is importable from
here; the subpackages are kvflow's own layout.

    from kvflow import Agent, ChatMessage, KvflowPlugin, TaskSpec

Names are loaded on first use, so that `import kvflow` inside a workflow sandbox stays cheap
and a workflow module never pulls in the worker's HTTP and database code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvflow.activities.tools import tool_heartbeats, tool_idempotency_key
    from kvflow.activities.wire import (
        ChatMessage,
        ContextRef,
        InferenceResult,
        ToolCall,
        ToolSpec,
        Usage,
    )
    from kvflow.scheduler.fleet import Fleet, format_usd, task_queue_for
    from kvflow.workers.config import FleetConfig, FleetConfigError, load_fleet
    from kvflow.workers.embedded import EmbeddedFleet
    from kvflow.workers.plugin import KvflowPlugin
    from kvflow.workers.workflow_worker import DEFAULT_WORKFLOW_QUEUE
    from kvflow.workflows.agent import SPEND_QUERY, Agent, SpendBreakdown, StepSpend, TaskSpec
    from kvflow.workflows.errors import TaskErrorType

_WHERE = {
    "Agent": "kvflow.workflows.agent",
    "ChatMessage": "kvflow.activities.wire",
    "ContextRef": "kvflow.activities.wire",
    "DEFAULT_WORKFLOW_QUEUE": "kvflow.workers.workflow_worker",
    "EmbeddedFleet": "kvflow.workers.embedded",
    "Fleet": "kvflow.scheduler.fleet",
    "FleetConfig": "kvflow.workers.config",
    "FleetConfigError": "kvflow.workers.config",
    "InferenceResult": "kvflow.activities.wire",
    "KvflowPlugin": "kvflow.workers.plugin",
    "SPEND_QUERY": "kvflow.workflows.agent",
    "SpendBreakdown": "kvflow.workflows.agent",
    "StepSpend": "kvflow.workflows.agent",
    "TaskErrorType": "kvflow.workflows.errors",
    "TaskSpec": "kvflow.workflows.agent",
    "ToolCall": "kvflow.activities.wire",
    "ToolSpec": "kvflow.activities.wire",
    "Usage": "kvflow.activities.wire",
    "format_usd": "kvflow.scheduler.fleet",
    "load_fleet": "kvflow.workers.config",
    "task_queue_for": "kvflow.scheduler.fleet",
    "tool_heartbeats": "kvflow.activities.tools",
    "tool_idempotency_key": "kvflow.activities.tools",
}

__all__ = [
    "DEFAULT_WORKFLOW_QUEUE",
    "SPEND_QUERY",
    "Agent",
    "ChatMessage",
    "ContextRef",
    "EmbeddedFleet",
    "Fleet",
    "FleetConfig",
    "FleetConfigError",
    "InferenceResult",
    "KvflowPlugin",
    "SpendBreakdown",
    "StepSpend",
    "TaskErrorType",
    "TaskSpec",
    "ToolCall",
    "ToolSpec",
    "Usage",
    "format_usd",
    "load_fleet",
    "task_queue_for",
    "tool_heartbeats",
    "tool_idempotency_key",
]


def __getattr__(name: str) -> Any:
    """Import a public name from the module that defines it, on first use (PEP 562)."""
    try:
        module = _WHERE[name]
    except KeyError:
        raise AttributeError(f"module 'kvflow' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

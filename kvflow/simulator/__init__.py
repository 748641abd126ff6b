"""A vLLM-compatible engine for machines without GPUs.

One engine core (`EngineCore`: vLLM v1's scheduler, paged KV cache with prefix caching,
preemption, and step times from GPU datasheet figures) runs under two clocks:

- in real time behind vLLM's OpenAI-compatible HTTP API (`SimServer`, `SimProcess`,
  `kvflow sim serve`), scaled by `time_scale`;
- under a discrete-event clock with no HTTP and no sleeping (`DiscreteEventFleet`,
  `simulate`), for fleet-scale benchmarks (`kvflow sim bench`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvflow.scheduler.builtin_tokenizer import Tokenizer, apply_chat_template
    from kvflow.simulator.des import (
        AgentWorkload,
        DiscreteEventFleet,
        FleetRequest,
        FleetView,
        LeastLoadedRouter,
        PrefixAwareRouter,
        RequestRecord,
        RoundRobinRouter,
        Router,
        SimulationResult,
        simulate,
    )
    from kvflow.simulator.engine import (
        EngineConfig,
        EngineCore,
        EngineStats,
        RequestStatus,
        SimReplica,
        SimRequest,
        StepResult,
    )
    from kvflow.simulator.faults import FAULT_HEADER, FaultSpec, parse_fault_header
    from kvflow.simulator.models import BUILTIN_MODELS, resolve_models
    from kvflow.simulator.perf import PerfModel
    from kvflow.simulator.server import ServerSettings, SimProcess, SimServer, SimulatedVllm

_EXPORTS: dict[str, str] = {
    "AgentWorkload": "kvflow.simulator.des",
    "BUILTIN_MODELS": "kvflow.simulator.models",
    "DiscreteEventFleet": "kvflow.simulator.des",
    "EngineConfig": "kvflow.simulator.engine",
    "EngineCore": "kvflow.simulator.engine",
    "EngineStats": "kvflow.simulator.engine",
    "FAULT_HEADER": "kvflow.simulator.faults",
    "FaultSpec": "kvflow.simulator.faults",
    "FleetRequest": "kvflow.simulator.des",
    "FleetView": "kvflow.simulator.des",
    "LeastLoadedRouter": "kvflow.simulator.des",
    "PerfModel": "kvflow.simulator.perf",
    "PrefixAwareRouter": "kvflow.simulator.des",
    "RequestRecord": "kvflow.simulator.des",
    "RequestStatus": "kvflow.simulator.engine",
    "RoundRobinRouter": "kvflow.simulator.des",
    "Router": "kvflow.simulator.des",
    "ServerSettings": "kvflow.simulator.server",
    "SimProcess": "kvflow.simulator.server",
    "SimReplica": "kvflow.simulator.engine",
    "SimRequest": "kvflow.simulator.engine",
    "SimServer": "kvflow.simulator.server",
    "SimulatedVllm": "kvflow.simulator.server",
    "SimulationResult": "kvflow.simulator.des",
    "StepResult": "kvflow.simulator.engine",
    "Tokenizer": "kvflow.scheduler.builtin_tokenizer",
    "apply_chat_template": "kvflow.scheduler.builtin_tokenizer",
    "parse_fault_header": "kvflow.simulator.faults",
    "resolve_models": "kvflow.simulator.models",
    "simulate": "kvflow.simulator.des",
}
"""Public name -> the module that defines it (imported on first use: the CLI stays quick)."""


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'simulator' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "BUILTIN_MODELS",
    "FAULT_HEADER",
    "AgentWorkload",
    "DiscreteEventFleet",
    "EngineConfig",
    "EngineCore",
    "EngineStats",
    "FaultSpec",
    "FleetRequest",
    "FleetView",
    "LeastLoadedRouter",
    "PerfModel",
    "PrefixAwareRouter",
    "RequestRecord",
    "RequestStatus",
    "RoundRobinRouter",
    "Router",
    "ServerSettings",
    "SimProcess",
    "SimReplica",
    "SimRequest",
    "SimServer",
    "SimulatedVllm",
    "SimulationResult",
    "StepResult",
    "Tokenizer",
    "apply_chat_template",
    "parse_fault_header",
    "resolve_models",
    "simulate",
]

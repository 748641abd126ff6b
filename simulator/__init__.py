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
    from simulator.des import (
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
    from simulator.engine import (
        EngineConfig,
        EngineCore,
        EngineStats,
        RequestStatus,
        SimReplica,
        SimRequest,
        StepResult,
    )
    from simulator.faults import FAULT_HEADER, FaultSpec, parse_fault_header
    from simulator.models import BUILTIN_MODELS, resolve_models
    from simulator.perf import PerfModel
    from simulator.server import ServerSettings, SimProcess, SimServer, SimulatedVllm
    from simulator.tokenizer import Tokenizer, apply_chat_template

_EXPORTS: dict[str, str] = {
    "AgentWorkload": "simulator.des",
    "BUILTIN_MODELS": "simulator.models",
    "DiscreteEventFleet": "simulator.des",
    "EngineConfig": "simulator.engine",
    "EngineCore": "simulator.engine",
    "EngineStats": "simulator.engine",
    "FAULT_HEADER": "simulator.faults",
    "FaultSpec": "simulator.faults",
    "FleetRequest": "simulator.des",
    "FleetView": "simulator.des",
    "LeastLoadedRouter": "simulator.des",
    "PerfModel": "simulator.perf",
    "PrefixAwareRouter": "simulator.des",
    "RequestRecord": "simulator.des",
    "RequestStatus": "simulator.engine",
    "RoundRobinRouter": "simulator.des",
    "Router": "simulator.des",
    "ServerSettings": "simulator.server",
    "SimProcess": "simulator.server",
    "SimReplica": "simulator.engine",
    "SimRequest": "simulator.engine",
    "SimServer": "simulator.server",
    "SimulatedVllm": "simulator.server",
    "SimulationResult": "simulator.des",
    "StepResult": "simulator.engine",
    "Tokenizer": "simulator.tokenizer",
    "apply_chat_template": "simulator.tokenizer",
    "parse_fault_header": "simulator.faults",
    "resolve_models": "simulator.models",
    "simulate": "simulator.des",
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

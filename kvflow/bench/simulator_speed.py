"""Speed of the discrete-event core: simulated requests per wall-clock minute on one core.

The benchmark runs an agent workload (`kvflow.simulator.des.AgentWorkload`: shared system prompts,
multi-step sessions over a growing context) on a heterogeneous fleet (by default 16 replicas:
6×H200, 6×H100, 4×L4 serving llama-3.1-8b) with a router, and measures wall time. It is the
figure behind the target "at least 50,000 requests per minute for a 16-replica fleet"; it
is printed by `kvflow sim bench`, never asserted by a timed test.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvflow.scheduler.gpus import GpuGeneration
from kvflow.simulator.des import (
    AgentWorkload,
    LeastLoadedRouter,
    PrefixAwareRouter,
    RoundRobinRouter,
    Router,
    simulate,
)
from kvflow.simulator.engine import EngineConfig, SimReplica
from kvflow.simulator.models import BUILTIN_MODELS

ROUTERS: dict[str, type[Router]] = {
    "prefix": PrefixAwareRouter,
    "least-loaded": LeastLoadedRouter,
    "round-robin": RoundRobinRouter,
}


def default_fleet(replicas: int = 16, model: str = "llama-3.1-8b") -> list[SimReplica]:
    """`replicas` replicas: 3/8 H200, 3/8 H100, the rest L4 (16 gives 6, 6 and 4)."""
    spec = BUILTIN_MODELS[model]
    h200 = replicas * 3 // 8
    h100 = replicas * 3 // 8
    gpus = (
        [GpuGeneration.H200] * h200
        + [GpuGeneration.H100] * h100
        + [GpuGeneration.L4] * (replicas - h200 - h100)
    )
    config = EngineConfig(max_model_len=16384)
    return [
        SimReplica(gpu, [spec], config, name=f"{gpu.value.lower()}/{index}")
        for index, gpu in enumerate(gpus)
    ]


@dataclass
class BenchResult:
    """The measured figures."""

    replicas: int
    router: str
    requests: int
    wall_seconds: float
    simulated_seconds: float
    requests_per_minute: float
    workload_seconds: float
    """Wall seconds spent generating the workload (block hashes), not counted above."""
    steps: int
    summary: dict[str, float]

    def as_json(self) -> dict[str, Any]:
        """The figures as a JSON-ready dict."""
        return {
            "replicas": self.replicas,
            "router": self.router,
            "requests": self.requests,
            "wall_seconds": self.wall_seconds,
            "simulated_seconds": self.simulated_seconds,
            "requests_per_wall_minute": self.requests_per_minute,
            "workload_generation_seconds": self.workload_seconds,
            "steps": self.steps,
            "steps_per_wall_second": self.steps / self.wall_seconds if self.wall_seconds else 0.0,
            "summary": self.summary,
        }


def run_benchmark(
    *,
    replicas: int = 16,
    tasks: int = 2000,
    task_rate: float | None = None,
    router: str = "prefix",
    seed: int = 0,
) -> BenchResult:
    """Simulate `tasks` agent tasks on `replicas` replicas and time it (wall clock).

    The default task rate (0.5 tasks per second per replica, about 2.75 requests per second
    per replica) keeps the fleet busy without an ever-growing queue.
    """
    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}; choose one of {', '.join(ROUTERS)}")
    fleet = default_fleet(replicas)
    workload = AgentWorkload(
        model="llama-3.1-8b",
        block_size=fleet[0].config.block_size,
        tasks=tasks,
        task_rate=task_rate if task_rate is not None else 0.5 * replicas,
        seed=seed,
    )
    generating = time.perf_counter()
    requests = list(workload)  # generated first: the figure is the simulation's own speed
    started = time.perf_counter()
    result = simulate(requests, fleet, ROUTERS[router]())
    wall = time.perf_counter() - started
    done = len(result.records)
    return BenchResult(
        replicas=replicas,
        router=router,
        requests=done,
        wall_seconds=wall,
        simulated_seconds=result.simulated_seconds,
        requests_per_minute=done / wall * 60 if wall > 0 else 0.0,
        workload_seconds=started - generating,
        steps=result.steps,
        summary=result.summary(),
    )

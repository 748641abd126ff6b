"""The fleets of the policy benchmark and their simulated replicas.

H100 replicas serving Llama 3.1 8B by default; the heterogeneous workload mixes H200, H100 and
L4 pools and a cheaper fallback model on its own L4 pool. Prices are per pool (token prices
in dollars per million; GPU-hour prices for the GPU-seconds beside them).
"""

from __future__ import annotations

from decimal import Decimal

from kvflow.scheduler.fleet import Fleet, ModelSpec, Pool, Tenant, TokenPrices
from kvflow.scheduler.gpus import GpuGeneration
from kvflow.simulator.engine import EngineConfig, SimReplica
from kvflow.simulator.models import BUILTIN_MODELS
from kvflow.simulator.perf import PerfModel
from kvflow.simulator.workloads import WORKLOADS, WorkloadSpec

MODEL = "llama-3.1-8b"
FALLBACK_MODEL = "llama-3.2-1b"
CONTEXT_LENGTH = 131_072
"""Llama 3.1's context (the built-in spec says 32k, what the demo serves)."""

_TENANTS = [
    Tenant(name="acme", tier=1, fairness_weight=3.0),
    Tenant(name="globex", tier=3, fairness_weight=2.0),
    Tenant(name="initech", tier=5, fairness_weight=1.0),
]


def _models() -> list[ModelSpec]:
    model = BUILTIN_MODELS[MODEL].model_copy(update={"context_length": CONTEXT_LENGTH})
    return [model, BUILTIN_MODELS[FALLBACK_MODEL]]


def bench_fleet(workload: str, replicas: int) -> Fleet:
    """The default fleet of a workload: H100s, or for `heterogeneous` H200/H100/L4 pools.

    Heterogeneous: 3/8 H200, 3/8 H100, 1/8 L4 serving the model and 1/8 L4 serving its
    cheaper fallback (at least one replica each).
    """
    models = _models()
    if workload != "heterogeneous":
        pools = [
            Pool(
                name="h100",
                gpu=GpuGeneration.H100,
                replicas=replicas,
                price_per_gpu_hour_usd=Decimal("2.90"),
                token_prices=TokenPrices.per_mtok("0.18", "0.018", "0.54"),
                warm_models=[MODEL],
                max_concurrency=256,
            )
        ]
        return Fleet(models=models, pools=pools, tenants=_TENANTS)
    if replicas < 4:
        raise ValueError("the heterogeneous fleet needs at least 4 replicas")
    h200 = max(1, replicas * 3 // 8)
    h100 = max(1, replicas * 3 // 8)
    l4 = max(1, (replicas - h200 - h100) // 2)
    small = replicas - h200 - h100 - l4
    pools = [
        Pool(
            name="h200",
            gpu=GpuGeneration.H200,
            replicas=h200,
            price_per_gpu_hour_usd=Decimal("3.80"),
            token_prices=TokenPrices.per_mtok("0.20", "0.02", "0.60"),
            warm_models=[MODEL],
            max_concurrency=256,
        ),
        Pool(
            name="h100",
            gpu=GpuGeneration.H100,
            replicas=h100,
            price_per_gpu_hour_usd=Decimal("2.90"),
            token_prices=TokenPrices.per_mtok("0.18", "0.018", "0.54"),
            warm_models=[MODEL],
            max_concurrency=256,
        ),
        Pool(
            name="l4",
            gpu=GpuGeneration.L4,
            replicas=l4,
            price_per_gpu_hour_usd=Decimal("0.80"),
            token_prices=TokenPrices.per_mtok("0.10", "0.01", "0.40"),
            warm_models=[MODEL],
            max_concurrency=64,
        ),
        Pool(
            name="l4-small",
            gpu=GpuGeneration.L4,
            replicas=small,
            price_per_gpu_hour_usd=Decimal("0.80"),
            token_prices=TokenPrices.per_mtok("0.03", "0.003", "0.10"),
            warm_models=[FALLBACK_MODEL],
            max_concurrency=128,
        ),
    ]
    return Fleet(models=models, pools=pools, tenants=_TENANTS)


def engine_config(
    spec: WorkloadSpec, *, priority: bool = True, retention: bool = False
) -> EngineConfig:
    """The engines' settings for `spec` (its `max_model_len` and block size, KV events on).

    `priority`: vLLM's `--scheduling-policy priority` (the engine-priority mechanism), else
    fcfs. `retention`: blocks kept by the retention priority their call asked for (the
    kv-retention mechanism), else least recently used first.
    """
    return EngineConfig(
        max_model_len=spec.max_model_len,
        block_size=spec.block_size,
        enable_kv_events=True,
        scheduling_policy="priority" if priority else "fcfs",
        kv_retention=retention,
    )


ENGINE = engine_config(WORKLOADS["agent"])


def simulated_replicas(
    fleet: Fleet, *, slow: dict[int, float] | None = None, engine: EngineConfig = ENGINE
) -> list[SimReplica]:
    """One simulated replica per replica of `fleet`, pool by pool (the scheduler's order).

    `slow` maps replica indexes to a slowdown factor (a fault: every step takes longer).
    """
    specs = {m.name: m for m in fleet.models}
    replicas: list[SimReplica] = []
    for pool in fleet.pools:
        models = [specs[name] for name in pool.warm_models]
        for name in pool.replica_names():
            factor = (slow or {}).get(len(replicas))
            config = engine if factor is None else engine.model_copy(update={"slowdown": factor})
            config = config.model_copy(update={"tensor_parallel": pool.gpus_per_replica})
            replicas.append(SimReplica(pool.gpu, models, config, name=name))
    return replicas


def fleet_tenants(fleet: Fleet) -> list[tuple[str, int]]:
    """The fleet's tenants as (name, tier)."""
    return [(t.name, t.tier) for t in fleet.tenants]


def perf_model(fleet: Fleet, pool: Pool, engine: EngineConfig) -> PerfModel:
    """The step-time model of `pool`'s replicas (its first warm model) under `engine`."""
    specs = {m.name: m for m in fleet.models}
    model = specs[pool.warm_models[0]]
    return PerfModel(
        gpu=SimReplica(pool.gpu, [model], engine).gpu,
        model=model,
        tensor_parallel=pool.gpus_per_replica,
        mfu=engine.mfu,
        bandwidth_efficiency=engine.bandwidth_efficiency,
        step_overhead_s=engine.step_overhead_s,
    )


def fastest_perf(fleet: Fleet, engine: EngineConfig) -> PerfModel:
    """The perf model of the fastest pool serving `MODEL` (unloaded decode of 1k context)."""
    serving = [p for p in fleet.pools if MODEL in p.warm_models] or list(fleet.pools)
    perfs = [perf_model(fleet, p, engine) for p in serving]
    return min(perfs, key=lambda p: p.decode_step_seconds(1, 1024))

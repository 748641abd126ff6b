"""Degrading to a fallback model: never to one that no replica serves.

A fleet may list a model (the fallback of another) that no replica runs. The scheduler must
then refuse the call rather than place it there: a real vLLM server answers 404 for a model it
was not started with, and the simulated fleet has no engine for it.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvflow.bench.policies import bench_fleet
from kvflow.scheduler.blocks import block_hashes
from kvflow.scheduler.core import Scheduler
from kvflow.scheduler.fleet import Fleet
from kvflow.scheduler.placement import Placement, PlacementRequest, Refusal, RefusalReason
from kvflow.scheduler.state import ReplicaMetrics
from kvflow.simulator import BUILTIN_MODELS, EngineConfig, SimReplica
from kvflow.simulator.des import DiscreteEventFleet, FleetRequest
from kvflow.simulator.policies.base import PolicySetup, TaskContext
from kvflow.simulator.policies.kvflow_scheduler import KvflowPolicy

BIG, SMALL = "llama-3.1-8b", "llama-3.2-1b"
ENGINE = EngineConfig(max_model_len=16384)
"""The simulated replicas' engines (the bench's, without KV events)."""


def fleet(*, endpoints: Any = "simulated", small_pool: bool = False) -> Fleet:
    """Two models, BIG falling back to SMALL; SMALL warm only when `small_pool`."""
    prices = {
        "input_per_mtok_usd": "0.18",
        "cached_input_per_mtok_usd": "0.018",
        "output_per_mtok_usd": "0.54",
    }
    pools: list[dict[str, Any]] = [
        {
            "name": "h100",
            "gpu": "H100",
            "replicas": 2,
            "endpoints": endpoints,
            "price_per_gpu_hour_usd": "2.90",
            "token_prices": prices,
            "warm_models": [BIG],
        }
    ]
    if small_pool:
        pools.append(
            {
                "name": "small",
                "gpu": "H100",
                "replicas": 1,
                "price_per_gpu_hour_usd": "2.90",
                "token_prices": prices,
                "warm_models": [SMALL],
            }
        )
    return Fleet.model_validate(
        {
            "models": [
                {
                    "name": BIG,
                    "parameters_b": 8.0,
                    "layers": 32,
                    "kv_heads": 8,
                    "head_dim": 128,
                    "context_length": 32768,
                    "fallback": SMALL,
                },
                {
                    "name": SMALL,
                    "parameters_b": 1.2,
                    "layers": 16,
                    "kv_heads": 8,
                    "head_dim": 64,
                    "context_length": 32768,
                },
            ],
            "pools": pools,
            "tenants": [{"name": "acme", "tier": 1, "fairness_weight": 1.0}],
        }
    )


OUTPUT_TOKENS = 4000
TIGHT_S = 30.0
"""4000 output tokens of the 8B take about 40 s on an H100; the 1B takes about 5 s, or 26 s
with a cold load of its weights: a call with 30 s left degrades to the 1B, cold or warm."""


def too_tight_for_big() -> PlacementRequest:
    """A call whose deadline the 8B model cannot meet, but the 1B could (it degrades)."""
    tokens = [(i * 31) % 50_000 for i in range(1000)]
    return PlacementRequest(
        model=BIG,
        block_hashes=block_hashes(tokens, 16),
        prompt_tokens=len(tokens),
        max_output_tokens=OUTPUT_TOKENS,
        tenant="acme",
        deadline_s_remaining=TIGHT_S,
    )


def scrape_every_replica(scheduler: Scheduler, models: tuple[str, ...]) -> None:
    for name in scheduler.replica_names():
        scheduler.update_metrics(name, ReplicaMetrics(running=0, waiting=0, models=models))


@pytest.mark.timeout(30)
def test_a_fallback_only_the_fleet_file_lists_is_not_degraded_to_once_replicas_name_theirs() -> (
    None
):
    scheduler = Scheduler(fleet(), clock=lambda: 1_700_000_000.0)
    # Every replica's scrape names what it serves: the 8B only.
    scrape_every_replica(scheduler, (BIG,))
    answer = scheduler.place(too_tight_for_big())
    assert isinstance(answer, Refusal), answer
    assert answer.reason is RefusalReason.DEADLINE
    assert f"{SMALL}: served by no replica" in answer.message


@pytest.mark.timeout(30)
def test_a_pool_of_vllm_servers_loads_no_other_model_cold() -> None:
    urls = ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]
    scheduler = Scheduler(fleet(endpoints=urls), clock=lambda: 1_700_000_000.0)
    # No scrape yet: the fleet file is all the scheduler knows, and vLLM serves one model.
    answer = scheduler.place(too_tight_for_big())
    assert isinstance(answer, Refusal), answer
    assert f"{SMALL}: served by no replica" in answer.message
    plain = scheduler.place(too_tight_for_big().model_copy(update={"model": SMALL}))
    assert isinstance(plain, Refusal) and plain.reason is RefusalReason.MODEL_NOT_WARM


@pytest.mark.timeout(30)
def test_a_fallback_some_replica_serves_is_still_degraded_to() -> None:
    scheduler = Scheduler(fleet(small_pool=True), clock=lambda: 1_700_000_000.0)
    for name in scheduler.replica_names():
        served = (SMALL,) if name.startswith("small/") else (BIG,)
        scheduler.update_metrics(name, ReplicaMetrics(running=0, waiting=0, models=served))
    answer = scheduler.place(too_tight_for_big())
    assert isinstance(answer, Placement), answer
    assert (answer.model, answer.replica, answer.degraded_from) == (SMALL, "small/0", BIG)


def run_in_simulated_fleet(
    fleet: Fleet, deadlines: dict[str, float], extra: dict[str, object] | None = None
) -> tuple[list[str], list[tuple[str, str]]]:
    """kvflow places one call per deadline on `fleet`'s simulated replicas, as the bench does.

    Returns the calls refused, and (call, model it ran on) for the calls that finished.
    """
    specs = {m.name: BUILTIN_MODELS[m.name] for m in fleet.models}
    replicas = [
        SimReplica(pool.gpu, [specs[m] for m in pool.warm_models], ENGINE, name=name)
        for pool in fleet.pools
        for name in pool.replica_names()
    ]
    setup = PolicySetup(
        fleet=fleet,
        replica_names=[n for p in fleet.pools for n in p.replica_names()],
        block_size=ENGINE.block_size,
        clock=lambda: sim.now,
        tokens_of=lambda parent, block: (),
        extra={"kv_events": False, **(extra or {})},
    )
    policy = KvflowPolicy(setup)
    refused: list[str] = []
    sim = DiscreteEventFleet(
        replicas,
        policy,
        on_scrape=lambda now: policy.on_scrape(sim.view, now),
        on_fail=lambda request, replica, _: refused.append(request.request_id),
    )

    def call(seed: int, name: str, deadline_s: float) -> FleetRequest:
        """One 1000-token prompt and OUTPUT_TOKENS of output, due at `deadline_s`."""
        tokens = [(seed * 7919 + i * 31) % 50_000 for i in range(1000)]
        task = TaskContext(
            workflow_id=name,
            tenant=fleet.tenants[0].name,
            tier=fleet.tenants[0].tier,
            deadline_at=deadline_s,
            started_at=0.0,
            steps_remaining=1,
            max_tokens=OUTPUT_TOKENS,
        )
        return FleetRequest(
            arrival_time=0.0,
            model=BIG,
            prompt_tokens=len(tokens),
            output_tokens=OUTPUT_TOKENS,
            block_hashes=block_hashes(tokens, setup.block_size),
            max_tokens=OUTPUT_TOKENS,
            tenant=task.tenant,
            request_id=name,
            context=task,
        )

    calls = [call(seed, name, due) for seed, (name, due) in enumerate(deadlines.items())]
    result = sim.run(calls)
    return refused, sorted((r.request.request_id, r.request.model) for r in result.records)


@pytest.mark.timeout(60)
def test_kvflow_in_the_simulated_fleet_refuses_a_call_rather_than_run_an_unserved_fallback() -> (
    None
):
    # The bench's fleet lists the 1B fallback, but its replicas run only the 8B.
    bench = bench_fleet("agent", 2)
    assert [p.warm_models for p in bench.pools] == [[BIG]]
    refused, ran = run_in_simulated_fleet(bench, {"tight": TIGHT_S, "roomy": 600.0})
    assert refused == ["tight"]
    assert ran == [("roomy", BIG)]


@pytest.mark.timeout(60)
def test_kvflow_in_the_simulated_fleet_degrades_only_when_the_bench_allows_it() -> None:
    # Here a pool of its own serves the 1B fallback.
    deadlines = {"tight": TIGHT_S, "roomy": 600.0}
    with_small = fleet(small_pool=True)
    refused, ran = run_in_simulated_fleet(with_small, deadlines, {"allow_fallback": True})
    assert (refused, ran) == ([], [("roomy", BIG), ("tight", SMALL)])
    refused, ran = run_in_simulated_fleet(with_small, deadlines, {"allow_fallback": False})
    assert (refused, ran) == (["tight"], [("roomy", BIG)])

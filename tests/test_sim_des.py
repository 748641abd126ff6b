"""The discrete-event fleet: every request finishes, deterministically, and routing matters."""

from __future__ import annotations

import itertools

import pytest

from kvflow.scheduler.gpus import GpuGeneration
from kvflow.simulator import (
    BUILTIN_MODELS,
    AgentWorkload,
    DiscreteEventFleet,
    EngineConfig,
    FleetRequest,
    LeastLoadedRouter,
    PrefixAwareRouter,
    RoundRobinRouter,
    SimReplica,
    SimulationResult,
    simulate,
)
from kvflow.simulator.kv_events import BlockStored

pytestmark = pytest.mark.timeout(60)

MODEL = BUILTIN_MODELS["llama-3.1-8b"]
CONFIG = EngineConfig(max_model_len=16384)


def fleet(gpus: list[str], config: EngineConfig = CONFIG) -> list[SimReplica]:
    return [SimReplica(gpu, [MODEL], config, name=f"{gpu}/{i}") for i, gpu in enumerate(gpus)]


def workload(tasks: int = 40, rate: float = 4.0, seed: int = 1) -> list[FleetRequest]:
    return list(AgentWorkload(model=MODEL.name, tasks=tasks, task_rate=rate, seed=seed))


def test_every_request_finishes_and_the_run_is_deterministic() -> None:
    requests = workload()
    first = simulate(requests, fleet(["H100"] * 4), LeastLoadedRouter())
    second = simulate(workload(), fleet(["H100"] * 4), LeastLoadedRouter())
    assert len(first.records) == len(requests) and first.unfinished == 0
    assert first.summary() == second.summary()
    assert all(r.output_tokens == r.request.output_tokens for r in first.records)
    assert all(0 <= r.queue_time <= r.ttft <= r.e2e_latency for r in first.records)


def test_runs_of_decode_steps_give_the_same_results_as_single_steps() -> None:
    config = EngineConfig(max_model_len=16384, num_gpu_blocks=2048)
    single = simulate(workload(), fleet(["H100", "L4"], config), decode_runs=False)
    runs = simulate(workload(), fleet(["H100", "L4"], config), decode_runs=True)
    assert single.steps == runs.steps
    assert single.preemptions == runs.preemptions > 0

    def outcome(result: SimulationResult) -> list[tuple[str, int, int, int, float, float]]:
        return sorted(
            (
                r.request.request_id,
                r.replica,
                r.cached_tokens,
                r.preemptions,
                round(r.ttft, 9),
                round(r.e2e_latency, 9),
            )
            for r in result.records
        )

    assert outcome(single) == outcome(runs)


def test_prefix_aware_routing_reuses_more_cache_than_round_robin() -> None:
    requests = workload(tasks=60)
    prefix = simulate(requests, fleet(["H100"] * 4), PrefixAwareRouter()).summary()
    spread = simulate(workload(tasks=60), fleet(["H100"] * 4), RoundRobinRouter()).summary()
    assert prefix["cached_share"] > spread["cached_share"] + 0.2
    assert prefix["ttft_p50"] < spread["ttft_p50"]


def test_a_faster_generation_finishes_the_same_work_sooner() -> None:
    summaries = {
        gpu: simulate(workload(rate=8.0), fleet([gpu] * 2), LeastLoadedRouter()).summary()
        for gpu in ("H200", "H100", "L4")
    }
    assert summaries["H200"]["e2e_p50"] < summaries["H100"]["e2e_p50"] < summaries["L4"]["e2e_p50"]


def test_agent_steps_extend_their_session_hash_chain() -> None:
    steps = [r for r in workload(tasks=5) if r.session == "task-0"]
    assert len(steps) >= 3
    for earlier, later in itertools.pairwise(steps):
        shared = earlier.block_hashes[: (earlier.prompt_tokens + earlier.output_tokens) // 16]
        assert later.block_hashes[: len(shared)] == shared
        assert later.prompt_tokens > earlier.prompt_tokens


def test_on_step_sees_kv_events_of_every_replica() -> None:
    config = EngineConfig(max_model_len=16384, enable_kv_events=True)
    stored: dict[int, set[int]] = {}

    def on_step(index: int, result: object) -> None:
        for event in getattr(result, "kv_events", []):
            if isinstance(event, BlockStored):
                stored.setdefault(index, set()).update(event.block_hashes)

    result = simulate(workload(tasks=10), fleet(["H100"] * 2, config), on_step=on_step)
    assert set(stored) == {0, 1}
    first = result.records[0]
    held = stored[first.replica]
    assert set(first.request.block_hashes[: first.request.prompt_tokens // 16]) <= held


def test_running_until_a_time_leaves_the_rest_unfinished() -> None:
    requests = workload(tasks=40)
    sim = DiscreteEventFleet(fleet(["L4"]), LeastLoadedRouter())
    result = sim.run(requests, until=5.0)
    assert result.simulated_seconds <= 5.0
    assert result.unfinished > 0 or len(result.records) < len(requests)


def test_cold_model_request_waits_for_the_load() -> None:
    small = BUILTIN_MODELS["llama-3.2-1b"]
    replica = SimReplica(GpuGeneration.H100, [small], CONFIG, cold_models=[MODEL])
    request = FleetRequest(arrival_time=0.0, model=MODEL.name, prompt_tokens=100, output_tokens=5)
    (record,) = simulate([request], [replica]).records
    assert record.ttft >= replica.engine(MODEL.name).perf.load_seconds()


def test_a_model_no_replica_serves_is_refused() -> None:
    request = FleetRequest(arrival_time=0.0, model="unknown", prompt_tokens=10, output_tokens=5)
    with pytest.raises(ValueError, match="no replica serves model 'unknown'"):
        simulate([request], fleet(["H100"]))


def test_stop_ends_the_run_after_the_current_event() -> None:
    requests = workload(tasks=40)
    sim = DiscreteEventFleet(fleet(["H100"] * 2), LeastLoadedRouter())
    sim.schedule(3.0, sim.stop)
    result = sim.run(requests)
    assert result.simulated_seconds == 3.0
    assert len(result.records) < len(requests)
    assert result.unfinished > 0
    # A later run goes on from there: what the engines hold finishes.
    assert sim.run().unfinished == 0


def test_metrics_refresh_on_demand_at_most_once_per_interval() -> None:
    scrapes: list[float] = []
    sim = DiscreteEventFleet(
        fleet(["H100"]), LeastLoadedRouter(), on_scrape=scrapes.append, metrics_interval_s=0.05
    )
    sim.submit(FleetRequest(arrival_time=0.0, model=MODEL.name, prompt_tokens=64, output_tokens=8))
    for when in (0.01, 0.02, 0.07, 0.08):
        sim.schedule(when, sim.refresh_metrics)
    sim.run()
    assert scrapes == [0.0, 0.07]
    assert sim.view.metrics[0].at == 0.07

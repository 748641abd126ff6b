"""The benchmark's bounds hold against the simulated engine, on the runs the benchmark makes."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from kvflow.bench.policies import default_sizes, goals, run_plan, run_policy, run_workload
from kvflow.bench.policies.bounds import batching_bound, lifetime_estimate_s, success_ceiling
from kvflow.bench.policies.figures import figures
from kvflow.bench.policies.fleet import bench_fleet, fleet_tenants
from kvflow.simulator.workloads import WORKLOADS, Task, Workload

pytestmark = pytest.mark.timeout(180)

AGENT_CAPACITY = 4.21
"""Tasks per second 4 H100 replicas serve on the agent workload (its measured capacity)."""


@pytest.mark.timeout(240)
def test_no_policy_beats_the_batching_bound_on_the_quick_agent_run_near_capacity() -> None:
    # `kvflow bench policies --quick --workload agent --capacity 4.21 --load 0.95`, seed 0:
    # its fleet, window and counted tasks. Chunked prefill runs inside decode steps and a
    # step costs the larger of its compute and memory time, so a prefill is not time a
    # replica loses to decoding: a bound charging it apart put model time above kvflow's.
    spec = WORKLOADS["agent"]
    replicas, window_lifetimes, least, _ = default_sizes(True, spec)
    fleet = bench_fleet("agent", replicas)
    rate = 0.95 * AGENT_CAPACITY
    plan = run_plan(
        lifetime_estimate_s(spec, fleet),
        task_rate=rate,
        window_lifetimes=window_lifetimes,
        min_counted=least,
    )
    drawn = Workload(
        spec, fleet_tenants(fleet), tasks=1, task_rate=1.0, seed=0, block_size=spec.block_size
    )
    window = plan.window

    def counted(task: Task) -> bool:
        return window.start <= task.arrival < window.end

    bound = batching_bound(
        drawn.at_rate(rate, until_s=plan.arrivals_until_s),
        fleet,
        spec,
        task_rate=rate,
        counted=counted,
    )
    assert bound is not None
    run = run_policy(
        "kvflow", spec=spec, fleet=fleet, task_rate=rate, seed=0, plan=plan, workload=drawn
    )
    measured = figures(run.outcome, 0.0)
    assert measured.success_rate == 1.0
    assert bound.mean_model_s <= measured.mean_model_s
    # Over the very tasks it finished, too.
    least_of_successes = bound.of(run.outcome.succeeded)
    assert least_of_successes is not None and least_of_successes <= measured.mean_model_s
    # The load still forces batching: above every call alone on an idle replica.
    idle = success_ceiling(drawn.at_rate(rate, until_s=plan.arrivals_until_s), fleet, spec,
                           counted=counted)  # fmt: skip
    assert bound.mean_model_s > idle.mean_model_s


def test_the_bound_over_every_counted_task_is_the_bound_and_a_subset_has_its_own() -> None:
    spec = WORKLOADS["agent"]
    fleet = bench_fleet("agent", 2)
    rate = 1.5
    drawn = Workload(
        spec, fleet_tenants(fleet), tasks=1, task_rate=1.0, seed=3, block_size=spec.block_size
    )
    arrivals = drawn.at_rate(rate, until_s=120.0)
    bound = batching_bound(arrivals, fleet, spec, task_rate=rate)
    assert bound is not None
    every = [task.index for task in arrivals]
    assert bound.of(every) == pytest.approx(bound.mean_model_s)
    # Fewer tasks finished are less load: their bound is their own, never the whole's.
    half = every[::2]
    subset = bound.of(half)
    assert subset is not None and subset > 0
    assert bound.of([]) is None
    # Beyond the replicas' time there is nothing to bound.
    assert batching_bound(arrivals, fleet, spec, task_rate=rate * 20) is None


def test_the_benchmark_says_per_seed_whether_the_batching_bound_holds_and_shouts_if_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    result = run_workload(
        "agent",
        replicas=2,
        seeds=(0,),
        load=0.9,
        policies=["kvflow", "round-robin"],
        capacity_tasks_per_s=2.0,
        window_lifetimes=0.3,
    )
    check = {g.text: g for g in result.goals}["batching bound ≤ every policy's mean model time"]
    assert check.met
    assert "seed 0: bound holds: yes" in check.detail
    # A bound above a policy's model time is a derivation gone wrong: not met, and logged.
    (bound,) = result.batching
    result.batching = [dataclasses.replace(bound, mean_model_s=1e6)]
    with caplog.at_level(logging.ERROR, logger="kvflow.bench.policies"):
        broken = {g.text: g for g in goals(result)}[
            "batching bound ≤ every policy's mean model time"
        ]
    assert not broken.met
    assert "seed 0: bound holds: no" in broken.detail
    assert any("batching bound is above" in r.getMessage() for r in caplog.records)

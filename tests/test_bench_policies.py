"""`kvflow bench policies`: every policy runs, the figures are computed right, the CLI behaves.

The goals' thresholds are the benchmark's to report; nothing here asserts them.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import typer

from kvflow.bench.policies import (
    WorkloadResult,
    policy_factories,
    run_plan,
    run_policy,
    run_workload,
)
from kvflow.bench.policies.bounds import (
    batching_bound,
    idle_call_s,
    kv_cache_tokens,
    kv_capacity_floor,
    lifetime_estimate_s,
    success_ceiling,
    zero_miss_floor,
)
from kvflow.bench.policies.figures import PolicyFigures, cost_per_success, figures, percentile
from kvflow.bench.policies.fleet import (
    bench_fleet,
    engine_config,
    fastest_perf,
    fleet_tenants,
    simulated_replicas,
)
from kvflow.bench.policies.relaxations import main as relax_main
from kvflow.bench.policies.task_runner import Outcome, TaskRunner
from kvflow.scheduler.blocks import ROOT_HASH, hash_block
from kvflow.scheduler.config import (
    DEFAULT_AXES,
    REQUIRED_AXIS,
    AdmissionConfig,
    PrefixConfig,
    SchedulerConfig,
)
from kvflow.simulator.policies import POLICIES, PolicySetup
from kvflow.simulator.policies.base import TaskContext
from kvflow.simulator.policies.kvflow_scheduler import LEVERS, lever_config
from kvflow.simulator.policies.oracle import GREEDY_REFERENCE
from kvflow.simulator.workloads import WORKLOADS, Call, Step, Task, Workload

pytestmark = pytest.mark.timeout(120)

KVFLOW = str(Path(sys.executable).with_name("kvflow"))


@pytest.mark.parametrize("name", [n for n in policy_factories() if n != GREEDY_REFERENCE])
def test_every_policy_runs_every_task_of_a_tiny_agent_workload_to_an_end(name: str) -> None:
    spec = WORKLOADS["agent"]
    outcome = run_policy(
        name, spec=spec, fleet=bench_fleet("agent", 4), task_rate=2.0, tasks=12, seed=3
    ).outcome
    assert outcome.tasks == 12
    assert outcome.successes > 0
    assert sum(outcome.tasks_by_tier.values()) == 12
    assert outcome.spend_micros > 0
    assert 0 < outcome.cached_tokens < outcome.prompt_tokens


def test_only_tasks_arriving_in_the_window_count_and_the_run_ends_with_them() -> None:
    spec = WORKLOADS["agent"]
    fleet = bench_fleet("agent", 2)
    plan = run_plan(100.0, task_rate=0.2, window_lifetimes=1.0)
    run = run_policy("round-robin", spec=spec, fleet=fleet, task_rate=0.2, seed=3, plan=plan)
    window = plan.window
    arrivals = [s.task.arrival for s in run.runner.states]
    inside = [a for a in arrivals if window.start <= a < window.end]
    assert run.outcome.tasks == len(inside) > 0
    assert min(arrivals) < window.start  # warm-up tasks ran, uncounted
    assert run.outcome.span_s == window.seconds == 100.0
    assert run.outcome.warmup_s == pytest.approx(window.start - min(arrivals))
    # The run stopped once the last counted task ended, whatever came after.
    counted_end = max(s.end for s in run.runner.states if s.counted)
    assert run.runner.sim.now == pytest.approx(counted_end)


@pytest.mark.parametrize("workload", ["hotspot", "heterogeneous", "long-agent", "overload"])
def test_kvflow_runs_the_other_workloads(workload: str) -> None:
    tasks = 3 if workload == "long-agent" else 12
    outcome = run_policy(
        "kvflow",
        spec=WORKLOADS[workload],
        fleet=bench_fleet(workload, 4),
        task_rate=0.05 if workload == "long-agent" else 2.0,
        tasks=tasks,
        seed=1,
    ).outcome
    assert outcome.tasks == tasks
    assert outcome.successes > 0


def test_a_workload_is_the_same_whatever_the_arrival_rate() -> None:
    tenants = [("acme", 1), ("globex", 3), ("initech", 5)]
    slow = Workload(WORKLOADS["agent"], tenants, tasks=5, task_rate=0.5, seed=9)
    fast = Workload(WORKLOADS["agent"], tenants, tasks=5, task_rate=50.0, seed=9)
    for a, b in zip(slow, fast, strict=True):
        assert (a.tenant, [len(s.calls) for s in a.steps]) == (
            b.tenant,
            [len(s.calls) for s in b.steps],
        )
        assert a.steps[-1].calls[0].block_hashes == b.steps[-1].calls[0].block_hashes
        assert a.arrival > b.arrival


def test_long_agent_tasks_have_long_growing_conversations_and_slow_test_runs() -> None:
    tenants = [("acme", 1), ("globex", 3), ("initech", 5)]
    tasks = list(Workload(WORKLOADS["long-agent"], tenants, tasks=20, task_rate=1.0, seed=0))
    for task in tasks:
        first = task.steps[0].calls[0].prompt_tokens
        last = task.steps[-1].calls[0]
        assert 4_000 <= first <= 8_200
        assert last.prompt_tokens + last.output_tokens <= 100_000
        assert 10 <= len(task.steps) <= 60 or last.prompt_tokens > 90_000
    pauses = [(s.tool, s.pause_after_s) for t in tasks for s in t.steps if s.tool]
    assert {tool for tool, _ in pauses} == {"read", "search", "edit", "test"}
    assert all(p < 1.0 for tool, p in pauses if tool == "read")
    assert max(p for tool, p in pauses if tool == "test") > 60.0


def test_tokens_of_turns_every_block_of_a_task_back_into_its_token_ids() -> None:
    workload = Workload(WORKLOADS["agent"], [("acme", 1)], tasks=3, task_rate=1.0, seed=2)
    for task in workload:
        for step in task.steps:
            for call in step.calls:
                parent = ROOT_HASH
                for h in call.block_hashes:
                    assert hash_block(parent, workload.tokens_of(parent, h)) == h
                    parent = h


def _chain(blocks: int, first_token: int = 0) -> list[int]:
    hashes, parent = [], ROOT_HASH
    for b in range(blocks):
        start = first_token + b * 16
        parent = hash_block(parent, range(start, start + 16))
        hashes.append(parent)
    return hashes


def test_cost_and_hit_rate_of_a_two_step_task_match_the_hand_computed_figures() -> None:
    # One H100 replica at 0.18 / 0.018 / 0.54 $ per million input / cached / output tokens,
    # i.e. micro-dollars per token. Step 1: 64 prompt tokens, 32 out. Step 2 repeats them and
    # adds 32 tokens: 128 prompt tokens, 32 out.
    fleet = bench_fleet("agent", 1)
    chain = _chain(10)
    task = Task(
        index=0,
        tenant="acme",
        tier=1,
        arrival=0.0,
        deadline_at=100.0,
        steps=[
            Step([Call(64, 32, chain[:6])], pause_after_s=1.0),
            Step([Call(128, 32, chain[:10])], pause_after_s=0.0),
        ],
    )
    policy = POLICIES["round-robin"](
        PolicySetup(
            fleet=fleet,
            replica_names=["h100/0"],
            block_size=16,
            clock=lambda: 0.0,
            tokens_of=lambda parent, h: range(16),
        )
    )
    runner = TaskRunner(fleet, simulated_replicas(fleet), policy, max_tokens=512)
    outcome = runner.run(iter([task]), lambda sim: None)

    # Step 1: nothing cached. 64·0.18 + 32·0.54 = 28.8 µ$, rounded half up: 29.
    # Step 2: step 1 computed its prompt and all but its last output token (95 tokens), so
    # 5 full blocks = 80 tokens are cached: 48·0.18 + 80·0.018 + 32·0.54 = 27.36 → 27.
    assert outcome.successes == 1
    assert outcome.spend_micros == 29 + 27
    assert outcome.cached_tokens == 80
    assert outcome.prompt_tokens == 64 + 128
    # Task time less the 1 s tool pause is its model time.
    assert outcome.model_times == [pytest.approx(outcome.task_times[0] - 1.0)]
    fig = figures(outcome, reference_hit_rate=0.5)
    assert fig.cost_per_successful_task_usd == Decimal("0.000056")
    assert fig.prefix_hit_rate == pytest.approx(80 / 192)
    assert fig.wasted_spend_share == 0.0
    assert fig.slo_attainment == {"1": 1.0}


def test_zero_miss_floor_of_a_task_and_a_fan_out_matches_the_hand_computed_figures() -> None:
    # The two-step task of the test above, then a second task whose one step fans out into
    # two calls sharing 4 blocks (64 tokens) of its own and adding 16 tokens each.
    fleet = bench_fleet("agent", 1)
    chain = _chain(10)
    other = _chain(4, first_token=1000)
    first = Task(
        0,
        "acme",
        1,
        0.0,
        100.0,
        [Step([Call(64, 32, chain[:6])], 1.0), Step([Call(128, 32, chain[:10])], 0.0)],
    )
    fan_out = Task(
        1,
        "acme",
        1,
        1.0,
        100.0,
        [Step([Call(80, 16, [*other[:4], 11, 12]), Call(80, 16, [*other[:4], 21, 22])], 0.0)],
    )
    floor = zero_miss_floor([first, fan_out], fleet, block_size=16)
    # Task 0: 29 µ$ (nothing cached), then the 6 blocks step 1 sent are cached (96 tokens,
    # one block more than the engine could reuse: a floor is optimistic):
    # 32·0.18 + 96·0.018 + 32·0.54 = 24.768 → 25 µ$.
    # Task 1: the first call pays for all 80 tokens: 80·0.18 + 16·0.54 = 23.04 → 23 µ$; its
    # sibling finds the 4 shared blocks: 16·0.18 + 64·0.018 + 16·0.54 = 12.672 → 13 µ$.
    assert floor.cost_per_task_usd == Decimal(29 + 25 + 23 + 13) / 2 / 1_000_000
    assert floor.prefix_hit_rate == pytest.approx((96 + 64) / (64 + 128 + 80 + 80))
    assert floor.of([1]) == Decimal(23 + 13) / 1_000_000
    # Uncounted tasks leave blocks behind for the counted ones but are not billed.
    counted = zero_miss_floor(
        [first, fan_out], fleet, block_size=16, counted=lambda task: task.index == 1
    )
    assert counted.cost_per_task_usd == Decimal(23 + 13) / 1_000_000


def _paused_task(index: int, tool: str, pause_s: float) -> Task:
    """Two steps: 64 prompt tokens, a tool of `pause_s`, then 128 that reuse the first 96."""
    chain = _chain(10, first_token=10_000 * index)
    steps = [
        Step([Call(64, 32, chain[:6])], pause_s, tool),
        Step([Call(128, 32, chain[:10])], 0.0),
    ]
    return Task(index, "acme", 1, float(index), 1_000.0, steps)


def test_kv_capacity_floor_keeps_what_a_policy_blind_to_the_pause_can_keep() -> None:
    # A file read of 1 s and two test runs of 100 s and 300 s, each holding a conversation
    # of 96 reusable tokens. The cache is sized so that, once the calls' own running time is
    # paid, it holds exactly the read and the shorter test run: 96 · 1 + 96 · 100 token-s.
    spec = WORKLOADS["agent"]
    fleet = bench_fleet("agent", 1)
    tasks = [_paused_task(0, "read", 1.0), _paused_task(1, "test", 100.0)]
    tasks.append(_paused_task(2, "test", 300.0))
    perf = fastest_perf(fleet, engine_config(spec))
    running = sum(
        call.prompt_tokens * idle_call_s(call, perf, cached)
        for task in tasks
        for call, cached in zip([s.calls[0] for s in task.steps], (0, 96), strict=True)
    )
    budget = 96 * 1 + 96 * 100
    rate = kv_cache_tokens(fleet, spec) * len(tasks) / (running + budget)
    floor = kv_capacity_floor(tasks, fleet, spec, task_rate=rate)
    zero = zero_miss_floor(tasks, fleet, block_size=16)
    # Knowing the pauses, keep the read and the 100-s run: 96 of 288 reusable tokens missed.
    assert floor.clairvoyant_hit_rate == pytest.approx((288 - 96) / 576)
    # Knowing only the kind: keep every read; a test run is kept 100 s or 300 s, equally
    # good per token-second (96 tokens for 19,200 token-s), so the 9,600 token-s left keep
    # a quarter of the test runs' conversations: 48 of their 192 tokens.
    assert floor.prefix_hit_rate == pytest.approx((288 - 144) / 576)
    # One keep time for both kinds: 1 s keeps the read (288 token-s), and the 9,408 left
    # buy 9,408 / 19,008 of the step to 100 s, which saves 96 tokens more.
    one_time = 96 + 96 * 9_408 / 19_008
    assert floor.one_keep_time_hit_rate == pytest.approx(one_time / 576)
    assert floor.demand_over_cache == pytest.approx(96 * 401 / budget)
    # Zero-miss: 29 + 25 µ$ a task. Each test run misses 72 tokens at ≥ 0.162 µ$ more.
    assert zero.cost_per_task_usd == Decimal(54) / 1_000_000
    assert floor.per_task_micros == {0: 54, 1: 54 + 11, 2: 54 + 11}
    assert floor.cost_per_task_usd == cost_per_success(54 * 3 + 22, 3)
    # Running calls held longer than on an idle fleet take the cache from the pauses: held
    # for the budget less the read's 96 token-s, only the read is kept.
    slow = kv_capacity_floor(
        tasks, fleet, spec, task_rate=rate, running_time_scale=1 + (budget - 96) / running
    )
    assert slow.prefix_hit_rate == pytest.approx(96 / 576)
    with pytest.raises(ValueError, match="running_time_scale must be at least 1"):
        kv_capacity_floor(tasks, fleet, spec, task_rate=rate, running_time_scale=0.5)
    # With the cache to hold every pause, it is the zero-miss floor.
    roomy = kv_capacity_floor(tasks, fleet, spec, task_rate=rate / 100)
    assert roomy.demand_over_cache < 1
    assert roomy.cost_per_task_usd == zero.cost_per_task_usd
    assert roomy.prefix_hit_rate == zero.prefix_hit_rate


def test_kv_capacity_floor_finds_shared_prompts_and_a_siblings_blocks_without_keeping() -> None:
    # No cache to keep anything through a pause: only what a task's earlier steps computed
    # is missed. Task 0 computes the system prompt (s1, s2) and its own blocks; task 1 finds
    # the system prompt, pauses, then fans out: its second call finds c1, which the first
    # computed a moment before.
    spec = WORKLOADS["agent"]
    fleet = bench_fleet("agent", 1)
    s1, s2, a, b, c1, c2, c3, d1 = (
        1,
        2,
        [10, 11, 12, 13, 14, 15, 16, 17],
        [20, 21, 22, 23],
        30,
        31,
        32,
        40,
    )
    tasks = [
        Task(0, "acme", 1, 0.0, 1_000.0, [
            Step([Call(64, 32, [s1, s2, *a[:4]])], 10.0),
            Step([Call(128, 32, [s1, s2, *a])], 0.0),
        ]),
        Task(1, "acme", 1, 1.0, 1_000.0, [
            Step([Call(64, 32, [s1, s2, *b])], 10.0),
            Step([
                Call(112, 16, [s1, s2, *b, c1, c2, c3]),
                Call(112, 16, [s1, s2, *b, c1, d1]),
            ], 0.0),
        ]),
    ]  # fmt: skip
    zero = zero_miss_floor(tasks, fleet, block_size=16)
    floor = kv_capacity_floor(tasks, fleet, spec, task_rate=1e12)
    # Zero-miss: 96 + 32 (the system prompt) + 96 + 112 of 480 prompt tokens cached.
    assert zero.prefix_hit_rate == pytest.approx(336 / 480)
    # Missed: task 0's 6 blocks (it computed the system prompt itself), and task 1's own 4
    # blocks in each sibling; never the system prompt task 0 sent, nor c1.
    assert floor.prefix_hit_rate == pytest.approx((336 - 96 - 64 - 64) / 480)
    assert floor.clairvoyant_hit_rate == floor.prefix_hit_rate


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_the_floor_is_below_every_policy_on_every_workload_on_two_seeds(workload: str) -> None:
    spec = WORKLOADS[workload]
    fleet = bench_fleet(workload, 4 if workload == "heterogeneous" else 2)
    lifetime = lifetime_estimate_s(spec, fleet)
    # A few counted tasks a run, after two lifetimes of warm-up.
    rate = (6 if workload == "long-agent" else 8) / lifetime
    result = run_workload(
        workload,
        fleet=fleet,
        seeds=(0, 1),
        load=1.0,
        capacity_tasks_per_s=rate,
        window_lifetimes=1.0,
    )
    assert len(result.floors) == 2
    for summary in result.summaries.values():
        assert len(summary.runs) == 2
        for run, floor in zip(summary.runs, result.floors, strict=True):
            assert floor.cost_per_task_usd is not None
            assert run.cost_per_successful_task_usd is not None, run.policy
            assert run.cost_per_successful_task_usd >= floor.cost_per_task_usd, run.policy
            assert run.floor_of_successes_usd is not None
            assert run.cost_per_successful_task_usd >= run.floor_of_successes_usd, run.policy
    assert len(result.capacity_floors) == 2
    for zero, kv in zip(result.floors, result.capacity_floors, strict=True):
        assert kv.cost_per_task_usd is not None and zero.cost_per_task_usd is not None
        assert kv.cost_per_task_usd >= zero.cost_per_task_usd
        assert kv.one_keep_time_hit_rate <= kv.prefix_hit_rate <= kv.clairvoyant_hit_rate
    # The batching bound, where the fleet is of one GPU: below every policy's model time.
    if workload != "heterogeneous":
        assert len(result.batching) == 2
        for summary in result.summaries.values():
            for run, batching in zip(summary.runs, result.batching, strict=True):
                assert run.mean_model_s >= batching.mean_model_s, run.policy


@pytest.mark.timeout(240)
def test_near_capacity_the_batching_bound_is_below_every_policy_and_above_the_idle_fleet() -> None:
    # The agent workload on 2 H100s at about 0.95 of their capacity (4.21 tasks/s on 4).
    spec = WORKLOADS["agent"]
    fleet = bench_fleet("agent", 2)
    rate = 2.0
    plan = run_plan(lifetime_estimate_s(spec, fleet), task_rate=rate, window_lifetimes=0.5)
    drawn = Workload(
        spec, fleet_tenants(fleet), tasks=1, task_rate=1.0, seed=0, block_size=spec.block_size
    )
    arrivals = drawn.at_rate(rate, until_s=plan.arrivals_until_s)
    window = plan.window

    def counted(task: Task) -> bool:
        return window.start <= task.arrival < window.end

    bound = batching_bound(arrivals, fleet, spec, task_rate=rate, counted=counted)
    assert bound is not None
    idle = success_ceiling(arrivals, fleet, spec, counted=counted).mean_model_s
    # The load forces batching: the bound is well above a call alone on its replica.
    assert bound.tpot_s > 1.3 * bound.idle_tpot_s and bound.mean_model_s > 1.2 * idle
    for policy in ("kvflow", "round-robin"):
        run = run_policy(
            policy, spec=spec, fleet=fleet, task_rate=rate, seed=0, plan=plan, workload=drawn
        )
        measured = figures(run.outcome, 0.0).mean_model_s
        assert measured >= bound.mean_model_s, policy
        # And over the very tasks the policy finished.
        least = bound.of(run.outcome.succeeded)
        assert least is not None and measured >= least, policy
    # Beyond what the replicas' whole time can serve there is no bound to give.
    assert batching_bound(arrivals, fleet, spec, task_rate=rate * 10, counted=counted) is None


@pytest.mark.timeout(120)
def test_the_batching_bound_says_which_tiers_steps_fit_at_the_loads_pace() -> None:
    # Overload's tier-1 steps are due in 6 s, tier 3's in 20 s, tier 5's in 90 s. At a light
    # load every step fits at the least mean time per token; at 2 tasks/s on 2 H100s the
    # pace (about 13 ms a token) stretches tier 1's longest answers past 6 s, and only there.
    spec = WORKLOADS["overload"]
    fleet = bench_fleet("overload", 2)
    drawn = Workload(
        spec, fleet_tenants(fleet), tasks=1, task_rate=1.0, seed=0, block_size=spec.block_size
    )

    def in_time(rate: float) -> dict[str, float]:
        plan = run_plan(lifetime_estimate_s(spec, fleet), task_rate=rate, window_lifetimes=0.5)
        window = plan.window
        bound = batching_bound(
            drawn.at_rate(rate, until_s=plan.arrivals_until_s),
            fleet,
            spec,
            task_rate=rate,
            counted=lambda task: window.start <= task.arrival < window.end,
        )
        assert bound is not None
        return bound.in_time_by_tier

    assert in_time(0.6) == {"1": 1.0, "3": 1.0, "5": 1.0}
    heavy = in_time(2.0)
    assert heavy["1"] < 0.95 and heavy["3"] == heavy["5"] == 1.0


def test_kvflow_keeps_a_conversation_on_its_replica_and_recomputes_less() -> None:
    # The agent workload near the load where the affinity bound starts passing over busy
    # prefix holders. With `keep_conversation` off, calls that continue a conversation move
    # to another replica and recompute it there; with it, they stay.
    spec, fleet = WORKLOADS["agent"], bench_fleet("agent", 4)
    previous = [f.name for f in dataclasses.fields(TaskContext)].index("previous_replica")
    moved: dict[bool, int] = {}
    hit: dict[bool, float] = {}
    for keep in (True, False):
        run = run_policy(
            "kvflow", spec=spec, fleet=fleet, task_rate=3.37, seed=0, tasks=300,
            record_decisions=True, extra={"keep_conversation": keep},
        )  # fmt: skip
        assert run.runner.decisions is not None
        continuing = [
            d
            for d in run.runner.decisions
            if d.replica is not None and d.context[previous] is not None
        ]
        assert len(continuing) > 1000, "too few conversations continued: the test proves nothing"
        moved[keep] = sum(d.context[previous] != d.replica for d in continuing)
        hit[keep] = figures(run.outcome, 0.0).prefix_hit_rate
    assert moved[False] > 50
    assert moved[True] < moved[False] / 10
    assert hit[True] > hit[False]


def test_objective_bound_moves_new_tasks_with_step_objectives_and_off_is_the_plain_bound() -> None:
    # Overload declares step objectives: with `objective_bound` on, new tasks' calls leave
    # prefix holders above the mean load; off, kvflow places as with the plain factor.
    spec, fleet = WORKLOADS["overload"], bench_fleet("overload", 4)

    def placements(**extra: object) -> list[int | None]:
        run = run_policy(
            "kvflow", spec=spec, fleet=fleet, task_rate=3.0, seed=0, tasks=200,
            record_decisions=True, extra=extra,
        )  # fmt: skip
        assert run.runner.decisions is not None
        return [d.replica for d in run.runner.decisions]

    plain = SchedulerConfig(prefix=PrefixConfig(affinity_load_factor_with_objective=1.25))
    on, off = placements(), placements(objective_bound=False)
    assert off == placements(scheduler_config=plain)
    assert sum(a != b for a, b in zip(on, off, strict=False)) > 10


def test_a_config_field_a_lever_sets_otherwise_is_refused_until_the_lever_is_off() -> None:
    own = SchedulerConfig(admission=AdmissionConfig(open_task_kv_by_tier=(3, 3, 3, 3, 3)))
    with pytest.raises(ValueError) as refused:
        lever_config(own, {})  # kv_admission is on by default
    message = str(refused.value)
    assert "admission.open_task_kv_by_tier" in message and "kv_admission lever (on)" in message
    assert "--levers kv_admission=off" in message
    assert lever_config(own, {"kv_admission": False}).admission.open_task_kv_by_tier == (
        3, 3, 3, 3, 3,
    )  # fmt: skip
    # A field set to what the lever sets anyway is no conflict; nor is one the lever leaves.
    same = SchedulerConfig(prefix=PrefixConfig(affinity_keeps_conversation=True))
    assert lever_config(same, {}).prefix.affinity_keeps_conversation is True
    with pytest.raises(ValueError, match=r"prefix.affinity_keeps_conversation = True"):
        lever_config(same, {"keep_conversation": False})


def test_ablation_runs_kvflow_once_without_each_axis_but_the_required_one_and_each_lever() -> None:
    result = run_workload(
        "agent",
        replicas=2,
        seeds=(0,),
        policies=["kvflow"],
        ablate=True,
        capacity_tasks_per_s=0.1,
        window_lifetimes=0.3,
    )
    levers = [f"{lever} {'off' if on else 'on'}" for lever, on in LEVERS.items()]
    assert list(result.ablations) == [a for a in DEFAULT_AXES if a != REQUIRED_AXIS] + levers
    for axis, summary in result.ablations.items():
        assert summary.runs[0].tasks == result.summaries["kvflow"].runs[0].tasks, axis
        assert summary.runs[0].success_rate > 0, axis


def test_figures_of_a_hand_made_outcome() -> None:
    outcome = Outcome(
        policy="p",
        replicas=2,
        tasks=4,
        successes=3,
        tasks_by_tier={1: 2, 5: 2},
        successes_by_tier={1: 1, 5: 2},
        spend_micros=1_000,
        wasted_micros=250,
        ttfts=[0.1, 0.2, 0.3, 0.4, 1.0],
        prompt_tokens=1_000,
        cached_tokens=600,
        span_s=10.0,
        busy_s=5.0,
        attempts_by_replica=[3, 1],
        failed_attempts=1,
        refusals=0,
        warmup_s=30.0,
        mean_task_s=120.0,
        busy_gpu_s=6.0,
        task_times=[100.0, 110.0, 150.0],
        model_times=[10.0, 20.0, 60.0],
    )
    fig = figures(outcome, reference_hit_rate=0.8)
    # 1,000 µ$ over 3 successful tasks = $0.000333333 (to the nano-dollar).
    assert fig.cost_per_successful_task_usd == Decimal("0.000333333")
    assert fig.gpu_seconds_per_successful_task == pytest.approx(2.0)
    assert fig.success_rate == 0.75
    assert fig.slo_attainment == {"1": 0.5, "5": 1.0}
    assert fig.goodput_tasks_per_s == pytest.approx(0.3)
    assert (fig.ttft_p50_s, fig.ttft_p90_s, fig.ttft_p99_s) == (0.3, 1.0, 1.0)
    assert fig.mean_task_s == pytest.approx(120.0)
    assert fig.p99_task_s == 150.0
    assert fig.mean_model_s == pytest.approx(30.0)
    assert fig.p99_model_s == 60.0
    assert fig.prefix_hit_rate == pytest.approx(0.6)
    assert fig.reference_prefix_hit_rate == 0.8
    assert fig.wasted_spend_share == 0.25
    assert fig.utilisation == pytest.approx(5.0 / 20.0)
    assert fig.max_replica_load_share == 0.75
    assert fig.max_replica_load_over_mean == 1.5
    # 30 s of warm-up arrivals for tasks that live 120 s: a quarter of a lifetime.
    assert fig.warmup_task_lifetimes == 0.25
    assert cost_per_success(1_000, 0) is None
    assert percentile([], 0.5) == 0.0


def _kvflow(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [KVFLOW, "bench", "policies", *args],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
        env={"COLUMNS": "250", "PATH": str(Path(sys.executable).parent)},
    )


HEADLINE_KEYS = {
    "cost_per_successful_task_usd",
    "gpu_seconds_per_successful_task",
    "success_rate",
    "slo_attainment",
    "goodput_tasks_per_s",
    "mean_task_s",
    "p99_task_s",
    "mean_model_s",
    "p99_model_s",
    "prefix_hit_rate",
    "max_replica_load_over_mean",
    "wasted_spend_share",
}


def test_bench_policies_prints_the_table_and_writes_the_json_keys_scripts_read(
    tmp_path: Path,
) -> None:
    out = tmp_path / "policies.json"
    done = _kvflow(
        "--workload", "agent", "--replicas", "2", "--seeds", "2", "--capacity", "0.2",
        "--window-lifetimes", "0.3", "--min-tasks", "0", "--no-sweep", "--jobs", "1",
        "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "goal:" in done.stdout
    assert "zero-miss floor" in done.stdout
    data = json.loads(out.read_text())
    assert data["seeds"] == [0, 1]
    workload = data["workloads"]["agent"]["workload"]
    assert workload["seeds"] == [0, 1]
    assert workload["capacity_tasks_per_s"] == 0.2
    assert workload["load"] == 0.8
    floor = workload["zero_miss_floor"]
    Decimal(floor["cost_per_successful_task_usd"])  # exact, never a float
    assert len(floor["ci95"]) == 2
    kv = workload["kv_capacity_floor"]
    kv_cost = Decimal(kv["cost_per_successful_task_usd"])
    assert kv_cost >= Decimal(floor["cost_per_successful_task_usd"])
    assert kv["one_keep_time_hit_rate"] <= kv["prefix_hit_rate"] <= kv["clairvoyant_hit_rate"]
    batching = workload["batching_bound"]
    assert batching["tpot_ms"] >= batching["idle_tpot_ms"] > 0
    assert batching["p99_model_s"] >= batching["mean_model_s"] > 0
    policies = data["workloads"]["agent"]["policies"]
    assert set(policies) == {*POLICIES, GREEDY_REFERENCE}
    assert any(name.endswith("-tuned") for name in policies)
    for name, fig in policies.items():
        assert set(fig) >= HEADLINE_KEYS, name
        assert set(fig["ci95"]) >= HEADLINE_KEYS, name
        low, high = fig["ci95"]["success_rate"]
        assert low <= fig["success_rate"] <= high
        cost = fig["cost_per_successful_task_usd"]
        assert cost is not None
        low, high = (Decimal(v) for v in fig["ci95"]["cost_per_successful_task_usd"])
        assert low <= Decimal(cost) <= high
        assert len(fig["runs"]) == 2
        assert set(fig["kvflow_ratio"]) >= HEADLINE_KEYS - {"slo_attainment"}
    assert policies["kvflow"]["kvflow_ratio"]["cost_per_successful_task_usd"] == 1.0


def test_plot_without_matplotlib_names_the_extra_to_install(tmp_path: Path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("matplotlib is installed: the message is for environments without it")
    done = _kvflow(
        "--workload", "agent", "--replicas", "2", "--seeds", "1", "--capacity", "0.2",
        "--window-lifetimes", "0.3", "--min-tasks", "0", "--no-sweep",
        "--policies", "round-robin", "--plot", str(tmp_path / "p.png"),
    )  # fmt: skip
    assert done.returncode == 2
    assert "pip install 'kvflow[bench]'" in done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workload", "nope"], "unknown workload 'nope'"),
        (["--load", "0"], "--load"),
        (["--load", "-0.5"], "--load"),
        (["--policies", "kvflow,nope"], "--policies: unknown 'nope'"),
        (["--mechanisms", "hints,magic"], "--mechanisms: unknown 'magic'"),
        (["--capacity", "0"], "--capacity"),
        (["--levers", "kv_admission,telepathy"], "--levers: 'telepathy' is not NAME"),
        (["--levers", "kv_admission=maybe"], "kv_admission (on by default)"),
        (["--levers", ","], "--levers: empty list"),
    ],
)
def test_bench_policies_refuses_bad_input_with_exit_code_2(args: list[str], message: str) -> None:
    done = _kvflow(*args)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def _one_seed(workload: str, anchor: str, capacity: float, **options: Any) -> WorkloadResult:
    """kvflow and one anchor on seed 0 of `workload`, 2 replicas, a short window (0.3)."""
    options.setdefault("window_lifetimes", 0.3)
    return run_workload(
        workload, replicas=2, seeds=(0,), policies=["kvflow", anchor],
        capacity_tasks_per_s=capacity, **options,
    )  # fmt: skip


def test_each_goal_of_a_workload_is_judged_on_kvflows_ratio_and_states_its_bound() -> None:
    result = _one_seed("overload", "sglang-tuned", 0.3)
    goals = {g.text: g for g in result.goals}
    assert list(goals) == [
        "goodput ≥ 1.3× the best anchor's",
        "tier-1 SLO attainment ≥ 99% at 150% of capacity",
        "wasted-spend share ≤ half the best anchor's",
        "batching bound ≤ every policy's mean model time",
    ]
    assert all("bound" in g.detail for g in goals.values())
    ratio = result.summaries["sglang-tuned"].ratios["goodput_tasks_per_s"]
    assert ratio is not None
    assert goals["goodput ≥ 1.3× the best anchor's"].met is (ratio.mean >= 1.3)
    tier1 = result.summaries["kvflow"].slo["1"]
    assert tier1 is not None
    assert goals["tier-1 SLO attainment ≥ 99% at 150% of capacity"].met is (tier1.mean >= 0.99)
    # A miss is read against what the anchors keep under the same load.
    theirs = result.summaries["sglang-tuned"].slo["1"]
    assert theirs is not None
    assert f"the best anchor keeps {theirs.mean:.1%} (sglang-tuned)" in (
        goals["tier-1 SLO attainment ≥ 99% at 150% of capacity"].detail
    )
    # And against the pace the load allows: the share of tier 1 in time at the batching bound.
    (batching,) = result.batching
    paced = batching.in_time_by_tier["1"]
    assert f"at the batching bound's {batching.tpot_s * 1000:.1f} ms, {paced:.1%} fit" in (
        goals["tier-1 SLO attainment ≥ 99% at 150% of capacity"].detail
    )


def test_the_floor_goal_says_where_the_best_anchor_stands_against_the_floor() -> None:
    result = _one_seed("agent", "sglang-tuned", 0.5, load=0.5)
    goals = {g.text: g for g in result.goals}
    goal = goals["cost per successful task within 2% of the zero-miss floor"]
    floor = result.floor_cost()
    theirs = result.summaries["sglang-tuned"].mean("cost_per_successful_task_usd")
    assert floor is not None and theirs is not None
    # Level with the best anchor, a miss is the engines' eviction, not kvflow's placement.
    assert f"the best anchor is at {theirs / float(floor):.3f}× (sglang-tuned)" in goal.detail


# Seven simulated long-agent runs: about 40 s on a quiet 2-core machine, past 120 s beside
# another heavy job; the limit guards against a hang, not against a slow machine.
@pytest.mark.timeout(360)
def test_the_long_agent_model_time_goal_names_a_relaxation_run_against_its_anchor() -> None:
    # One headline seed, and one more run for the model-time bound alone (a window long
    # enough that the larger caches bracket the floor's hit rate on both).
    result = _one_seed("long-agent", "llm-d-precise", 0.0229, bound_seeds=2, window_lifetimes=0.5)
    goals = {g.text: g for g in result.goals}
    detail = goals["mean model time ≤ 0.8× the best anchor's"].detail
    # The closed-form part of the bound, then model time at the floor's hit rate: kvflow on
    # larger caches, read at the floor's hit rate, over the anchor's model time on that seed.
    assert "recomputing what the KV-capacity floor misses adds" in detail
    (anchor_run,) = result.summaries["llm-d-precise"].runs
    (kvflow_run,) = result.summaries["kvflow"].runs
    assert sorted(result.model_s_at_floor) == [0, 1]
    # Bracketed by kvflow's own run and its largest cache's: no extrapolation.
    assert result.model_s_at_floor[0] < kvflow_run.mean_model_s
    assert kvflow_run.prefix_hit_rate < result.capacity_floors[0].prefix_hit_rate
    # Seed by seed over the anchor's: the headline seed's run, and the estimate's own.
    ratios = [
        result.model_s_at_floor[0] / anchor_run.mean_model_s,
        result.model_s_at_floor[1] / result.bound_model_s["llm-d-precise"][1],
    ]
    assert f"model time is about {sum(ratios) / 2:.3f}× [" in detail
    assert "over 2 seeds (kvflow on engines" in detail
    # Read between larger caches, it is called what it is.
    assert "estimate, not a bound: at the KV-capacity floor's hit rate" in detail
    # The seed run for the bound alone stays out of the headline figures.
    assert [run.seed for run in result.summaries["kvflow"].runs] == [0]
    command = detail.split("`")[1].split()
    assert command[:3] == ["python", "-m", "kvflow.bench.policies.relaxations"]
    # The command as printed is one the study takes, on this run's fleet, load and anchor.
    app = typer.Typer(add_completion=False)
    app.command()(relax_main)
    study = typer.main.get_command(app)
    options = study.make_context("relaxations", command[3:]).params
    assert options["workload"] == "long-agent"
    assert options["capacity"] * options["load"] == pytest.approx(result.task_rate, rel=1e-3)
    assert options["replicas"] == 2
    assert options["anchor"] == "llm-d-precise"
    assert set(options["mechanisms"].split(",")) == set(result.mechanisms)


def test_kv_admission_keeps_long_agent_past_capacity_out_of_the_collapse() -> None:
    # Long-agent at 2× capacity: admitting every task, returning conversations find their KV
    # evicted and recompute it; holding new tasks while the open ones outgrow the caches
    # keeps what they cached, at a fraction of the cost per successful task.
    spec, fleet = WORKLOADS["long-agent"], bench_fleet("long-agent", 2)
    measured: dict[bool, tuple[int, PolicyFigures]] = {}
    for lever in (True, False):
        run = run_policy(
            "kvflow", spec=spec, fleet=fleet, task_rate=0.0458, seed=0, tasks=200,
            extra={"kv_admission": lever},
        )  # fmt: skip
        measured[lever] = (run.outcome.refusals, figures(run.outcome, 0.0))
    (held, on), (_, off) = measured[True], measured[False]
    assert held > 100, "no task waited: the test proves nothing"
    assert on.prefix_hit_rate > off.prefix_hit_rate + 0.15
    assert on.success_rate >= off.success_rate
    assert on.cost_per_successful_task_usd is not None
    assert off.cost_per_successful_task_usd is not None
    assert on.cost_per_successful_task_usd < off.cost_per_successful_task_usd * Decimal("0.8")

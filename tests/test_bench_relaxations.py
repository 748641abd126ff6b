"""The relaxations that explain a missed goal: a larger KV cache, eviction by true return."""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Callable
from decimal import Decimal

import pytest
import typer
from typer.testing import CliRunner

from kvflow.bench.policies.bounds import at_hit_rate
from kvflow.bench.policies.fleet import bench_fleet
from kvflow.bench.policies.late_steps import main as late_steps_main
from kvflow.bench.policies.relaxations import against_anchor, main, seed_floors
from kvflow.bench.policies.runs import run_policy
from kvflow.bench.policies.task_runner import OVERDUE_S, ClairvoyantBlockPool, oracle_retention
from kvflow.simulator.kvcache import MAX_RETENTION_PRIORITY
from kvflow.simulator.workloads import WORKLOADS, Workload

pytestmark = pytest.mark.timeout(120)


def test_oracle_retention_tells_the_pool_when_the_conversation_comes_back() -> None:
    assert oracle_retention(0.2, last=False) == (MAX_RETENTION_PRIORITY, 0.2)
    assert oracle_retention(120.0, last=False) == (MAX_RETENTION_PRIORITY, 120.0)
    # A task's last call never comes back: a priority without seconds, needed never.
    assert oracle_retention(0.0, last=True) == (0, None)


Trace = list[tuple[int, int | None]]
"""Per moment: the block used then, and the moment it is next used (None: never)."""


def _trace(seed: int, length: int, distinct: int) -> Trace:
    rng = random.Random(seed)
    uses = [rng.randrange(distinct) for _ in range(length)]
    return [
        (block, next((j for j in range(i + 1, length) if uses[j] == block), None))
        for i, block in enumerate(uses)
    ]


def _pool_hits(trace: Trace, capacity: int) -> int:
    """Hits of a `ClairvoyantBlockPool` of `capacity` blocks on `trace`, as an engine uses it."""
    pool = ClairvoyantBlockPool(capacity + 1, 16)
    hits = 0
    for now, (block, following) in enumerate(trace):
        found = pool.longest_cached_prefix([block], 1)
        if found:
            hits += 1
            pool.touch(found)
        else:
            found = pool.allocate(1, float(now)) or []
            pool.cache_blocks(found, [block], None, [])
        if following is None:
            pool.release(found, float(now), 0, None)
        else:
            pool.release(found, float(now), MAX_RETENTION_PRIORITY, float(following - now))
    return hits


def _best_hits(trace: Trace, capacity: int) -> int:
    """The most hits any eviction order gets on `trace`: every choice tried."""

    @functools.cache
    def best(at: int, cached: frozenset[int]) -> int:
        if at == len(trace):
            return 0
        block = trace[at][0]
        if block in cached:
            return 1 + best(at + 1, cached)
        if len(cached) < capacity:
            return best(at + 1, cached | {block})
        return max(best(at + 1, (cached - {out}) | {block}) for out in cached)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(40))
def test_clairvoyant_eviction_misses_no_more_than_any_eviction_order(seed: int) -> None:
    rng = random.Random(seed)
    trace = _trace(seed, length=rng.randint(6, 13), distinct=rng.randint(3, 6))
    capacity = rng.randint(1, 3)
    assert _pool_hits(trace, capacity) == _best_hits(trace, capacity)


def test_clairvoyant_eviction_keeps_the_conversation_back_soonest_not_the_shortest_pause() -> None:
    # Two conversations released at different times: A at 0 for 100 s (back at 100), B at 90
    # for 20 s (back at 110). A fixed priority from the pause keeps B (the shorter pause);
    # the one back sooner is A.
    pool = ClairvoyantBlockPool(3, 16)
    a, b = pool.allocate(1, 0.0) or [], pool.allocate(1, 0.0) or []
    pool.cache_blocks(a, [1], None, [])
    pool.cache_blocks(b, [2], None, [])
    pool.release(a, 0.0, MAX_RETENTION_PRIORITY, 100.0)
    pool.release(b, 90.0, MAX_RETENTION_PRIORITY, 20.0)
    assert pool.allocate(1, 95.0) == b
    assert pool.is_cached(1) and not pool.is_cached(2)


def test_a_block_unused_well_past_its_return_is_taken_for_never_needed() -> None:
    # A conversation due back at 10 s, another at 500 s. Within the grace the one due first
    # is kept; past it, its next call went to another replica: needed never, evicted first.
    def evicted_at(now: float) -> int:
        pool = ClairvoyantBlockPool(3, 16)
        for block_hash, back in ((1, 10.0), (2, 500.0)):
            block = pool.allocate(1, 0.0) or []
            pool.cache_blocks(block, [block_hash], None, [])
            pool.release(block, 0.0, MAX_RETENTION_PRIORITY, back)
        pool.allocate(1, now)
        (gone,) = [h for h in (1, 2) if not pool.is_cached(h)]
        return gone

    assert evicted_at(10.0 + OVERDUE_S / 2) == 2
    assert evicted_at(10.0 + OVERDUE_S * 1.5) == 1


def test_engines_evicting_by_true_return_get_a_clairvoyant_pool() -> None:
    spec = WORKLOADS["agent"]
    run = run_policy(
        "round-robin", spec=spec, fleet=bench_fleet("agent", 2), task_rate=1.0, seed=0,
        tasks=4, retention_oracle=True,
    )  # fmt: skip
    for replica in run.runner.sim.replicas:
        for engine in replica.engines.values():
            assert isinstance(engine.pool, ClairvoyantBlockPool)
    assert run.outcome.successes == 4


def test_model_time_is_read_between_the_hit_rates_measured_and_never_beyond() -> None:
    points = [(0.76, 164.0), (0.79, 155.0), (0.815, 142.0)]
    assert at_hit_rate(points, 0.80) == pytest.approx(155.0 - 13.0 * 0.01 / 0.025)
    assert at_hit_rate(points, 0.76) == pytest.approx(164.0)
    assert at_hit_rate(points, 0.82) is None
    assert at_hit_rate(points, 0.70) is None


def test_a_larger_kv_cache_gives_every_engine_that_many_blocks() -> None:
    spec = WORKLOADS["agent"]
    fleet = bench_fleet("agent", 2)

    def blocks(scale: float) -> list[int]:
        run = run_policy(
            "round-robin", spec=spec, fleet=fleet, task_rate=1.0, seed=0, tasks=2,
            kv_cache_scale=scale,
        )  # fmt: skip
        return [next(iter(r.engines.values())).num_gpu_blocks for r in run.runner.sim.replicas]

    base = blocks(1.0)
    assert blocks(1.5) == [round(b * 1.5) for b in base]
    with pytest.raises(ValueError, match="one pool"):
        run_policy(
            "round-robin", spec=spec, fleet=bench_fleet("heterogeneous", 4), task_rate=1.0,
            seed=0, tasks=1, kv_cache_scale=2.0,
        )  # fmt: skip


@pytest.mark.parametrize("study", [main, late_steps_main], ids=["relaxations", "late_steps"])
def test_an_unknown_workload_is_a_clear_error_without_a_traceback(
    study: Callable[..., None],
) -> None:
    app = typer.Typer()
    app.command()(study)
    done = CliRunner().invoke(app, ["--workload", "nope", "--capacity", "0.1"])
    assert done.exit_code == 2
    assert "unknown workload 'nope'" in done.output
    assert "Traceback" not in done.output


def test_scales_that_are_not_numbers_are_a_clear_error() -> None:
    app = typer.Typer()
    app.command()(main)
    done = CliRunner().invoke(app, ["--workload", "agent", "--capacity", "1", "--scales", "1,x"])
    assert done.exit_code == 2
    assert "--scales takes positive numbers separated by commas, got '1,x'" in done.output


def test_the_floor_at_measured_load_is_above_the_bound_and_none_without_a_measure() -> None:
    # Long-agent, 2 replicas, seed 0: running calls held twice their idle-fleet time take
    # cache from the pauses; the bound itself holds them for the idle time.
    bound_only = seed_floors("long-agent", 2, 0, 0.0229, None)
    assert bound_only["loaded"] is None
    idle = bound_only["idle_model_s"]
    floors = seed_floors("long-agent", 2, 0, 0.0229, 2 * idle)
    loaded = floors["loaded"]
    assert loaded["running_time_scale"] == pytest.approx(2.0)
    assert loaded["prefix_hit_rate"] < floors["floor_hit_rate"]
    assert Decimal(loaded["cost_usd"]) > Decimal(floors["floor_cost_usd"])
    # Faster than an idle fleet is no measurement: the bound's own time is used.
    faster = seed_floors("long-agent", 2, 0, 0.0229, idle / 2)["loaded"]
    assert faster["prefix_hit_rate"] == pytest.approx(floors["floor_hit_rate"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workload", "agent", "--mechanisms", "hints,telepathy"], "unknown mechanism telepathy"),
        (["--workload", "long-agent", "--anchor", "llm-e"], "unknown policy 'llm-e'"),
    ],
    ids=["mechanism", "anchor"],
)
def test_an_unknown_name_is_a_clear_error_before_any_run(args: list[str], message: str) -> None:
    app = typer.Typer()
    app.command()(main)
    done = CliRunner().invoke(app, [*args, "--capacity", "0.0229"])
    assert done.exit_code == 2
    assert f"{message}; choose from" in done.output
    assert "Traceback" not in done.output


def test_retention_by_the_tools_kind_reads_the_kind_never_the_pause() -> None:
    spec = WORKLOADS["long-agent"]
    medians = {tool.name: tool.pause_median_s for tool in spec.tools}
    run = run_policy(
        "round-robin", spec=spec, fleet=bench_fleet("long-agent", 2), task_rate=0.1, seed=0,
        tasks=2, retention_oracle=True, kind_oracle=True, record_decisions=True,
    )  # fmt: skip
    tasks = {state.task.index: state.task for state in run.runner.states}
    decisions = run.runner.decisions
    assert decisions
    seen_kinds = set()
    for decision in decisions:
        task_part, step_part, _ = decision.request_id.split("#")[0].split("/")
        task = tasks[int(task_part.removeprefix("task-"))]
        step = task.steps[int(step_part)]
        if step is task.steps[-1]:
            assert decision.retention == (0, None)
            continue
        assert step.tool is not None
        seen_kinds.add(step.tool)
        # Two calls before the same kind ask alike, however long each pause really was.
        assert decision.retention == oracle_retention(medians[step.tool], last=False)
    assert len(seen_kinds) > 1, "one kind of tool only: the test proves nothing"
    # Without the oracle it would silently change nothing: refused instead.
    with pytest.raises(ValueError, match="kind_oracle needs retention_oracle"):
        run_policy(
            "round-robin", spec=spec, fleet=bench_fleet("long-agent", 2), task_rate=0.1,
            seed=0, tasks=1, kind_oracle=True,
        )  # fmt: skip


def test_even_arrivals_start_the_same_tasks_exactly_one_gap_apart() -> None:
    spec = WORKLOADS["long-agent"]
    tenants = [("acme", 1), ("globex", 3), ("initech", 5)]
    poisson = list(Workload(spec, tenants, tasks=50, task_rate=0.5, seed=3))
    even = list(Workload(spec, tenants, tasks=50, task_rate=0.5, seed=3, even_arrivals=True))
    assert [t.arrival for t in even] == pytest.approx([2.0 * n for n in range(1, 51)])
    # The Poisson stream is not even; the tasks themselves are the same ones.
    gaps = [b.arrival - a.arrival for a, b in itertools.pairwise(poisson)]
    assert max(gaps) > 2 * min(gaps)
    assert [(t.tier, t.steps) for t in even] == [(t.tier, t.steps) for t in poisson]
    # Derived workloads keep the spacing, and a run cannot mix a workload with another one.
    assert next(iter(Workload(spec, tenants, tasks=1, task_rate=1.0, even_arrivals=True).at_rate(
        0.25, tasks=2
    ))).arrival == pytest.approx(4.0)  # fmt: skip
    with pytest.raises(ValueError, match="even_arrivals"):
        run_policy(
            "round-robin", spec=spec, fleet=bench_fleet("long-agent", 2), task_rate=1.0, seed=0,
            tasks=1, even_arrivals=True,
            workload=Workload(spec, tenants, tasks=1, task_rate=1.0),
        )  # fmt: skip


def test_each_relaxation_is_set_against_the_anchor_seed_by_seed() -> None:
    def run(seed: int, variant: str, cost: str, model_s: float) -> dict[str, object]:
        return {
            "seed": seed, "variant": variant, "prefix_hit_rate": 0.8,
            "cost_per_successful_task_usd": cost, "mean_model_s": model_s, "success_rate": 1.0,
        }  # fmt: skip

    result = {
        "anchor": "llm-d-precise",
        "runs": [
            run(0, "cache ×1", "0.10", 150.0),
            run(1, "cache ×1", "0.20", 100.0),
            run(0, "anchor llm-d-precise", "0.10", 100.0),
            run(1, "anchor llm-d-precise", "0.25", 200.0),
        ],
        "seeds": [
            {"seed": 0, "floor_cost_usd": "0.08", "model_s_at_floor": 90.0},
            # A seed whose floor's hit rate no cache size bracketed has no model time there.
            {"seed": 1, "floor_cost_usd": "0.20", "model_s_at_floor": None},
        ],
    }
    ratios = against_anchor(result)
    assert "anchor llm-d-precise" not in ratios
    # Paired by seed, not mean over mean: (1.5 + 0.5) / 2, where 250 / 300 would be 0.83.
    ours = ratios["cache ×1"]
    assert ours["model_s"]["mean"] == pytest.approx(1.0)
    assert ours["cost"]["mean"] == pytest.approx((1.0 + 0.8) / 2)
    assert ours["cost"]["seeds"] == 2
    assert ratios["KV-capacity floor (the bound)"]["cost"]["mean"] == pytest.approx(0.8)
    at_floor = ratios["at the KV-capacity floor's hit rate"]["model_s"]
    assert at_floor == {"mean": pytest.approx(0.9), "ci95": None, "seeds": 1}

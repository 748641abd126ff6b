"""The relaxations that explain a missed goal: a larger KV cache, eviction by true return."""

from __future__ import annotations

import itertools
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
from kvflow.bench.policies.task_runner import ORACLE_RETENTION_S, oracle_retention
from kvflow.simulator.kvcache import DEFAULT_RETENTION_PRIORITY
from kvflow.simulator.workloads import WORKLOADS, Workload

pytestmark = pytest.mark.timeout(120)


def test_oracle_retention_keeps_the_conversation_back_soonest_and_drops_a_finished_one() -> None:
    read, search, test_run = (oracle_retention(s, last=False) for s in (0.2, 1.0, 120.0))
    assert read[0] > search[0] > test_run[0] > DEFAULT_RETENTION_PRIORITY
    assert read[1] == pytest.approx(0.2 + ORACLE_RETENTION_S)
    assert test_run[1] == pytest.approx(120.0 + ORACLE_RETENTION_S)
    # A task's last call never comes back: below every other, evicted first.
    assert oracle_retention(0.0, last=True) == (0, None)
    assert oracle_retention(10_000.0, last=False)[0] == DEFAULT_RETENTION_PRIORITY + 1


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

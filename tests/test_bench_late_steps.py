"""Late steps: the calls cut by their step's deadline, and the loads a router saw around them."""

from __future__ import annotations

from dataclasses import asdict

import typer
from typer.testing import CliRunner

from kvflow.bench.policies.fleet import bench_fleet
from kvflow.bench.policies.late_steps import main, summary
from kvflow.bench.policies.runs import run_policy
from kvflow.simulator.workloads import WORKLOADS


def test_a_call_cut_by_its_steps_deadline_is_listed_with_the_loads_around_it() -> None:
    # Overload at several times what two replicas serve: steps run past their allowance.
    run = run_policy(
        "least-loaded", spec=WORKLOADS["overload"], fleet=bench_fleet("overload", 2),
        task_rate=4.0, seed=0, tasks=60,
    )  # fmt: skip
    lates = run.runner.late_steps
    assert lates, "no step ran past its deadline at 4 tasks/s on two replicas"
    failed = {s.task.index for s in run.runner.states if not s.ok}
    for late in lates:
        # Each is a call of a task that failed, on a replica that held it.
        assert late.task in failed
        assert 0 <= late.replica < 2 and late.load >= 1
        assert late.placed_least_load <= late.placed_load
        assert late.least_load <= late.mean_load and late.least_load <= late.load
        assert late.lower_tier_calls <= late.load - 1
    counts = summary([{"seed": 0, **asdict(late)} for late in lates])
    assert sum(c["late"] for c in counts.values()) == len(lates)


def test_late_calls_are_told_apart_by_what_placement_and_the_batch_could_have_done() -> None:
    def row(placed: int, least: int, load: int, mean: float, lower: int) -> dict[str, object]:
        return {
            "seed": 0, "task": 0, "tier": 1, "output_tokens": 512, "replica": 0,
            "placed_load": placed, "placed_least_load": least, "placed_mean_load": mean,
            "load": load, "lower_tier_calls": lower, "least_load": least, "mean_load": mean,
        }  # fmt: skip

    counts = summary(
        [
            row(placed=9, least=8, load=12, mean=12.0, lower=3),  # no emptier; at the mean
            row(placed=12, least=8, load=14, mean=11.5, lower=0),  # placed on a busy one
            row(placed=8, least=8, load=11, mean=11.25, lower=2),
        ]
    )
    assert counts == {
        "1": {
            "late": 3,
            "no_emptier_at_placement": 2,
            "at_most_mean_at_deadline": 2,
            "beside_lower_tiers": 2,
        }
    }


def test_a_capacity_of_zero_is_a_clear_error_without_a_traceback() -> None:
    # An unknown workload: tests/test_bench_relaxations.py, for both studies.
    app = typer.Typer()
    app.command()(main)
    done = CliRunner().invoke(app, ["--workload", "overload", "--capacity", "0"])
    assert done.exit_code == 2
    assert "the task rate must be positive, got 0.0" in done.output
    assert "Traceback" not in done.output

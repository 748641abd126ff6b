"""Late steps: where each call cut by its step's deadline stood, to explain a missed SLO.

A tier's SLO on the policy benchmark is missed when one of a task's steps runs past its
allowance (the overload workload declares one per tier). This runs a policy on the seeds,
tasks and load of a quick `kvflow bench policies` run and lists every counted call still
running when its step's deadline passed (`TaskRunner.late_steps`), with the loads a router
reads (running plus waiting calls per replica):

- at the placement: the chosen replica's load against the least and the mean of the
  replicas serving the model. A call placed within one call of the least loaded replica
  had no emptier replica to go to: placement had nothing better then;
- at the deadline: the replica's load, how many of its calls were of lower tiers, and the
  least and mean load. Where the replica was no busier than the mean, spreading could not
  have shrunk its batch; only keeping calls out of the batch (admission) or taking them
  out of it (preemption) could have.

    python -m kvflow.bench.policies.late_steps --workload overload --capacity 1.25 --load 1.5
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import multiprocessing
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from kvflow.bench.policies.fleet import bench_fleet
from kvflow.bench.policies.relaxations import (
    CapacityOption,
    JobsOption,
    LoadOption,
    SeedsOption,
    WorkloadOption,
    quick_plan,
)
from kvflow.bench.policies.runs import run_policy
from kvflow.bench.policies.task_runner import LateStep
from kvflow.simulator.workloads import WORKLOADS

NO_EMPTIER = 1
"""A placement within this many calls of the least loaded replica had no emptier one."""


def _run(
    workload: str, replicas: int, task_rate: float, policy: str, seed: int
) -> tuple[int, int, list[LateStep]]:
    """(seed, counted tasks, late calls) of one run."""
    spec = WORKLOADS[workload]
    fleet = bench_fleet(workload, replicas)
    plan = quick_plan(spec, fleet, task_rate)
    run = run_policy(policy, spec=spec, fleet=fleet, task_rate=task_rate, seed=seed, plan=plan)
    return seed, run.outcome.tasks, list(run.runner.late_steps)


def late_steps(
    workload: str, *, task_rate: float, seeds: list[int], policy: str = "kvflow", workers: int = 2
) -> dict[str, Any]:
    """Every late call of `policy` on every seed, and the counts that classify them."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    if task_rate <= 0:
        raise ValueError(f"the task rate must be positive, got {task_rate}")
    replicas = WORKLOADS[workload].quick_replicas
    run = functools.partial(_run, workload, replicas, task_rate, policy)
    context = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(max(1, workers), mp_context=context) as pool:
        runs = list(pool.map(run, seeds))
    rows = [{"seed": seed, **asdict(late)} for seed, _, lates in runs for late in lates]
    return {
        "workload": workload,
        "policy": policy,
        "replicas": replicas,
        "task_rate_per_s": task_rate,
        "counted_tasks": sum(tasks for _, tasks, _ in runs),
        "late": rows,
        "summary": summary(rows),
    }


def summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per tier, counts of the late calls in `rows` by what stood around them.

    Late calls; those placed with no emptier replica; those on a replica no busier than the
    mean at the deadline; those with calls of lower tiers beside them.
    """
    out: dict[str, dict[str, int]] = {}
    for row in rows:
        tier = out.setdefault(
            str(row["tier"]),
            {"late": 0, "no_emptier_at_placement": 0, "at_most_mean_at_deadline": 0,
             "beside_lower_tiers": 0},
        )  # fmt: skip
        tier["late"] += 1
        tier["no_emptier_at_placement"] += row["placed_load"] <= row["placed_least_load"] + (
            NO_EMPTIER
        )
        tier["at_most_mean_at_deadline"] += row["load"] <= row["mean_load"]
        tier["beside_lower_tiers"] += row["lower_tier_calls"] > 0
    return out


def _table(result: dict[str, Any]) -> Table:
    table = Table(
        title=f"Calls cut by their step's deadline: {result['policy']} on {result['workload']}, "
        f"{result['counted_tasks']} counted tasks"
    )
    for column in (
        "seed",
        "tier",
        "answer",
        "placed on load",
        "least / mean then",
        "load at deadline",
        "lower tiers",
        "least / mean then",
    ):
        table.add_column(column, justify="right")
    for row in result["late"]:
        table.add_row(
            str(row["seed"]),
            str(row["tier"]),
            str(row["output_tokens"]),
            str(row["placed_load"]),
            f"{row['placed_least_load']} / {row['placed_mean_load']:.1f}",
            str(row["load"]),
            str(row["lower_tier_calls"]),
            f"{row['least_load']} / {row['mean_load']:.1f}",
        )
    return table


def main(
    workload: WorkloadOption,
    capacity: CapacityOption,
    load: LoadOption = 1.0,
    seeds: SeedsOption = 5,
    policy: Annotated[str, typer.Option(help="the policy to run")] = "kvflow",
    jobs: JobsOption = 2,
    json_file: Annotated[Path | None, typer.Option("--json", help="write the calls here")] = None,
) -> None:
    """List the calls cut by their step's deadline and the loads around them (module doc)."""
    try:
        result = late_steps(
            workload, task_rate=capacity * load, seeds=list(range(seeds)), policy=policy,
            workers=jobs,
        )  # fmt: skip
    except ValueError as error:
        Console(stderr=True).print(f"error: {error}", highlight=False)
        raise typer.Exit(2) from None
    console = Console()
    console.print(_table(result))
    for tier, counts in result["summary"].items():
        console.print(
            f"tier {tier}: {counts['late']} late; placed within {NO_EMPTIER} call of the least "
            f"loaded replica: {counts['no_emptier_at_placement']}; on a replica no busier than "
            f"the mean at the deadline: {counts['at_most_mean_at_deadline']}; beside calls of "
            f"lower tiers: {counts['beside_lower_tiers']}",
            highlight=False,
        )
    if json_file is not None:
        json_file.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    typer.run(main)

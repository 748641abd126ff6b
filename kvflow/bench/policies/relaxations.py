"""Relaxations: what a fleet does with more than any policy has, to explain a missed goal.

Where the KV cache binds (long-agent), the KV-capacity floor (`kv_capacity_floor`) bounds the
hit rate of every policy that cannot see how long a tool call will run, but model time has no
such closed form: a miss slows the recomputing call and, through the prefill it adds to the
batch, every call decoding beside it. So model time is measured against hit rate, with one
constraint lifted at a time, on the seeds, tasks and load of `kvflow bench policies`:

- **a larger KV cache** (`kv_cache_scale`): the same policy on engines with that multiple of
  their cache. Least-recently-used eviction then reaches higher hit rates, and the model time
  at the floor's hit rate, interpolated between the scales, estimates the model time of a
  policy that reached the floor on the fleet as it is (`model_s_at_floor`). An estimate, not
  a bound: a policy can choose which conversations to miss by recompute cost, or move the
  recompute off the critical path;
- **eviction by true return** (`retention_oracle`): engines that evict the block whose next
  use is furthest away, each conversation's return read from the task's future
  (`ClairvoyantBlockPool`, Belady's order: no eviction order misses fewer blocks on the same
  uses), which no policy knows;
- **eviction by the tool's kind** (`kind_oracle`, where the workload has tools): the same, with
  each pause replaced by the typical pause of the tool the call's answer will ask for. A
  policy learns that tool only from the answer, after the call ended, so this too is more
  than any policy has; it says what knowing the tool, not the pause, is worth;
- **evenly spaced starts** (`even_arrivals`, with `--even-arrivals`): the same tasks starting
  exactly 1 / rate apart instead of as a Poisson stream. That is the smoothest any admission
  that holds new tasks back could make the load, without the wait it would cost them; it
  says what admission could buy against the peaks of the cache's demand.

With `--anchor`, that policy also runs on the fleet as it is, and each relaxation is set
against it seed by seed (`against_anchor`): the ratio a goal of the form "≤ k× the best
anchor's" has to beat, with its 95% interval. Where even the relaxation's interval lies
above k, the relaxation is the bound that explains the miss.

Beside them, the KV-capacity floor twice: as the bound (running calls hold their prompt for
their idle-fleet model time) and with running calls held as long as the policy's measured
model time says (`running_time_scale`: measured over idle model time, on the fleet as it is).
The second is an estimate, not a bound: it says how much of the gap between the bound and
what engines reach is the KV that calls under load hold while they run.

Neither is a policy: both read what production cannot have, and only bound what placement,
admission and eviction order can buy.

    python -m kvflow.bench.policies.relaxations --workload long-agent --capacity 0.0229 \
        [--mechanisms engine-priority,router-queue,hints,task-end] [--even-arrivals]
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
from dataclasses import asdict, dataclass
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from kvflow.bench.policies.bounds import (
    at_hit_rate,
    kv_capacity_floor,
    lifetime_estimate_s,
    success_ceiling,
)
from kvflow.bench.policies.figures import figures, mean_ci
from kvflow.bench.policies.fleet import bench_fleet, engine_config, fleet_tenants
from kvflow.bench.policies.runs import RunPlan, policy_factories, run_plan, run_policy
from kvflow.scheduler.fleet import Fleet
from kvflow.simulator.policies.base import DEFAULT_MECHANISMS, MECHANISMS
from kvflow.simulator.workloads import WORKLOADS, Task, Workload, WorkloadSpec

AT_FLOOR = "at the KV-capacity floor's hit rate"
"""The `against_anchor` key of model time read at the floor's hit rate."""
AT_FLOOR_ESTIMATE = (
    "at the KV-capacity floor's hit rate (an estimate: read between larger LRU caches)"
)
"""Its label where printed: not a bound, a policy can choose which conversations to miss."""
SCALES = (1.0, 1.15, 1.3, 1.5, 1.75)
"""KV-cache multiples run by default: from the fleet as it is to past the floor's hit rate."""


@dataclass(frozen=True)
class RelaxedRun:
    """One run: a seed, what was lifted, and what the policy reached."""

    seed: int
    variant: str
    """`cache ×<scale>`, `oracle retention`, `retention by the tool's kind` or `even
    arrivals`."""
    prefix_hit_rate: float
    cost_per_successful_task_usd: str
    mean_model_s: float
    success_rate: float


@dataclass(frozen=True)
class _Job:
    workload: str
    replicas: int
    seed: int
    task_rate: float
    policy: str
    scale: float
    oracle: bool
    mechanisms: frozenset[str] = DEFAULT_MECHANISMS
    kind: bool = False
    even: bool = False
    anchor: bool = False


def quick_plan(spec: WorkloadSpec, fleet: Fleet, task_rate: float) -> RunPlan:
    """The run plan of a quick `kvflow bench policies` run at `task_rate`."""
    return run_plan(
        lifetime_estimate_s(spec, fleet), task_rate=task_rate, window_lifetimes=1.0,
        min_counted=100,
    )  # fmt: skip


def _run(job: _Job) -> RelaxedRun:
    spec = WORKLOADS[job.workload]
    fleet = bench_fleet(job.workload, job.replicas)
    plan = quick_plan(spec, fleet, job.task_rate)
    run = run_policy(
        job.policy, spec=spec, fleet=fleet, task_rate=job.task_rate, seed=job.seed, plan=plan,
        kv_cache_scale=job.scale, retention_oracle=job.oracle, mechanisms=job.mechanisms,
        kind_oracle=job.kind, even_arrivals=job.even,
    )  # fmt: skip
    fig = figures(run.outcome, 0.0)
    return RelaxedRun(
        seed=job.seed,
        variant=(
            f"anchor {job.policy}"
            if job.anchor
            else "retention by the tool's kind"
            if job.kind
            else "oracle retention"
            if job.oracle
            else "even arrivals"
            if job.even
            else f"cache ×{job.scale:g}"
        ),
        prefix_hit_rate=fig.prefix_hit_rate,
        cost_per_successful_task_usd=str(fig.cost_per_successful_task_usd),
        mean_model_s=fig.mean_model_s,
        success_rate=fig.success_rate,
    )


def _usd(amount: Decimal | None) -> str | None:
    return None if amount is None else str(amount)


def seed_floors(
    workload: str, replicas: int, seed: int, task_rate: float, measured_model_s: float | None
) -> dict[str, Any]:
    """The KV-capacity floor of that run's counted tasks: the bound, and at measured load.

    `measured_model_s`, the policy's mean model time on the fleet as it is, over the idle
    fleet's, is the `running_time_scale` of the second (none without a measurement).
    """
    spec = WORKLOADS[workload]
    fleet = bench_fleet(workload, replicas)
    plan = quick_plan(spec, fleet, task_rate)
    window = plan.window
    drawn = Workload(
        spec, fleet_tenants(fleet), tasks=1, task_rate=1.0, seed=seed,
        block_size=engine_config(spec).block_size,
    )  # fmt: skip
    arrivals = drawn.at_rate(task_rate, until_s=plan.arrivals_until_s)

    def counted(task: Task) -> bool:
        return window.start <= task.arrival < window.end

    bound = kv_capacity_floor(arrivals, fleet, spec, task_rate=task_rate, counted=counted)
    idle_model_s = success_ceiling(arrivals, fleet, spec, counted=counted).mean_model_s
    result: dict[str, Any] = {
        "seed": seed,
        "floor_hit_rate": bound.prefix_hit_rate,
        "floor_cost_usd": _usd(bound.cost_per_task_usd),
        "idle_model_s": idle_model_s,
        "loaded": None,
    }
    if measured_model_s is not None and idle_model_s > 0:
        scale = max(1.0, measured_model_s / idle_model_s)
        loaded = kv_capacity_floor(
            arrivals, fleet, spec, task_rate=task_rate, counted=counted,
            running_time_scale=scale,
        )  # fmt: skip
        result["loaded"] = {
            "running_time_scale": scale,
            "prefix_hit_rate": loaded.prefix_hit_rate,
            "cost_usd": _usd(loaded.cost_per_task_usd),
        }
    return result


def relax(
    workload: str,
    *,
    task_rate: float,
    seeds: list[int],
    replicas: int | None = None,
    policy: str = "kvflow",
    scales: tuple[float, ...] = SCALES,
    oracle: bool = True,
    workers: int = 2,
    mechanisms: frozenset[str] = DEFAULT_MECHANISMS,
    even_arrivals: bool = False,
    anchor: str | None = None,
) -> dict[str, Any]:
    """Every scale (and the oracle, even arrivals) on every seed; the floor's figures there.

    `anchor`: that policy too, on the fleet as it is with the same mechanisms, and every
    relaxation's ratio to it (`against_anchor`).
    """
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    if task_rate <= 0:
        raise ValueError(f"the task rate must be positive, got {task_rate}")
    known = policy_factories()
    for name in (policy, anchor):
        if name is not None and name not in known:
            raise ValueError(f"unknown policy {name!r}; choose from {', '.join(known)}")
    count = replicas or WORKLOADS[workload].quick_replicas
    jobs = [
        _Job(workload, count, seed, task_rate, policy, scale, False, mechanisms)
        for seed in seeds
        for scale in scales
    ]
    if oracle:
        jobs += [
            _Job(workload, count, seed, task_rate, policy, 1.0, True, mechanisms) for seed in seeds
        ]
        if WORKLOADS[workload].tools:
            jobs += [
                _Job(workload, count, seed, task_rate, policy, 1.0, True, mechanisms, kind=True)
                for seed in seeds
            ]
    if even_arrivals:
        jobs += [
            _Job(workload, count, seed, task_rate, policy, 1.0, False, mechanisms, even=True)
            for seed in seeds
        ]
    if anchor is not None:
        jobs += [
            _Job(workload, count, seed, task_rate, anchor, 1.0, False, mechanisms, anchor=True)
            for seed in seeds
        ]
    context = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(max(1, workers), mp_context=context) as pool:
        runs = list(pool.map(_run, jobs))
        # The model time measured on the fleet as it is: what its running calls hold.
        measured = {r.seed: r.mean_model_s for r in runs if r.variant == "cache ×1"}
        floors = list(
            pool.map(
                seed_floors,
                [workload] * len(seeds),
                [count] * len(seeds),
                seeds,
                [task_rate] * len(seeds),
                [measured.get(seed) for seed in seeds],
            )
        )
    for floor in floors:
        points = [
            (r.prefix_hit_rate, r.mean_model_s)
            for r in runs
            if r.seed == floor["seed"] and r.variant.startswith("cache")
        ]
        floor["model_s_at_floor"] = at_hit_rate(points, floor["floor_hit_rate"])
    result: dict[str, Any] = {
        "workload": workload,
        "policy": policy,
        "anchor": anchor,
        "replicas": count,
        "task_rate_per_s": task_rate,
        "mechanisms": sorted(mechanisms),
        "runs": [asdict(r) for r in runs],
        "seeds": floors,
    }
    if anchor is not None:
        result["against_anchor"] = against_anchor(result)
    return result


def _paired(ours: dict[int, float], theirs: dict[int, float]) -> dict[str, Any] | None:
    """Ours over theirs seed by seed: the mean, the 95% interval, the seeds paired."""
    ratios = [ours[seed] / theirs[seed] for seed in sorted(ours) if theirs.get(seed)]
    interval = mean_ci(ratios)
    if interval is None:
        return None
    return {"mean": round(interval.mean, 6), "ci95": interval.as_pair(), "seeds": interval.n}


def against_anchor(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each relaxation's cost and model time over the anchor's, paired by seed.

    Rows: every variant run (the policy at each cache size, the oracles), the KV-capacity
    floor (cost only: it has no model time) and the model time at the floor's hit rate.
    A goal "≤ k× the best anchor's" that even a relaxation's interval lies above is out of
    reach of every policy that relaxation bounds.
    """
    label = f"anchor {result['anchor']}"
    anchor_runs = {r["seed"]: r for r in result["runs"] if r["variant"] == label}
    anchor_cost = {s: float(r["cost_per_successful_task_usd"]) for s, r in anchor_runs.items()}
    anchor_model = {s: r["mean_model_s"] for s, r in anchor_runs.items()}
    out: dict[str, dict[str, Any]] = {}
    for variant in dict.fromkeys(r["variant"] for r in result["runs"]):
        if variant == label:
            continue
        rows = [r for r in result["runs"] if r["variant"] == variant]
        out[variant] = {
            "cost": _paired(
                {r["seed"]: float(r["cost_per_successful_task_usd"]) for r in rows}, anchor_cost
            ),
            "model_s": _paired({r["seed"]: r["mean_model_s"] for r in rows}, anchor_model),
        }
    seeds = result["seeds"]
    out["KV-capacity floor (the bound)"] = {
        "cost": _paired(
            {s["seed"]: float(s["floor_cost_usd"]) for s in seeds if s["floor_cost_usd"]},
            anchor_cost,
        ),
        "model_s": None,
    }
    out[AT_FLOOR] = {
        "cost": None,
        "model_s": _paired(
            {s["seed"]: s["model_s_at_floor"] for s in seeds if s["model_s_at_floor"]},
            anchor_model,
        ),
    }
    return out


def _cell(values: list[float], fmt: str) -> str:
    """The mean ± the 95% half-width of `values` (empty without any)."""
    interval = mean_ci(values)
    if interval is None:
        return ""
    pair = interval.as_pair()
    half = "" if pair is None else f" ±{format(pair[1] - interval.mean, fmt)}"
    return f"{format(interval.mean, fmt)}{half}"


def _variant_table(title: str, *figures: str) -> Table:
    """A table of variants (left) and their `figures` (right-aligned)."""
    table = Table(title=title)
    table.add_column("variant", justify="left")
    for column in figures:
        table.add_column(column, justify="right")
    return table


def _table(result: dict[str, Any]) -> Table:
    table = _variant_table(
        f"{result['workload']}: {result['policy']} with one constraint lifted (mean ± 95% "
        "half-width over seeds)",
        "hit", "$/successful task", "model s", "success",
    )  # fmt: skip
    variants = list(dict.fromkeys(r["variant"] for r in result["runs"]))
    for variant in variants:
        rows = [r for r in result["runs"] if r["variant"] == variant]
        table.add_row(
            variant,
            _cell([r["prefix_hit_rate"] for r in rows], ".1%"),
            _cell([float(r["cost_per_successful_task_usd"]) for r in rows], ".5f"),
            _cell([r["mean_model_s"] for r in rows], ".1f"),
            _cell([r["success_rate"] for r in rows], ".1%"),
        )
    seeds = result["seeds"]
    table.add_row(
        "KV-capacity floor (the bound)",
        _cell([s["floor_hit_rate"] for s in seeds], ".1%"),
        _cell([float(s["floor_cost_usd"]) for s in seeds if s["floor_cost_usd"]], ".5f"),
        _cell([s["idle_model_s"] for s in seeds], ".1f") + " (idle fleet)",
        "",
    )
    loaded = [s["loaded"] for s in seeds if s["loaded"]]
    if loaded:
        scale = sum(item["running_time_scale"] for item in loaded) / len(loaded)
        table.add_row(
            f"the floor with running calls held {scale:.2f}× longer, as measured (an estimate)",
            _cell([item["prefix_hit_rate"] for item in loaded], ".1%"),
            _cell([float(item["cost_usd"]) for item in loaded if item["cost_usd"]], ".5f"),
            "",
            "",
        )
    at_floor = [s["model_s_at_floor"] for s in seeds if s["model_s_at_floor"]]
    model = mean_ci(at_floor)
    table.add_row(
        AT_FLOOR_ESTIMATE,
        _cell([s["floor_hit_rate"] for s in seeds], ".1%"),
        "",
        "" if model is None else f"{model.mean:.1f} ({len(at_floor)} seeds)",
        "",
    )
    return table


def _ratio_cell(paired: dict[str, Any] | None) -> str:
    """`0.912× [0.881, 0.943]`, or empty without a figure."""
    if paired is None:
        return ""
    pair = paired["ci95"]
    spread = "" if pair is None else f" [{pair[0]:.3f}, {pair[1]:.3f}]"
    return f"{paired['mean']:.3f}×{spread}"


def _anchor_table(result: dict[str, Any]) -> Table:
    table = _variant_table(
        f"{result['workload']}: each relaxation over {result['anchor']} on the fleet as it is, "
        "paired by seed (mean [95% interval])",
        "× cost", "× model time",
    )  # fmt: skip
    for variant, ratios in result["against_anchor"].items():
        # The JSON keeps its key; the table says what the figure is.
        label = AT_FLOOR_ESTIMATE if variant == AT_FLOOR else variant
        table.add_row(label, _ratio_cell(ratios["cost"]), _ratio_cell(ratios["model_s"]))
    return table


def _mechanisms(text: str) -> frozenset[str]:
    """`--mechanisms`: names of `MECHANISMS`, comma-separated."""
    names = frozenset(part.strip() for part in text.split(",") if part.strip())
    unknown = sorted(names - set(MECHANISMS))
    if unknown:
        raise ValueError(
            f"unknown mechanism {', '.join(unknown)}; choose from {', '.join(MECHANISMS)}"
        )
    return names


def _scales(text: str) -> tuple[float, ...]:
    """`--scales`: positive numbers, comma-separated."""
    try:
        multiples = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        multiples = ()
    if not multiples or min(multiples) <= 0:
        raise ValueError(f"--scales takes positive numbers separated by commas, got {text!r}")
    return multiples


WorkloadOption = Annotated[str, typer.Option(help="a workload of `kvflow bench policies`")]
CapacityOption = Annotated[
    float, typer.Option(help="tasks per second at 1× load (the benchmark's capacity)")
]
LoadOption = Annotated[float, typer.Option(help="multiple of the capacity")]
SeedsOption = Annotated[int, typer.Option(min=1, help="seeds 0 … N−1")]
JobsOption = Annotated[int, typer.Option(min=1, help="processes")]
"""The options a study of a benchmark run shares (this module's, `late_steps`)."""


def main(
    workload: WorkloadOption,
    capacity: CapacityOption,
    load: LoadOption = 1.0,
    seeds: SeedsOption = 5,
    replicas: Annotated[
        int | None,
        typer.Option(min=1, help="replicas in the fleet (default: the workload's quick fleet)"),
    ] = None,
    policy: Annotated[str, typer.Option(help="the policy to relax")] = "kvflow",
    scales: Annotated[
        str, typer.Option(help="KV-cache multiples, comma-separated (1 is the fleet as it is)")
    ] = "1,1.15,1.3,1.5,1.75",
    oracle: Annotated[
        bool, typer.Option(help="also run eviction by true return and by the tool's kind")
    ] = True,
    even_arrivals: Annotated[
        bool, typer.Option(help="also run the same tasks starting evenly spaced")
    ] = False,
    mechanisms: Annotated[
        str, typer.Option(help="mechanisms around every run, comma-separated (as the benchmark)")
    ] = ",".join(sorted(DEFAULT_MECHANISMS)),
    anchor: Annotated[
        str | None,
        typer.Option(help="also run this policy as it is, and set every relaxation against it"),
    ] = None,
    jobs: JobsOption = 2,
    json_file: Annotated[Path | None, typer.Option("--json", help="write the runs here")] = None,
) -> None:
    """Run `policy` with a larger KV cache and with eviction by true return (module doc)."""
    try:
        multiples = _scales(scales)
        result = relax(
            workload, task_rate=capacity * load, seeds=list(range(seeds)), replicas=replicas,
            policy=policy, scales=multiples, oracle=oracle, workers=jobs,
            mechanisms=_mechanisms(mechanisms), even_arrivals=even_arrivals, anchor=anchor,
        )  # fmt: skip
    except ValueError as error:
        Console(stderr=True).print(f"error: {error}", highlight=False)
        raise typer.Exit(2) from None
    Console().print(_table(result))
    if anchor is not None:
        Console().print(_anchor_table(result))
    if json_file is not None:
        json_file.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    typer.run(main)

"""`kvflow bench ...`: benchmarks that print a table and optionally write JSON."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvflow.bench.decision_latency import (
    DEFAULT_SIZES,
    UNBOUNDED_AFFINITY,
    LatencyResult,
    QualityResult,
    measure,
    measure_quality,
)
from kvflow.bench.policies import (
    WorkloadResult,
    default_sizes,
    policy_factories,
    role,
    run_workload,
)
from kvflow.bench.policies.figures import Interval, MoneyInterval, mean_ci, money_ci
from kvflow.scheduler.build import scheduler_build
from kvflow.simulator.policies import POLICIES
from kvflow.simulator.policies.base import DEFAULT_MECHANISMS, MECHANISMS
from kvflow.simulator.policies.kvflow_scheduler import LEVERS
from kvflow.simulator.policies.oracle import GREEDY_REFERENCE
from kvflow.simulator.workloads import WORKLOADS

bench_app = typer.Typer(
    help="Benchmarks of kvflow's policies and overheads.",
    no_args_is_help=True,
)

_PIPE_WIDTH = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 120
_out = Console(width=_PIPE_WIDTH)
_err = Console(stderr=True, width=_PIPE_WIDTH)


def _usage_error(message: str) -> typer.Exit:
    # The message is plain text: a `[bench]` in it is not a markup tag.
    _err.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    return typer.Exit(2)


def _parse_sizes(text: str) -> list[int]:
    sizes: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 4 or int(part) % 4 or int(part) > 4096:
            raise _usage_error(
                f"--sizes: {part!r} is not a replica count; give multiples of 4 between 4 and "
                "4096 separated by commas, e.g. --sizes 16,64,256,1024"
            )
        sizes.append(int(part))
    return sizes


@bench_app.command("scheduler")
def scheduler_latency(
    json_file: Annotated[
        Path | None,
        typer.Option("--json", help="also write the figures to this JSON file"),
    ] = None,
    sizes: Annotated[
        str,
        typer.Option("--sizes", help="fleet sizes (replicas), comma-separated"),
    ] = ",".join(str(s) for s in DEFAULT_SIZES),
    decisions: Annotated[
        int,
        typer.Option("--decisions", min=10, max=1_000_000, help="timed decisions per size"),
    ] = 2000,
    seed: Annotated[int, typer.Option("--seed", help="random seed of the workload")] = 7,
) -> None:
    """Decision latency of the scheduler (p50/p99) on fleets of 16 to 1,024 replicas."""
    counts = _parse_sizes(sizes)
    if json_file is not None and not json_file.parent.exists():
        raise _usage_error(
            f"--json: folder {json_file.parent} does not exist; create it or pick another path"
        )
    # The scheduler logs circuit changes of the synthetic fleet; they are not news here.
    logging.getLogger("scheduler").setLevel(logging.ERROR)
    results: list[LatencyResult] = []
    quality: list[tuple[QualityResult, QualityResult]] = []
    with _out.status("measuring...") as status:
        for count in counts:
            status.update(f"measuring {count} replicas ({decisions} decisions)...")
            results.append(measure(count, decisions=decisions, seed=seed))
            status.update(f"scoring every replica for {count} replicas...")
            scored = min(300, decisions)
            quality.append(
                (
                    measure_quality(count, decisions=scored, seed=seed),
                    measure_quality(count, scored, seed, config=UNBOUNDED_AFFINITY),
                )
            )

    build = scheduler_build()
    table = Table(
        title="Scheduler decision latency (µs, one decision at a time; "
        + ("compiled with mypyc)" if build == "mypyc" else "uncompiled: `make bench` compiles)")
    )
    for column in (
        "replicas",
        "decisions",
        "p50",
        "p90",
        "p99",
        "CPU p99",
        "settle p50",
        "settle p99",
        "fixed p50",
        "fixed p99",
    ):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            str(r.replicas),
            str(r.decisions),
            f"{r.p50_us:.0f}",
            f"{r.p90_us:.0f}",
            f"{r.p99_us:.0f}",
            f"{r.cpu_p99_us:.0f}",
            f"{r.settle_p50_us:.0f}",
            f"{r.settle_p99_us:.0f}",
            f"{r.reference_p50_us:.0f}",
            f"{r.reference_p99_us:.0f}",
        )
    _out.print(table)
    _out.print(
        "p50 to p99: wall-clock time of place(), the answer a caller waits for, including any "
        "time the process waited for a core (CPU p99 counts the deciding thread's CPU time "
        "only). settle: the bookkeeping the control plane runs right after sending the answer "
        "(prefix index, load, stickiness). fixed: the same pure-Python work every time, about "
        "as long as the median decision and timed between decisions; its tail is the "
        "machine's, a floor under the decisions' p99. The JSON file has more figures.",
        highlight=False,
    )
    picks = Table(title="Placement quality (the pick against every replica scored)")
    for column in (
        "replicas",
        "decisions",
        "not the best",
        "mean regret",
        "p99 regret",
        "search misses",
        "its mean regret",
    ):
        picks.add_column(column, justify="right")
    for q, unbounded in quality:
        picks.add_row(
            str(q.replicas),
            str(q.decisions),
            str(q.off_best),
            f"{q.mean_regret:.1%}",
            f"{q.p99_regret:.1%}",
            str(unbounded.off_best),
            f"{unbounded.mean_regret:.1%}",
        )
    _out.print(picks)
    _out.print(
        "not the best: placements (rendezvous picks aside) whose replica did not have the "
        "lowest objective of all replicas scored, including those the affinity load bound "
        "moved off a busy prefix holder on purpose; regret: objective of the pick over the "
        "lowest, minus 1, rendezvous picks included (they may be up to the rendezvous "
        "tolerance above it by design). search misses: the same count on the same stream with "
        "the affinity load bound lifted, what pruning the search costs.",
        highlight=False,
    )
    if json_file is not None:
        payload = {
            "scheduler_build": build,
            "decision_latency_us": {
                str(r.replicas): {
                    "p50": round(r.p50_us, 2),
                    "p99": round(r.p99_us, 2),
                    "p90": round(r.p90_us, 2),
                    "max": round(r.max_us, 2),
                    "mean": round(r.mean_us, 2),
                    "cpu_p50": round(r.cpu_p50_us, 2),
                    "cpu_p99": round(r.cpu_p99_us, 2),
                    "settle_p50": round(r.settle_p50_us, 2),
                    "settle_p99": round(r.settle_p99_us, 2),
                    "place_and_settle_p99": round(r.total_p99_us, 2),
                    "fixed_work_p50": round(r.reference_p50_us, 2),
                    "fixed_work_p99": round(r.reference_p99_us, 2),
                    "decisions": r.decisions,
                    "placed": r.placed,
                    "refused": r.refused,
                }
                for r in results
            },
            "placement_quality": {
                str(q.replicas): {
                    "decisions": q.decisions,
                    "not_best": q.off_best,
                    "mean_regret": round(q.mean_regret, 4),
                    "p99_regret": round(q.p99_regret, 4),
                    "search_misses": unbounded.off_best,
                    "search_misses_mean_regret": round(unbounded.mean_regret, 4),
                }
                for q, unbounded in quality
            },
        }
        json_file.write_text(json.dumps(payload, indent=2) + "\n")
        _out.print(f"wrote {json_file}", highlight=False)


# ---------------------------------------------------------------------------- policies

_WORKLOAD_NAMES = ("agent", "hotspot", "heterogeneous", "faults", "long-agent", "overload")


def _usd(value: Decimal | None) -> str:
    return "—" if value is None else f"${value:.6f}"


def _pm(interval: Interval | None, spec: str = ".3f", scale: float = 1.0) -> str:
    """`mean ±half-width` of an interval over seeds (the mean alone for one seed)."""
    if interval is None:
        return "—"
    text = format(interval.mean * scale, spec)
    if interval.low is None or interval.high is None:
        return text
    return f"{text} ±{format((interval.high - interval.low) / 2 * scale, spec)}"


def _money_pm(interval: MoneyInterval | None) -> str:
    if interval is None:
        return "—"
    text = f"${interval.mean:.6f}"
    if interval.low is None or interval.high is None:
        return text
    return f"{text} ±{(interval.high - interval.low) / 2:.6f}"


def _ratio(interval: Interval | None) -> str:
    """A ratio to kvflow and its interval: `0.91 [0.88, 0.95]`."""
    if interval is None:
        return "—"
    if interval.low is None or interval.high is None:
        return f"{interval.mean:.2f}"
    return f"{interval.mean:.2f} [{interval.low:.2f}, {interval.high:.2f}]"


def _policy_table(result: WorkloadResult) -> Table:
    capacity = result.capacity
    table = Table(
        title=(
            f"{result.name}: {result.replicas} replicas, {result.load:.0%} of capacity "
            f"({result.task_rate:.3g} tasks/s; capacity {capacity.tasks_per_s:.3g} tasks/s, "
            f"{capacity.policy}), seeds {result.seeds[0]}–{result.seeds[-1]}, "
            f"mechanisms for every policy: {', '.join(sorted(result.mechanisms)) or 'none'}"
        ),
        caption=result.description,
    )
    tiers = sorted({t for s in result.summaries.values() for t in s.slo}, key=int)
    columns = [
        "policy",
        "$/successful task",
        "kvflow × cost",
        "GPU-s/task",
        "success",
        *[f"SLO t{t}" for t in tiers],
        "goodput/s",
        "kvflow × goodput",
        "task s mean/p99",
        "model s mean/p99",
        "hit",
        "wasted",
        "busiest",
    ]
    for column in columns:
        table.add_column(column, justify="left" if column == "policy" else "right")
    for name, summary in result.summaries.items():
        gpu = summary.intervals.get("gpu_seconds_per_successful_task")
        table.add_row(
            name if role(name) != "reference" else f"{name} (reference)",
            _money_pm(summary.cost),
            _ratio(summary.ratios.get("cost_per_successful_task_usd")),
            _pm(gpu, ".1f"),
            _pm(summary.intervals.get("success_rate"), ".1%"),
            *[_pm(summary.slo.get(t), ".1%") for t in tiers],
            _pm(summary.intervals.get("goodput_tasks_per_s"), ".3g"),
            _ratio(summary.ratios.get("goodput_tasks_per_s")),
            f"{summary.mean('mean_task_s') or 0:.0f}/{summary.mean('p99_task_s') or 0:.0f}",
            f"{summary.mean('mean_model_s') or 0:.1f}/{summary.mean('p99_model_s') or 0:.1f}",
            f"{summary.mean('prefix_hit_rate') or 0:.1%}",
            f"{summary.mean('wasted_spend_share') or 0:.1%}",
            f"{summary.mean('max_replica_load_over_mean') or 0:.2f}×",
        )
    floor = money_ci([f.cost_per_task_usd for f in result.floors if f.cost_per_task_usd])
    hit = mean_ci([f.prefix_hit_rate for f in result.floors])
    cells = ["" for _ in columns[2:]]
    cells[columns.index("hit") - 2] = "" if hit is None else f"{hit.mean:.1%}"
    table.add_row("zero-miss floor", _money_pm(floor), *cells)
    kv_floor = money_ci(
        [f.cost_per_task_usd for f in result.capacity_floors if f.cost_per_task_usd]
    )
    if kv_floor is not None and floor is not None and kv_floor.mean > floor.mean:
        # Only where the cache binds: elsewhere it is the zero-miss floor again.
        hit = mean_ci([f.prefix_hit_rate for f in result.capacity_floors])
        cells = ["" for _ in columns[2:]]
        cells[columns.index("hit") - 2] = "" if hit is None else f"{hit.mean:.1%}"
        table.add_row("KV-capacity floor", _money_pm(kv_floor), *cells)
    return table


def _sweep_table(result: WorkloadResult) -> Table:
    table = Table(
        title=(
            f"{result.name}: $/successful task, tier-1 SLO and goodput/s by load "
            f"(× capacity {result.capacity.tasks_per_s:.3g} tasks/s), mean ± 95% half-width"
        )
    )
    loads = sorted(result.sweep)
    table.add_column("policy")
    for load in loads:
        table.add_column(f"{load:.2g}×", justify="right")
    names = sorted(
        {n for cell in result.sweep.values() for n in cell}, key=list(result.summaries).index
    )
    for name in names:
        cells = []
        for load in loads:
            summary = result.sweep[load].get(name)
            if summary is None:
                cells.append("—")
                continue
            cells.append(
                f"{_money_pm(summary.cost)} {_pm(summary.slo.get('1'), '.0%')} "
                f"{_pm(summary.intervals.get('goodput_tasks_per_s'), '.3g')}"
            )
        table.add_row(name, *cells)
    return table


def _ablation_table(result: WorkloadResult) -> Table:
    table = Table(
        title=f"{result.name}: kvflow with one axis off, or one lever flipped ({result.load:.0%})"
    )
    columns = (
        "axis off / lever",
        "$/successful task",
        "kvflow × cost",
        "success",
        "SLO t1",
        "goodput/s",
        "model s mean",
        "hit",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == columns[0] else "right")
    for axis, summary in result.ablations.items():
        table.add_row(
            axis,
            _money_pm(summary.cost),
            _ratio(summary.ratios.get("cost_per_successful_task_usd")),
            _pm(summary.intervals.get("success_rate"), ".1%"),
            _pm(summary.slo.get("1"), ".1%"),
            _pm(summary.intervals.get("goodput_tasks_per_s"), ".3f"),
            _pm(summary.intervals.get("mean_model_s"), ".1f"),
            f"{summary.mean('prefix_hit_rate') or 0:.1%}",
        )
    return table


def _notes(result: WorkloadResult) -> list[str]:
    """What the reader needs beside the table: the bounds, the load, the warm-up."""
    notes: list[str] = []
    ceiling = mean_ci([c.overall for c in result.ceilings])
    if ceiling is not None:
        notes.append(f"an idle fleet finishes {ceiling.mean:.1%} of the tasks in time (ceiling)")
    reference = result.summaries.get(GREEDY_REFERENCE)
    if reference is not None:
        demand = reference.mean("kv_demand") or 0.0
        warm = reference.mean("warmup_task_lifetimes") or 0.0
        util = reference.mean("utilisation") or 0.0
        notes.append(
            f"under {GREEDY_REFERENCE}: open conversations need {demand:.2f}× the fleet's KV "
            f"cache, engines busy {util:.0%}, warm-up {warm:.1f} task lifetimes"
        )
    short = [n for n, s in result.summaries.items() if (s.mean("warmup_task_lifetimes") or 0) < 2]
    if short:
        notes.append(
            "[yellow]warm-up under two measured lifetimes[/] for "
            + ", ".join(short)
            + " (their tasks live longer than the estimate)"
        )
    return notes


def _plot(results: list[WorkloadResult], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise _usage_error(
            "--plot needs matplotlib: pip install 'kvflow[bench]' (or leave out --plot)"
        ) from None
    swept = [r for r in results if len(r.sweep) > 1] or results
    figure, axes = plt.subplots(len(swept), 2, figsize=(12, 4 * len(swept)), squeeze=False)
    for row, result in zip(axes, swept, strict=True):
        cells = result.sweep if len(result.sweep) > 1 else {result.load: result.summaries}
        loads = sorted(cells)
        names = sorted({n for c in cells.values() for n in c}, key=list(result.summaries).index)
        for name in names:
            xs, costs, cost_err, slo, slo_err = [], [], [], [], []
            for at in loads:
                summary = cells[at].get(name)
                if summary is None or summary.cost is None:
                    continue
                xs.append(at)
                # Plotting needs floats; the figures themselves stay exact.
                costs.append(float(summary.cost.mean))
                cost_err.append(
                    0.0
                    if summary.cost.high is None
                    else float(summary.cost.high - summary.cost.mean)
                )
                tier1 = summary.slo.get("1")
                slo.append(0.0 if tier1 is None else tier1.mean * 100)
                slo_err.append(
                    0.0 if tier1 is None or tier1.high is None else (tier1.high - tier1.mean) * 100
                )
            row[0].errorbar(xs, costs, yerr=cost_err, marker="o", capsize=3, label=name)
            row[1].errorbar(xs, slo, yerr=slo_err, marker="o", capsize=3, label=name)
        row[0].set_title(f"{result.name}: cost per successful task (95% interval)")
        row[0].set_xlabel("load (× capacity)")
        row[0].set_ylabel("USD")
        row[1].set_title(f"{result.name}: tier-1 SLO attainment")
        row[1].set_xlabel("load (× capacity)")
        row[1].set_ylabel("%")
        row[1].legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def _names(text: str, flag: str, known: Sequence[str], *, none: bool = False) -> list[str]:
    """A comma-separated list of names from `known` (or `none` for an empty one)."""
    if none and text.strip() == "none":
        return []
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise _usage_error(
            f"{flag}: unknown {', '.join(repr(n) for n in unknown) or 'empty list'}; "
            f"choose from {', '.join(known)}" + (" (or none)" if none else "")
        )
    return names


def _levers(text: str) -> dict[str, object]:
    """`--levers`: NAME switches kvflow's lever on, NAME=off off (`LEVERS`)."""
    switched: dict[str, object] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, _, value = part.partition("=")
        name, value = name.strip(), value.strip().lower() or "on"
        if name not in LEVERS or value not in ("on", "off"):
            raise _usage_error(
                f"--levers: {part!r} is not NAME or NAME=off; levers: "
                + ", ".join(f"{n} ({'on' if on else 'off'} by default)" for n, on in LEVERS.items())
            )
        switched[name] = value == "on"
    if not switched:
        raise _usage_error("--levers: empty list; give NAME to switch a lever on, NAME=off off")
    return switched


@bench_app.command("policies")
def policies_bench(
    quick: Annotated[
        bool,
        typer.Option("--quick", help="a small fleet, a one-lifetime window, loads 0.5×, 1×, 2×"),
    ] = False,
    workload: Annotated[
        str | None,
        typer.Option(
            "--workload", help=f"one of {', '.join(_WORKLOAD_NAMES)} (default: all of them)"
        ),
    ] = None,
    seeds: Annotated[
        int | None,
        typer.Option("--seeds", min=1, max=100, help="seeds per cell (default 5 quick, 10 full)"),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="the first seed")] = 0,
    load: Annotated[
        float | None,
        typer.Option("--load", help="load as a multiple of capacity (default: the workload's)"),
    ] = None,
    replicas: Annotated[
        int | None,
        typer.Option("--replicas", min=1, max=1024, help="replicas of the default fleet"),
    ] = None,
    policies: Annotated[
        str | None,
        typer.Option("--policies", help="policies to compare, comma-separated (default: all)"),
    ] = None,
    mechanisms: Annotated[
        str,
        typer.Option(
            "--mechanisms",
            help=(
                "mechanisms applied around every policy, comma-separated, or none: "
                + ", ".join(MECHANISMS)
            ),
        ),
    ] = ",".join(sorted(DEFAULT_MECHANISMS)),
    sweep: Annotated[
        bool, typer.Option("--sweep/--no-sweep", help="also run the sweep of loads")
    ] = True,
    sweep_policies: Annotated[
        str | None,
        typer.Option(
            "--sweep-policies",
            help="policies of the sweep (default: kvflow and the best anchor at --load)",
        ),
    ] = None,
    capacity: Annotated[
        float | None,
        typer.Option("--capacity", help="tasks/s of 1× load; skips measuring it"),
    ] = None,
    window_lifetimes: Annotated[
        float | None,
        typer.Option(
            "--window-lifetimes",
            min=0.01,
            max=100,
            help="counting window in task lifetimes (default 1 quick, 3 full)",
        ),
    ] = None,
    min_tasks: Annotated[
        int | None,
        typer.Option(
            "--min-tasks",
            min=0,
            help="lengthen the window until this many tasks arrive in it (100 quick, 500 full)",
        ),
    ] = None,
    jobs: Annotated[
        int | None,
        typer.Option("--jobs", min=1, max=256, help="processes (default: CPU cores, ≤ seeds)"),
    ] = None,
    ablate: Annotated[
        bool,
        typer.Option(
            "--ablate", help="also run kvflow with each axis off, and each lever flipped, in turn"
        ),
    ] = False,
    levers: Annotated[
        str | None,
        typer.Option(
            "--levers",
            help=(
                "kvflow's levers switched from their defaults, comma-separated: NAME on, "
                "NAME=off off (" + ", ".join(LEVERS) + ")"
            ),
        ),
    ] = None,
    fleet_file: Annotated[
        Path | None, typer.Option("--fleet", help="fleet.toml to simulate instead of the default")
    ] = None,
    host_tier: Annotated[
        float,
        typer.Option(
            "--host-tier",
            help=(
                "host memory for KV blocks per replica, as a multiple of its GPU KV cache "
                "(vLLM's native offloading), for every policy alike; 0: none"
            ),
        ),
    ] = 0.0,
    json_file: Annotated[
        Path | None, typer.Option("--json", help="also write the figures to this JSON file")
    ] = None,
    plot_file: Annotated[
        Path | None,
        typer.Option("--plot", help="plot cost and tier-1 SLO against load (needs matplotlib)"),
    ] = None,
) -> None:
    """Every placement policy on the same simulated fleet and workload, side by side."""
    names = list(_WORKLOAD_NAMES) if workload is None else [workload]
    if workload is not None and workload not in WORKLOADS:
        raise _usage_error(
            f"--workload: unknown workload {workload!r}; choose one of "
            + ", ".join(_WORKLOAD_NAMES)
        )
    if load is not None and (not math.isfinite(load) or load <= 0 or load > 10):
        raise _usage_error(f"--load: {load} is not a load; give a multiple of capacity in (0, 10]")
    if capacity is not None and (not math.isfinite(capacity) or capacity <= 0):
        raise _usage_error(f"--capacity: {capacity} is not a rate; give tasks per second > 0")
    if not math.isfinite(host_tier) or not 0 <= host_tier <= 1000:
        raise _usage_error(
            f"--host-tier: {host_tier} is not a size; give a multiple of the GPU KV cache "
            "from 0 (none) to 1000, e.g. 2"
        )
    for path, flag in ((json_file, "--json"), (plot_file, "--plot")):
        if path is not None and not path.parent.exists():
            raise _usage_error(f"{flag}: folder {path.parent} does not exist")
    known = list(policy_factories())
    compared = list(POLICIES) if policies is None else _names(policies, "--policies", known)
    chosen = frozenset(_names(mechanisms, "--mechanisms", MECHANISMS, none=True))
    swept = None if sweep_policies is None else _names(sweep_policies, "--sweep-policies", known)
    extra = None if levers is None else {"kvflow": _levers(levers)}
    fleet = None
    if fleet_file is not None:
        from kvflow.workers.console import load_fleet_or_exit

        fleet = load_fleet_or_exit(fleet_file)
        if "heterogeneous" in names and workload is None:
            names.remove("heterogeneous")  # the fleet file is the heterogeneity
    count = seeds or (5 if quick else 10)
    seed_list = list(range(seed, seed + count))
    workers = jobs or max(1, min(count, os.cpu_count() or 1))
    logging.getLogger("kvflow").setLevel(logging.ERROR)
    logging.getLogger("scheduler").setLevel(logging.ERROR)
    results: list[WorkloadResult] = []
    started = time.perf_counter()
    with _out.status("simulating...") as status:
        for name in names:
            spec = WORKLOADS[name]
            default_replicas, window, least, loads = default_sizes(quick, spec)
            size = replicas or default_replicas
            if fleet is None and size < 4 and name == "heterogeneous":
                raise _usage_error("--replicas: the heterogeneous fleet needs at least 4")
            results.append(
                run_workload(
                    name,
                    fleet=fleet,
                    replicas=size,
                    seeds=seed_list,
                    load=load,
                    policies=compared,
                    sweep_loads=loads if sweep else (),
                    sweep_policies=swept,
                    window_lifetimes=window if window_lifetimes is None else window_lifetimes,
                    min_counted=least if min_tasks is None else min_tasks,
                    mechanisms=chosen,
                    capacity_tasks_per_s=capacity,
                    progress=lambda text: status.update(f"simulating {text}..."),
                    ablate=ablate,
                    workers=workers,
                    extra=extra,
                    host_tier=host_tier,
                )
            )
    for result in results:
        _out.print(_policy_table(result))
        for note in _notes(result):
            _out.print(f"  {note}", highlight=False)
        for goal in result.goals:
            mark = "[green]met[/]" if goal.met else "[red]not met[/]"
            _out.print(f"  goal: {goal.text}: {mark} ({goal.detail})", highlight=False)
        if len(result.sweep) > 1:
            _out.print(_sweep_table(result))
        if result.ablations:
            _out.print(_ablation_table(result))
        _out.print(f"  {result.name}: {result.elapsed_s:.0f} s", highlight=False)
    _out.print(
        "Means over seeds ± the 95% interval's half-width (Student t). kvflow ×: kvflow's "
        "figure over the row's, seed by seed, with its interval (cost below 1 and goodput "
        "above 1: kvflow does better). GPU-s/task: engine busy time × GPUs over successful "
        "tasks. model s: task time less the task's own tool pauses. zero-miss floor: every "
        "call finds cached all that an earlier call computed, at the cheapest prices; no "
        "placement costs less. KV-capacity floor (where the cache binds): the same with the "
        "fleet's KV cache, for a policy that knows each tool's kind but not how long it will "
        "run. busiest: the busiest replica's attempts over the mean. "
        "benchmarks/README.md explains the method. "
        f"Simulated in {time.perf_counter() - started:.0f} s.",
        highlight=False,
    )
    if json_file is not None:
        payload = {
            "seeds": seed_list,
            "mechanisms": sorted(chosen),
            "quick": quick,
            "host_tier": host_tier,
            "elapsed_s": round(time.perf_counter() - started, 1),
            "workloads": {r.name: r.as_json() for r in results},
        }
        json_file.write_text(json.dumps(payload, indent=2) + "\n")
        _out.print(f"wrote {json_file}", highlight=False)
    if plot_file is not None:
        _plot(results, plot_file)
        _out.print(f"wrote {plot_file}", highlight=False)


@bench_app.command("overhead")
def overhead_bench(
    json_file: Annotated[
        Path | None, typer.Option("--json", help="also write the figures to this JSON file")
    ] = None,
    quick: Annotated[
        bool, typer.Option("--quick", help="20 serial steps and 20 concurrent tasks")
    ] = False,
    serial_steps: Annotated[
        int | None,
        typer.Option("--serial-steps", min=2, max=100_000, help="serial steps per stack"),
    ] = None,
    tasks: Annotated[
        int | None,
        typer.Option("--tasks", min=1, max=10_000, help="concurrent 5-step tasks per stack"),
    ] = None,
) -> None:
    """A kvflow step against the same call as a plain Temporal activity, on a real server."""
    from kvflow.bench.overhead import default_sizes, run_overhead

    if json_file is not None and not json_file.parent.exists():
        raise _usage_error(f"--json: folder {json_file.parent} does not exist")
    default_serial, default_tasks = default_sizes(quick)
    logging.getLogger("kvflow").setLevel(logging.ERROR)
    with _out.status("measuring...") as status:
        result = run_overhead(
            serial_steps=serial_steps or default_serial,
            tasks=tasks or default_tasks,
            progress=lambda text: status.update(f"{text}..."),
        )
    bare, kv = result.bare, result.kvflow
    table = Table(
        title=f"kvflow step vs plain Temporal activity ({result.serial_steps} serial steps; "
        f"{result.tasks} concurrent {result.steps_per_task}-step tasks)"
    )
    for column in ("figure", "bare activity", "kvflow step", "kvflow ×", "goal", "met"):
        table.add_column(column, justify="right")
    by_goal = {g.text: g for g in result.goals}

    def mark(text: str) -> str:
        return "[green]met[/]" if by_goal[text].met else "[red]not met[/]"

    median_goal, history_goal, cpu_goal, rate_goal = (g.text for g in result.goals)
    table.add_row(
        "step p50 (ms)",
        f"{bare.p50:.1f}",
        f"{kv.p50:.1f}",
        f"{kv.p50 / bare.p50:.2f}",
        "within 10 ms",
        mark(median_goal),
    )
    table.add_row("step p99 (ms)", f"{bare.p99:.1f}", f"{kv.p99:.1f}", f"{kv.p99 / bare.p99:.2f}")
    table.add_row(
        "history bytes / step",
        f"{bare.history_bytes_per_step:.0f}",
        f"{kv.history_bytes_per_step:.0f}",
        f"{kv.history_bytes_per_step / bare.history_bytes_per_step:.2f}",
        "≤ 2×",
        mark(history_goal),
    )
    table.add_row(
        "CPU ms / step",
        f"{bare.cpu_ms_per_step:.1f}",
        f"{kv.cpu_ms_per_step:.1f}",
        f"{kv.cpu_ms_per_step / bare.cpu_ms_per_step:.2f}",
        "≤ 1.3×",
        mark(cpu_goal),
    )
    table.add_row(
        f"steps / s ({result.tasks} tasks)",
        f"{bare.steps_per_s:.1f}",
        f"{kv.steps_per_s:.1f}",
        f"{kv.steps_per_s / bare.steps_per_s:.2f}",
        "≥ 0.8×",
        mark(rate_goal),
    )
    _out.print(table)
    for goal in result.goals:
        state = "[green]met[/]" if goal.met else "[red]not met[/]"
        _out.print(f"  goal: {goal.text}: {state} ({goal.detail})", highlight=False)
    _out.print(
        "Both stacks run through the Temporal dev server (in memory) against a simulated "
        "replica with model time near zero, one stack at a time. CPU: this process (workers, "
        "simulator, control plane, client) and the Temporal server, over the concurrent run. "
        "History: serialized events of the concurrent tasks. benchmarks/README.md explains "
        "the method.",
        highlight=False,
    )
    if json_file is not None:
        json_file.write_text(json.dumps(result.as_json(), indent=2) + "\n")
        _out.print(f"wrote {json_file}", highlight=False)

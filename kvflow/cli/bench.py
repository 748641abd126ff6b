"""`kvflow bench ...`: benchmarks that print a table and optionally write JSON."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from decimal import Decimal
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvflow.scheduler.bench import (
    DEFAULT_SIZES,
    LatencyResult,
    QualityResult,
    measure,
    measure_quality,
)
from kvflow.scheduler.build import scheduler_build
from kvflow.simulator.policy_bench import WorkloadResult, default_sizes, run_workload
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
    quality: list[QualityResult] = []
    with _out.status("measuring...") as status:
        for count in counts:
            status.update(f"measuring {count} replicas ({decisions} decisions)...")
            results.append(measure(count, decisions=decisions, seed=seed))
            status.update(f"scoring every replica for {count} replicas...")
            quality.append(measure_quality(count, decisions=min(300, decisions), seed=seed))

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
    for column in ("replicas", "decisions", "not the best", "mean regret", "p99 regret"):
        picks.add_column(column, justify="right")
    for q in quality:
        picks.add_row(
            str(q.replicas),
            str(q.decisions),
            str(q.off_best),
            f"{q.mean_regret:.1%}",
            f"{q.p99_regret:.1%}",
        )
    _out.print(picks)
    _out.print(
        "not the best: placements (rendezvous picks aside) whose replica did not have the "
        "lowest objective of all replicas scored; regret: objective of the pick over the "
        "lowest, minus 1, rendezvous picks included (they may be up to the rendezvous "
        "tolerance above it by design).",
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
                }
                for q in quality
            },
        }
        json_file.write_text(json.dumps(payload, indent=2) + "\n")
        _out.print(f"wrote {json_file}", highlight=False)


# ---------------------------------------------------------------------------- policies

_WORKLOAD_NAMES = ("agent", "hotspot", "heterogeneous", "faults")


def _usd(value: Decimal | None) -> str:
    return "—" if value is None else f"${value:.6f}"


def _policy_table(result: WorkloadResult) -> Table:
    table = Table(
        title=(
            f"{result.name}: {result.replicas} replicas, {result.tasks} tasks (the first "
            f"{result.warmup_tasks} warm-up), {result.offered_load:.0%} offered load "
            f"({result.task_rate:.2f} tasks/s; the oracle's engines busy "
            f"{result.oracle.utilisation:.0%}), seed {result.seed}"
        ),
        caption=result.description,
    )
    tiers = sorted({t for f in result.policies.values() for t in f.slo_attainment}, key=int)
    columns = [
        "policy",
        "$/successful task",
        "kvflow ×",
        "success",
        *[f"SLO t{t}" for t in tiers],
        "goodput/s",
        "TTFT p50/p90/p99 s",
        "hit (oracle)",
        "wasted",
        "util",
        "busiest",
    ]
    for column in columns:
        table.add_column(column, justify="left" if column == "policy" else "right")
    kvflow = result.policies.get("kvflow")
    ours = kvflow.cost_per_successful_task_usd if kvflow is not None else None
    rows = [*result.policies.values(), result.oracle]
    for fig in rows:
        cost = fig.cost_per_successful_task_usd
        ratio = "—" if ours is None or not cost else f"{ours / cost:.2f}"
        table.add_row(
            fig.policy if fig is not result.oracle else "oracle (bound)",
            _usd(cost),
            ratio,
            f"{fig.success_rate:.1%}",
            *[f"{fig.slo_attainment.get(t, 0.0):.1%}" for t in tiers],
            f"{fig.goodput_tasks_per_s:.3f}",
            f"{fig.ttft_p50_s:.2f}/{fig.ttft_p90_s:.2f}/{fig.ttft_p99_s:.2f}",
            f"{fig.prefix_hit_rate:.1%} ({fig.oracle_prefix_hit_rate:.1%})",
            f"{fig.wasted_spend_share:.1%}",
            f"{fig.utilisation:.1%}",
            f"{fig.max_replica_load_share:.1%} ({fig.max_replica_load_over_mean:.2f}×)",
        )
    if result.floor is not None:
        floor = result.floor.cost_per_task_usd
        cells = ["" for _ in columns[3:]]
        cells[columns.index("hit (oracle)") - 3] = f"{result.floor.prefix_hit_rate:.1%}"
        table.add_row(
            "zero-miss floor",
            _usd(floor),
            "—" if ours is None or not floor else f"{ours / floor:.2f}",
            *cells,
        )
    return table


def _ablation_table(result: WorkloadResult) -> Table:
    table = Table(
        title=f"{result.name}: kvflow with one axis switched off ({result.offered_load:.0%} load)"
    )
    tiers = sorted({t for f in result.ablations.values() for t in f.slo_attainment}, key=int)
    for column in (
        "axis off",
        "$/successful task",
        "× kvflow",
        "success",
        *[f"SLO t{t}" for t in tiers],
        "TTFT p99 s",
        "hit",
        "busiest",
    ):
        table.add_column(column, justify="left" if column == "axis off" else "right")
    kvflow = result.policies.get("kvflow")
    ours = kvflow.cost_per_successful_task_usd if kvflow is not None else None
    for axis, fig in result.ablations.items():
        cost = fig.cost_per_successful_task_usd
        table.add_row(
            axis,
            _usd(cost),
            "—" if not ours or cost is None else f"{cost / ours:.3f}",
            f"{fig.success_rate:.1%}",
            *[f"{fig.slo_attainment.get(t, 0.0):.1%}" for t in tiers],
            f"{fig.ttft_p99_s:.2f}",
            f"{fig.prefix_hit_rate:.1%}",
            f"{fig.max_replica_load_over_mean:.2f}×",
        )
    return table


def _sweep_table(result: WorkloadResult) -> Table:
    table = Table(
        title=(f"{result.name}: $/successful task, tier-1 SLO and engines busy, by offered load")
    )
    loads = sorted(result.sweep)
    table.add_column("policy")
    for load in loads:
        table.add_column(f"{load:.0%}", justify="right")
    for name in result.policies:
        cells = []
        for load in loads:
            fig = result.sweep[load].get(name)
            if fig is None:
                cells.append("—")
                continue
            tier1 = fig.slo_attainment.get("1")
            cells.append(
                f"{_usd(fig.cost_per_successful_task_usd)} "
                f"{'—' if tier1 is None else f'{tier1:.0%}'} {fig.utilisation:.0%}"
            )
        table.add_row(name, *cells)
    return table


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
        loads = sorted(result.sweep)
        for name in result.policies:
            costs = [result.sweep[at][name].cost_per_successful_task_usd for at in loads]
            slo = [result.sweep[at][name].slo_attainment.get("1", 0.0) for at in loads]
            # Plotting needs floats; the figures themselves stay exact.
            row[0].plot(
                [a * 100 for a in loads],
                [float(c) if c is not None else float("nan") for c in costs],
                marker="o",
                label=name,
            )
            row[1].plot([a * 100 for a in loads], [s * 100 for s in slo], marker="o", label=name)
        row[0].set_title(f"{result.name}: cost per successful task")
        row[0].set_xlabel("offered load (%)")
        row[0].set_ylabel("USD")
        row[1].set_title(f"{result.name}: tier-1 SLO attainment")
        row[1].set_xlabel("offered load (%)")
        row[1].set_ylabel("%")
        row[1].legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


@bench_app.command("policies")
def policies_bench(
    quick: Annotated[
        bool, typer.Option("--quick", help="8 replicas, 400 tasks, 3 loads (under 2 minutes)")
    ] = False,
    workload: Annotated[
        str | None,
        typer.Option(
            "--workload", help=f"one of {', '.join(_WORKLOAD_NAMES)} (default: all of them)"
        ),
    ] = None,
    fleet_file: Annotated[
        Path | None, typer.Option("--fleet", help="fleet.toml to simulate instead of the default")
    ] = None,
    load: Annotated[float, typer.Option("--load", help="offered load, e.g. 0.8 for 80%")] = 0.8,
    seed: Annotated[int, typer.Option("--seed", help="random seed of the workloads")] = 0,
    tasks: Annotated[
        int | None, typer.Option("--tasks", min=1, help="tasks per run (default by mode)")
    ] = None,
    replicas: Annotated[
        int | None,
        typer.Option("--replicas", min=1, max=1024, help="replicas of the default fleet"),
    ] = None,
    sweep: Annotated[
        bool, typer.Option("--sweep/--no-sweep", help="also run the agent workload at 50–110%")
    ] = True,
    ablate: Annotated[
        bool,
        typer.Option("--ablate", help="also run kvflow with each axis switched off in turn"),
    ] = False,
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
    if not math.isfinite(load) or load <= 0 or load > 10:
        raise _usage_error(f"--load: {load} is not an offered load; give a number in (0, 10]")
    for path, flag in ((json_file, "--json"), (plot_file, "--plot")):
        if path is not None and not path.parent.exists():
            raise _usage_error(f"{flag}: folder {path.parent} does not exist")
    fleet = None
    if fleet_file is not None:
        from kvflow.workers.console import load_fleet_or_exit

        fleet = load_fleet_or_exit(fleet_file)
        if any(name == "heterogeneous" for name in names) and workload is None:
            names.remove("heterogeneous")  # the fleet file is the heterogeneity
    count, default_tasks, sweep_loads = default_sizes(quick)
    count = replicas or count
    if fleet is None and count < 4 and "heterogeneous" in names:
        raise _usage_error("--replicas: the heterogeneous fleet needs at least 4")
    logging.getLogger("kvflow").setLevel(logging.ERROR)
    results: list[WorkloadResult] = []
    started = time.perf_counter()
    with _out.status("simulating...") as status:
        for name in names:
            results.append(
                run_workload(
                    name,
                    fleet=fleet,
                    replicas=count,
                    tasks=tasks or default_tasks,
                    load=load,
                    seed=seed,
                    sweep_loads=sweep_loads if sweep and name == "agent" else (),
                    progress=lambda text: status.update(f"simulating {text}..."),
                    ablate=ablate,
                )
            )
    for result in results:
        _out.print(_policy_table(result))
        oracle = result.oracle
        if oracle.warmup_lifetimes < 1:
            _out.print(
                f"  [yellow]not a steady load:[/] the warm-up's arrivals span "
                f"{oracle.warmup_lifetimes:.2f} of a task's mean lifetime "
                f"({oracle.mean_task_s:.0f} s under the oracle), so the counted tasks arrive "
                "while the fleet still fills; more --tasks or fewer --replicas reach a steady "
                "load",
                highlight=False,
            )
        for goal in result.goals:
            mark = "[green]met[/]" if goal.met else "[red]not met[/]"
            _out.print(f"  goal: {goal.text}: {mark} ({goal.detail})", highlight=False)
        if len(result.sweep) > 1:
            _out.print(_sweep_table(result))
        if result.ablations:
            _out.print(_ablation_table(result))
    _out.print(
        "kvflow ×: kvflow's cost per successful task over the row's (below 1: kvflow is "
        "cheaper). hit (oracle): cached prompt tokens / prompt tokens, and the oracle policy's "
        "(knows every cache and load). zero-miss floor: every call finds cached all that an "
        "earlier call computed, at the cheapest prices; no placement costs less. busiest: "
        "the busiest replica's share of attempts, and over the mean. benchmarks/README.md "
        "explains the method. "
        f"Simulated in {time.perf_counter() - started:.0f} s.",
        highlight=False,
    )
    if json_file is not None:
        if len(results) == 1:
            payload: dict[str, object] = results[0].as_json()
        else:
            payload = {"workloads": {r.name: r.as_json() for r in results}}
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
    from kvflow.workers.overhead_bench import default_sizes, run_overhead

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

"""`kvflow bench ...`: benchmarks that print a table and optionally write JSON."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvflow.scheduler.bench import (
    DEFAULT_SIZES,
    LatencyResult,
    QualityResult,
    measure,
    measure_quality,
)
from kvflow.scheduler.build import scheduler_build

bench_app = typer.Typer(
    help="Benchmarks of kvflow's policies and overheads.",
    no_args_is_help=True,
)

_PIPE_WIDTH = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 120
_out = Console(width=_PIPE_WIDTH)
_err = Console(stderr=True, width=_PIPE_WIDTH)


def _usage_error(message: str) -> typer.Exit:
    _err.print(f"[bold red]error:[/] {message}", highlight=False)
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

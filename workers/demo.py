"""`kvflow demo`: the whole system on one machine, with a workload that exercises it.

It starts the embedded stack (Temporal dev server with its UI, one simulated vLLM replica and
one GPU worker per replica of the fleet, the workflow worker with the three samples), then runs
a mix of agent tasks for the fleet's tenants at a rate that saturates the fleet for a while,
with faults injected: one replica crashes mid-stream, one runs slow. A live display shows tasks
per tenant, fleet load and cache hits; the end shows the finance report, where the calls went,
and the Temporal UI address with a query for the failed tasks.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import urllib.parse
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.common import Priority
from temporalio.contrib.pydantic import pydantic_data_converter

from activities.context_store import DirectoryContextStore
from ledger.cli import print_whole, report_table
from ledger.report import GroupField, ReportQuery, format_usd
from ledger.store import AsyncLedger, open_async_ledger
from scheduler.fleet import Fleet
from simulator import FaultSpec
from workers.embedded import EmbeddedFleet
from workers.workflow_worker import DEFAULT_WORKFLOW_QUEUE

SAMPLE_MODULES = (
    "samples.research_assistant",
    "samples.support_triage",
    "samples.code_review",
)


@dataclass
class DemoOptions:
    """What `kvflow demo` was asked to do."""

    tasks: int = 60
    seed: int = 7
    rate_per_s: float = 10.0
    """Tasks started per second: faster than the fleet finishes them, so a backlog forms."""
    time_scale: float = 4.0
    crash_replica: str | None = None
    """Replica that crashes mid-stream (default: the second replica of the first pool)."""
    slow_replica: str | None = None
    """Replica whose engine runs `slowdown` times slower (default: the last pool's last)."""
    slowdown: float = 4.0


@dataclass
class TaskRun:
    """One started task and how it ended."""

    tenant: str
    sample: str
    handle: WorkflowHandle[Any, Any]
    outcome: str = "running"
    error: str | None = None


@dataclass
class Tally:
    """Live counts for the progress display."""

    started: Counter[str] = field(default_factory=Counter)
    succeeded: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)


def log_to_file(path: Path) -> Path:
    """Send all logging (workers, scheduler, simulators) to `path`, keeping the display clean.

    Failed attempts are expected in the demo (faults are injected); their tracebacks belong in
    a log an operator can open, not in the progress display.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return path


def default_faults(fleet: Fleet, options: DemoOptions) -> dict[str, FaultSpec]:
    """A crash mid-stream on one replica and a slow engine on another."""
    names = [n for pool in fleet.pools for n in pool.replica_names()]
    first_pool = fleet.pools[0].replica_names()
    crash = options.crash_replica or (first_pool[1] if len(first_pool) > 1 else None)
    slow = options.slow_replica or (names[-1] if len(names) > 2 else None)
    faults: dict[str, FaultSpec] = {}
    if crash in names:
        faults[crash] = FaultSpec(crash_after=40)
    if slow in names and slow != crash:
        faults[slow] = FaultSpec(slowdown=options.slowdown)
    return faults


def load_samples() -> list[ModuleType]:
    """The sample packages the workload mixes (each exports WORKFLOW, ACTIVITIES, example_input)."""
    import importlib

    return [importlib.import_module(name) for name in SAMPLE_MODULES]


async def run_demo(
    client: Client,
    fleet: Fleet,
    *,
    state_dir: Path,
    options: DemoOptions,
    console: Console,
    ui_url: str | None = None,
    keep_running: bool = False,
) -> list[TaskRun]:
    """Run the workload on an embedded fleet, print the reports, and return the tasks.

    With `keep_running`, the fleet and its workers stay up after the reports until the task
    running this coroutine is cancelled (Ctrl-C), so the Temporal UI can be explored.
    """
    samples = load_samples()
    started = time.monotonic()
    run_id = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    ledger_path = state_dir / f"demo-{run_id}.db"
    ledger = await open_async_ledger(f"sqlite:///{ledger_path}", migrate=True)
    faults = default_faults(fleet, options)
    if faults:
        console.print(
            "Faults: "
            + "; ".join(
                f"{name} {'crashes mid-stream' if f.crash_after is not None else 'runs slow'}"
                for name, f in faults.items()
            ),
            highlight=False,
        )
    rng = random.Random(options.seed)
    tally = Tally()
    runs: list[TaskRun] = []
    async with EmbeddedFleet(
        client,
        fleet,
        ledger=ledger,
        store=DirectoryContextStore(state_dir / "context"),
        time_scale=options.time_scale,
        faults=faults,
        seed=options.seed,
    ) as embedded:
        worker = await embedded.workflow_worker(
            workflows=[s.WORKFLOW for s in samples],
            activities=[a for s in samples for a in s.ACTIVITIES],
            task_queue=DEFAULT_WORKFLOW_QUEUE,
            max_concurrent_workflow_tasks=64,
        )
        async with worker:
            with Live(
                _progress(embedded, tally, fleet),
                console=console,
                refresh_per_second=4,
                transient=False,
            ) as live:
                pending: set[asyncio.Task[None]] = set()
                for i in range(options.tasks):
                    tenant = fleet.tenants[i % len(fleet.tenants)]
                    sample = samples[rng.randrange(len(samples))]
                    task_input = sample.example_input(rng, tenant.name)
                    handle = await client.start_workflow(
                        sample.WORKFLOW.run,
                        task_input,
                        id=f"demo-{run_id}-{i:03d}-{uuid.uuid4().hex[:6]}",
                        task_queue=DEFAULT_WORKFLOW_QUEUE,
                        priority=Priority(
                            priority_key=tenant.tier,
                            fairness_key=tenant.name,
                            fairness_weight=tenant.fairness_weight,
                        ),
                    )
                    run = TaskRun(tenant.name, sample.__name__.rsplit(".", 1)[-1], handle)
                    runs.append(run)
                    tally.started[tenant.name] += 1
                    pending.add(asyncio.create_task(_await(run, tally)))
                    live.update(_progress(embedded, tally, fleet))
                    await asyncio.sleep(rng.expovariate(options.rate_per_s))
                while pending:
                    _, pending = await asyncio.wait(pending, timeout=0.25)
                    live.update(_progress(embedded, tally, fleet))
                live.update(_progress(embedded, tally, fleet))
            console.print(summarize(runs, started), highlight=False)
            failures = failed_tasks(runs)
            if failures is not None:
                print_whole(console, failures)
            print_whole(console, await finance_report(ledger))
            print_whole(console, await placement_summary(ledger))
            console.print(
                f"Ledger: {ledger_path} (`kvflow report --db sqlite:///{ledger_path}`)",
                highlight=False,
                soft_wrap=True,
            )
            if ui_url:
                console.print(f"Temporal UI: {ui_url}", highlight=False)
                console.print(
                    f"Tasks that did not succeed: {failed_tasks_url(ui_url)}",
                    highlight=False,
                    soft_wrap=True,
                )
            if keep_running:
                console.print("The stack stays up; Ctrl-C stops it.")
                await asyncio.Event().wait()
    await ledger.close()
    return runs


async def _await(run: TaskRun, tally: Tally) -> None:
    try:
        await run.handle.result()
        run.outcome = "succeeded"
        tally.succeeded[run.tenant] += 1
    except WorkflowFailureError as failure:
        run.outcome = "failed"
        cause = failure.cause
        kind = getattr(cause, "type", None) or type(cause).__name__
        run.error = f"{kind}: {getattr(cause, 'message', None) or cause}"
        tally.failed[run.tenant] += 1


def _progress(embedded: EmbeddedFleet, tally: Tally, fleet: Fleet) -> Group:
    tasks = Table(title="Tasks", title_justify="left")
    for column in ("tenant", "tier", "started", "succeeded", "failed", "running"):
        tasks.add_column(column)
    for tenant in fleet.tenants:
        name = tenant.name
        running = tally.started[name] - tally.succeeded[name] - tally.failed[name]
        tasks.add_row(
            name,
            str(tenant.tier),
            str(tally.started[name]),
            str(tally.succeeded[name]),
            str(tally.failed[name]),
            str(running),
        )
    load = Table(title="Fleet", title_justify="left")
    for column in (
        "replica",
        "GPU",
        "up",
        "circuit",
        "running",
        "waiting",
        "KV used",
        "prefix blocks",
    ):
        load.add_column(column)
    if embedded.control_plane is not None:
        for status in embedded.control_plane.scheduler.status():
            load.add_row(
                status.replica,
                status.gpu,
                "yes" if status.up else "[red]down[/]",
                status.circuit,
                str(status.running),
                str(status.waiting),
                f"{status.kv_cache_usage:.0%}",
                f"{status.blocks_indexed:,}",
            )
    return Group(tasks, load)


async def placement_summary(ledger: AsyncLedger) -> Table:
    """Per pool: calls, cached share of prompt tokens, spend."""
    report = await ledger.report(ReportQuery(group_by=(GroupField.POOL,)))
    table = Table(title="Where the model calls ran", title_justify="left")
    for column in ("pool", "tasks", "attempts", "cached share of prompt", "spend"):
        table.add_column(column)
    for row in report.rows:
        share = row.cached_token_share
        table.add_row(
            str(row.keys.get("pool")),
            str(row.tasks),
            str(row.attempts),
            "-" if share is None else f"{share:.0%}",
            f"${format_usd(row.spend_micros)}",
        )
    return table


def failed_tasks(runs: Sequence[TaskRun]) -> Table | None:
    """The tasks that did not succeed and why, as an operator would want to read it."""
    failed = [r for r in runs if r.outcome == "failed"]
    if not failed:
        return None
    table = Table(title="Tasks that did not succeed", title_justify="left")
    for column in ("workflow id", "tenant", "sample", "error"):
        table.add_column(column)
    for run in failed:
        table.add_row(run.handle.id, run.tenant, run.sample, (run.error or "")[:160])
    return table


def failed_tasks_url(ui_url: str) -> str:
    """A Temporal UI link listing the demo's tasks that did not succeed."""
    query = "KvflowOutcome != 'succeeded' AND KvflowOutcome != 'running'"
    return f"{ui_url}/namespaces/default/workflows?query={urllib.parse.quote(query)}"


async def finance_report(ledger: AsyncLedger) -> Table:
    """The finance report of the demo's ledger, by tenant and workflow type."""
    report = await ledger.report(ReportQuery())
    return report_table(report)


async def connect_local(address: str) -> Client:
    """A client of the embedded server with kvflow's data converter."""
    return await Client.connect(address, data_converter=pydantic_data_converter)


def summarize(runs: Sequence[TaskRun], started: float) -> str:
    """One line: how many tasks succeeded and how long the workload took."""
    ok = sum(1 for r in runs if r.outcome == "succeeded")
    return (
        f"{ok} of {len(runs)} tasks succeeded in {time.monotonic() - started:.0f} s "
        f"({len(runs) - ok} failed)"
    )


__all__ = [
    "DemoOptions",
    "failed_tasks_url",
    "finance_report",
    "format_usd",
    "placement_summary",
    "run_demo",
]

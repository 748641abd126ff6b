"""`kvflow demo`: the whole system on one machine, with a workload that exercises it.

It starts the embedded stack (Temporal dev server with its UI, one simulated vLLM replica and
one GPU worker per replica of the fleet, the workflow worker with the three samples), then runs
a mix of agent tasks for the fleet's tenants at a rate that saturates the fleet for a while,
with faults injected: one replica crashes mid-stream, one runs slow. A live display shows tasks
per tenant, fleet load and cache hits; the end shows the finance report, where the calls went,
and, with `--keep-running` (the stack stays up), the Temporal UI address with a query for the
failed tasks and each simulated replica's URL.

On real vLLM servers (`--endpoints`, or `--engine vllm` which starts them) the fleet's pools
give way to one pool, `vllm`, with a replica per server; its GPU generation and prices are the
fleet's first pool's. Real servers have no fault injection, so none is done there.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import random
import statistics
import time
import urllib.parse
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.common import Priority
from temporalio.runtime import (
    LogForwardingConfig,
    LoggingConfig,
    Runtime,
    TelemetryConfig,
    TelemetryFilter,
)
from temporalio.service import RPCError
from temporalio.worker import Worker

from kvflow.activities.claim_check import claim_check_of
from kvflow.activities.context_store import DEFAULT_CONTEXT_DIR, DirectoryContextStore
from kvflow.activities.wire import INLINE_LIMIT_BYTES
from kvflow.ledger.report import GroupField, ReportQuery
from kvflow.ledger.store import (
    LEDGER_URL_ENV,
    AsyncLedger,
    default_ledger_url,
    open_async_ledger,
)
from kvflow.ledger.table import print_whole, report_table
from kvflow.scheduler.config import AdmissionConfig, SchedulerConfig
from kvflow.scheduler.fleet import Fleet, Pool, format_usd
from kvflow.scheduler.redact import redact_url
from kvflow.simulator import FaultSpec
from kvflow.workers.control_plane import ControlPlane
from kvflow.workers.embedded import EmbeddedFleet
from kvflow.workers.plugin import KvflowPlugin
from kvflow.workers.vllm_server import Engine, VllmInstall, VllmServer, stop_servers
from kvflow.workers.workflow_worker import DEFAULT_WORKFLOW_QUEUE
from kvflow.workflows.agent import SPEND_QUERY, SpendBreakdown

SAMPLES = {
    "research_assistant": "kvflow.samples.research_assistant",
    "support_triage": "kvflow.samples.support_triage",
    "code_review": "kvflow.samples.code_review",
    "openai_agents_travel": "kvflow.samples.openai_agents_travel",
    "pydantic_ai_support": "kvflow.samples.pydantic_ai_support",
}
"""The samples `--samples` can name, by short name."""
DEFAULT_SAMPLES = ("research_assistant", "support_triage", "code_review")
"""The samples of the default workload: the ones written with kvflow's step API."""
SAMPLE_EXTRAS = {"openai_agents_travel": "openai-agents", "pydantic_ai_support": "pydantic-ai"}
"""The optional dependencies (`pip install 'kvflow[EXTRA]'`) a framework's sample needs."""
VLLM_POOL = "vllm"
"""The one pool the demo's fleet has when it runs on real vLLM servers."""
VLLM_MAX_MODEL_LEN = 16_384
"""Context of the vLLM servers `--engine vllm` starts: the code-review sample's prompts reach
about 8k tokens with a small vocabulary (the tiny test model's), and its steps add to them."""

DEMO_ADMISSION = AdmissionConfig(saturation_by_tier=(4.0, 2.0, 1.5, 1.0, 0.75))
"""The demo's admission: tier 5 waits from 75% of the slots; tiers 1 to 4 as by default.

With the scheduler's default (tier 5 waits from 100%), the demo's 60 tasks on a 2-core machine
peaked at 1.1 times the slots of llama-3.1-8b for a moment and no call was ever refused, so the
"admission waits" column read 0 for every tenant (two runs, seed 7); from 75% the tier-5
tenant's calls waited 14 times in a run, tiers 1 and 3 never. The demo prints this setting."""

FleetT = TypeVar("FleetT", bound=Fleet)


class EndpointError(Exception):
    """A vLLM endpoint the demo was given does not answer, or does not serve the samples."""


class SampleError(Exception):
    """`--samples` names a sample that does not exist or whose framework is not installed."""


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
    samples: tuple[str, ...] = DEFAULT_SAMPLES
    """The samples whose tasks the workload mixes (names of `SAMPLES`)."""
    admission: AdmissionConfig = field(default_factory=lambda: DEMO_ADMISSION)
    """The scheduler's admission under saturation (`DEMO_ADMISSION`)."""


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
    admission_waits: Counter[str] = field(default_factory=Counter)
    """Times a tenant's steps were told "fleet saturated, wait" (low tiers wait first)."""
    seconds: dict[str, list[float]] = field(default_factory=dict)
    """Wall-clock seconds of each finished task, per tenant."""


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
    """A crash mid-stream on one replica and a slow engine on another (simulated ones only)."""
    simulated = [pool for pool in fleet.pools if isinstance(pool.endpoints, str)]
    if not simulated:
        return {}
    names = [n for pool in simulated for n in pool.replica_names()]
    first_pool = simulated[0].replica_names()
    crash = options.crash_replica or (first_pool[1] if len(first_pool) > 1 else None)
    slow = options.slow_replica or (names[-1] if len(names) > 2 else None)
    faults: dict[str, FaultSpec] = {}
    if crash in names:
        faults[crash] = FaultSpec(crash_after=40)
    if slow in names and slow != crash:
        faults[slow] = FaultSpec(slowdown=options.slowdown)
    return faults


def parse_samples(text: str) -> tuple[str, ...]:
    """Sample names from `NAME[,NAME...]` or `all`; `SampleError` naming the choices if bad."""
    if text.strip() == "all":
        return tuple(SAMPLES)
    names: list[str] = []
    for part in text.split(","):
        name = part.strip().replace("-", "_")
        if not name:
            continue
        if name not in SAMPLES:
            raise SampleError(
                f"--samples: no sample {part.strip()!r}; choose from {', '.join(SAMPLES)} or all"
            )
        if name not in names:
            names.append(name)
    if not names:
        raise SampleError(f"--samples is empty; e.g. --samples {','.join(DEFAULT_SAMPLES)}")
    return tuple(names)


def load_samples(names: Sequence[str] = DEFAULT_SAMPLES) -> list[ModuleType]:
    """The sample packages the workload mixes (each exports WORKFLOW, ACTIVITIES, example_input).

    A framework's sample also exports `client_plugins()`, the plugins its workflow worker's
    client needs after `KvflowPlugin`, and `TASK_QUEUE`, its own queue (`framework_worker`).
    Its framework is an optional dependency: without it, `SampleError` says which extra to
    install.
    """
    loaded: list[ModuleType] = []
    for name in names:
        try:
            loaded.append(importlib.import_module(SAMPLES[name]))
        except ImportError as exc:
            extra = SAMPLE_EXTRAS.get(name)
            # Only a missing framework is the user's to install; a broken sample is kvflow's.
            if extra is None or (exc.name or "kvflow").startswith("kvflow"):
                raise
            raise SampleError(
                f"the sample {name} needs its framework ({exc.name or exc}): "
                f"pip install 'kvflow[{extra}]'"
            ) from None
    return loaded


def sample_name(sample: ModuleType) -> str:
    """The short name of a sample package (`research_assistant`)."""
    return sample.__name__.rsplit(".", 1)[-1]


def sample_task_queue(sample: ModuleType) -> str:
    """The workflow task queue of a sample's tasks: its own (`TASK_QUEUE`) for a framework's."""
    queue = getattr(sample, "TASK_QUEUE", None)
    return queue if isinstance(queue, str) else DEFAULT_WORKFLOW_QUEUE


def framework_worker(
    client: Client, control_plane: ControlPlane, sample: ModuleType, **options: Any
) -> Worker:
    """The workflow worker of a framework's sample, on its own queue (not yet started).

    Its client is the demo's with `KvflowPlugin` on the running control plane and then the
    framework's plugins (`client_plugins()`), in that order, as the sample's own worker has
    them: the framework's plugin extends kvflow's data converter.
    """
    config = client.config()
    # The demo client's claim checks (store and threshold), or none: its GPU workers decode
    # what this worker encodes.
    claim_check = claim_check_of(config["data_converter"])
    plugins = [
        KvflowPlugin(
            control_plane=control_plane,
            context_store=claim_check.store if claim_check else DEFAULT_CONTEXT_DIR,
            claim_check_bytes=claim_check.threshold_bytes if claim_check else None,
        ),
        *sample.client_plugins(),
    ]
    config["plugins"] = [*config["plugins"], *plugins]
    framework_client = Client(**config)
    return Worker(
        framework_client,
        task_queue=sample_task_queue(sample),
        workflows=[sample.WORKFLOW],
        activities=list(sample.ACTIVITIES),
        **options,
    )


def sample_models(samples: Sequence[ModuleType] | None = None) -> list[str]:
    """The models the samples' workflows ask for (each workflow module's `MODEL`), in order."""
    models: list[str] = []
    for sample in samples if samples is not None else load_samples():
        model = getattr(importlib.import_module(sample.WORKFLOW.__module__), "MODEL", None)
        if isinstance(model, str) and model not in models:
            models.append(model)
    return models


def parse_endpoints(text: str) -> list[str]:
    """Base URLs from `URL[,URL...]`, without trailing `/` or `/v1`; `EndpointError` if bad."""
    urls: list[str] = []
    for part in text.split(","):
        url = part.strip().rstrip("/")
        if not url:
            continue
        # `/v1` is the OpenAI path prefix, which people often paste with the server address.
        url = url.removesuffix("/v1")
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise EndpointError(
                f"--endpoints: {redact_url(part.strip())!r} is not a URL; give each vLLM "
                "server's base URL, e.g. http://127.0.0.1:8000"
            )
        if url in urls:
            raise EndpointError(
                f"--endpoints: {redact_url(url)} is listed twice; one URL per server"
            )
        urls.append(url)
    if not urls:
        raise EndpointError("--endpoints is empty; e.g. --endpoints http://127.0.0.1:8000")
    return urls


def check_endpoints(
    urls: Sequence[str],
    required: Sequence[str],
    *,
    names_to_serve: Sequence[str] = (),
    timeout_s: float = 5.0,
) -> dict[str, list[str]]:
    """The models each vLLM server serves (`GET /v1/models`), checked against `required`.

    Raises `EndpointError` naming the URL, what it serves and how to fix it when a server does
    not answer or does not serve every model in `required`; the fix suggests serving
    `names_to_serve` (e.g. all the fleet's models; default `required`).
    """
    served: dict[str, list[str]] = {}
    fix_names = " ".join(names_to_serve or required)
    with httpx.Client(timeout=timeout_s) as http:
        for url in urls:
            # Messages name the server without the credentials its URL may carry.
            shown = redact_url(url)
            try:
                response = http.get(f"{url}/v1/models")
            except httpx.HTTPError as exc:
                raise EndpointError(
                    f"{shown} does not answer ({type(exc).__name__}): start a vLLM server there "
                    f"(`python -m vllm.entrypoints.openai.api_server --model DIR "
                    f"--served-model-name {fix_names}`), or fix --endpoints"
                ) from None
            try:
                cards = response.json()["data"] if response.status_code == 200 else None
                models = [str(card["id"]) for card in cards] if isinstance(cards, list) else None
            except (ValueError, KeyError, TypeError):
                models = None
            if models is None:
                raise EndpointError(
                    f"{shown}/v1/models answered {response.status_code} without a model list: "
                    "is it a vLLM (OpenAI-compatible) server? Give its base URL, without /v1"
                )
            missing = [m for m in required if m not in models]
            if missing:
                raise EndpointError(
                    f"{shown} serves {', '.join(models) or 'no model'}, not "
                    f"{', '.join(missing)} that the demo's samples ask for: start vLLM with "
                    f"`--served-model-name {fix_names}` (one model may be served under "
                    "several names)"
                )
            served[url] = models
    return served


def fleet_on_endpoints(
    fleet: FleetT, served: Mapping[str, Sequence[str]], *, task_end_release: bool = False
) -> FleetT:
    """`fleet` with its pools replaced by one pool `vllm`: a replica per URL of `served`.

    The pool takes the GPU generation, GPUs per replica, prices and concurrency of the
    fleet's first pool; its warm models are the fleet's models that every server serves.
    `task_end_release`: the servers run kvflow's engine scheduler (`VllmServer(task_end=True)`),
    so a task's end is sent to them (`Pool.task_end_release`).
    """
    first = fleet.pools[0]
    warm = [m.name for m in fleet.models if all(m.name in names for names in served.values())]
    if not warm:
        raise EndpointError(
            "the vLLM servers serve none of the fleet's models ("
            + ", ".join(m.name for m in fleet.models)
            + "); start them with --served-model-name naming those"
        )
    pool = Pool(
        name=VLLM_POOL,
        gpu=first.gpu,
        replicas=len(served),
        gpus_per_replica=first.gpus_per_replica,
        endpoints=list(served),
        price_per_gpu_hour_usd=first.price_per_gpu_hour_usd,
        token_prices=first.token_prices,
        warm_models=warm,
        max_concurrency=first.max_concurrency,
        task_end_release=task_end_release,
    )
    data = fleet.model_dump()
    data["pools"] = [pool.model_dump()]
    return type(fleet).model_validate(data)


@contextlib.contextmanager
def local_vllm_servers(
    install: VllmInstall,
    model_dir: Path,
    *,
    served_model_names: Sequence[str],
    replicas: int,
    log_dir: Path,
    max_model_len: int = VLLM_MAX_MODEL_LEN,
) -> Iterator[list[VllmServer]]:
    """Start `replicas` vLLM servers on `model_dir` (all at once), stop them all on exit.

    The servers are started but not waited for: call `wait_ready()` on each (they load in
    parallel meanwhile). Each logs to `log_dir/vllm-<i>.log`. They schedule with kvflow's
    `TaskEndScheduler`, so an ended task's KV is reused first (`fleet_on_endpoints(...,
    task_end_release=True)` sends the ends).
    """
    servers: list[VllmServer] = []
    try:
        for index in range(replicas):
            server = VllmServer(
                install,
                model_dir=model_dir,
                served_model_names=served_model_names,
                max_model_len=max_model_len,
                log_path=log_dir / f"vllm-{index}.log",
                task_end=True,
            )
            servers.append(server)
            server.start()
        yield servers
    finally:
        stop_servers(servers)


async def run_demo(
    client: Client,
    fleet: Fleet,
    *,
    state_dir: Path,
    options: DemoOptions,
    console: Console,
    ui_url: str | None = None,
    keep_running: bool = False,
    fleet_file: Path | None = None,
) -> list[TaskRun]:
    """Run the workload on an embedded fleet, print the reports, and return the tasks.

    With `fleet_file`, each simulated replica runs in a process of its own (`kvflow sim serve
    --fleet FILE --replica NAME`), as a real deployment's vLLM servers would.

    With `keep_running`, the fleet and its workers stay up after the reports until the task
    running this coroutine is cancelled (Ctrl-C or SIGTERM), so the Temporal UI can be
    explored.
    """
    samples = load_samples(options.samples)
    started = time.monotonic()
    run_started = datetime.now(UTC)
    run_id = run_started.strftime("%Y%m%d-%H%M%S")
    # The ledger `kvflow report` reads by default (from this directory), so that the report
    # after a demo shows its tasks; the demo's own reports cover this run only.
    ledger_url = os.environ.get(LEDGER_URL_ENV) or f"sqlite:///{state_dir / 'ledger.db'}"
    ledger = await open_async_ledger(ledger_url, migrate=True)
    faults = default_faults(fleet, options)
    if not any(isinstance(pool.endpoints, str) for pool in fleet.pools):
        console.print(
            "Faults: none; the replicas are real vLLM servers, which have no fault injection "
            "(that is the simulator's)",
            highlight=False,
        )
    elif faults:
        console.print(
            "Faults: "
            + "; ".join(
                f"{name} {'crashes mid-stream' if f.crash_after is not None else 'runs slow'}"
                for name, f in faults.items()
            ),
            highlight=False,
        )
    console.print(admission_line(options.admission), highlight=False)
    rng = random.Random(options.seed)
    tally = Tally()
    runs: list[TaskRun] = []
    async with (
        EmbeddedFleet(
            client,
            fleet,
            ledger=ledger,
            store=DirectoryContextStore(state_dir / "context"),
            time_scale=options.time_scale,
            faults=faults,
            seed=options.seed,
            fleet_file=fleet_file,
            scheduler_config=SchedulerConfig(admission=options.admission),
        ) as embedded,
        contextlib.AsyncExitStack() as workers,
    ):
        # The step-API samples share the default workflow worker; a framework's sample gets
        # its own, on its own queue, with the framework's plugins.
        own = [s for s in samples if hasattr(s, "client_plugins")]
        shared = [s for s in samples if s not in own]
        if shared:
            worker = await embedded.workflow_worker(
                workflows=[s.WORKFLOW for s in shared],
                activities=[a for s in shared for a in s.ACTIVITIES],
                task_queue=DEFAULT_WORKFLOW_QUEUE,
                max_concurrent_workflow_tasks=64,
            )
            await workers.enter_async_context(worker)
        for sample in own:
            assert embedded.control_plane is not None
            await workers.enter_async_context(
                framework_worker(
                    client, embedded.control_plane, sample, max_concurrent_workflow_tasks=64
                )
            )
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
                    task_queue=sample_task_queue(sample),
                    priority=Priority(
                        priority_key=tenant.tier,
                        fairness_key=tenant.name,
                        fairness_weight=tenant.fairness_weight,
                    ),
                )
                run = TaskRun(tenant.name, sample_name(sample), handle)
                runs.append(run)
                tally.started[tenant.name] += 1
                pending.add(asyncio.create_task(_await(run, tally)))
                live.update(_progress(embedded, tally, fleet))
                await asyncio.sleep(rng.expovariate(options.rate_per_s))
            while pending:
                _, pending = await asyncio.wait(pending, timeout=0.25)
                live.update(_progress(embedded, tally, fleet))
            live.update(_progress(embedded, tally, fleet))
        # The live display's last frame does not end its line when output is not a terminal.
        console.print()
        console.print(summarize(runs, started), highlight=False)
        failures = failed_tasks(runs)
        if failures is not None:
            print_whole(console, failures)
        print_whole(console, await finance_report(ledger, since=run_started))
        print_whole(console, await placement_summary(ledger, since=run_started))
        report_command = "kvflow report" + (
            "" if ledger_url == default_ledger_url() else f" --db {redact_url(ledger_url)}"
        )
        console.print(
            f"Ledger: {redact_url(ledger_url)} (`{report_command}`)",
            highlight=False,
            soft_wrap=True,
        )
        if keep_running:
            if ui_url:
                console.print(f"Temporal UI: {ui_url}", highlight=False)
                if failures is not None:
                    console.print(
                        f"Tasks that did not succeed: {failed_tasks_url(ui_url)}",
                        highlight=False,
                        soft_wrap=True,
                    )
            _print_replicas(console, embedded)
            console.print("The stack stays up; Ctrl-C or SIGTERM stops it.")
            await asyncio.Event().wait()
        elif ui_url and failures is not None:
            # The UI stops with the stack, now: a link to it would be dead.
            console.print(
                "The Temporal UI stops with the demo: run it with --keep-running to look at the "
                "tasks that did not succeed there (the stack then stays up until Ctrl-C).",
                highlight=False,
                soft_wrap=True,
            )
    await ledger.close()
    return runs


def admission_line(admission: AdmissionConfig) -> str:
    """What the "admission waits" column counts, and from which load each tier waits."""
    thresholds = ", ".join(f"{t:.0%}" for t in admission.saturation_by_tier)
    return (
        "Admission: a call waits (the 'admission waits' column) while the replicas serving its "
        f"model run at least this share of their slots, tiers 1 to 5: {thresholds}"
    )


def _print_replicas(console: Console, embedded: EmbeddedFleet) -> None:
    """Each simulated replica's URL, for `KvflowPlugin(fleet, endpoints={...})` or curl."""
    if not embedded.sims:
        return
    console.print("Simulated replicas (vLLM's OpenAI API and /metrics):", highlight=False)
    for name, sim in embedded.sims.items():
        console.print(f"  {name:<8} {sim.base_url}", highlight=False)


async def _await(run: TaskRun, tally: Tally) -> None:
    started = time.monotonic()
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
    tally.seconds.setdefault(run.tenant, []).append(time.monotonic() - started)
    try:
        breakdown = await run.handle.query(SPEND_QUERY, result_type=SpendBreakdown)
    except RPCError:
        return  # the query is for the display only
    tally.admission_waits[run.tenant] += sum(s.admission_waits for s in breakdown.steps)


def _progress(embedded: EmbeddedFleet, tally: Tally, fleet: Fleet) -> Group:
    tasks = Table(title="Tasks", title_justify="left")
    for column in (
        "tenant",
        "tier",
        "started",
        "succeeded",
        "failed",
        "running",
        "admission waits",
        "median s",
    ):
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
            str(tally.admission_waits[name]),
            f"{statistics.median(tally.seconds[name]):.1f}" if tally.seconds.get(name) else "-",
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


async def placement_summary(ledger: AsyncLedger, *, since: datetime | None = None) -> Table:
    """Per pool, of the tasks closed since `since`: calls, cached share of prompt, spend."""
    report = await ledger.report(ReportQuery(group_by=(GroupField.POOL,), since=since))
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
    query = (
        "KvflowOutcome != 'succeeded' AND KvflowOutcome != 'running' "
        "AND KvflowOutcome != 'continued_as_new'"
    )
    return f"{ui_url}/namespaces/default/workflows?query={urllib.parse.quote(query)}"


async def finance_report(ledger: AsyncLedger, *, since: datetime | None = None) -> Table:
    """The finance report of the tasks closed since `since`, by tenant and workflow type."""
    report = await ledger.report(ReportQuery(since=since))
    return report_table(report)


async def connect_local(address: str, context_dir: Path | None = None) -> Client:
    """A client of the embedded server with kvflow's data converter and tracing.

    With `context_dir` (the stack's context store) its codec keeps payloads over 2 KB there,
    as the workers' does; without, it claim-checks nothing.

    The SDK core's own log lines (e.g. "workflow task took more than 5 s" when the machine is
    busy) are forwarded to Python logging, so they land in the demo's log file rather than
    over the progress display.
    """
    runtime = Runtime(
        telemetry=TelemetryConfig(
            logging=LoggingConfig(
                filter=TelemetryFilter(core_level="WARN", other_level="ERROR"),
                forwarding=LogForwardingConfig(logger=logging.getLogger("temporalio.core")),
            )
        )
    )
    plugin = KvflowPlugin(
        context_dir=context_dir or DEFAULT_CONTEXT_DIR,
        claim_check_bytes=None if context_dir is None else INLINE_LIMIT_BYTES,
    )
    return await Client.connect(address, plugins=[plugin], runtime=runtime)


def summarize(runs: Sequence[TaskRun], started: float) -> str:
    """One line: how many tasks succeeded and how long the workload took."""
    ok = sum(1 for r in runs if r.outcome == "succeeded")
    return (
        f"{ok} of {len(runs)} tasks succeeded in {time.monotonic() - started:.0f} s "
        f"({len(runs) - ok} failed)"
    )


__all__ = [
    "DemoOptions",
    "EndpointError",
    "Engine",
    "SampleError",
    "check_endpoints",
    "failed_tasks_url",
    "finance_report",
    "fleet_on_endpoints",
    "local_vllm_servers",
    "parse_endpoints",
    "parse_samples",
    "placement_summary",
    "run_demo",
    "sample_models",
]

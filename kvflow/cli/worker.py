"""`kvflow worker ...`: the long-running worker processes."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated

import typer
from temporalio.client import Client

from kvflow.activities.context_store import ContextStore
from kvflow.cli.context import DEFAULT_CONTEXT_STORE, ContextStoreOption, open_store_or_exit
from kvflow.cli.url_options import fail_without_secrets, http_url_or_exit, url_option
from kvflow.ledger.errors import LedgerError
from kvflow.ledger.store import default_ledger_url, open_async_ledger
from kvflow.scheduler.build import scheduler_build
from kvflow.scheduler.redact import encode_password, redact_url
from kvflow.workers.config import FleetConfig
from kvflow.workers.console import fail, load_fleet_or_exit, out
from kvflow.workers.control_plane import ControlPlane
from kvflow.workers.gpu_worker import GpuWorker
from kvflow.workers.modules import WorkerModuleError, load_worker_modules
from kvflow.workers.plugin import KvflowPlugin
from kvflow.workers.replica import GpuWorkerError, resolve_replica
from kvflow.workers.search_attributes import SearchAttributesMissing
from kvflow.workers.tracing import TRACES_ENV, TraceExport, TracingError, configure_tracing
from kvflow.workers.workflow_worker import DEFAULT_WORKFLOW_QUEUE, workflow_worker

worker_app = typer.Typer(help="Run kvflow's worker processes.", no_args_is_help=True)


LedgerOption = Annotated[
    str | None,
    typer.Option("--ledger", callback=url_option, help="ledger URL (default: $KVFLOW_LEDGER_URL)"),
]


TracesOption = Annotated[
    TraceExport | None,
    typer.Option(
        "--traces", help=f"span export: console, otlp or off (default: ${TRACES_ENV} or off)"
    ),
]


def _tracing(traces: TraceExport | None, service: str) -> None:
    try:
        configure_tracing(traces, service=service)
    except (TracingError, ValueError) as exc:
        fail(f"tracing: {exc}; set {TRACES_ENV} to console, otlp or off")


def _unreachable(config: FleetConfig, exc: Exception) -> str:
    """Which Temporal address was tried, and where that address came from."""
    address = config.temporal.effective_address()
    source = "TEMPORAL_ADDRESS" if address != config.temporal.address else "the fleet's [temporal]"
    return f"cannot reach Temporal at {address} (from {source}): {exc}"


async def _connect(config: FleetConfig, store: ContextStore) -> Client:
    """A Temporal client of the fleet whose codec keeps large payloads in `store`.

    The worker's activities share the same store.
    """
    return await Client.connect(
        **config.temporal.connect_config(), plugins=[KvflowPlugin(context_store=store)]
    )


def _shutdown_on_signals(shutdown: Callable[[], Awaitable[None]]) -> None:
    """Ctrl-C or SIGTERM starts a graceful shutdown instead of killing in-flight work."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, lambda: asyncio.ensure_future(shutdown()))


@worker_app.command("gpu")
def gpu(
    replica: Annotated[str, typer.Option("--replica", help="POOL/INDEX, e.g. h200/0")],
    fleet: Annotated[Path, typer.Option("--fleet", help="fleet file")] = Path("fleet.toml"),
    endpoint: Annotated[
        str | None,
        typer.Option(
            "--endpoint",
            callback=url_option,
            help="vLLM base URL (default: the pool's endpoints entry)",
        ),
    ] = None,
    graceful_shutdown_s: Annotated[
        float, typer.Option("--graceful-shutdown", help="seconds in-flight calls may finish")
    ] = 10.0,
    ledger_url: LedgerOption = None,
    context_store: ContextStoreOption = DEFAULT_CONTEXT_STORE,
    traces: TracesOption = None,
) -> None:
    """Serve one vLLM replica's task queue until Ctrl-C / SIGTERM."""
    config = load_fleet_or_exit(fleet)
    _tracing(traces, "kvflow-gpu-worker")
    ledger_url = encode_password(ledger_url or default_ledger_url())
    try:
        binding = resolve_replica(config, replica, endpoint)
    except GpuWorkerError as exc:
        fail_without_secrets(str(exc), endpoint)
    http_url_or_exit("--endpoint" if endpoint else f"{binding.name}'s endpoint", binding.base_url)
    store = open_store_or_exit(context_store, "--context-store")

    async def serve() -> None:
        client = await _connect(config, store)
        ledger = await open_async_ledger(ledger_url, migrate=True)
        try:
            worker = GpuWorker(
                client,
                binding,
                ledger=ledger,
                store=store,
                graceful_shutdown_s=graceful_shutdown_s,
            )
            _shutdown_on_signals(worker.shutdown)
            await worker.run(
                on_ready=lambda: out.print(
                    f"GPU worker for {binding.name} ({redact_url(binding.base_url)}) polls "
                    f"{worker.task_queue}"
                )
            )
        finally:
            await ledger.close()

    try:
        asyncio.run(serve())
    except (GpuWorkerError, LedgerError) as exc:
        fail_without_secrets(str(exc), ledger_url, binding.base_url, code=1)
    except RuntimeError as exc:
        # Client.connect raises RuntimeError when the Temporal server cannot be reached.
        fail_without_secrets(_unreachable(config, exc), ledger_url, binding.base_url, code=1)
    out.print(f"GPU worker for {binding.name} stopped.")


def _replica_endpoints(config: FleetConfig, items: list[str]) -> dict[str, str]:
    """`--endpoint REPLICA=URL` options as a map; exit 2, password masked, on a bad one."""
    replicas = {name for pool in config.pools for name in pool.replica_names()}
    endpoints: dict[str, str] = {}
    for item in items:
        name, _, url = item.partition("=")
        url = encode_password(url.strip())
        if not url.startswith(("http://", "https://")):
            fail_without_secrets(
                f"--endpoint {name}={redact_url(url)}: write REPLICA=URL, "
                "e.g. h100/0=http://10.0.0.5:8000",
                url,
            )
        if name not in replicas:
            fail_without_secrets(
                f"--endpoint {name}={redact_url(url)}: the fleet has no replica {name!r}; "
                f"its replicas: {', '.join(sorted(replicas))}",
                url,
            )
        endpoints[name] = http_url_or_exit(f"--endpoint {name}=", url)
    return endpoints


DEFAULT_MODULES = [
    "kvflow.samples.research_assistant",
    "kvflow.samples.support_triage",
    "kvflow.samples.code_review",
]


@worker_app.command("workflow")
def workflow_command(
    fleet: Annotated[Path, typer.Option("--fleet", help="fleet file")] = Path("fleet.toml"),
    module: Annotated[
        list[str] | None,
        typer.Option(
            "--module",
            help="a module whose workflows and activities the worker runs, e.g. workflows "
            "(repeatable; looked up from the current directory; default: the samples)",
        ),
    ] = None,
    endpoint: Annotated[
        list[str] | None,
        typer.Option("--endpoint", help="REPLICA=URL for a simulated pool's replica (repeatable)"),
    ] = None,
    task_queue: Annotated[str, typer.Option("--task-queue")] = DEFAULT_WORKFLOW_QUEUE,
    ledger_url: LedgerOption = None,
    context_store: ContextStoreOption = DEFAULT_CONTEXT_STORE,
    traces: TracesOption = None,
) -> None:
    """Run agent workflows and the control plane (scheduler, ledger, context store)."""
    config = load_fleet_or_exit(fleet)
    _tracing(traces, "kvflow-workflow-worker")
    ledger_url = encode_password(ledger_url or default_ledger_url())
    endpoints = _replica_endpoints(config, endpoint or [])
    secret_urls = [ledger_url, *endpoints.values()]
    try:
        workflows, activities = load_worker_modules(module or DEFAULT_MODULES)
    except WorkerModuleError as exc:
        fail(str(exc))
    store = open_store_or_exit(context_store, "--context-store")

    async def serve() -> None:
        client = await _connect(config, store)
        ledger = await open_async_ledger(ledger_url, migrate=True)
        try:
            async with ControlPlane(
                config,
                endpoints=endpoints,
                ledger=ledger,
                store=store,
            ) as control:
                worker = await workflow_worker(
                    client,
                    control,
                    workflows=workflows,
                    activities=activities,
                    task_queue=task_queue,
                )
                loop = asyncio.get_running_loop()
                for signum in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(
                        signum, lambda: asyncio.ensure_future(worker.shutdown())
                    )
                names = ", ".join(w.__name__ for w in workflows)
                build = "compiled with mypyc" if scheduler_build() == "mypyc" else "uncompiled"
                out.print(
                    f"workflow worker on {task_queue}: {names} (scheduler {build})",
                    highlight=False,
                )
                await worker.run()
        finally:
            await ledger.close()

    try:
        asyncio.run(serve())
    except (SearchAttributesMissing, LedgerError, ValueError) as exc:
        fail_without_secrets(str(exc), *secret_urls, code=1)
    except RuntimeError as exc:
        fail_without_secrets(_unreachable(config, exc), *secret_urls, code=1)
    out.print("workflow worker stopped.")

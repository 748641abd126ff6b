"""`kvflow worker ...`: the long-running worker processes."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Annotated

import typer

from workers.console import fail, load_fleet_or_exit, out
from workers.gpu_worker import GpuWorker, GpuWorkerError, connect, resolve_replica

worker_app = typer.Typer(help="Run kvflow's worker processes.", no_args_is_help=True)


@worker_app.command("gpu")
def gpu(
    replica: Annotated[str, typer.Option("--replica", help="POOL/INDEX, e.g. h200/0")],
    fleet: Annotated[Path, typer.Option("--fleet", help="fleet file")] = Path("fleet.toml"),
    endpoint: Annotated[
        str | None,
        typer.Option("--endpoint", help="vLLM base URL (default: the pool's endpoints entry)"),
    ] = None,
    graceful_shutdown_s: Annotated[
        float, typer.Option("--graceful-shutdown", help="seconds in-flight calls may finish")
    ] = 10.0,
) -> None:
    """Serve one vLLM replica's task queue until Ctrl-C / SIGTERM."""
    config = load_fleet_or_exit(fleet)
    try:
        binding = resolve_replica(config, replica, endpoint)
    except GpuWorkerError as exc:
        fail(str(exc))

    async def serve() -> None:
        client = await connect(config)
        worker = GpuWorker(client, binding, graceful_shutdown_s=graceful_shutdown_s)
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, lambda: asyncio.ensure_future(worker.shutdown()))
        out.print(f"GPU worker for {binding.name} ({binding.base_url}) polls {worker.task_queue}")
        await worker.run()

    try:
        asyncio.run(serve())
    except GpuWorkerError as exc:
        fail(str(exc), code=1)
    except RuntimeError as exc:
        # Client.connect raises RuntimeError when the Temporal server cannot be reached.
        fail(f"cannot reach Temporal at {config.temporal.address}: {exc}", code=1)
    out.print(f"GPU worker for {binding.name} stopped.")

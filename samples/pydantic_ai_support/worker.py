"""Run this sample's workflow worker: kvflow's control plane plus Pydantic AI's plugin.

python -m samples.pydantic_ai_support.worker --fleet fleet.toml --endpoint h100/0=http://127.0.0.1:8100

`kvflow worker workflow` registers no framework plugin, so a Pydantic AI agent gets a worker
of its own, written as any user's would be: the client carries `KvflowPlugin` (the fleet's
scheduler, ledger and context store) and then `KvflowPydanticAIPlugin` (Pydantic AI's sandbox
settings, converter and the agent's tool activities).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path
from typing import Any

from rich.console import Console
from temporalio.client import Client
from temporalio.worker import Worker

from kvflow import KvflowPlugin, load_fleet
from kvflow.contrib.pydantic_ai import KvflowPydanticAIPlugin

from ..starter import run
from . import TASK_QUEUE, WORKFLOW


async def serve(
    fleet_file: Path, endpoints: dict[str, str], task_queue: str, context_dir: Path | None
) -> None:
    """Poll `task_queue` for the sample's workflow until Ctrl-C or SIGTERM."""
    fleet = load_fleet(fleet_file)
    options: dict[str, Any] = {"endpoints": endpoints}
    if context_dir is not None:
        options["context_dir"] = context_dir
    # KvflowPlugin first: it sets kvflow's data converter, which the next plugin extends.
    plugins = [KvflowPlugin(fleet, **options), KvflowPydanticAIPlugin()]
    client = await Client.connect(**fleet.temporal.connect_config(), plugins=plugins)
    worker = Worker(client, task_queue=task_queue, workflows=[WORKFLOW])
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, lambda: asyncio.ensure_future(worker.shutdown()))
    Console().print(f"workflow worker on {task_queue}: {WORKFLOW.__name__}", highlight=False)
    await worker.run()


def main() -> None:
    """Parse the command line and serve."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleet", type=Path, default=Path("fleet.toml"), help="fleet file")
    parser.add_argument(
        "--endpoint",
        action="append",
        default=[],
        help="REPLICA=URL for a simulated pool's replica (repeatable)",
    )
    parser.add_argument("--task-queue", default=TASK_QUEUE)
    parser.add_argument(
        "--context-dir", type=Path, default=None, help="the context store shared with GPU workers"
    )
    args = parser.parse_args()
    endpoints = dict(item.partition("=")[::2] for item in args.endpoint)
    address = load_fleet(args.fleet).temporal.effective_address()
    run(serve(args.fleet, endpoints, args.task_queue, args.context_dir), address)


if __name__ == "__main__":
    main()

"""What every sample's starter shares: its command line, the client, and a clean exit.

Each sample's `starter.py` keeps only what is its own: the task it starts and what it prints.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console
from temporalio.client import Client

from kvflow import DEFAULT_WORKFLOW_QUEUE, KvflowPlugin


def arguments(description: str, *, tenant: str, seed_help: str) -> argparse.ArgumentParser:
    """The options every starter takes: --address, --task-queue, --tenant, --seed, --context-dir."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--address", default="127.0.0.1:7233", help="Temporal HOST:PORT")
    parser.add_argument("--task-queue", default=DEFAULT_WORKFLOW_QUEUE)
    parser.add_argument("--tenant", default=tenant)
    parser.add_argument("--seed", type=int, default=0, help=seed_help)
    parser.add_argument(
        "--context-dir",
        type=Path,
        default=None,
        help="the workers' context store, where payloads over 2 KB are kept (default: "
        "KvflowPlugin's, .kvflow/context)",
    )
    return parser


async def connect(address: str, context_dir: Path | None = None) -> Client:
    """A client through `KvflowPlugin`: the data converter and tracing kvflow's workers use.

    Pydantic models; payloads over 2 KB are kept in the context store at `context_dir` (default
    `.kvflow/context`), which must be the workers' own.
    """
    return await Client.connect(address, plugins=[KvflowPlugin(context_dir=context_dir)])


def run(start: Coroutine[Any, Any, None], address: str) -> NoReturn:
    """Run `start` and exit: 0, or 1 with a message when no Temporal server answers.

    The process ends with `os._exit` after flushing: the Temporal SDK's native runtime can
    crash while Python finalizes.
    """
    code = 0
    try:
        asyncio.run(start)
    except RuntimeError as exc:  # Client.connect found no Temporal server there
        Console(stderr=True).print(f"[red]cannot reach Temporal at {address}[/]: {exc}")
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

"""Start one research task on a running kvflow stack and print its answer and spend.

python -m samples.research_assistant.starter --address 127.0.0.1:7233 --tenant acme
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import uuid

from rich.console import Console
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from samples.research_assistant import ResearchAssistant, example_input
from scheduler.fleet import format_usd
from workers.workflow_worker import DEFAULT_WORKFLOW_QUEUE
from workflows.agent import SPEND_QUERY, SpendBreakdown


async def start(address: str, task_queue: str, tenant: str, seed: int) -> None:
    """Run one task to its end and print what it found and what it cost."""
    client = await Client.connect(address, data_converter=pydantic_data_converter)
    task = example_input(random.Random(seed), tenant)
    console = Console()
    console.print(f"[bold]{task.question}[/] ({len(task.source):,} bytes of source)")
    handle = await client.start_workflow(
        ResearchAssistant.run, task, id=f"research-{uuid.uuid4()}", task_queue=task_queue
    )
    answer = await handle.result()
    spend = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
    for question, finding in zip(answer.sub_questions, answer.findings, strict=True):
        console.print(f"[cyan]{question}[/]\n  {finding}")
    console.print(f"[bold]Answer[/] after {answer.critique_rounds} critique round(s):")
    console.print(answer.answer)
    console.print(f"{len(spend.steps)} steps, ${format_usd(spend.spend_micros)}, id {handle.id}")


def main() -> int:
    """Parse the command line and start one task."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--address", default="127.0.0.1:7233", help="Temporal HOST:PORT")
    parser.add_argument("--task-queue", default=DEFAULT_WORKFLOW_QUEUE)
    parser.add_argument("--tenant", default="acme")
    parser.add_argument("--seed", type=int, default=0, help="picks the example question")
    args = parser.parse_args()
    try:
        asyncio.run(start(args.address, args.task_queue, args.tenant, args.seed))
    except RuntimeError as exc:  # Client.connect found no Temporal server there
        Console(stderr=True).print(f"[red]cannot reach Temporal at {args.address}[/]: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    # The Temporal SDK's native runtime can crash while Python finalizes; skip finalization.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

"""Start one support ticket on a running kvflow stack and print what happened to it.

    python -m samples.support_triage.starter --address 127.0.0.1:7233 --tenant globex

The tools run on the workflow worker, in its process: their store is that process's, so the
starter prints what the workflow returned, not the store.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import uuid

from rich.console import Console
from temporalio.client import Client, WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter

from samples.support_triage import SupportTriage, example_input
from scheduler.fleet import format_usd
from workers.workflow_worker import DEFAULT_WORKFLOW_QUEUE
from workflows.agent import SPEND_QUERY, SpendBreakdown


async def start(address: str, task_queue: str, tenant: str, seed: int) -> None:
    """Run one ticket to its end and print the triage, the refund and the reply."""
    client = await Client.connect(address, data_converter=pydantic_data_converter)
    task = example_input(random.Random(seed), tenant)
    console = Console()
    console.print(f"[bold]{task.ticket.subject}[/] from {task.ticket.account_id}")
    handle = await client.start_workflow(
        SupportTriage.run, task, id=f"support-{uuid.uuid4()}", task_queue=task_queue
    )
    try:
        result = await handle.result()
        console.print(f"{result.triage.category}, urgency {result.triage.urgency}")
        if result.refund is not None:
            console.print(f"refunded {result.refund.request.amount_cents} cents")
        console.print(f"reply ({result.delivery}):\n{result.reply}")
    except WorkflowFailureError as failure:
        console.print(f"[red]failed[/]: {failure.cause}")
    spend = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
    for step in spend.steps:
        console.print(f"  {step.index}. {step.kind} {step.name}: {step.outcome}")
    console.print(f"{spend.outcome}, ${format_usd(spend.spend_micros)}, id {handle.id}")


def main() -> int:
    """Parse the command line and start one ticket."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--address", default="127.0.0.1:7233", help="Temporal HOST:PORT")
    parser.add_argument("--task-queue", default=DEFAULT_WORKFLOW_QUEUE)
    parser.add_argument("--tenant", default="globex")
    parser.add_argument("--seed", type=int, default=0, help="picks the example ticket")
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

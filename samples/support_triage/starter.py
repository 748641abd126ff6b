"""Start one support ticket on a running kvflow stack and print what happened to it.

    python -m samples.support_triage.starter --address 127.0.0.1:7233 --tenant globex

The tools run on the workflow worker, in its process: their store is that process's, so the
starter prints what the workflow returned, not the store.
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path

from rich.console import Console
from temporalio.client import WorkflowFailureError

from kvflow import SPEND_QUERY, SpendBreakdown, format_usd

from ..starter import arguments, connect, run
from . import SupportTriage, example_input


async def start(
    address: str, task_queue: str, tenant: str, seed: int, context_dir: Path | None
) -> None:
    """Run one ticket to its end and print the triage, the refund and the reply."""
    client = await connect(address, context_dir)
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


if __name__ == "__main__":
    parser = arguments(
        __doc__.splitlines()[0], tenant="globex", seed_help="picks the example ticket"
    )
    args = parser.parse_args()
    run(
        start(args.address, args.task_queue, args.tenant, args.seed, args.context_dir),
        args.address,
    )

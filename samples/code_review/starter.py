"""Start one code review on a running kvflow stack and print which model reviewed each file.

python -m samples.code_review.starter --address 127.0.0.1:7233 --tenant initech
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

from samples.code_review import CodeReview, example_input
from scheduler.fleet import format_usd
from workers.workflow_worker import DEFAULT_WORKFLOW_QUEUE
from workflows.agent import SPEND_QUERY, SpendBreakdown


async def start(
    address: str, task_queue: str, tenant: str, seed: int, budget: float | None
) -> None:
    """Run one review to its end and print it, with the model and replica of each step."""
    client = await Client.connect(address, data_converter=pydantic_data_converter)
    task = example_input(random.Random(seed), tenant)
    if budget is not None:
        task.spec.latency_budget_s = budget
    console = Console()
    budget = task.spec.latency_budget_s
    console.print(f"[bold]{task.repository}[/]: {len(task.files)} files, {budget:g} s budget")
    handle = await client.start_workflow(
        CodeReview.run, task, id=f"review-{uuid.uuid4()}", task_queue=task_queue
    )
    try:
        report = await handle.result()
        for review in report.files:
            console.print(f"[cyan]{review.file}[/] ({review.model} on {review.replica})")
            console.print(f"  {review.comments}")
        console.print(f"[bold]Summary[/] ({report.summary_model}): {report.summary}")
    except WorkflowFailureError as failure:
        # E.g. DeadlineExceeded: no replica could finish a step in its share of the budget.
        console.print(f"[red]failed[/]: {failure.cause}")
    spend = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
    console.print(f"${format_usd(spend.spend_micros)}, {spend.retries} re-placements, {handle.id}")


def main() -> int:
    """Parse the command line and start one review."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--address", default="127.0.0.1:7233", help="Temporal HOST:PORT")
    parser.add_argument("--task-queue", default=DEFAULT_WORKFLOW_QUEUE)
    parser.add_argument("--tenant", default="initech")
    parser.add_argument("--seed", type=int, default=0, help="picks the example diff")
    parser.add_argument(
        "--budget", type=float, help="the latency budget in seconds (default: 2.5 s per step)"
    )
    args = parser.parse_args()
    try:
        asyncio.run(start(args.address, args.task_queue, args.tenant, args.seed, args.budget))
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

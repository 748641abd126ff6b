"""Start one code review on a running kvflow stack and print which model reviewed each file.

python -m samples.code_review.starter --address 127.0.0.1:7233 --tenant initech
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path

from rich.console import Console
from temporalio.client import WorkflowFailureError

from kvflow import SPEND_QUERY, SpendBreakdown, format_usd

from ..starter import arguments, connect, run
from . import CodeReview, example_input


async def start(
    address: str,
    task_queue: str,
    tenant: str,
    seed: int,
    budget: float | None,
    context_dir: Path | None,
) -> None:
    """Run one review to its end and print it, with the model and replica of each step."""
    client = await connect(address, context_dir)
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


if __name__ == "__main__":
    parser = arguments(
        __doc__.splitlines()[0], tenant="initech", seed_help="picks the example diff"
    )
    parser.add_argument(
        "--budget", type=float, help="the latency budget in seconds (default: 2.5 s per step)"
    )
    args = parser.parse_args()
    run(
        start(args.address, args.task_queue, args.tenant, args.seed, args.budget, args.context_dir),
        args.address,
    )

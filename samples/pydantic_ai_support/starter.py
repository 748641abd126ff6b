"""Ask the Pydantic AI support agent one question on a running stack; print its answer and spend.

python -m samples.pydantic_ai_support.starter --address 127.0.0.1:7233 --tenant acme
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path

from rich.console import Console

from kvflow import SPEND_QUERY, SpendBreakdown, format_usd

from ..starter import arguments, connect, run
from . import TASK_QUEUE, PydanticAISupport, example_input


async def start(
    address: str, task_queue: str, tenant: str, seed: int, context_dir: Path | None
) -> None:
    """Run one question to its answer and print it, where each call ran and what it cost."""
    client = await connect(address, context_dir)
    task = example_input(random.Random(seed), tenant)
    console = Console()
    console.print(f"[bold]{task.question}[/]")
    handle = await client.start_workflow(
        PydanticAISupport.run, task, id=f"pydantic-ai-support-{uuid.uuid4()}", task_queue=task_queue
    )
    answer = await handle.result()
    spend = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
    console.print(f"{answer.reply.reply} [dim](escalate: {answer.reply.escalate})[/]")
    for step in spend.steps:
        where = " → ".join(a.replica for a in step.attempts)
        console.print(f"  {step.index}. {step.name} on {where}: ${format_usd(step.cost_micros)}")
    console.print(
        f"{answer.model_requests} model calls, {answer.tool_calls} tool call(s), "
        f"${format_usd(spend.spend_micros)}, id {handle.id}"
    )


if __name__ == "__main__":
    parser = arguments(__doc__.splitlines()[0], tenant="acme", seed_help="picks the question")
    parser.set_defaults(task_queue=TASK_QUEUE)
    args = parser.parse_args()
    run(
        start(args.address, args.task_queue, args.tenant, args.seed, args.context_dir),
        args.address,
    )

"""Start one research task on a running kvflow stack and print its answer and spend.

python -m samples.research_assistant.starter --address 127.0.0.1:7233 --tenant acme
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path

from rich.console import Console

from kvflow import SPEND_QUERY, SpendBreakdown, format_usd

from ..starter import arguments, connect, run
from . import ResearchAssistant, example_input


async def start(
    address: str, task_queue: str, tenant: str, seed: int, context_dir: Path | None
) -> None:
    """Run one task to its end and print what it found and what it cost."""
    client = await connect(address, context_dir)
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


if __name__ == "__main__":
    parser = arguments(
        __doc__.splitlines()[0], tenant="acme", seed_help="picks the example question"
    )
    args = parser.parse_args()
    run(
        start(args.address, args.task_queue, args.tenant, args.seed, args.context_dir),
        args.address,
    )

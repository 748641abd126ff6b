"""Run the travel agent's workflow worker in this process and plan one trip through it.

python -m samples.openai_agents_travel.starter --fleet fleet.toml --endpoint h100/0=URL

It needs Temporal and a GPU worker per replica it may use (see the README's "Your own agent"):
the workflow worker here, with kvflow's control plane and `KvflowAgentsPlugin`, places the
agent's model calls on them.
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path

from rich.console import Console
from temporalio.client import Client
from temporalio.worker import Worker

from kvflow import SPEND_QUERY, KvflowPlugin, SpendBreakdown, format_usd, load_fleet
from kvflow.contrib.openai_agents import KvflowAgentsPlugin

from ..starter import arguments, run
from . import ACTIVITIES, TASK_QUEUE, WORKFLOW, example_input


async def start(
    address: str,
    task_queue: str,
    tenant: str,
    seed: int,
    context_dir: Path | None,
    fleet_file: Path,
    endpoints: dict[str, str],
) -> None:
    """Serve the workflow while one trip is planned, then print the answers and the cost."""
    fleet = load_fleet(fleet_file)
    client = await Client.connect(
        address,
        namespace=fleet.temporal.namespace,
        # KvflowPlugin first: KvflowAgentsPlugin keeps its claim-check codec.
        plugins=[
            KvflowPlugin(fleet, endpoints=endpoints, context_dir=context_dir),
            KvflowAgentsPlugin(),
        ],
    )
    task = example_input(random.Random(seed), tenant)
    console = Console()
    console.print(f"[bold]{task.origin} → {task.destination} on {task.day}[/]")
    async with Worker(client, task_queue=task_queue, workflows=[WORKFLOW], activities=ACTIVITIES):
        handle = await client.start_workflow(
            WORKFLOW.run, task, id=f"travel-{uuid.uuid4()}", task_queue=task_queue
        )
        plan = await handle.result()
        spend = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
    console.print(f"[cyan]Weather[/]: {plan.weather}")
    console.print(f"[cyan]Flights[/]: {plan.answer}")
    console.print(f"tools called: {', '.join(plan.tools_called)}")
    for step in spend.steps:
        where = ", ".join(f"{a.replica} {a.outcome}" for a in step.attempts)
        console.print(f"  {step.index}. {step.name}: {where}, ${format_usd(step.cost_micros)}")
    console.print(
        f"{plan.model_calls} model calls, ${format_usd(spend.spend_micros)}, id {handle.id}",
        highlight=False,
    )


def _endpoints(items: list[str]) -> dict[str, str]:
    pairs = dict(item.partition("=")[::2] for item in items)
    bad = [item for item in items if "=" not in item]
    if bad:
        raise SystemExit(f"--endpoint {bad[0]!r}: write REPLICA=URL, e.g. h100/0=http://...")
    return pairs


if __name__ == "__main__":
    parser = arguments(__doc__.splitlines()[0], tenant="acme", seed_help="picks the example trip")
    parser.set_defaults(task_queue=TASK_QUEUE)
    parser.add_argument("--fleet", type=Path, default=Path("fleet.toml"), help="fleet file")
    parser.add_argument(
        "--endpoint",
        action="append",
        default=[],
        help="REPLICA=URL for a simulated pool's replica (repeatable)",
    )
    args = parser.parse_args()
    run(
        start(
            args.address,
            args.task_queue,
            args.tenant,
            args.seed,
            args.context_dir,
            args.fleet,
            _endpoints(args.endpoint),
        ),
        args.address,
    )

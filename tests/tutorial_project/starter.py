"""Starts one task and prints its answer."""

import asyncio
import uuid

from temporalio.client import Client
from workflows import AnswerQuestion, Question

from kvflow import KvflowPlugin, TaskSpec, load_fleet


async def main() -> None:
    fleet = load_fleet("fleet.toml")
    client = await Client.connect(**fleet.temporal.connect_config(), plugins=[KvflowPlugin()])
    answer = await client.execute_workflow(
        AnswerQuestion.run,
        Question(spec=TaskSpec(tenant="acme", latency_budget_s=60), text="What is a KV cache?"),
        id=f"question-{uuid.uuid4()}",
        task_queue="agents",
    )
    print(f"answer: {answer.words} words", flush=True)


if __name__ == "__main__":
    asyncio.run(main())

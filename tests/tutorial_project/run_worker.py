"""Runs this project's workflows on kvflow's control plane."""

import asyncio

from activities import count_words
from temporalio.client import Client
from temporalio.worker import Worker
from workflows import AnswerQuestion

from kvflow import KvflowPlugin, load_fleet


async def main() -> None:
    fleet = load_fleet("fleet.toml")
    plugin = KvflowPlugin(fleet, ledger="sqlite:///ledger.db")
    client = await Client.connect(**fleet.temporal.connect_config(), plugins=[plugin])
    worker = Worker(
        client, task_queue="agents", workflows=[AnswerQuestion], activities=[count_words]
    )
    print("worker started", flush=True)
    await worker.run()


if __name__ == "__main__":
    asyncio.run(main())

"""Temporal's task-queue priority, as the embedded server is configured: 1 before 3 before 5.

The scheduler relies on this: under saturation, a tier-1 tenant's model calls leave a GPU
replica's backlog before tier-5 calls do.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.common import Priority
from temporalio.worker import Worker

ran: list[int] = []


@activity.defn
async def record_priority(priority_key: int) -> None:
    ran.append(priority_key)


@workflow.defn
class PrioritizedCall:
    @workflow.run
    async def run(self, priority_key: int, activity_queue: str) -> None:
        await workflow.execute_activity(
            record_priority,
            priority_key,
            task_queue=activity_queue,
            start_to_close_timeout=timedelta(seconds=10),
            priority=Priority(priority_key=priority_key),
        )


async def _all_activities_scheduled(client: Client, workflow_ids: list[str]) -> None:
    for _ in range(200):
        pending = 0
        for workflow_id in workflow_ids:
            description = await client.get_workflow_handle(workflow_id).describe()
            pending += len(description.raw_description.pending_activities)
        if pending == len(workflow_ids):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("activities were not all scheduled")


async def test_backlog_runs_priority_1_before_3_before_5(temporal_client: Client):
    ran.clear()
    workflow_queue = f"wf-{uuid.uuid4()}"
    activity_queue = f"gpu-{uuid.uuid4()}"
    # Interleaved, so arrival order differs from priority order.
    priorities = [5, 3, 1] * 4
    async with Worker(temporal_client, task_queue=workflow_queue, workflows=[PrioritizedCall]):
        handles = [
            await temporal_client.start_workflow(
                PrioritizedCall.run,
                args=[p, activity_queue],
                id=f"prio-{p}-{i}-{uuid.uuid4()}",
                task_queue=workflow_queue,
            )
            for i, p in enumerate(priorities)
        ]
        await _all_activities_scheduled(temporal_client, [h.id for h in handles])
        # One slot: the worker takes one activity at a time from the backlog.
        async with Worker(
            temporal_client,
            task_queue=activity_queue,
            activities=[record_priority],
            max_concurrent_activities=1,
        ):
            await asyncio.gather(*(h.result() for h in handles))
    assert ran == sorted(priorities), f"activities ran in priority order {ran}"

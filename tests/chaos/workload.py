"""The tasks a fault scenario runs: seeded multi-step agent tasks in a few prefix groups.

Each task is a `MultiStepAgent` (tests/agent_workflows.py) conversation of `steps` model calls
whose system message is its group's document, so the tasks of one group share a prompt prefix
and the schedulers should send them to one replica. The same seed gives the same tasks.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError

from kvflow.workflows.agent import TaskSpec
from tests import agent_workflows as wf
from tests.chaos.cluster import MODEL, SCAN_PROBE, TENANT
from tests.chaos.traces import TaskTrace, trace

START_RETRY_S = 60.0
"""How long starting one task may retry while the Temporal server is unreachable."""
PROBE_MEMO = "scan_probe"
"""The memo field every task carries `SCAN_PROBE` in, for the secret scan of its history."""

_WORDS = [
    "replica",
    "prefix",
    "cache",
    "tenant",
    "budget",
    "latency",
    "decode",
    "prefill",
    "token",
    "stream",
    "worker",
    "ledger",
    "attempt",
    "placement",
    "queue",
    "fairness",
    "priority",
    "circuit",
    "breaker",
    "probe",
    "heartbeat",
    "history",
]


def group_document(seed: int, group: int, words: int = 160) -> str:
    """A system message of about `words` words, the same for the same seed and group."""
    rng = random.Random(f"{seed}-{group}")
    return f"Group {group} brief. " + " ".join(rng.choice(_WORDS) for _ in range(words))


@dataclass
class Workload:
    """`tasks` tasks of `steps` calls each over `groups` prefix groups."""

    client: Client
    task_queue: str
    run_id: str
    """Prefix of the workflow ids, unique per scenario run."""
    seed: int = 0
    tasks: int = 60
    groups: int = 6
    steps: int = 3
    max_tokens: int = 48
    retry_budget: int = 3
    handles: list[WorkflowHandle[Any, Any]] = field(default_factory=list)
    group_of: dict[str, int] = field(default_factory=dict)
    """Workflow id → its prefix group."""

    def task(self, n: int) -> wf.StepsInput:
        """The n-th task's input."""
        return wf.StepsInput(
            spec=TaskSpec(tenant=TENANT, expected_steps=self.steps, retry_budget=self.retry_budget),
            model=MODEL,
            steps=self.steps,
            max_tokens=self.max_tokens,
            context=group_document(self.seed, n % self.groups),
        )

    async def start(self, count: int | None = None, rate_per_s: float = 10.0) -> None:
        """Start the next `count` tasks (default: all), `rate_per_s` a second."""
        first = len(self.handles)
        last = self.tasks if count is None else min(self.tasks, first + count)
        for n in range(first, last):
            workflow_id = f"{self.run_id}-{n:03d}"
            handle = await self._start_one(n, workflow_id)
            self.handles.append(handle)
            self.group_of[workflow_id] = n % self.groups
            await asyncio.sleep(1.0 / rate_per_s)

    async def _start_one(self, n: int, workflow_id: str) -> WorkflowHandle[Any, Any]:
        """Start one task, riding out a Temporal outage as a client with retries would."""
        deadline = time.monotonic() + START_RETRY_S
        while True:
            try:
                return await self.client.start_workflow(
                    wf.MultiStepAgent.run,
                    self.task(n),
                    id=workflow_id,
                    task_queue=self.task_queue,
                    memo={PROBE_MEMO: SCAN_PROBE},
                )
            except WorkflowAlreadyStartedError:
                # An earlier try reached the server before the answer was lost: it runs.
                return self.client.get_workflow_handle(workflow_id)
            except RPCError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)

    async def wait(self, timeout_s: float) -> dict[str, WorkflowExecutionStatus | None]:
        """Wait, bounded, until every started task closed; each one's final status."""
        deadline = time.monotonic() + timeout_s
        for handle in self.handles:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                await asyncio.wait_for(handle.result(), remaining)
            except TimeoutError:
                break
            except Exception:
                pass  # a failed task is a finding, reported by its status
        return {h.id: (await h.describe()).status for h in self.handles}

    async def traces(self) -> dict[str, TaskTrace]:
        """Every task's history, read into a trace."""
        return {h.id: await trace(self.client, h) for h in self.handles}


def completed(statuses: dict[str, WorkflowExecutionStatus | None]) -> int:
    """How many tasks completed."""
    return sum(s == WorkflowExecutionStatus.COMPLETED for s in statuses.values())


def not_completed(statuses: dict[str, WorkflowExecutionStatus | None]) -> dict[str, str]:
    """Workflow id → status name, for the tasks that did not complete."""
    return {
        wid: (s.name if s else "UNKNOWN")
        for wid, s in statuses.items()
        if s != WorkflowExecutionStatus.COMPLETED
    }

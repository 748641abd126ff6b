"""A GPU worker that billed an attempt reports that bill, whatever fails after it.

The workflow bills a failed attempt from its error's details (`AttemptProgress`), the GPU
worker from the same figures into its ledger row. A context store that cannot take a write
(here a real `DirectoryContextStore` on a disk with no space left) must not break that: the
attempt fails with a typed, retryable error that carries its bill, the workflow places the
call again, and the workflow's spend equals the ledger's rows.

A real Temporal dev server, simulated replicas, real GPU workers and a PostgreSQL ledger.
"""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle

from kvflow.activities.context_store import DirectoryContextStore
from kvflow.activities.inference import ReplicaBinding
from kvflow.activities.wire import INLINE_LIMIT_BYTES, ContextRef
from kvflow.ledger.records import AttemptOutcome
from kvflow.simulator.faults import FaultSpec
from kvflow.workers.gpu_worker import GpuWorker
from kvflow.workflows.agent import SPEND_QUERY, SpendBreakdown
from tests import agent_workflows as wf
from tests.fixtures_ledger import with_schema
from tests.ledger_books import assert_books_balance
from tests.stacks import MODEL, PoolPlan, Stack, fleet_stack, task_spec

FULL = "full/0"
"""The replica whose GPU worker's disk is full: the cheapest, so the scheduler's first choice."""


class FullDisk(DirectoryContextStore):
    """The stack's context store, seen from a machine whose disk has no space left.

    Reads work; storing any new text fails as the file system fails it, with `ENOSPC`.
    """

    def put(self, text: str, tenant: str | None = None) -> ContextRef:
        """Refuse the write, as a full disk does."""
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.root))


@pytest.fixture
def postgres_ledger_url(postgres_server_url: str, postgres_schema_prefix: str) -> str:
    """An empty PostgreSQL ledger: a schema of its own on the test server."""
    return with_schema(postgres_server_url, f"{postgres_schema_prefix}_{uuid.uuid4().hex[:8]}")


@asynccontextmanager
async def full_disk_stack(
    client: Client, tmp_path: Path, ledger_url: str, full: FaultSpec
) -> AsyncIterator[Stack]:
    """A cheap replica (`full/0`, faults `full`) whose GPU worker's disk is full, and a dearer
    healthy backup; every other part of the stack is the real one."""
    pools = [
        PoolPlan(
            "full", gpu="H200", prices=("0.05", "0.005", "0.15"), faults=full, gpu_worker=False
        ),
        PoolPlan("backup", gpu="H100", prices=("0.40", "0.04", "1.20")),
    ]
    async with fleet_stack(client, tmp_path, pools, ledger_url=ledger_url) as s:
        binding = ReplicaBinding(
            pool=s.fleet.pool("full"), index=0, base_url=s.embedded.sims[FULL].base_url
        )
        # The stack's GPU worker for the replica, but on a full disk.
        gpu_worker = GpuWorker(
            client,
            binding,
            ledger=s.ledger,
            store=FullDisk(s.context_dir),
            spool_dir=tmp_path / "spool-full",
            graceful_shutdown_s=1.0,
            heartbeat_interval_s=0.2,
        )
        async with gpu_worker:
            yield s


async def _failure_messages(handle: WorkflowHandle[Any, Any]) -> list[tuple[str, str]]:
    """The (type, message) of every failed activity in the task's history."""
    history = await handle.fetch_history()
    return [
        (
            e.activity_task_failed_event_attributes.failure.application_failure_info.type,
            e.activity_task_failed_event_attributes.failure.message,
        )
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED
    ]


async def _check_billed_and_placed_again(
    s: Stack, handle: WorkflowHandle[Any, Any], error_type: str
) -> None:
    """The task ended on the backup; the full disk's attempt is billed alike by both books."""
    out = await handle.result()
    assert out.replicas == ["backup/0"]
    breakdown = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
    [step] = breakdown.steps
    first, second = step.attempts
    assert (first.replica, first.outcome) == (FULL, error_type)
    assert (second.replica, second.outcome) == ("backup/0", "ok")
    assert breakdown.retries == 1
    run_id = (await handle.describe()).run_id or ""
    rows = {row.replica: row for row in await s.ledger.attempts_for(handle.id, run_id)}
    full = rows[FULL]
    assert full.outcome == AttemptOutcome.FAILED and full.error_type == error_type
    # The workflow bills the attempt exactly as its row does: tokens and micro-dollars.
    assert full.cost_micros > 0
    assert first.cost_micros == full.cost_micros
    assert (first.prompt_tokens, first.completion_tokens) == (
        full.prompt_tokens,
        full.completion_tokens,
    )
    task = await assert_books_balance(s, handle)
    assert task.spend_micros == breakdown.spend_micros == sum(r.cost_micros for r in rows.values())


@pytest.mark.postgres
@pytest.mark.timeout(180)
async def test_answer_a_full_disk_cannot_store_is_placed_again_and_billed_as_its_row(
    temporal_client: Client, tmp_path: Path, postgres_ledger_url: str
) -> None:
    async with full_disk_stack(temporal_client, tmp_path, postgres_ledger_url, FaultSpec()) as s:
        # An answer of about 6 KB: over the inline limit, so the GPU worker must store it.
        task = wf.StepsInput(
            spec=task_spec(expected_steps=1), model=MODEL, steps=1, max_tokens=1200
        )
        handle = await s.start(wf.MultiStepAgent.run, task)
        await _check_billed_and_placed_again(s, handle, "ContextStoreFailed")
        [(error_type, message)] = await _failure_messages(handle)
    assert error_type == "ContextStoreFailed"
    assert "could not store the answer" in message and "No space left on device" in message
    assert max((await handle.result()).answer_bytes) > INLINE_LIMIT_BYTES


@pytest.mark.postgres
@pytest.mark.timeout(180)
async def test_call_cut_on_a_full_disk_keeps_its_typed_error_and_its_bill(
    temporal_client: Client, tmp_path: Path, postgres_ledger_url: str
) -> None:
    # The replica drops the connection 800 tokens in: more output than travels inline, so
    # the failure's details cannot carry it without the store; they still carry the bill.
    cut = FaultSpec(disconnect_after=800)
    async with full_disk_stack(temporal_client, tmp_path, postgres_ledger_url, cut) as s:
        task = wf.StepsInput(
            spec=task_spec(expected_steps=1), model=MODEL, steps=1, max_tokens=1200
        )
        handle = await s.start(wf.MultiStepAgent.run, task)
        await _check_billed_and_placed_again(s, handle, "StreamCut")
        breakdown = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
        [(error_type, _message)] = await _failure_messages(handle)
    assert error_type == "StreamCut"
    first, second = breakdown.steps[0].attempts
    assert first.completion_tokens == 800
    # Nothing was stored to continue from: the backup decoded the whole answer.
    assert second.reused_tokens == 0 and second.completion_tokens == 1200

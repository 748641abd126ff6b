"""(a) A GPU worker killed with SIGKILL while it streams, in a run of 60 three-step tasks.

The killed worker's calls stop heartbeating; each is billed from its last heartbeat by the
workflow and resumed on another replica. Later calls sent to the dead worker's queue time out
unstarted and are re-placed. Every task must complete, every attempt a GPU worker took must
have exactly one ledger row, and every task exactly one task row that matches it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import pytest

from kvflow.ledger.store import AsyncLedger
from tests.chaos.conftest import ClusterFactory
from tests.chaos.figures import ScenarioFigures
from tests.chaos.scenario import Outcome, assert_no_secret_leaked, finish
from tests.chaos.traces import Attempt, TaskTrace
from tests.chaos.workload import Workload

pytestmark = pytest.mark.chaos

TASKS = 60
RUN_TIMEOUT_S = 150


@dataclass
class Run:
    outcome: Outcome
    victim: str
    lost: list[tuple[str, Attempt]]
    """(workflow id, attempt) of every attempt that died with the worker."""


@pytest.fixture(scope="module")
async def run(
    chaos_cluster: ClusterFactory, chaos_ledger: AsyncLedger, request: pytest.FixtureRequest
) -> Run:
    started_at = time.monotonic()
    async with chaos_cluster() as cluster:
        assert cluster.client is not None
        work = Workload(
            cluster.client, cluster.task_queue, f"a-{uuid.uuid4().hex[:8]}", tasks=TASKS
        )
        starting = asyncio.create_task(work.start(rate_per_s=8))
        victim, streams = await cluster.kill_gpu_worker_while_streaming()
        await starting
        await work.wait(RUN_TIMEOUT_S)
        figures = ScenarioFigures(
            scenario="a. GPU worker killed mid-stream",
            faults=f"kill -9 of the GPU worker of {victim.name} while it streamed",
            faults_injected=1,
        )
        outcome = await finish(cluster, chaos_ledger, work.handles, figures, started_at=started_at)
    lost = [
        (wid, a)
        for wid, t in outcome.traces.items()
        for a in t.attempts
        if a.replica == victim.name and a.timeout == "HEARTBEAT"
    ]
    unstarted = sum(
        a.replica == victim.name and a.timeout == "SCHEDULE_TO_START"
        for t in outcome.traces.values()
        for a in t.attempts
    )
    figures.faults += f" ({streams} streams)"
    figures.notes += [
        f"{streams} streams running at the kill, {len(lost)} attempts lost with the worker "
        f"(billed from their last heartbeat: {outcome.books.estimates} estimates)",
        f"{unstarted} later calls sent to the dead worker's queue timed out unstarted "
        "and were re-placed",
    ]
    outcome.record(request.node.nodeid)
    return Run(outcome, victim.name, lost)


def _finished_elsewhere(task: TaskTrace, lost: Attempt) -> bool:
    """Whether the call of `lost` (its task's next attempt) succeeded on another replica."""
    later = [a for a in task.attempts if a.scheduled_at > lost.scheduled_at and a.started]
    return bool(later) and later[0].replica != lost.replica and later[0].outcome == "ok"


def test_every_task_completes_although_a_gpu_worker_was_killed_mid_stream(run: Run):
    assert run.lost, "the kill cut no stream: no attempt on the victim ended in a heartbeat timeout"
    assert run.outcome.not_completed == {}, run.outcome.not_completed
    assert run.outcome.figures.tasks_completed == TASKS


def test_calls_cut_by_the_kill_finish_on_another_replica(run: Run):
    stranded = [
        (wid, a.activity_id)
        for wid, a in run.lost
        if not _finished_elsewhere(run.outcome.traces[wid], a)
    ]
    assert stranded == []


def test_every_attempt_is_billed_once_and_every_task_row_matches(run: Run):
    books = run.outcome.books
    assert books.problems() == [], "\n".join(books.problems())
    assert books.billed_once == books.attempts
    assert books.task_rows == TASKS
    # A stream cut by the kill cannot be billed by its dead worker: its estimate stands. An
    # attempt whose stream had ended and whose row was written just before the kill is lost
    # to Temporal all the same (its completion was never reported), and keeps its exact row;
    # `problems()` already refuses an estimate for any attempt that is not lost.
    assert 1 <= books.estimates <= len(run.lost), (books.estimates, len(run.lost))


def test_no_secret_reaches_a_log_or_a_history(run: Run):
    assert_no_secret_leaked(run.outcome)

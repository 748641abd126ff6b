"""(c) The Temporal server stopped and started again mid-run, on its SQLite file.

While it is down, workers cannot poll, heartbeat or report results; GPU workers keep
streaming and bill what they finish. When it is back, calls whose heartbeats were missed time
out and are re-placed, and late results are dropped. Every task must complete and every
attempt a GPU worker took must have exactly one ledger row, however its result was lost.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import pytest

from kvflow.ledger.store import AsyncLedger
from kvflow.workflows.search_attributes import RETRIES
from tests.chaos.conftest import ClusterFactory
from tests.chaos.figures import ScenarioFigures
from tests.chaos.scenario import Outcome, assert_no_secret_leaked, finish
from tests.chaos.workload import Workload
from tests.waiting import eventually

pytestmark = pytest.mark.chaos

TASKS = 60
DOWN_S = 8.0
"""Longer than the heartbeat timeout (2 s): calls running across the outage lose their
heartbeats, so the restart exercises re-placement and lost results, not just reconnection."""
RUN_TIMEOUT_S = 150
STARTED_BEFORE_STOP = 15
CALLS_AT_STOP = 2
"""The server is stopped once this many calls stream on the simulators: they are cut off."""


@dataclass
class Run:
    outcome: Outcome
    timed_out: int
    """Attempts that a GPU worker took and whose result never reached the workflow."""
    replacements: int
    """Placements beyond each task's first per step: every re-placement, free or not."""
    charged: int
    """Re-placements the tasks charged to their retry budgets (`KvflowRetries`, summed)."""


@pytest.fixture(scope="module")
async def run(
    chaos_cluster: ClusterFactory, chaos_ledger: AsyncLedger, request: pytest.FixtureRequest
) -> Run:
    started_at = time.monotonic()
    async with chaos_cluster() as cluster:
        assert cluster.client is not None
        work = Workload(
            cluster.client, cluster.task_queue, f"c-{uuid.uuid4().hex[:8]}", tasks=TASKS
        )
        # Tasks keep being started through the outage, as clients keep calling.
        starting = asyncio.create_task(work.start(rate_per_s=4))
        streaming: list[int] = []

        async def under_way() -> bool:
            streaming[:] = [await cluster.running_streams(r) for r in cluster.replicas]
            return len(work.handles) >= STARTED_BEFORE_STOP and sum(streaming) >= CALLS_AT_STOP

        await eventually(
            under_way,
            within=60,
            what=f"{STARTED_BEFORE_STOP} tasks started and {CALLS_AT_STOP} calls streaming",
        )
        cluster.stop_temporal()
        in_flight = len(work.handles)
        await asyncio.sleep(DOWN_S)
        cluster.start_temporal()
        await starting
        await work.wait(RUN_TIMEOUT_S)
        figures = ScenarioFigures(
            scenario="c. Temporal server restarted",
            faults=f"Temporal dev server stopped for {DOWN_S:.0f} s mid-run, restarted on "
            "its SQLite file",
            faults_injected=1,
        )
        outcome = await finish(cluster, chaos_ledger, work.handles, figures, started_at=started_at)
        charged = 0
        for handle in work.handles:
            described = await handle.describe()
            charged += described.typed_search_attributes.get(RETRIES) or 0
    replacements = sum(len(t.attempts) - work.steps for t in outcome.traces.values())
    timed_out = sum(
        a.started and a.outcome == "timed_out" for t in outcome.traces.values() for a in t.attempts
    )
    figures.notes.append(
        f"{in_flight} tasks started before the stop ({sum(streaming)} calls streaming), the "
        f"rest during and after the outage; {timed_out} attempts lost their result to it and "
        "were re-placed"
    )
    figures.notes.append(
        f"{replacements} re-placements in all, {charged} of them charged to a retry budget"
    )
    outcome.record(request.node.nodeid)
    return Run(outcome, timed_out, replacements, charged)


def test_calls_running_when_the_server_stopped_lost_their_results(run: Run):
    # Their GPU workers could not report them; history shows them timed out and re-placed.
    assert run.timed_out >= 1


def test_re_placements_after_the_outage_spend_no_retry_budget(run: Run):
    # The outage cut those calls, not their replicas: their tasks re-place them free. Were
    # they charged, every re-placement would be.
    assert run.charged <= run.replacements - run.timed_out, (run.charged, run.replacements)


def test_every_task_completes_after_the_temporal_server_restarts(run: Run):
    assert run.outcome.not_completed == {}, run.outcome.not_completed
    assert run.outcome.figures.tasks_completed == TASKS


def test_every_attempt_is_billed_once_and_every_task_row_matches(run: Run):
    books = run.outcome.books
    assert books.problems() == [], "\n".join(books.problems())
    assert books.billed_once == books.attempts
    assert books.task_rows == TASKS


def test_no_secret_reaches_a_log_or_a_history(run: Run):
    assert_no_secret_leaked(run.outcome)

"""(b) Workflow workers killed with SIGKILL mid-run: one of three, then all three in turn.

Each workflow worker runs its own scheduler, with its own prefix index, and a killed one comes
back with an empty one. Every task must still complete, and the schedulers must agree without
sharing state: every call of one prefix group goes to the same replica, whichever worker (or
restarted worker) placed it. Bad task inputs arrive meanwhile and must fail at once with
`InvalidTask`, before any model call.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import pytest
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError

from kvflow.ledger.store import AsyncLedger
from kvflow.workflows import errors
from kvflow.workflows.agent import TaskSpec
from tests import agent_workflows as wf
from tests.chaos.cluster import MODEL, TENANT
from tests.chaos.conftest import ClusterFactory
from tests.chaos.figures import ScenarioFigures
from tests.chaos.scenario import Outcome, assert_no_secret_leaked, finish
from tests.chaos.workload import Workload
from tests.test_task_input import BAD_CALLS, HELLO

pytestmark = pytest.mark.chaos

TASKS = 60
RUN_TIMEOUT_S = 150
DOWN_S = 4.0
"""How long a killed workflow worker stays down before it is started again."""


@dataclass
class Run:
    outcome: Outcome
    bad: list[WorkflowHandle[Any, Any]]
    refused: int
    """Bad inputs that failed with InvalidTask."""
    replicas: dict[int, set[str]]
    """Prefix group → the replicas its calls were placed on."""
    deciders: dict[int, set[str]]
    """Prefix group → the workflow-worker processes whose schedulers placed its calls."""


async def _start_bad_inputs(client: Any, task_queue: str, run_id: str) -> list[Any]:
    """One task per bad call of tests/test_task_input.py, on this cluster's fleet."""
    return [
        await client.start_workflow(
            wf.OneCall.run,
            wf.CallInput(
                **{"spec": TaskSpec(tenant=TENANT), "model": MODEL, "messages": HELLO, **fields}
            ),
            id=f"{run_id}-bad-{n}",
            task_queue=task_queue,
        )
        for n, (fields, _) in enumerate(BAD_CALLS.values())
    ]


async def _invalid_task(handle: WorkflowHandle[Any, Any]) -> bool:
    try:
        await asyncio.wait_for(handle.result(), 60)
    except WorkflowFailureError as failed:
        cause = failed.cause
        return (
            isinstance(cause, ApplicationError) and cause.type == errors.TaskErrorType.INVALID_TASK
        )
    return False


@pytest.fixture(scope="module")
async def run(
    chaos_cluster: ClusterFactory, chaos_ledger: AsyncLedger, request: pytest.FixtureRequest
) -> Run:
    started_at = time.monotonic()
    async with chaos_cluster() as cluster:
        assert cluster.client is not None
        run_id = f"b-{uuid.uuid4().hex[:8]}"
        work = Workload(cluster.client, cluster.task_queue, run_id, tasks=TASKS, groups=6)
        # Slow enough that tasks are running through every kill below (about 40 s).
        starting = asyncio.create_task(work.start(rate_per_s=1.5))
        bad = await _start_bad_inputs(cluster.client, cluster.task_queue, run_id)
        kills = 0
        workers = cluster.workflow_workers
        # One of three, then each in turn: 0, 1, 2, 0 again, each restarted after DOWN_S.
        for worker in [workers[0], workers[1], workers[2], workers[0]]:
            await asyncio.sleep(3.0)
            worker.kill()
            kills += 1
            await asyncio.sleep(DOWN_S)
            await cluster.restart(worker)
        await starting
        await work.wait(RUN_TIMEOUT_S)
        refused = sum([await _invalid_task(h) for h in bad])
        figures = ScenarioFigures(
            scenario="b. workflow workers killed",
            faults=f"kill -9 of a workflow worker {kills} times (each of 3, restarted)",
            faults_injected=kills,
        )
        outcome = await finish(
            cluster, chaos_ledger, work.handles, figures, started_at=started_at, bad_inputs=bad
        )
    replicas: dict[int, set[str]] = defaultdict(set)
    deciders: dict[int, set[str]] = defaultdict(set)
    for handle in work.handles:
        group = work.group_of[handle.id]
        for placed in outcome.traces[handle.id].placements:
            replicas[group].add(placed.replica)
            deciders[group].add(placed.worker)
    kept = sum(len(r) == 1 for r in replicas.values())
    figures.notes += [
        f"{refused} of {len(bad)} bad inputs failed at once with InvalidTask",
        f"{kept} of {len(replicas)} prefix groups kept one replica, each placed by "
        f"{min(map(len, deciders.values()))}-{max(map(len, deciders.values()))} "
        "scheduler processes",
    ]
    outcome.record(request.node.nodeid)
    return Run(outcome, bad, refused, replicas, deciders)


def test_every_task_completes_while_workflow_workers_are_killed_in_turn(run: Run):
    assert run.outcome.not_completed == {}, run.outcome.not_completed
    assert run.outcome.figures.tasks_completed == TASKS


def test_every_attempt_is_billed_once_and_every_task_row_matches(run: Run):
    books = run.outcome.books
    assert books.problems() == [], "\n".join(books.problems())
    assert books.billed_once == books.attempts
    assert books.task_rows == TASKS + len(run.bad)


def test_bad_inputs_fail_at_once_with_invalid_task_and_reach_no_gpu_worker(run: Run):
    assert run.refused == len(run.bad) == len(BAD_CALLS)
    for handle in run.bad:
        assert run.outcome.statuses[handle.id] == WorkflowExecutionStatus.FAILED
        assert run.outcome.traces[handle.id].attempts == []


def test_the_same_prefix_goes_to_the_same_replica_whichever_worker_places_it(run: Run):
    # Each group was placed by several scheduler processes (killed and restarted ones).
    assert all(len(d) >= 2 for d in run.deciders.values()), run.deciders
    scattered = {g: sorted(r) for g, r in run.replicas.items() if len(r) > 1}
    assert scattered == {}, f"prefix groups placed on several replicas: {scattered}"


def test_no_secret_reaches_a_log_or_a_history(run: Run):
    assert_no_secret_leaked(run.outcome)

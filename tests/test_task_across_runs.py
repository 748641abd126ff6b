"""A task's identity, books and caps across its workflow's runs.

A task that continues as new is one task over several runs: its runs form one chain in the
ledger, it stays open in the scheduler, and its caps (spend, retries, deadline) are the
task's. A cron run or a workflow retry, which Temporal gives the same `first_execution_run_id`
and a `continued_run_id` too, is a task of its own. Calls outside `async with agent:` have no
task, and are refused.

Real Temporal dev server, simulated replicas, real GPU workers and a SQLite ledger
(`tests.stacks.fleet_stack`); the ledger-only tests run on SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError

from kvflow.activities.control_plane import ControlPlaneActivities
from kvflow.ledger.errors import LedgerSchemaError
from kvflow.ledger.records import TaskOutcome
from kvflow.ledger.report import ReportQuery
from kvflow.ledger.store import Ledger
from kvflow.simulator.faults import FaultDice, FaultSpec
from kvflow.workers.reconcile import reconcile
from kvflow.workflows import errors
from kvflow.workflows.agent import TaskSpec
from tests import agent_workflows as wf
from tests.fixtures_ledger import T0, attempt_record, task_record
from tests.stacks import MODEL, PoolPlan, Stack, fleet_stack
from tests.test_scheduler_kv_admission import (
    BLOCK,
    make_scheduler,
    open_tasks,
    task_call,
)
from tests.test_scheduler_placement import make_fleet, placed, refused
from tests.test_workflow_bookkeeping import TaskRowsFail
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(120)

RESULT_TIMEOUT_S = 60


def _spec(**kwargs: Any) -> TaskSpec:
    return TaskSpec(**{"tenant": "acme", "expected_steps": 1, **kwargs})


async def _result(handle: WorkflowHandle[Any, Any]) -> Any:
    return await asyncio.wait_for(handle.result(), RESULT_TIMEOUT_S)


async def _run_spend(s: Stack, workflow_id: str, run_id: str) -> int:
    return sum(a.cost_micros for a in await s.ledger.attempts_for(workflow_id, run_id))


async def _runs(s: Stack, workflow_id: str, count: int) -> list[tuple[str, TaskOutcome, str]]:
    """The task rows of `workflow_id`'s runs in close order, (run id, outcome, chain), once
    `count` are in."""
    found: list[tuple[str, TaskOutcome, str, Any]] = []

    async def written() -> bool:
        found.clear()
        async for execution in s.client.list_workflows(f"WorkflowId = '{workflow_id}'"):
            book = await s.ledger.task(workflow_id, execution.run_id or "")
            if book is not None:
                found.append((book.run_id, book.outcome, book.chain, book.closed_at))
        return len(found) >= count

    await eventually(written, within=30, what=f"{count} task rows of {workflow_id}")
    return [(run, outcome, chain) for run, outcome, chain, _ in sorted(found, key=lambda r: r[3])]


# ---- 5. a cron run or a workflow retry is a task of its own ---------------------------------------


async def test_a_workflow_retry_after_a_continued_run_is_a_task_of_its_own(
    temporal_client: Client, tmp_path: Path
):
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        # Run 1 continues as new; run 2 fails; Temporal retries the workflow as run 3, which
        # succeeds. All three share `first_execution_run_id`.
        handle = await s.client.start_workflow(
            wf.ContinueOnce.run,
            wf.ContinueInput(spec=_spec(), model=MODEL, runs_left=1, fail_first_try=True),
            id=f"retried-after-continuing-{uuid.uuid4()}",
            task_queue=s.task_queue,
            retry_policy=RetryPolicy(
                initial_interval=timedelta(milliseconds=100), maximum_attempts=2
            ),
        )
        await _result(handle)
        runs = await _runs(s, handle.id, 3)
        (first, *_), (second, *_), (retry, *_) = runs
        assert [outcome for _, outcome, _ in runs] == [
            TaskOutcome.CONTINUED_AS_NEW,
            TaskOutcome.FAILED,
            TaskOutcome.SUCCEEDED,
        ]
        # Runs 1 and 2 are one task, which failed; the retry starts a chain of its own.
        assert [chain for *_, chain in runs] == [first, first, retry]
        spends = [await _run_spend(s, handle.id, run) for run, *_ in runs]
        assert all(spend > 0 for spend in spends)
        report = await s.ledger.report(ReportQuery(group_by=()))
        totals = report.totals
        assert (totals.tasks, totals.succeeded) == (2, 1)
        # The failed task's runs are waste, the continued one included; the retry costs
        # its own run only.
        assert totals.wasted_micros == spends[0] + spends[1]
        assert totals.p50_micros == totals.p95_micros == spends[2]
        assert second


async def test_reconcile_chains_a_retry_apart_from_the_runs_it_retried(
    temporal_client: Client, tmp_path: Path
):
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        # The same three runs, none of whose rows the workflow can write.
        broken = TaskRowsFail(s.ledger, LedgerSchemaError("schema version 9"), times=100)
        s.control.activities.ledger = broken
        handle = await s.client.start_workflow(
            wf.ContinueOnce.run,
            wf.ContinueInput(spec=_spec(), model=MODEL, runs_left=1, fail_first_try=True),
            id=f"reconciled-retry-{uuid.uuid4()}",
            task_queue=s.task_queue,
            retry_policy=RetryPolicy(
                initial_interval=timedelta(milliseconds=100), maximum_attempts=2
            ),
        )
        await _result(handle)
        assert broken.calls == 3
        written: dict[str, tuple[TaskOutcome, str]] = {}

        async def reconciled() -> bool:
            result = await reconcile(s.ledger, temporal_client, query=f"WorkflowId = '{handle.id}'")
            written.update((row.run_id, (row.outcome, row.chain)) for row in result.written)
            return len(written) == 3

        await eventually(reconciled, within=30, what="reconcile writes the three rows")
        by_outcome = {outcome: (run, chain) for run, (outcome, chain) in written.items()}
        continued, _ = by_outcome[TaskOutcome.CONTINUED_AS_NEW]
        # From the runs' start events: the continued run's next run is its task; the retry,
        # though it names the same first run, is a task of its own.
        assert by_outcome[TaskOutcome.FAILED][1] == continued
        retry, chain = by_outcome[TaskOutcome.SUCCEEDED]
        assert chain == retry


async def test_a_cron_run_is_a_task_of_its_own_beside_one_that_continued_as_new(
    temporal_client: Client, tmp_path: Path
):
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        # Cron run 1 succeeds; cron run 2 continues as new (which ends the cron schedule)
        # and its next run succeeds.
        handle = await s.client.start_workflow(
            wf.CronContinuesOnce.run,
            wf.CronInput(spec=_spec(), model=MODEL),
            id=f"cron-continuing-{uuid.uuid4()}",
            task_queue=s.task_queue,
            cron_schedule="@every 1s",
        )
        try:
            runs = await _runs(s, handle.id, 3)
        finally:
            with contextlib.suppress(RPCError):
                await s.client.get_workflow_handle(handle.id).terminate("the test is over")
        assert [outcome for _, outcome, _ in runs[:3]] == [
            TaskOutcome.SUCCEEDED,
            TaskOutcome.CONTINUED_AS_NEW,
            TaskOutcome.SUCCEEDED,
        ]
        (cron_1, *_), (cron_2, *_), (continued, *_) = runs[:3]
        assert [chain for *_, chain in runs[:3]] == [cron_1, cron_2, cron_2]
        spends = {run: await _run_spend(s, handle.id, run) for run, *_ in runs[:3]}
        report = await s.ledger.report(ReportQuery(group_by=()))
        totals = report.totals
        assert (totals.tasks, totals.succeeded, totals.wasted_micros) == (2, 2, 0)
        # Cron run 1 costs its own run; the other task costs both its runs.
        costs = sorted([spends[cron_1], spends[cron_2] + spends[continued]])
        assert (totals.p50_micros, totals.p95_micros) == tuple(costs)


def test_rows_from_before_split_a_chain_shared_by_cron_runs_at_their_final_rows(
    ledger: Ledger,
) -> None:
    # As earlier versions wrote them: every run names the first run of the workflow, cron
    # runs and retries included. Cron run 1 continued as new and succeeded in its next run;
    # cron run 2 continued as new and failed in its next run; cron run 3 succeeded.
    rows = [
        ("cron-1", TaskOutcome.CONTINUED_AS_NEW),
        ("cron-1b", TaskOutcome.SUCCEEDED),
        ("cron-2", TaskOutcome.CONTINUED_AS_NEW),
        ("cron-2b", TaskOutcome.FAILED),
        ("cron-3", TaskOutcome.SUCCEEDED),
    ]
    # Written in another order than they closed: the order that counts is the close.
    for minute, (run, outcome) in reversed(list(enumerate(rows, start=1))):
        ledger.record_attempt(attempt_record("wf-cron", run_id=run, started_at=T0))
        closed_at = T0 + timedelta(minutes=minute)
        chain = None if run == "cron-1" else "cron-1"
        ledger.record_task(
            task_record(
                "wf-cron", run_id=run, outcome=outcome, closed_at=closed_at, chain_run_id=chain
            )
        )
    spend = attempt_record().cost_micros
    totals = ledger.report(ReportQuery(group_by=())).totals
    assert (totals.tasks, totals.succeeded) == (3, 2)
    # cron-2's continued spend is the failed task's waste; cron-1's is its succeeded task's.
    assert totals.wasted_micros == 2 * spend
    # Succeeded: cron-1 + cron-1b, and cron-3 alone (not cron-3 with every continued run).
    assert (totals.p50_micros, totals.p95_micros) == (spend, 2 * spend)


# ---- 6. a task that continues as new stays open in the scheduler ----------------------------------


async def test_a_task_that_continued_as_new_stays_open_for_kv_admission() -> None:
    scheduler = make_scheduler()
    activities = ControlPlaneActivities(scheduler, fleet=make_fleet(), block_size=BLOCK)
    open_tasks(scheduler, 4)  # 12,800 tokens open: past tier 3's 12,000
    refused(scheduler.place(task_call(1)))
    for n in (100, 101):
        # Their runs continued as new: the rows are written, the tasks go on.
        continued = task_record(f"task-{n}", tenant="acme", outcome=TaskOutcome.CONTINUED_AS_NEW)
        assert await asyncio.wait_for(activities.record_task(continued), 10) is False
    # A new tier-3 task still waits behind the open tasks' KV.
    refused(scheduler.place(task_call(1)))
    # The continued task's next run goes on as the same open task.
    placed(scheduler.place(task_call(100, tenant="acme")))
    # Its end, in the next run, frees its share.
    for n in (100, 101):
        ended = task_record(f"task-{n}", run_id="run-2", tenant="acme")
        await asyncio.wait_for(activities.record_task(ended), 10)
    placed(scheduler.place(task_call(1)))


# ---- 7. a task's caps hold across its runs --------------------------------------------------------


async def test_a_continued_task_keeps_its_deadline(temporal_client: Client, tmp_path: Path):
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        # Run 1 waits past the task's 2 s latency budget, then continues as new.
        handle = await s.start(
            wf.ContinueOnce.run,
            wf.ContinueInput(
                spec=_spec(latency_budget_s=2.0, expected_steps=2),
                model=MODEL,
                runs_left=1,
                pause_s=3.0,
            ),
        )
        with pytest.raises(WorkflowFailureError) as failure:
            await _result(handle)
        cause = failure.value.cause
        assert isinstance(cause, ApplicationError)
        assert cause.type == errors.TaskErrorType.DEADLINE_EXCEEDED
        assert "2 s latency budget is spent" in cause.message
        runs = await _runs(s, handle.id, 2)
        assert [outcome for _, outcome, _ in runs] == [
            TaskOutcome.CONTINUED_AS_NEW,
            TaskOutcome.FAILED,
        ]
        # The next run placed nothing: its task's time was up when it started.
        assert await _run_spend(s, handle.id, runs[1][0]) == 0


async def test_a_continued_task_keeps_its_spend_cap(temporal_client: Client, tmp_path: Path):
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only", prices=PRICEY)]) as s:
        # What one run's call costs and is expected to cost, from a task with no cap.
        shape = wf.ContinueInput(spec=_spec(), model=MODEL, runs_left=0, max_tokens=64)
        probe = await s.start(wf.ContinueOnce.run, shape)
        await _result(probe)
        spent = await _run_spend(s, probe.id, await _run_id(probe))
        (estimate,) = await _estimates(probe)
        assert spent > 0 and estimate > 0
        # A cap that each run's call fits in alone, but not after the other run's spend.
        cap = estimate + spent // 2
        capped = shape.model_copy(update={"spec": _spec(budget_micros=cap), "runs_left": 1})
        handle = await s.start(wf.ContinueOnce.run, capped)
        with pytest.raises(WorkflowFailureError) as failure:
            await _result(handle)
        cause = failure.value.cause
        assert isinstance(cause, ApplicationError)
        assert cause.type == errors.TaskErrorType.PLACEMENT_REFUSED
        assert "spend cap" in cause.message
        runs = await _runs(s, handle.id, 2)
        assert [outcome for _, outcome, _ in runs] == [
            TaskOutcome.CONTINUED_AS_NEW,
            TaskOutcome.FAILED,
        ]
        assert await _run_spend(s, handle.id, runs[1][0]) == 0


PRICEY = ("200", "20", "600")
"""Token prices at which one short call costs thousands of micro-dollars, not a handful."""


async def _estimates(handle: WorkflowHandle[Any, Any]) -> list[int]:
    """The expected cost of each placement in the run's history (its place markers)."""
    found = []
    async for event in handle.fetch_history_events():
        if event.event_type != EventType.EVENT_TYPE_MARKER_RECORDED:
            continue
        for payloads in event.marker_recorded_event_attributes.details.values():
            for payload in payloads.payloads:
                with contextlib.suppress(ValueError):
                    answer = json.loads(payload.data)
                    if isinstance(answer, dict) and answer.get("placement"):
                        found.append(int(answer["placement"]["est_cost_micros"]))
    return found


async def test_a_continued_task_keeps_its_retry_budget(temporal_client: Client, tmp_path: Path):
    # One replica, whose first and third answers are 503s: each run's call fails once.
    rate = 0.5
    pools = [PoolPlan("one", faults=FaultSpec(error_rate=rate, error_code=503))]
    async with fleet_stack(temporal_client, tmp_path, pools, seed=_seed_failing(rate)) as s:
        task = wf.ContinueInput(spec=_spec(retry_budget=1), model=MODEL, runs_left=1)
        handle = await s.start(wf.ContinueOnce.run, task)
        with pytest.raises(WorkflowFailureError) as failure:
            await _result(handle)
        cause = failure.value.cause
        assert isinstance(cause, ApplicationError)
        # Run 1 used the task's one re-placement: run 2's failed call has none left.
        assert cause.type == errors.TaskErrorType.RETRY_BUDGET_EXHAUSTED, cause.message
        assert "1 re-placements are used up" in cause.message
        runs = await _runs(s, handle.id, 2)
        assert [outcome for _, outcome, _ in runs] == [
            TaskOutcome.CONTINUED_AS_NEW,
            TaskOutcome.FAILED,
        ]
        attempts = [await s.ledger.attempts_for(handle.id, run) for run, *_ in runs]
        assert [len(run_attempts) for run_attempts in attempts] == [2, 1]


def _seed_failing(rate: float) -> int:
    """A simulator seed whose `error_rate` fails the first and third requests only of four."""
    seed = 0
    while True:
        dice = FaultDice(seed)
        if [dice.fails(rate) for _ in range(4)] == [True, False, True, False]:
            return seed
        seed += 1


async def _run_id(handle: WorkflowHandle[Any, Any]) -> str:
    return (await handle.describe()).run_id or ""


# ---- 8. no call without a task ---------------------------------------------------------------------


@pytest.mark.parametrize("tool", [False, True], ids=["infer", "tool"])
async def test_a_call_outside_the_agents_block_fails_the_workflow_with_the_block_to_write(
    temporal_client: Client, tmp_path: Path, tool: bool
):
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        handle = await s.start(
            wf.CallsOutsideTheBlock.run, wf.OutsideInput(spec=_spec(), model=MODEL, tool=tool)
        )
        with pytest.raises(WorkflowFailureError) as failure:
            await _result(handle)
        cause = failure.value.cause
        assert isinstance(cause, ApplicationError)
        assert cause.type == errors.TaskErrorType.OUTSIDE_TASK and cause.non_retryable
        method = "tool" if tool else "infer"
        assert f"    async with agent:\n        ... = await agent.{method}(...)" in cause.message
        # Refused before it placed or ran anything: nothing spent without a task.
        assert await s.ledger.attempts_for(handle.id, await _run_id(handle)) == []
        report = await s.ledger.report(ReportQuery(group_by=()))
        assert report.unclosed_attempts == 0

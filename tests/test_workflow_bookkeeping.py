"""The step API's bookkeeping under faults: bounded control-plane calls, task rows that agree
with how the task ended, cancelled and resumed attempts billed as they were, and history that
keeps offloaded content out and replays after the recorded types change.

Real Temporal dev server, simulated replicas, real GPU workers and a SQLite ledger, built by
`tests.stacks.fleet_stack`.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
from pathlib import Path
from typing import Any

import pytest
from pydantic import Field
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.worker import Replayer, Worker

from kvflow.activities.context_store import DirectoryContextStore
from kvflow.activities.inference import INFER_ACTIVITY
from kvflow.activities.wire import (
    ContextRef,
    InferenceRequest,
    InferenceResult,
    PlaceAnswer,
    Timings,
    Usage,
)
from kvflow.ledger.errors import LedgerSchemaError, LedgerUnavailable
from kvflow.ledger.records import AttemptOutcome, TaskOutcome, TaskRecord
from kvflow.ledger.report import ReportQuery
from kvflow.ledger.store import AsyncLedger
from kvflow.scheduler.config import AdmissionConfig, SchedulerConfig
from kvflow.scheduler.fleet import task_queue_for
from kvflow.workers.reconcile import reconcile
from kvflow.workflows import agent as agent_module
from kvflow.workflows import errors, search_attributes
from kvflow.workflows.agent import SPEND_QUERY, SpendBreakdown, TaskSpec
from tests import agent_workflows as wf
from tests.history import wait_until_streaming
from tests.stacks import MODEL, PoolPlan, cheap_pool_that_crashes, fleet_stack, refund_task
from tests.waiting import eventually

DATA = Path(__file__).parent / "data"
PLACE_HISTORY = DATA / "history_one_step_placed.json"
"""A one-step `MultiStepAgent` run recorded before `PlaceAnswer` and `Placement` changed."""
RESULT_TIMEOUT_S = 60


def _spec(**kwargs: Any) -> TaskSpec:
    return TaskSpec(**{"tenant": "acme", "expected_steps": 1, **kwargs})


async def _result(handle: WorkflowHandle[Any, Any]) -> Any:
    return await asyncio.wait_for(handle.result(), RESULT_TIMEOUT_S)


async def _run_id(handle: WorkflowHandle[Any, Any]) -> str:
    return (await handle.describe()).run_id or ""


# ---- control-plane local activities are bounded ------------------------------------------------


async def test_unknown_tenant_fails_the_task_at_once_with_its_fix_and_runs_compensations(
    temporal_client: Client, tmp_path: Path
):
    wf.REFUNDS.clear()
    wf.REVERSED.clear()
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        refund = wf.Refund(account="T-1", amount_cents=400)
        task = refund_task(refund, tenant="acmee", expected_steps=2)
        handle = await s.start(wf.RefundThenReply.run, task)
        with pytest.raises(WorkflowFailureError) as failed:
            await _result(handle)
        cause = failed.value.cause
        assert isinstance(cause, ApplicationError) and cause.non_retryable, cause
        assert cause.type == errors.TaskErrorType.INVALID_TASK
        assert "step 1/2 'reply'" in cause.message
        assert "unknown tenant 'acmee'" in cause.message and "TaskSpec.tenant" in cause.message
        # Failed as a task (not a workflow task retried forever), undone, and on the ledger.
        history = await handle.fetch_history()
        failures = [
            e for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
        ]
        assert failures == []
        assert [refund] == wf.REFUNDS and [refund] == wf.REVERSED
        row = await s.ledger.task(handle.id, await _run_id(handle))
        assert row is not None and row.outcome == TaskOutcome.COMPENSATED


# ---- the task row agrees with how the task ended -----------------------------------------------


class TaskRowsFail:
    """The real ledger, whose `record_task` raises `error` the first `times` calls."""

    def __init__(self, ledger: AsyncLedger, error: Exception, times: int) -> None:
        self.ledger = ledger
        self.error = error
        self.failures_left = times
        self.calls = 0

    async def record_task(self, record: TaskRecord) -> bool:
        self.calls += 1
        if self.failures_left > 0:
            self.failures_left -= 1
            raise self.error
        return await self.ledger.record_task(record)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ledger, name)


async def test_task_row_that_cannot_be_written_leaves_a_succeeded_task_for_reconcile(
    temporal_client: Client, tmp_path: Path
):
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        task = wf.StepsInput(spec=_spec(), model=MODEL, steps=1)

        # A ledger that is down for a moment: the row is written on a retry.
        flaky = TaskRowsFail(s.ledger, LedgerUnavailable("database is locked"), times=1)
        s.control.activities.ledger = flaky
        handle = await s.start(wf.MultiStepAgent.run, task)
        await _result(handle)
        row = await s.ledger.task(handle.id, await _run_id(handle))
        assert row is not None and row.outcome == TaskOutcome.SUCCEEDED and flaky.calls == 2

        # A ledger that can never take the row: the task still succeeds with its result, and
        # its outcome says so, for reconcile to write the row from.
        broken = TaskRowsFail(s.ledger, LedgerSchemaError("schema version 9"), times=100)
        s.control.activities.ledger = broken
        handle = await s.start(wf.MultiStepAgent.run, task)
        out = await _result(handle)
        assert len(out.replicas) == 1 and broken.calls == 1
        description = await handle.describe()
        assert description.status == WorkflowExecutionStatus.COMPLETED
        attrs = description.typed_search_attributes
        assert attrs.get(search_attributes.OUTCOME) == "succeeded"
        run_id = description.run_id or ""
        assert await s.ledger.task(handle.id, run_id) is None
        for _ in range(100):  # visibility lags about a second
            result = await reconcile(s.ledger, temporal_client, query=f"WorkflowId = '{handle.id}'")
            if result.written:
                break
            await asyncio.sleep(0.1)
        row = await s.ledger.task(handle.id, run_id)
        assert row is not None and row.outcome == TaskOutcome.SUCCEEDED
        attempts = await s.ledger.attempts_for(handle.id, run_id)
        assert row.spend_micros == sum(a.cost_micros for a in attempts) > 0


async def _started_search_attributes(
    client: Client, workflow_id: str, run_id: str
) -> dict[str, Any]:
    """The search attributes a run started with (its first event), by name."""
    history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
    first = history.events[0]
    assert first.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED
    fields = first.workflow_execution_started_event_attributes.search_attributes.indexed_fields
    return {name: json.loads(payload.data) for name, payload in fields.items()}


async def test_a_task_that_continues_as_new_books_every_run_in_its_cost(
    temporal_client: Client, tmp_path: Path
):
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        handle = await s.start(
            wf.ContinueOnce.run, wf.ContinueInput(spec=_spec(), model=MODEL, runs_left=1)
        )
        await _result(handle)
        first, last = handle.result_run_id or "", await _run_id(handle)
        assert first and last and first != last
        continued = await s.ledger.task(handle.id, first)
        assert continued is not None and continued.outcome == TaskOutcome.CONTINUED_AS_NEW
        final = await s.ledger.task(handle.id, last)
        assert final is not None and final.outcome == TaskOutcome.SUCCEEDED
        spends = [
            sum(a.cost_micros for a in await s.ledger.attempts_for(handle.id, run))
            for run in (first, last)
        ]
        assert continued.spend_micros == spends[0] > 0 and final.spend_micros == spends[1] > 0
        # In the Temporal UI the closed run says why it closed, with its exact spend; the next
        # run started as running, with none of the closed run's figures.
        closed = await s.client.get_workflow_handle(handle.id, run_id=first).describe()
        assert closed.typed_search_attributes.get(search_attributes.OUTCOME) == "continued_as_new"
        assert closed.typed_search_attributes.get(search_attributes.SPEND_MICROS) == spends[0]
        started = await _started_search_attributes(s.client, handle.id, last)
        assert started == {
            search_attributes.TENANT.name: _spec().tenant,
            search_attributes.OUTCOME.name: "running",
        }
        live = await s.client.get_workflow_handle(handle.id, run_id=last).describe()
        assert live.typed_search_attributes.get(search_attributes.OUTCOME) == "succeeded"
        # One task, which succeeded, costing what both runs spent; nothing left unclosed.
        report = await s.ledger.report(ReportQuery(group_by=()))
        totals = report.totals
        assert (totals.tasks, totals.succeeded, totals.wasted_micros) == (1, 1, 0)
        assert totals.spend_micros == sum(spends)
        assert report.unclosed_attempts == 0 and report.unclosed_spend_micros == 0
        # The runs form one chain, so the task costs what both spent, in its percentiles too.
        assert (continued.chain_run_id, final.chain_run_id) == (None, first)
        assert totals.p50_micros == sum(spends)

        # A continued run whose row the workflow could not write gets it from reconcile.
        broken = TaskRowsFail(s.ledger, LedgerSchemaError("schema version 9"), times=100)
        s.control.activities.ledger = broken
        handle = await s.start(
            wf.ContinueOnce.run, wf.ContinueInput(spec=_spec(), model=MODEL, runs_left=1)
        )
        await _result(handle)
        first, last = handle.result_run_id or "", await _run_id(handle)
        assert broken.calls == 2 and await s.ledger.task(handle.id, first) is None
        written: dict[str, tuple[TaskOutcome, str | None]] = {}
        for _ in range(100):  # visibility lags about a second
            result = await reconcile(s.ledger, temporal_client, query=f"WorkflowId = '{handle.id}'")
            written.update((row.run_id, (row.outcome, row.chain_run_id)) for row in result.written)
            if len(written) == 2:
                break
            await asyncio.sleep(0.1)
        # Visibility names each run's chain, as the workflow does.
        assert written == {
            first: (TaskOutcome.CONTINUED_AS_NEW, None),
            last: (TaskOutcome.SUCCEEDED, first),
        }
        report = await s.ledger.report(ReportQuery(group_by=()))
        assert (report.totals.tasks, report.totals.succeeded) == (2, 2)
        assert report.unclosed_attempts == 0


# ---- search attributes: what changed, at most every interval, exact at the close ----------------


async def test_search_attributes_upsert_what_changed_and_end_exact(
    temporal_client: Client, tmp_path: Path
):
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        steps = 8
        handle = await s.start(
            wf.MultiStepAgent.run, wf.StepsInput(spec=_spec(), model=MODEL, steps=steps)
        )
        await _result(handle)
        history = await handle.fetch_history()
        upserts = [
            e
            for e in history.events
            if e.event_type == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES
        ]
        seen: dict[str, bytes] = {}
        running_at: list[float] = []
        for event in upserts:
            fields = event.upsert_workflow_search_attributes_event_attributes.search_attributes
            indexed = fields.indexed_fields
            # Each upsert carries only the attributes whose value changed.
            for name, payload in indexed.items():
                assert seen.get(name) != payload.data, (name, payload.data)
                seen[name] = payload.data
            if "KvflowSpendMicros" in indexed and "KvflowOutcome" not in indexed:
                running_at.append(event.event_time.ToDatetime().timestamp())
        # The running figures are upserted at most once per interval of workflow time (the
        # event time is the end of the workflow task whose start is the workflow's clock).
        interval = agent_module.SEARCH_ATTRIBUTE_INTERVAL.total_seconds()
        for earlier, later in itertools.pairwise(running_at):
            assert later - earlier >= interval - 0.5
        assert len(upserts) <= steps + 2
        # Closed, the task shows the exact figures.
        breakdown = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
        attrs = (await handle.describe()).typed_search_attributes
        assert attrs.get(search_attributes.OUTCOME) == "succeeded"
        assert attrs.get(search_attributes.SPEND_MICROS) == breakdown.spend_micros > 0
        assert attrs.get(search_attributes.STEPS) == steps
        assert attrs.get(search_attributes.RETRIES) == 0


# ---- a cancelled call is billed and its replica freed ------------------------------------------


async def test_cancelled_call_is_billed_and_the_scheduler_frees_its_replica(
    temporal_client: Client, tmp_path: Path
):
    wf.REFUNDS.clear()
    wf.REVERSED.clear()
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only", gpu="L4")]) as s:
        refund = wf.Refund(account="C-4", amount_cents=700)
        task = refund_task(refund, expected_steps=2, max_tokens=3000)
        handle = await s.start(wf.RefundThenReply.run, task)
        await wait_until_streaming(handle)
        await handle.cancel()
        with pytest.raises(WorkflowFailureError):
            await _result(handle)
        description = await handle.describe()
        assert description.status == WorkflowExecutionStatus.CANCELED
        run_id = description.run_id or ""
        [attempt] = await s.ledger.attempts_for(handle.id, run_id)
        assert attempt.outcome == AttemptOutcome.CANCELLED and attempt.cost_micros > 0
        # Task spend, the search attribute and the task row all count it.
        breakdown = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
        assert breakdown.spend_micros == attempt.cost_micros
        assert breakdown.steps[1].attempts[0].outcome == "cancelled"
        assert description.typed_search_attributes.get(search_attributes.SPEND_MICROS) == (
            attempt.cost_micros
        )
        row = await s.ledger.task(handle.id, run_id)
        assert row is not None and row.outcome == TaskOutcome.CANCELLED
        assert row.spend_micros == attempt.cost_micros
        # The scheduler heard of it: nothing is left in flight on the replica.
        [status] = s.control.scheduler.status()
        assert status.inflight == 0
        assert s.control.scheduler.tenant_spend_today("acme") == attempt.cost_micros


# ---- cut attempts whose output was continued are not waste --------------------------------------


async def test_cut_attempt_continued_elsewhere_is_recorded_resumed_and_not_wasted(
    temporal_client: Client, tmp_path: Path
):
    async with fleet_stack(temporal_client, tmp_path, cheap_pool_that_crashes()) as s:
        task = wf.StepsInput(spec=_spec(), model=MODEL, steps=1, max_tokens=60)
        handle = await s.start(wf.MultiStepAgent.run, task)
        out = await _result(handle)
        assert out.replicas == ["backup/0"]
        run_id = await _run_id(handle)
        by_replica = {a.replica: a for a in await s.ledger.attempts_for(handle.id, run_id)}
        cut, final = by_replica["cheap/0"], by_replica["backup/0"]
        assert cut.outcome == AttemptOutcome.RESUMED_ELSEWHERE and cut.cost_micros > 0
        assert final.outcome == AttemptOutcome.OK and final.reused_tokens > 0
        report = await s.ledger.report(ReportQuery.parse(group_by=""))
        assert report.totals.succeeded == 1
        assert report.totals.spend_micros == cut.cost_micros + final.cost_micros
        assert report.totals.wasted_micros == 0


# ---- history: offloaded content stays out, schema repair sees it all ----------------------------

REPAIRED = '{"approve": true, "reason": "fine", "score": 7}'


class OffloadingReplica:
    """A GPU worker whose first answer is large, offloaded and invalid; then a valid one."""

    def __init__(self, store: DirectoryContextStore) -> None:
        self.store = store
        self.requests: list[InferenceRequest] = []
        self.first_answer = ""

    @activity.defn(name=INFER_ACTIVITY)
    async def infer(self, request: InferenceRequest) -> InferenceResult:
        self.requests.append(request)
        if len(self.requests) == 1:
            text = '{"approve": true, "reason": "' + "because " * 400  # cut: not valid JSON
            self.first_answer = text
            ref = await self.store.aput(text)
            return self._result(text="", ref=ref)
        return self._result(text=REPAIRED, ref=None)

    def _result(self, text: str, ref: ContextRef | None) -> InferenceResult:
        return InferenceResult(
            text=text,
            text_ref=ref,
            finish_reason="length",
            usage=Usage(prompt_tokens=10, completion_tokens=5),
            timings=Timings(),
            model=MODEL,
            replica="other/0",
            pool="other",
            gpu="H100",
            cost_micros=3,
        )


async def test_schema_repair_shows_the_model_its_whole_offloaded_answer(
    temporal_client: Client, tmp_path: Path
):
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("other", gpu_worker=False)]) as s:
        store = DirectoryContextStore(tmp_path / "context")
        replica = OffloadingReplica(store)
        async with Worker(
            temporal_client, task_queue=task_queue_for("other", 0), activities=[replica.infer]
        ):
            handle = await s.start(
                wf.StructuredVerdict.run, wf.VerdictInput(spec=_spec(), model=MODEL)
            )
            verdict = await _result(handle)
        assert verdict == wf.Verdict.model_validate_json(REPAIRED)
        repair = replica.requests[1].messages or []
        assistant = [m for m in repair if m.role == "assistant"]
        assert len(assistant) == 1 and isinstance(assistant[0].content, ContextRef)
        assert store.get(assistant[0].content) == replica.first_answer


async def test_offloaded_context_leaves_no_preview_in_history(
    temporal_client: Client, tmp_path: Path
):
    secret = "Quarterly numbers for the board, do not share: "
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        task = wf.StepsInput(spec=_spec(), model=MODEL, steps=1, context=secret * 60)
        handle = await s.start(wf.MultiStepAgent.run, task)
        await _result(handle)
        history = await handle.fetch_history()
    # The task's input carries it; nothing after that may (no preview in any reference).
    started, *rest = history.events
    assert secret.encode() in started.SerializeToString()
    leaks = [e.event_type for e in rest if secret[:40].encode() in e.SerializeToString()]
    assert leaks == []


# ---- recorded placements replay after their types change --------------------------------------


def _replayer(client: Client) -> Replayer:
    return Replayer(workflows=wf.ALL_WORKFLOWS, data_converter=client.data_converter)


def _with_unknown_fields(history_json: str) -> str:
    """The history as a newer kvflow would have recorded it: more fields in every placement."""
    history = json.loads(history_json)
    changed = 0
    for event in history["events"]:
        marker = event.get("markerRecordedEventAttributes")
        if not marker or "result" not in marker.get("details", {}):
            continue
        for payload in marker["details"]["result"]["payloads"]:
            answer = json.loads(base64.b64decode(payload.get("data", "")) or "null")
            if not isinstance(answer, dict) or "placement" not in answer:
                continue
            answer["queue_position"] = 3
            answer["placement"]["carbon_g_per_call"] = 0.4
            payload["data"] = base64.b64encode(json.dumps(answer).encode()).decode()
            changed += 1
    assert changed == 1
    return json.dumps(history)


class PlaceAnswerWithHint(PlaceAnswer):
    """`PlaceAnswer` as a later version might have it: one more field, with a default."""

    hint: str = Field(default="")


async def test_recorded_placements_replay_after_fields_are_added(
    temporal_client: Client, monkeypatch: pytest.MonkeyPatch
):
    from temporalio.client import WorkflowHistory

    text = PLACE_HISTORY.read_text()
    workflow_id = "recorded-one-step"
    replayer = _replayer(temporal_client)
    # As recorded, by this version.
    await replayer.replay_workflow(WorkflowHistory.from_json(workflow_id, text))
    # Recorded by a newer version whose placements carry fields this one does not know.
    await replayer.replay_workflow(
        WorkflowHistory.from_json(workflow_id, _with_unknown_fields(text))
    )
    # Replayed by a newer version that added a field (with a default) to the answer.
    monkeypatch.setattr(agent_module, "PlaceAnswer", PlaceAnswerWithHint)
    await replayer.replay_workflow(WorkflowHistory.from_json(workflow_id, text))


@pytest.mark.skipif(
    not os.environ.get("KVFLOW_RECORD_HISTORY"),
    reason="records tests/data anew; only when the recorded workflow itself changes",
)
async def test_record_the_placed_history(temporal_client: Client, tmp_path: Path):
    """Run one placed step and keep its history as `PLACE_HISTORY`."""
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        handle = await s.start(
            wf.MultiStepAgent.run, wf.StepsInput(spec=_spec(), model=MODEL, steps=1)
        )
        await _result(handle)
        history = await handle.fetch_history()
    DATA.mkdir(exist_ok=True)
    PLACE_HISTORY.write_text(json.dumps(json.loads(history.to_json()), indent=1) + "\n")


# ---- admission under a fleet that is really busy --------------------------------------------


async def test_a_busy_fleet_makes_the_lower_tier_wait_while_tier_1_is_admitted(
    temporal_client: Client, tmp_path: Path
):
    # Tier 3 (globex) is admitted while the replica's (running + waiting) / slots is under
    # 0.1, tier 1 (acme) under 4: two long calls in flight on 16 slots (0.125) saturate the
    # fleet for globex and not for acme. The load is the replica's own, scraped and counted
    # by the control plane: no stub answers "saturated".
    config = SchedulerConfig(
        admission=AdmissionConfig(saturation_by_tier=(4.0, 2.0, 0.1, 0.1, 0.1), retry_after_s=0.5)
    )
    async with fleet_stack(
        temporal_client, tmp_path, [PoolPlan("only", gpu="L4")], scheduler=config
    ) as s:
        long = wf.StepsInput(spec=_spec(expected_steps=1), model=MODEL, steps=1, max_tokens=3000)
        busy = [await s.start(wf.MultiStepAgent.run, long) for _ in range(2)]
        for handle in busy:
            await wait_until_streaming(handle)
        short = {"model": MODEL, "steps": 1, "max_tokens": 8}
        tier3 = await s.start(
            wf.MultiStepAgent.run,
            wf.StepsInput(spec=_spec(tenant="globex", expected_steps=1), **short),
        )
        tier1 = await s.start(
            wf.MultiStepAgent.run, wf.StepsInput(spec=_spec(expected_steps=1), **short)
        )
        for handle in [tier1, tier3, *busy]:
            await _result(handle)
        first = await tier1.query(SPEND_QUERY, result_type=SpendBreakdown)
        waited = await tier3.query(SPEND_QUERY, result_type=SpendBreakdown)
        assert first.steps[0].admission_waits == 0
        assert waited.steps[0].admission_waits >= 1 and waited.steps[0].outcome == "ok"
        # The wait is a durable timer in the lower tier's history, and it ended only after
        # tier 1's call had been placed.
        history = await tier3.fetch_history()
        timers = [e for e in history.events if e.event_type == EventType.EVENT_TYPE_TIMER_STARTED]
        assert len(timers) == waited.steps[0].admission_waits
        tier1_placed = min(
            e.event_time.ToDatetime()
            for e in (await tier1.fetch_history()).events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        )
        tier3_placed = min(
            e.event_time.ToDatetime()
            for e in history.events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        )
        assert tier1_placed < tier3_placed


@pytest.mark.timeout(120)
async def test_bug_in_workflow_code_closes_nothing_and_undoes_nothing(
    temporal_client: Client, tmp_path: Path
) -> None:
    """Only the end of a workflow closes its task: a workflow-task failure is retried."""
    wf.REFUNDS.clear()
    wf.REVERSED.clear()
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        refund = wf.Refund(account="C-1", amount_cents=5)
        handle = await s.start(
            wf.BugAfterRefund.run,
            refund_task(refund, expected_steps=1),
        )
        await eventually(
            lambda: _has_event(handle, EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED),
            within=30,
            what="the workflow task fails on the bug",
        )
        description = await handle.describe()
        run_id = description.run_id or ""
        assert description.status is WorkflowExecutionStatus.RUNNING
        assert await s.ledger.task(handle.id, run_id) is None
        assert description.typed_search_attributes.get(search_attributes.OUTCOME) == "running"
        assert [refund] == wf.REFUNDS and wf.REVERSED == [], "undone for a task still running"
        # An operator ends it; reconcile then writes its one row from its attempt rows.
        await handle.terminate("the deploy with the fix is not out yet")
        closed = f"WorkflowId = '{handle.id}' AND ExecutionStatus != 'Running'"

        async def listed_closed() -> bool:
            return (await s.client.count_workflows(closed)).count == 1

        await eventually(
            listed_closed,
            within=30,
            what="visibility lists the run as closed",
        )
        await reconcile(s.ledger, s.client, query=f"WorkflowId = '{handle.id}'")
        task = await s.ledger.task(handle.id, run_id)
        assert task is not None and task.outcome is TaskOutcome.TERMINATED
        assert task.spend_micros > 0 and task.attempts == 1


async def _has_event(handle: WorkflowHandle[Any, Any], event: EventType.ValueType) -> bool:
    history = await handle.fetch_history()
    return any(e.event_type == event for e in history.events)

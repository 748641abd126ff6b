"""The step API end to end: real Temporal dev server, simulated replicas, real GPU workers.

Each test builds a small fleet of simulated vLLM replicas (in this process), one GPU worker per
replica, the workflow worker with its scheduler, and a SQLite ledger; then runs agent workflows
through it and checks what an operator and finance would see.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from datetime import UTC, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.api.failure.v1 import Failure
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
)
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from kvflow.activities.context_store import (
    TENANTS_DIR,
    ContextNotFound,
    DirectoryContextStore,
    tenant_folder,
)
from kvflow.activities.control_plane import END_TASK_ACTIVITY
from kvflow.activities.inference import INFER_ACTIVITY
from kvflow.activities.tokenize import FleetTokenizers
from kvflow.activities.wire import (
    AttemptProgress,
    Checkpoint,
    ContextRef,
    InferenceRequest,
    InferenceResult,
    UnreadableDetails,
)
from kvflow.ledger.records import TaskOutcome
from kvflow.scheduler.axes import kv_capacity_blocks
from kvflow.scheduler.config import AdmissionConfig, LatencyConfig, SchedulerConfig
from kvflow.scheduler.core import Scheduler
from kvflow.scheduler.fleet import Fleet, Pool, Tenant, TokenPrices, task_queue_for
from kvflow.scheduler.placement import (
    Observation,
    Placement,
    PlacementRequest,
    Refusal,
    RefusalReason,
)
from kvflow.scheduler.state import ReplicaMetrics
from kvflow.simulator import BUILTIN_MODELS, EngineConfig, ServerSettings, SimServer
from kvflow.simulator.faults import FaultDice, FaultSpec
from kvflow.workers.config import load_fleet
from kvflow.workers.control_plane import ControlPlane
from kvflow.workers.workflow_worker import workflow_worker
from kvflow.workflows import errors, search_attributes
from kvflow.workflows.agent import (
    ADMISSION_WAIT_STRETCH,
    MAX_ADMISSION_WAITS,
    SPEND_QUERY,
    SpendBreakdown,
)
from kvflow.workflows.calls import LOCAL_RETRY
from tests import agent_workflows as wf
from tests.faulty_proxy import Fault, FaultyProxy
from tests.history import wait_until_streaming
from tests.stacks import (
    MODEL,
    PoolPlan,
    assert_replays,
    cheap_pool_that_crashes,
    fails_for_its_deadline,
    fleet_for,
    fleet_stack,
    refund_task,
    task_spec,
)
from tests.waiting import eventually


async def _heartbeated(handle: WorkflowHandle[Any, Any]) -> bool:
    pending = (await handle.describe()).raw_description.pending_activities
    return bool(pending) and pending[0].HasField("heartbeat_details")


async def _inferring(handle: WorkflowHandle[Any, Any]) -> bool:
    pending = (await handle.describe()).raw_description.pending_activities
    return bool(pending) and pending[0].activity_type.name == "kvflow.infer"


async def test_five_step_task_runs_where_the_scheduler_placed_each_step(
    temporal_client: Client, tmp_path: Path
):
    pools = [PoolPlan("fast", gpu="H200", replicas=2), PoolPlan("slow", gpu="L4")]
    async with fleet_stack(temporal_client, tmp_path, pools) as s:
        # A system prompt of several index entries (64 tokens each), so that every later step
        # finds the conversation's prefix where the first step left it.
        context = "You are a careful research agent. " * 12
        steps = wf.StepsInput(spec=task_spec(), model=MODEL, context=context)
        handle = await s.start(wf.MultiStepAgent.run, steps)
        out = await handle.result()
        assert len(out.replicas) == 5

        # Each inference activity went to the task queue of the replica that answered, with a
        # summary that names the step and the placement's reason.
        history = await handle.fetch_history()
        scheduled = [
            e
            for e in history.events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
            and e.activity_task_scheduled_event_attributes.activity_type.name == "kvflow.infer"
        ]
        assert len(scheduled) == 5
        for i, (event, replica) in enumerate(zip(scheduled, out.replicas, strict=True)):
            pool, index = replica.split("/")
            queue = event.activity_task_scheduled_event_attributes.task_queue.name
            assert queue == task_queue_for(pool, int(index))
            summary = temporal_client.data_converter.payload_converter.from_payload(
                event.user_metadata.summary, str
            )
            assert f"step {i + 1}/5 'part-{i + 1}'" in summary and replica in summary

        # What the UI shows: search attributes, current details, and the spend query.
        breakdown = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
        assert breakdown.outcome == "succeeded" and len(breakdown.steps) == 5
        assert breakdown.spend_micros > 0 and breakdown.retries == 0
        attrs = (await handle.describe()).typed_search_attributes
        assert attrs.get(search_attributes.TENANT) == "acme"
        assert attrs.get(search_attributes.OUTCOME) == "succeeded"
        assert attrs.get(search_attributes.SPEND_MICROS) == breakdown.spend_micros
        assert attrs.get(search_attributes.STEPS) == 5
        metadata = await handle.query("__temporal_workflow_metadata", result_type=WorkflowMetadata)
        assert "part-5" in metadata.current_details and out.replicas[4] in metadata.current_details

        # The ledger: five billed attempts and one succeeded task whose spend is their sum.
        task, attempts = await s.rows(handle)
        assert len(attempts) == 5
        assert sum(a.cost_micros for a in attempts) == breakdown.spend_micros
        assert task is not None and task.outcome == TaskOutcome.SUCCEEDED
        assert task.spend_micros == breakdown.spend_micros and task.attempts == 5
        # Later steps share the conversation's prefix: the scheduler kept them where it was
        # cached, and the replicas reported cached tokens.
        assert len(set(out.replicas[1:])) == 1
        assert sum(a.cached_tokens for a in attempts) > 0
        await assert_replays(handle)


async def test_each_call_carries_its_steps_deadline_to_the_gpu_worker(
    temporal_client: Client, tmp_path: Path
):
    # What an engine that pauses lower tiers by it (Pool.deadline_pause) is sent: the step's
    # objective from when the call was asked, in the activity's input an operator can read.
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        task = wf.StepsInput(spec=task_spec(step_slo_s=30.0), model=MODEL, steps=2)
        handle = await s.start(wf.MultiStepAgent.run, task)
        await asyncio.wait_for(handle.result(), 60)
        history = await handle.fetch_history()
    started = history.events[0].event_time.ToDatetime(tzinfo=UTC)
    scheduled = [
        e
        for e in history.events
        if e.activity_task_scheduled_event_attributes.activity_type.name == INFER_ACTIVITY
    ]
    assert len(scheduled) == 2
    for event in scheduled:
        [call] = await temporal_client.data_converter.decode(
            event.activity_task_scheduled_event_attributes.input.payloads, [InferenceRequest]
        )
        assert isinstance(call, InferenceRequest) and call.step_deadline is not None
        asked_at = call.step_deadline - timedelta(seconds=30)
        assert started <= asked_at <= event.event_time.ToDatetime(tzinfo=UTC)


async def test_replica_that_crashes_mid_stream_is_resumed_elsewhere_and_both_attempts_billed(
    temporal_client: Client, tmp_path: Path
):
    async with fleet_stack(temporal_client, tmp_path, cheap_pool_that_crashes()) as s:
        task = wf.StepsInput(spec=task_spec(expected_steps=1), model=MODEL, steps=1, max_tokens=60)
        handle = await s.start(wf.MultiStepAgent.run, task)
        out = await handle.result()
        assert out.replicas == ["backup/0"]
        breakdown = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
        [step] = breakdown.steps
        first, second = step.attempts
        assert first.replica == "cheap/0" and first.outcome in {"StreamCut", "TimeoutHeartbeat"}
        assert second.replica == "backup/0" and second.outcome == "ok"
        # The continuation reused what the crashed replica had streamed.
        assert second.reused_tokens > 0
        assert second.completion_tokens == 60 - second.reused_tokens
        assert breakdown.retries == 1
        _, attempts = await s.rows(handle)
        assert {a.replica for a in attempts} == {"cheap/0", "backup/0"}
        assert all(a.cost_micros > 0 for a in attempts)
        assert breakdown.spend_micros == sum(a.cost_micros for a in attempts)
        await assert_replays(handle)


async def test_queue_without_a_worker_times_out_to_start_and_is_replaced(
    temporal_client: Client, tmp_path: Path
):
    pools = [
        PoolPlan("orphan", gpu="H200", prices=("0.05", "0.005", "0.15"), gpu_worker=False),
        PoolPlan("served", gpu="H100"),
    ]
    fast_timeouts = SchedulerConfig(
        latency=LatencyConfig(schedule_to_start_margin_s=1.0, min_schedule_to_start_s=1.0)
    )
    async with fleet_stack(temporal_client, tmp_path, pools, scheduler=fast_timeouts) as s:
        task = wf.StepsInput(spec=task_spec(expected_steps=1), model=MODEL, steps=1)
        handle = await s.start(wf.MultiStepAgent.run, task)
        out = await handle.result()
        assert out.replicas == ["served/0"]
        breakdown = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
        first, second = breakdown.steps[0].attempts
        assert (first.replica, first.outcome, first.cost_micros) == (
            "orphan/0",
            "ScheduleToStart",
            0,
        )
        assert second.outcome == "ok"
        # The call no worker took ran nowhere: no ledger row, and no attempt in the counts.
        assert breakdown.attempts == 1
        row = await s.ledger.task(handle.id, (await handle.describe()).run_id or "")
        assert row is not None and row.attempts == row.attempts_at_close == 1
        await assert_replays(handle)


async def test_deadline_too_tight_fails_fast_and_runs_the_compensation(
    temporal_client: Client, tmp_path: Path
):
    wf.REFUNDS.clear()
    wf.REVERSED.clear()
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only", gpu="L4")]) as s:
        refund = wf.Refund(account="A-17", amount_cents=2_500)
        task = refund_task(
            refund, tenant="globex", latency_budget_s=0.05, expected_steps=2, max_tokens=2_000
        )

        async def start() -> WorkflowHandle[Any, Any]:
            wf.REFUNDS.clear()
            return await s.start(wf.RefundThenReply.run, task)

        # A try whose budget was spent before the refund cannot show the reply's refusal.
        handle, cause = await fails_for_its_deadline(
            start, started_late=lambda message: "tool 'refund'" in message
        )
        assert "step 1/2 'reply'" in cause.message
        assert [refund] == wf.REFUNDS and [refund] == wf.REVERSED
        run_id = (await handle.describe()).run_id or ""
        row = await s.ledger.task(handle.id, run_id)
        assert row is not None and row.outcome == TaskOutcome.COMPENSATED
        breakdown = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
        assert [st.kind for st in breakdown.steps] == ["tool", "infer", "compensation"]
        assert breakdown.steps[2].outcome == "ok"
        # The refund is the one step the task completed; undoing it is not a step of the task.
        assert row.steps == 1
        await assert_replays(handle)


async def test_a_task_the_load_would_make_late_fails_overloaded_before_it_spends(
    temporal_client: Client, tmp_path: Path
):
    # Task admission on, and the scraper stopped once it has scraped, so that the load the
    # test sets is the one the scheduler sees: the replica's 16 slots running and as many
    # calls waiting.
    admitting = SchedulerConfig(latency=LatencyConfig(task_admission=True))
    pools = [PoolPlan("only", gpu="H100")]
    async with fleet_stack(temporal_client, tmp_path, pools, scheduler=admitting) as s:
        scheduler = s.control.scheduler
        s.control.scraper.stop()
        assert s.control._scraping is not None
        await asyncio.wait_for(s.control._scraping, 10)
        busy = ReplicaMetrics(running=16, waiting=16)
        scheduler.update_metrics("only/0", busy)

        # The same first step on a scheduler at this load and on an idle one: an objective
        # between the two is met by an idle fleet and missed under this load.
        def first_step(at: Scheduler) -> float:
            answer = at.place(
                PlacementRequest(
                    model=MODEL, block_hashes=[], prompt_tokens=64, max_output_tokens=16,
                    tenant="acme", steps_remaining=1,
                )
            )  # fmt: skip
            assert isinstance(answer, Placement)
            return answer.est_duration_s

        loaded_at = Scheduler(s.fleet, admitting)
        loaded_at.update_metrics("only/0", busy)
        loaded, idle = first_step(loaded_at), first_step(Scheduler(s.fleet, admitting))
        assert loaded > 4 * idle, (loaded, idle)
        task = wf.StepsInput(
            spec=task_spec(expected_steps=1, step_slo_s=(loaded * idle) ** 0.5),
            model=MODEL,
            steps=1,
        )
        handle = await s.start(wf.MultiStepAgent.run, task)
        with pytest.raises(WorkflowFailureError) as failed:
            await asyncio.wait_for(handle.result(), 60)
        cause = failed.value.cause
        assert isinstance(cause, ApplicationError)
        assert cause.type == errors.TaskErrorType.OVERLOADED and cause.non_retryable
        assert "nothing was spent" in cause.message
        # Nothing ran: no attempt, no spend; the task's row says it failed.
        row, attempts = await s.rows(handle)
        assert attempts == []
        assert row is not None and row.outcome == TaskOutcome.FAILED
        assert row.spend_micros == 0
        breakdown = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
        assert breakdown.spend_micros == 0
        assert [step.outcome for step in breakdown.steps] == ["refused: overloaded"]
        await assert_replays(handle)


@pytest.mark.parametrize("budget", [2, 3])
async def test_exhausted_retry_budget_fails_with_its_own_error_and_bills_every_attempt(
    temporal_client: Client, tmp_path: Path, budget: int
):
    # Every replica cuts its streams: each attempt is paid for, none finishes. A budget of
    # 3 is the scheduler's own cap too (`max_task_retries`): the task still gets all three.
    replicas = budget + 1
    pools = [PoolPlan("flaky", gpu="H100", replicas=replicas, faults=FaultSpec(disconnect_after=8))]
    async with fleet_stack(temporal_client, tmp_path, pools) as s:
        task = wf.StepsInput(
            spec=task_spec(expected_steps=1, retry_budget=budget),
            model=MODEL,
            steps=1,
            max_tokens=60,
        )
        handle = await s.start(wf.MultiStepAgent.run, task)
        with pytest.raises(WorkflowFailureError) as failed:
            await handle.result()
        cause = failed.value.cause
        assert (
            isinstance(cause, ApplicationError)
            and cause.type == errors.TaskErrorType.RETRY_BUDGET_EXHAUSTED
        )
        assert f"{budget} re-placements are used up" in cause.message
        _, attempts = await s.rows(handle)
        assert len(attempts) == replicas and all(a.cost_micros > 0 for a in attempts)
        assert len({a.replica for a in attempts}) == replicas
        run_id = (await handle.describe()).run_id or ""
        row = await s.ledger.task(handle.id, run_id)
        assert row is not None and row.outcome == TaskOutcome.FAILED
        assert row.spend_micros == sum(a.cost_micros for a in attempts)
        await assert_replays(handle)


def _seed_failing_first_only(rate: float) -> int:
    """A simulator seed whose `error_rate` fails the first request and not the next two."""
    seed = 0
    while True:
        dice = FaultDice(seed)
        if [dice.fails(rate) for _ in range(3)] == [True, False, False]:
            return seed
        seed += 1


async def test_a_call_its_only_replica_failed_is_placed_there_again_within_the_budget(
    temporal_client: Client, tmp_path: Path
):
    # One replica: its first answer is a 503. Exclusion keeps a re-placement off a replica
    # that just failed while another could serve it; with none, the call goes back to it.
    rate = 0.5
    pools = [PoolPlan("one", gpu="H100", faults=FaultSpec(error_rate=rate, error_code=503))]
    seed = _seed_failing_first_only(rate)
    async with fleet_stack(temporal_client, tmp_path, pools, seed=seed) as s:
        task = wf.StepsInput(
            spec=task_spec(expected_steps=1, retry_budget=2), model=MODEL, steps=1, max_tokens=40
        )
        handle = await s.start(wf.MultiStepAgent.run, task)
        await handle.result()
        breakdown = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
        attempts = breakdown.steps[0].attempts
        assert [a.outcome for a in attempts][-1] == "ok" and len(attempts) == 2, attempts
        assert {a.replica for a in attempts} == {"one/0"} and breakdown.retries == 1
        await assert_replays(handle)


async def test_a_replica_that_fails_every_attempt_spends_the_whole_retry_budget(
    temporal_client: Client, tmp_path: Path
):
    # Every attempt on the only replica is cut: the task fails on its retry budget, the
    # error an operator can act on, not on the exclusion of its one replica.
    pools = [PoolPlan("one", gpu="H100", faults=FaultSpec(disconnect_after=8))]
    async with fleet_stack(temporal_client, tmp_path, pools) as s:
        task = wf.StepsInput(
            spec=task_spec(expected_steps=1, retry_budget=2), model=MODEL, steps=1, max_tokens=60
        )
        handle = await s.start(wf.MultiStepAgent.run, task)
        with pytest.raises(WorkflowFailureError) as failed:
            await handle.result()
        cause = failed.value.cause
        assert isinstance(cause, ApplicationError)
        assert cause.type == errors.TaskErrorType.RETRY_BUDGET_EXHAUSTED, cause.message
        _, rows = await s.rows(handle)
        assert len(rows) == 3 and {row.replica for row in rows} == {"one/0"}
        await assert_replays(handle)


@activity.defn(name=INFER_ACTIVITY)
async def infer_from_another_version(request: InferenceRequest) -> InferenceResult:
    """A GPU worker whose failure details are not the `AttemptProgress` this version reads."""
    raise ApplicationError("stream cut", {"text": ["Dear", "customer"]}, type="StreamCut")


async def test_failure_details_that_do_not_validate_park_the_task_with_a_typed_error(
    temporal_client: Client, tmp_path: Path
):
    wf.REFUNDS.clear()
    wf.REVERSED.clear()
    pools = [PoolPlan("other", gpu="H100", gpu_worker=False)]
    async with fleet_stack(temporal_client, tmp_path, pools) as s:
        refund = wf.Refund(account="A-18", amount_cents=900)
        task = refund_task(refund, expected_steps=2)
        async with Worker(
            temporal_client,
            task_queue=task_queue_for("other", 0),
            activities=[infer_from_another_version],
        ):
            handle = await s.start(wf.RefundThenReply.run, task)
            failure = await _first_workflow_task_failure(handle)
        try:
            assert failure.application_failure_info.type == "UnreadableDetails"
            assert "the details of StreamCut from other/0 are not an AttemptProgress" in (
                failure.message
            )
            # The message names the field that did not validate (text: a string or a reference).
            assert "text.str: Input should be a valid string" in failure.message
            # A version mismatch is not the task's failure: nothing is undone or recorded, and
            # the task goes on once the workers agree.
            assert [refund] == wf.REFUNDS and wf.REVERSED == []
            description = await handle.describe()
            assert description.status == WorkflowExecutionStatus.RUNNING
            assert await s.ledger.task(handle.id, description.run_id or "") is None
        finally:
            await handle.terminate("test over")


async def _first_workflow_task_failure(handle: WorkflowHandle[Any, Any]) -> Failure:
    for _ in range(200):
        async for event in handle.fetch_history_events():
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
                return event.workflow_task_failed_event_attributes.failure
        await asyncio.sleep(0.05)
    raise AssertionError("the workflow task never failed")


def test_heartbeat_details_are_read_back_as_a_typed_record():
    # Details recorded before the record existed were plain dicts with the same keys.
    beat = {
        "text": "Dear customer,",
        "completion_tokens": 4,
        "replica": "fast/0",
        "usage": {"prompt_tokens": 120, "cached_tokens": 64, "completion_tokens": 4},
        "cost_micros": 31,
    }
    progress = AttemptProgress.from_details([beat], source="the last heartbeat details")
    assert progress is not None
    assert progress.resumable() == Checkpoint(text="Dear customer,", completion_tokens=4)
    assert (progress.usage.prompt_tokens, progress.cost_micros) == (120, 31)
    assert AttemptProgress.from_details([], source="no heartbeat") is None
    # No text yet: the attempt is billed but there is nothing to resume from.
    started = AttemptProgress.from_details([{"replica": "fast/0", "cost_micros": 5}], source="-")
    assert started is not None and started.resumable() is None and started.cost_micros == 5
    with pytest.raises(UnreadableDetails, match=r"last heartbeat .* cost_micros: Input should"):
        AttemptProgress.from_details(
            [{**beat, "cost_micros": "a lot"}], source="the last heartbeat details from fast/0"
        )


async def test_structured_output_comes_back_as_the_pydantic_model(
    temporal_client: Client, tmp_path: Path
):
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        handle = await s.start(
            wf.StructuredVerdict.run, wf.VerdictInput(spec=task_spec(expected_steps=1), model=MODEL)
        )
        verdict = await handle.result()
        assert isinstance(verdict, wf.Verdict)
        await assert_replays(handle)


async def test_long_conversation_keeps_history_small(temporal_client: Client, tmp_path: Path):
    steps, tokens = 40, 500
    pools = [PoolPlan("big", gpu="H200", max_model_len=32768)]
    async with fleet_stack(temporal_client, tmp_path, pools) as s:
        task = wf.StepsInput(
            spec=task_spec(expected_steps=steps), model=MODEL, steps=steps, max_tokens=tokens
        )
        handle = await s.start(wf.MultiStepAgent.run, task)
        out = await handle.result()
        history = await handle.fetch_history()
    # Bytes of history each step added: from one inference call to the next.
    per_step: list[int] = []
    for event in history.events:
        attributes = event.activity_task_scheduled_event_attributes
        if attributes.activity_type.name == "kvflow.infer":
            per_step.append(0)
        if per_step:
            per_step[-1] += event.ByteSize()
    conversation = sum(out.answer_bytes)
    total = sum(per_step)
    # Sent inline, step i would carry the whole conversation before it.
    inline = sum(sum(out.answer_bytes[:i]) for i in range(steps))
    print(
        f"\n{steps} steps, conversation {conversation:,} B; history {total:,} B "
        f"(steps 1-10: {sum(per_step[:10]) // 10:,} B/step, 31-40: "
        f"{sum(per_step[-10:]) // 10:,} B/step); inline it would be {inline:,} B"
    )
    assert len(per_step) == steps
    # What the workflow stored is its tenant's: another tenant cannot open it by digest.
    root = tmp_path / "context"
    stored = [f for f in root.rglob("*") if f.is_file()]
    assert stored
    assert {f.relative_to(root).parts[:2] for f in stored} == {(TENANTS_DIR, tenant_folder("acme"))}
    store = DirectoryContextStore(root)
    ref = ContextRef(digest=stored[0].name, size=stored[0].stat().st_size, tenant="acme")
    assert store.get(ref, "acme")
    for stranger in (ref, ref.model_copy(update={"tenant": None})):
        with pytest.raises(ContextNotFound):
            store.get(stranger, "globex")
    # The cost of a step does not grow with the conversation...
    assert sum(per_step[-10:]) < 1.5 * sum(per_step[:10])
    # ...so history is a small fraction of what the conversation would weigh inline.
    assert total < inline / 8


class HeardEnds:
    """The real scheduler, noting each task end it hears and the activity it came from."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.ends: list[tuple[str, str, bool, bool]] = []
        """(workflow id, activity type, whether a local activity, whether it was counted)."""

    def place(self, request: PlacementRequest) -> Placement | Refusal:
        return self.scheduler.place(request)

    def observe(self, observation: Observation) -> None:
        self.scheduler.observe(observation)

    def settle(self) -> None:
        self.scheduler.settle()

    def end_task(self, workflow_id: str) -> bool:
        counted = self.scheduler.end_task(workflow_id)
        info = activity.info()
        self.ends.append((workflow_id, info.activity_type, info.is_local, counted))
        return counted


class SaturatedFor(HeardEnds):
    """The real scheduler, behind an admission gate that says "saturated" `times` times."""

    def __init__(self, scheduler: Scheduler, times: int, retry_after_s: float = 0.2) -> None:
        super().__init__(scheduler)
        self.refusals_left = times
        self.retry_after_s = retry_after_s

    def place(self, request: PlacementRequest) -> Placement | Refusal:
        if self.refusals_left > 0:
            self.refusals_left -= 1
            return Refusal(
                reason=RefusalReason.SATURATED,
                message="the fleet is saturated for tier 3",
                model=request.model,
                tenant=request.tenant,
                retry_after_s=self.retry_after_s,
                retryable=True,
            )
        return self.scheduler.place(request)


async def test_step_waits_for_admission_when_the_fleet_is_saturated(
    temporal_client: Client, tmp_path: Path
):
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        s.control.activities.scheduler = SaturatedFor(s.control.scheduler, times=2)
        task = wf.StepsInput(
            spec=task_spec(tenant="globex", expected_steps=1), model=MODEL, steps=1
        )
        handle = await s.start(wf.MultiStepAgent.run, task)
        out = await handle.result()
        assert out.replicas == ["only/0"]
        breakdown = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
        [step] = breakdown.steps
        assert step.admission_waits == 2 and step.outcome == "ok" and breakdown.retries == 0
        history = await handle.fetch_history()
        timers = [e for e in history.events if e.event_type == EventType.EVENT_TYPE_TIMER_STARTED]
        assert len(timers) == 2
        await assert_replays(handle)


async def test_admission_wait_that_would_pass_the_deadline_fails_fast(
    temporal_client: Client, tmp_path: Path
):
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        s.control.activities.scheduler = SaturatedFor(s.control.scheduler, times=100)
        # A gate that never opens within the budget: the step waits while it can, then fails.
        task = wf.StepsInput(
            spec=task_spec(expected_steps=1, latency_budget_s=2), model=MODEL, steps=1
        )
        handle = await s.start(wf.MultiStepAgent.run, task)
        with pytest.raises(WorkflowFailureError) as failed:
            await handle.result()
        cause = failed.value.cause
        assert (
            isinstance(cause, ApplicationError)
            and cause.type == errors.TaskErrorType.PLACEMENT_REFUSED
        )
        assert "saturated" in cause.message


def _timer_waits(history: Any) -> list[float]:
    """The durations of the workflow's timers, in the order they started."""
    return [
        e.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta().total_seconds()
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_TIMER_STARTED
    ]


async def test_a_step_with_a_deadline_waits_for_admission_past_the_count_until_admitted(
    temporal_client: Client, tmp_path: Path
):
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        times = MAX_ADMISSION_WAITS + 4
        s.control.activities.scheduler = SaturatedFor(
            s.control.scheduler, times=times, retry_after_s=0.05
        )
        # Held past the count of waits a step without a deadline gets, well within its own.
        task = wf.StepsInput(
            spec=task_spec(tenant="globex", expected_steps=1, latency_budget_s=600),
            model=MODEL,
            steps=1,
        )
        handle = await s.start(wf.MultiStepAgent.run, task)
        await asyncio.wait_for(handle.result(), 120)
        [step] = (await handle.query(SPEND_QUERY, result_type=SpendBreakdown)).steps
        assert step.admission_waits == times and step.outcome == "ok"
        waits = _timer_waits(await handle.fetch_history())
        assert len(waits) == times
        assert waits[:MAX_ADMISSION_WAITS] == [0.05] * MAX_ADMISSION_WAITS
        # Then each wait is a tenth of the step's wait so far, which grows with them.
        stretched = waits[MAX_ADMISSION_WAITS:]
        assert all(wait > 0.05 for wait in stretched), stretched
        assert stretched == sorted(stretched), stretched
        assert stretched[0] >= ADMISSION_WAIT_STRETCH * sum(waits[:MAX_ADMISSION_WAITS])
        await assert_replays(handle)


async def test_a_step_without_a_deadline_stops_waiting_for_admission_at_the_count(
    temporal_client: Client, tmp_path: Path
):
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        s.control.activities.scheduler = SaturatedFor(
            s.control.scheduler, times=MAX_ADMISSION_WAITS + 4, retry_after_s=0.05
        )
        task = wf.StepsInput(
            spec=task_spec(tenant="globex", expected_steps=1), model=MODEL, steps=1
        )
        handle = await s.start(wf.MultiStepAgent.run, task)
        with pytest.raises(WorkflowFailureError) as failed:
            await asyncio.wait_for(handle.result(), 120)
        cause = failed.value.cause
        assert isinstance(cause, ApplicationError)
        assert cause.type == errors.TaskErrorType.PLACEMENT_REFUSED
        assert "saturated" in cause.message
        assert _timer_waits(await handle.fetch_history()) == [0.05] * MAX_ADMISSION_WAITS


async def test_the_scheduler_that_placed_a_task_hears_its_end_whoever_writes_its_row(
    temporal_client: Client, tmp_path: Path
):
    # Two workflow workers' processes on one queue: the tasks run on the first, whose
    # scheduler places their calls and counts them; the ledger rows may be written by either
    # (a normal activity goes to any worker that polls for it).
    counting = SchedulerConfig(admission=AdmissionConfig(open_task_kv_by_tier=(100.0,) * 5))
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        placing = ControlPlane(
            s.fleet,
            endpoints={name: sim.base_url for name, sim in s.embedded.sims.items()},
            ledger=s.ledger,
            store=DirectoryContextStore(s.context_dir),
            config=counting,
        )
        queue = f"agents-{uuid.uuid4()}"
        # Eager execution runs a workflow's activity on its own worker when that worker has
        # a free slot, which is no promise (a retry goes through the queue): off here, and
        # one slot for activities, so that most rows are written by the other process.
        runs = await workflow_worker(
            s.client,
            placing,
            workflows=[wf.MultiStepAgent],
            task_queue=queue,
            disable_eager_activity_execution=True,
            max_concurrent_activities=1,
        )
        # Another process: its own connection (one client takes one worker per queue).
        elsewhere = await Client.connect(
            s.client.service_client.config.target_host,
            namespace=s.client.namespace,
            data_converter=s.client.data_converter,
        )
        rows_elsewhere = Worker(
            elsewhere, task_queue=queue, activities=[s.control.activities.record_task]
        )
        async with placing, runs, rows_elsewhere:
            handles = [
                await s.client.start_workflow(
                    wf.MultiStepAgent.run,
                    wf.StepsInput(spec=task_spec(expected_steps=2), model=MODEL, steps=2),
                    id=f"task-{uuid.uuid4()}",
                    task_queue=queue,
                )
                for _ in range(8)
            ]
            for handle in handles:
                await asyncio.wait_for(handle.result(), 60)
                row, _ = await s.rows(handle)
                assert row is not None and row.outcome == TaskOutcome.SUCCEEDED
            # The placing scheduler counted each task and heard each end: none is left open.
            # (Heard only with the ledger row, most would still count here.)
            still_open = [h.id for h in handles if placing.scheduler.end_task(h.id)]
            assert still_open == []


async def test_a_terminated_task_stops_counting_open_at_the_next_check(
    temporal_client: Client, tmp_path: Path
):
    # A terminated workflow runs no code, so its end never reaches the scheduler that counts
    # it open for KV admission; Temporal's visibility says it stopped running.
    watchful = SchedulerConfig(
        admission=AdmissionConfig(open_task_kv_by_tier=(100.0,) * 5, open_task_check_s=0.2)
    )
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")], scheduler=watchful) as s:
        task = wf.StepsInput(spec=task_spec(expected_steps=2), model=MODEL, steps=1)
        waiting = await s.start(wf.AnswerThenGiveUp.run, task)
        terminated = await s.start(wf.AnswerThenGiveUp.run, task)
        scheduler = s.control.scheduler

        def counted() -> set[str]:
            return set(scheduler.idle_open_tasks(0.0))

        await eventually(
            lambda: counted() == {waiting.id, terminated.id},
            within=30,
            what="both tasks' first calls placed and counted open",
        )
        await terminated.terminate("an operator stopped it")
        await eventually(
            lambda: counted() == {waiting.id},
            within=30,
            what="the terminated task no longer counted open",
        )
        watch = s.control.open_task_watch
        assert watch is not None and watch.ended == 1
        # The task that still runs is looked up again and again, and stays counted.
        looked_up = watch.lookups
        await eventually(
            lambda: watch.lookups >= looked_up + 3, within=30, what="three more lookups"
        )
        assert counted() == {waiting.id} and watch.ended == 1
        await waiting.signal(wf.AnswerThenGiveUp.give_up)
        with contextlib.suppress(WorkflowFailureError):
            await asyncio.wait_for(waiting.result(), 60)
        assert counted() == set()  # its own end reached the scheduler


async def test_a_tasks_end_releases_its_kv_on_the_engine_that_served_it(
    temporal_client: Client, tmp_path: Path
):
    # A pool whose engines run kvflow's engine scheduler (the simulator honours it as vLLM
    # with TaskEndScheduler does): the workflow's close reaches the engine of its last call.
    fleet = fleet_for([PoolPlan("only")]).model_dump()
    fleet["pools"][0]["task_end_release"] = True
    async with fleet_stack(
        temporal_client, tmp_path, [PoolPlan("only")], fleet=Fleet.model_validate(fleet)
    ) as s:
        task = wf.StepsInput(spec=task_spec(expected_steps=2), model=MODEL, steps=2)
        handle = await s.start(wf.MultiStepAgent.run, task)
        await asyncio.wait_for(handle.result(), 60)
        await asyncio.wait_for(s.control.releases.drain(), 30)
        assert (s.control.releases.sent, s.control.releases.failed) == (1, 0)
        server = s.embedded.sims["only/0"]
        assert isinstance(server, SimServer) and server.sim is not None
        # Every block the task's calls filled was its own, and free once they ended.
        assert server.sim.released_blocks > 0


class EndTaskBreaks(HeardEnds):
    """The real scheduler, whose `end_task` fails every time it is called from the workflow."""

    def end_task(self, workflow_id: str) -> bool:
        counted = super().end_task(workflow_id)
        if activity.info().is_local:
            raise RuntimeError("the scheduler's state is broken")
        return counted


async def test_a_task_ends_with_its_outcome_and_row_when_the_scheduler_cannot_hear_it(
    temporal_client: Client, tmp_path: Path
):
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        broken = EndTaskBreaks(s.control.scheduler)
        s.control.activities.scheduler = broken
        task = wf.StepsInput(spec=task_spec(expected_steps=1), model=MODEL, steps=1)
        handle = await s.start(wf.MultiStepAgent.run, task)
        out = await asyncio.wait_for(handle.result(), 60)
        assert out.replicas == ["only/0"]
        # Every try of the local activity failed; the task still closed, row written.
        local = [end for end in broken.ends if end[2]]
        assert len(local) == LOCAL_RETRY.maximum_attempts, broken.ends
        row, _ = await s.rows(handle)
        assert row is not None and row.outcome == TaskOutcome.SUCCEEDED


def _context(word: str, words: int = 600) -> str:
    """A system prompt of `words` words that differs from every other from its first word."""
    return " ".join(f"{word}{n % 17}" for n in range(words))


async def test_a_task_that_fails_frees_its_kv_share_for_the_task_admission_held(
    temporal_client: Client, tmp_path: Path
):
    pools = [PoolPlan("only")]
    held_ctx, first_ctx = _context("waiting"), _context("failing")
    tokenizer = FleetTokenizers(fleet_for(pools)).for_model(MODEL)
    prompt = len(await tokenizer.encode_chat([{"role": "system", "content": first_ctx}]))
    assert prompt > 500, prompt
    block_size = 16
    capacity = block_size * kv_capacity_blocks(
        fleet_for(pools).pools[0], BUILTIN_MODELS[MODEL], block_size, SchedulerConfig()
    )
    # Tier 3 may open tasks up to 1.5 prompts' KV: one task at a time. (The scraped cache is
    # within a few per cent of the estimate; the window is half a prompt wide either way.)
    multiple = 1.5 * prompt / capacity
    admission = AdmissionConfig(open_task_kv_by_tier=(multiple,) * 5, open_task_retry_after_s=0.2)
    config = SchedulerConfig(admission=admission)
    async with fleet_stack(temporal_client, tmp_path, pools, scheduler=config) as s:
        heard = HeardEnds(s.control.scheduler)
        s.control.activities.scheduler = heard
        first = await s.start(
            wf.AnswerThenGiveUp.run,
            wf.StepsInput(
                spec=task_spec(tenant="globex", expected_steps=3), model=MODEL, context=first_ctx
            ),
        )

        async def answered() -> bool:
            spend = await first.query(SPEND_QUERY, result_type=SpendBreakdown)
            return bool(spend.steps) and spend.steps[0].outcome == "ok"

        await eventually(answered, within=30, what="the first task's model call")
        held = await s.start(
            wf.MultiStepAgent.run,
            wf.StepsInput(
                spec=task_spec(tenant="globex", expected_steps=1, latency_budget_s=60),
                model=MODEL,
                steps=1,
                context=held_ctx,
            ),
        )

        async def waiting() -> bool:
            spend = await held.query(SPEND_QUERY, result_type=SpendBreakdown)
            return bool(spend.steps) and spend.steps[0].admission_waits >= 2

        await eventually(waiting, within=30, what="admission holding the second task")
        # The first task fails long before the held one's deadline: its end makes room.
        await first.signal(wf.AnswerThenGiveUp.give_up)
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(first.result(), 30)
        out = await asyncio.wait_for(held.result(), 60)
        assert out.replicas == ["only/0"]
        [step] = (await held.query(SPEND_QUERY, result_type=SpendBreakdown)).steps
        assert step.outcome == "ok" and step.admission_waits >= 2
        # The scheduler heard the end from the task's own worker (a local activity), first.
        ends = [end for end in heard.ends if end[0] == first.id]
        assert ends[0] == (first.id, END_TASK_ACTIVITY, True, True), heard.ends
        await assert_replays(first)


async def test_gpu_worker_that_shuts_down_mid_call_hands_it_back_and_it_is_replaced(
    temporal_client: Client, tmp_path: Path
):
    pools = [
        PoolPlan("leaving", gpu="L4", prices=("0.05", "0.005", "0.15")),
        PoolPlan("staying", gpu="H100", prices=("0.40", "0.04", "1.20")),
    ]
    async with fleet_stack(temporal_client, tmp_path, pools) as s:
        task = wf.StepsInput(
            spec=task_spec(expected_steps=1), model=MODEL, steps=1, max_tokens=3000
        )
        handle = await s.start(wf.MultiStepAgent.run, task)
        # Wait until the call runs on the cheap replica, then shut its GPU worker down.
        await eventually(
            lambda: _heartbeated(handle), within=10, what="the call heartbeats its progress"
        )
        await s.gpu_workers["leaving/0"].shutdown()
        out = await handle.result()
        assert out.replicas == ["staying/0"]
        breakdown = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
        first, second = breakdown.steps[0].attempts
        assert first.replica == "leaving/0" and first.outcome == "ReplicaShuttingDown"
        assert second.replica == "staying/0" and second.outcome == "ok"
        # The handed-back call continued from what the leaving replica had produced.
        assert second.reused_tokens > 0
        assert second.completion_tokens == 3000 - second.reused_tokens


async def test_kv_events_from_the_engines_make_the_prefix_index_precise(
    temporal_client: Client, tmp_path: Path
):
    # Two replicas that publish vLLM's KV-cache events, listed in the fleet as a real
    # deployment would list its vLLM servers.
    sockets = Path(tempfile.mkdtemp(prefix="kvflow-kv-"))  # ipc paths must stay short
    events = [f"ipc://{sockets}/{i}.sock" for i in range(2)]
    sims = [
        SimServer(
            ServerSettings(
                gpu="H100",
                models=[BUILTIN_MODELS[MODEL]],
                time_scale=20.0,
                seed=i,
                engine=EngineConfig(block_size=16, max_model_len=4096),
                kv_events_endpoint=events[i],
                replica_name=f"evented/{i}",
            )
        ).start()
        for i in range(2)
    ]
    try:
        fleet = Fleet(
            models=[BUILTIN_MODELS[MODEL]],
            pools=[
                Pool(
                    name="evented",
                    gpu="H100",
                    replicas=2,
                    endpoints=[sim.base_url for sim in sims],
                    kv_events=events,
                    price_per_gpu_hour_usd=Decimal("2"),
                    token_prices=TokenPrices(
                        input_per_mtok_usd=Decimal("0.2"),
                        cached_input_per_mtok_usd=Decimal("0.02"),
                        output_per_mtok_usd=Decimal("0.6"),
                    ),
                    warm_models=[MODEL],
                )
            ],
            tenants=[Tenant(name="acme", tier=1)],
        )
        async with fleet_stack(temporal_client, tmp_path, fleet=fleet) as s:
            task = wf.StepsInput(spec=task_spec(expected_steps=3), model=MODEL, steps=3)
            handle = await s.start(wf.MultiStepAgent.run, task)
            out = await handle.result()
            status = {r.replica: r for r in s.control.scheduler.status()}
            used = status[out.replicas[-1]]
            # The engine's own account of what it cached reached the index.
            assert used.precise and used.blocks_indexed > 0
            assert sum(sub.events for sub in s.control.kv_subscribers) > 0
    finally:
        for sim in sims:
            sim.stop()


async def test_cancelled_task_runs_its_compensations_and_is_recorded_as_cancelled(
    temporal_client: Client, tmp_path: Path
):
    wf.REFUNDS.clear()
    wf.REVERSED.clear()
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only", gpu="L4")]) as s:
        refund = wf.Refund(account="C-3", amount_cents=900)
        task = refund_task(refund, expected_steps=2, max_tokens=3000)
        handle = await s.start(wf.RefundThenReply.run, task)
        # Cancel while the reply is being written (after the refund went out).
        await eventually(lambda: _inferring(handle), within=10, what="the model call is in flight")
        await handle.cancel()
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        assert [refund] == wf.REVERSED
        description = await handle.describe()
        assert description.status == WorkflowExecutionStatus.CANCELED
        row = await s.ledger.task(handle.id, description.run_id or "")
        assert row is not None and row.outcome == TaskOutcome.CANCELLED
        attrs = (await handle.describe()).typed_search_attributes
        assert attrs.get(search_attributes.OUTCOME) == "cancelled"


async def _last_heartbeat(handle: WorkflowHandle[Any, Any]) -> float:
    pending = (await handle.describe()).raw_description.pending_activities
    return pending[0].last_heartbeat_time.ToNanoseconds() / 1e9 if pending else 0.0


async def _events(handle: WorkflowHandle[Any, Any]) -> list[Any]:
    return [event async for event in handle.fetch_history_events()]


async def test_a_task_cancelled_while_an_undoable_tool_runs_waits_for_it_and_undoes_it(
    temporal_client: Client, tmp_path: Path
):
    # The refund tool never heartbeats, so the cancellation cannot stop it: it issues the
    # refund a second later whatever the workflow does. Leaving it there would leave a refund
    # no compensation reverses.
    wf.REFUNDS.clear()
    wf.REVERSED.clear()
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")]) as s:
        refund = wf.Refund(account="C-slow", amount_cents=700)
        task = refund_task(refund, expected_steps=1)
        handle = await s.start(wf.SlowRefundThenReply.run, task)
        await eventually(
            lambda: refund.account in wf.REFUNDS_STARTED, within=20, what="the refund starts"
        )
        await handle.cancel()
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        # The refund went out and was reversed; the reply was never asked for.
        assert [refund] == wf.REFUNDS and [refund] == wf.REVERSED
        description = await handle.describe()
        assert description.status == WorkflowExecutionStatus.CANCELED
        events = await _events(handle)
        scheduled = [
            (i, e.activity_task_scheduled_event_attributes.activity_type.name)
            for i, e in enumerate(events)
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        ]
        assert INFER_ACTIVITY not in [name for _, name in scheduled]
        tools = [(i, name) for i, name in scheduled if not name.startswith("kvflow.")]
        assert [name for _, name in tools] == ["issue_refund_slowly", "reverse_refund"]
        # The reversal was scheduled once the refund had completed, not while it ran.
        completed = [e.event_type for e in events].index(
            EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
        )
        assert completed < tools[1][0]
        row = await s.ledger.task(handle.id, description.run_id or "")
        assert row is not None and row.outcome == TaskOutcome.CANCELLED
        await assert_replays(handle)


@pytest.mark.parametrize("ending", ["answered", "cut"])
async def test_a_task_cancelled_as_its_call_ends_otherwise_stops_there_as_cancelled(
    temporal_client: Client, tmp_path: Path, ending: str
):
    """The call's own end wins the race with the cancellation: the task still ends CANCELED.

    The reply's stream is held at the proxy until the workflow has asked the GPU worker to
    stop the call, then let go at once, before the worker's next heartbeat brings it the
    cancellation: the call completes (`answered`) or fails as a cut stream does (`cut`) after
    its cancellation was requested, which Temporal's SDK hands the workflow as an ordinary
    answer or failure. The task must neither go on to its follow-up call nor re-place the
    cut one; its refund is reversed, and what the reply cost is its spend.
    """
    sim = SimServer(
        ServerSettings(
            gpu="H100",
            models=[BUILTIN_MODELS[MODEL]],
            time_scale=20.0,
            engine=EngineConfig(block_size=16, max_model_len=4096),
        )
    ).start()
    proxy = FaultyProxy(sim.base_url).start()
    fleet = fleet_for([PoolPlan("only")])
    pool = fleet.pools[0].model_copy(update={"endpoints": [proxy.base_url]})
    fleet = fleet.model_copy(update={"pools": [pool]})
    try:
        async with fleet_stack(temporal_client, tmp_path, [PoolPlan("only")], fleet=fleet) as s:
            for attempt in range(1, 4):
                wf.REVERSED.clear()
                proxy.holding.clear()
                proxy.release.clear()
                proxy.cut_on_release = ending == "cut"
                proxy.fault = Fault(hold_after_chunks=4)
                refund = wf.Refund(account=f"C-race-{attempt}", amount_cents=500)
                task = refund_task(refund, expected_steps=3, max_tokens=32)
                handle = await s.start(wf.RefundReplyFollowUp.run, task)
                await eventually(proxy.holding.is_set, within=20, what="the reply is streaming")
                # Cancel just after a heartbeat reached the server: the GPU worker's next one,
                # which would bring it the cancellation, is a heartbeat interval away.
                beat = await _last_heartbeat(handle)
                with contextlib.suppress(AssertionError):
                    await eventually(
                        functools.partial(_heartbeat_after, handle, beat),
                        within=3,
                        what="a heartbeat",
                    )
                await handle.cancel()
                await eventually(
                    functools.partial(
                        _has_event, handle, EventType.EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED
                    ),
                    within=10,
                    what="the workflow asks the GPU worker to stop the reply",
                    interval=0.01,
                )
                proxy.fault = Fault()
                proxy.release.set()
                with pytest.raises(WorkflowFailureError):
                    await handle.result()
                events = await _events(handle)
                kinds = [event.event_type for event in events]
                call_end = (
                    EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
                    if ending == "answered"
                    else EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED
                )
                if (
                    call_end
                    in kinds[kinds.index(EventType.EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED) :]
                ):
                    break  # the race this test is about: the call ended after the request
            else:
                pytest.fail("the GPU worker heard of the cancellation first in all 3 tries")
            description = await handle.describe()
            assert description.status == WorkflowExecutionStatus.CANCELED
            scheduled = [
                e.activity_task_scheduled_event_attributes.activity_type.name
                for e in events
                if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
            ]
            # The refund, the reply and the refund's reversal: no follow-up call, no re-placement.
            assert scheduled.count(INFER_ACTIVITY) == 1, scheduled
            assert [refund] == wf.REVERSED
            row = await s.ledger.task(handle.id, description.run_id or "")
            assert row is not None and row.outcome == TaskOutcome.CANCELLED
            # The reply's one attempt is the cancelled task's spend: answered in full and
            # billed as such, or cut and billed as waste.
            assert row.attempts == 1 and row.spend_micros > 0
            assert row.wasted_micros == (0 if ending == "answered" else row.spend_micros)
            spend = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
            assert spend.outcome == "cancelled" and spend.spend_micros == row.spend_micros
            outcomes = {
                step.name: step.outcome for step in spend.steps if step.kind != "compensation"
            }
            assert outcomes == {"refund": "ok", "reply": "cancelled"}
            await assert_replays(handle)
    finally:
        proxy.stop()
        sim.stop()


async def _heartbeat_after(handle: WorkflowHandle[Any, Any], beat: float) -> bool:
    return await _last_heartbeat(handle) > beat


async def _has_event(handle: WorkflowHandle[Any, Any], kind: EventType.ValueType) -> bool:
    return any(event.event_type == kind for event in await _events(handle))


async def test_gpu_worker_process_killed_mid_call_is_billed_and_the_call_resumes_elsewhere(
    temporal_env: WorkflowEnvironment, tmp_path: Path
):
    client = temporal_env.client
    sims = [
        SimServer(
            ServerSettings(
                gpu=gpu,
                models=[BUILTIN_MODELS[MODEL]],
                time_scale=20.0,
                seed=i,
                engine=EngineConfig(block_size=16, max_model_len=8192),
            )
        ).start()
        for i, gpu in enumerate(("L4", "H100"))
    ]
    ledger_url = f"sqlite:///{tmp_path}/ledger.db"
    fleet_file = tmp_path / "fleet.toml"
    fleet_file.write_text(
        f"""
[[models]]
name = "{MODEL}"
parameters_b = 1.2
layers = 16
kv_heads = 8
head_dim = 64
context_length = 32768

[[pools]]
name = "doomed"
gpu = "L4"
replicas = 1
endpoints = ["{sims[0].base_url}"]
price_per_gpu_hour_usd = "0.8"
warm_models = ["{MODEL}"]
[pools.token_prices]
input_per_mtok_usd = "0.05"
cached_input_per_mtok_usd = "0.005"
output_per_mtok_usd = "0.15"

[[pools]]
name = "safe"
gpu = "H100"
replicas = 1
endpoints = ["{sims[1].base_url}"]
price_per_gpu_hour_usd = "2.9"
warm_models = ["{MODEL}"]
[pools.token_prices]
input_per_mtok_usd = "0.40"
cached_input_per_mtok_usd = "0.04"
output_per_mtok_usd = "1.20"

[[tenants]]
name = "acme"
tier = 1
"""
    )
    fleet = load_fleet(fleet_file)
    # The doomed replica's GPU worker is a process of its own, so it can really die.
    env = {**os.environ, "TEMPORAL_ADDRESS": client.service_client.config.target_host}
    worker_log = (tmp_path / "gpu.log").open("w")
    doomed = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "kvflow"),
        "worker",
        "gpu",
        "--fleet",
        str(fleet_file),
        "--replica",
        "doomed/0",
        "--ledger",
        ledger_url,
        "--context-dir",
        str(tmp_path / "context"),  # the stack's store
        "--traces",
        "off",
        env=env,
        stdout=worker_log,
        stderr=subprocess.STDOUT,
    )
    try:
        await eventually(
            lambda: "polls kvflow.gpu.doomed.0" in (tmp_path / "gpu.log").read_text(),
            within=15,
            what="the GPU worker polls its queue",
        )
        # The fleet file's fleet; the plan says only that the stack runs no GPU worker for
        # the doomed replica, whose worker is that process.
        plans = [PoolPlan("doomed", gpu_worker=False)]
        # Clients with kvflow's plugin on the stack's store, as `kvflow worker workflow` has:
        # the dead worker's last heartbeat may be claim-checked, and the workflow reads it.
        async with fleet_stack(
            client, tmp_path, plans, fleet=fleet, ledger_url=ledger_url, plugins=[]
        ) as s:
            task = wf.StepsInput(
                spec=task_spec(expected_steps=1), model=MODEL, steps=1, max_tokens=4000
            )
            handle = await s.start(wf.MultiStepAgent.run, task)
            # Kill it once a heartbeat has carried some output.
            await wait_until_streaming(handle)
            doomed.send_signal(signal.SIGKILL)
            out = await handle.result()
            breakdown = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
            _, attempts = await s.rows(handle)
        assert out.replicas == ["safe/0"]
        first, second = breakdown.steps[0].attempts
        assert first.replica == "doomed/0" and first.outcome == "TimeoutHeartbeat"
        assert second.reused_tokens > 0  # resumed from the dead worker's last heartbeat
        # Finance sees both attempts: the dead worker's row was written from its heartbeat.
        by_replica = {a.replica: a for a in attempts}
        assert set(by_replica) == {"doomed/0", "safe/0"}
        assert by_replica["doomed/0"].error_type == "TimeoutHeartbeat"
        assert by_replica["doomed/0"].cost_micros == first.cost_micros > 0
        assert sum(a.cost_micros for a in attempts) == breakdown.spend_micros
    finally:
        if doomed.returncode is None:
            doomed.kill()
        await doomed.wait()
        worker_log.close()
        for sim in sims:
            sim.stop()

"""The three samples, end to end: the example fleet.toml simulated, a real Temporal dev server.

One stack serves the module, as `kvflow demo` does: six simulated replicas (2×H200, 2×H100,
2×L4) with a GPU worker each, a workflow worker with the three samples registered, and a SQLite
ledger. Each test runs a sample's example input and checks what its user would see.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError

import samples.code_review as code_review
import samples.research_assistant as research
import samples.support_triage as support
from kvflow.activities.wire import INLINE_LIMIT_BYTES
from kvflow.ledger.records import AttemptRecord, TaskOutcome, TaskRecord
from kvflow.workers.config import load_fleet
from kvflow.workflows import errors
from kvflow.workflows.agent import SPEND_QUERY, SpendBreakdown
from samples.support_triage import activities as desk
from tests.public_api import internal_imports
from tests.stacks import Stack, assert_replays, fails_for_its_deadline, fleet_stack
from tests.waiting import slowdown

FLEET_FILE = Path(__file__).resolve().parent.parent / "fleet.toml"
SAMPLES = [research, support, code_review]
WORKFLOWS = [s.WORKFLOW for s in SAMPLES]


@pytest.fixture(scope="module")
async def stack(
    temporal_client: Client, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    # Clients and workers share the context store (no plugin besides kvflow's): payloads over
    # 2 KB travel as references.
    async with fleet_stack(
        temporal_client,
        tmp_path_factory.mktemp("samples"),
        fleet=load_fleet(FLEET_FILE),
        workflows=WORKFLOWS,
        activities=[a for s in SAMPLES for a in s.ACTIVITIES],
        plugins=[],
    ) as s:
        yield s


def assert_ledger_adds_up(task: TaskRecord, attempts: list[AttemptRecord], spend: int) -> None:
    assert attempts and all(a.cost_micros > 0 for a in attempts)
    assert task.spend_micros == sum(a.cost_micros for a in attempts) == spend
    assert task.attempts == len(attempts)


async def test_research_assistant_answers_after_parallel_sub_questions_on_a_cached_source(
    stack: Stack,
):
    task = research.example_input(random.Random(7), "acme")
    assert len(task.source.encode()) > INLINE_LIMIT_BYTES
    handle = await stack.start(research.WORKFLOW.run, task)
    answer = await handle.result()

    assert answer.answer and answer.question == task.question
    assert 3 <= len(answer.sub_questions) == len(answer.findings) <= 5
    assert 1 <= answer.critique_rounds <= task.max_critique_rounds

    spend = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
    names = [s.name for s in spend.steps]
    subs = [f"sub-question {i}" for i in range(1, len(answer.sub_questions) + 1)]
    assert names[: 2 + len(subs)] == ["plan", *subs, "draft"]
    assert names[-1] == "answer" and all(s.outcome == "ok" for s in spend.steps)
    assert sum(n.startswith("critique") for n in names) == answer.critique_rounds

    # Fan-out: every sub-question was dispatched before the first of them came back.
    history = await handle.fetch_history()
    summary_of = step_summary_reader(handle)
    scheduled = {
        e.event_id
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and "'sub-question" in summary_of(e)
    }
    completed = [
        e.event_id
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
        and e.activity_task_completed_event_attributes.scheduled_event_id in scheduled
    ]
    assert len(scheduled) == len(completed) == len(subs)
    assert max(scheduled) < min(completed)

    # The shared source stayed cached: later steps were billed for cached input tokens.
    row, attempts = await stack.rows(handle)
    assert row is not None
    assert row.outcome == TaskOutcome.SUCCEEDED and row.workflow_type == "ResearchAssistant"
    assert_ledger_adds_up(row, attempts, spend.spend_micros)
    later = [a for a in attempts if a.step != "plan"]
    print(
        f"\nresearch: {len(spend.steps)} steps, {answer.critique_rounds} critique rounds, "
        f"cached {sum(a.cached_tokens for a in later):,} of {sum(a.prompt_tokens for a in later):,}"
        f" prompt tokens after the plan, replicas {sorted({a.replica for a in attempts})}"
    )
    assert sum(a.cached_tokens for a in later) > sum(a.prompt_tokens for a in later) / 2
    await assert_replays(handle, WORKFLOWS)


def step_summary_reader(handle: WorkflowHandle[Any, Any]) -> Any:
    converter = handle._client.data_converter.payload_converter

    def summary(event: Any) -> str:
        if not event.user_metadata.HasField("summary"):
            return ""
        return str(converter.from_payload(event.user_metadata.summary, str))

    return summary


async def test_support_ticket_is_refunded_and_answered(stack: Stack):
    account = _account(stack)
    task = _ticket(account, disputed=account.recent_charges_cents[0])
    handle = await stack.start(support.WORKFLOW.run, task)
    result = await handle.result()

    assert result.refund is not None and not result.refund.reversed
    assert desk.ACCOUNTS[account.id].credit_cents == account.recent_charges_cents[0]
    assert result.reply and result.delivery == f"queued for {account.email}"
    assert [r.to for r in desk.OUTBOX if r.ticket_id == task.ticket.ticket_id] == [account.email]

    spend = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
    assert [(s.kind, s.name) for s in spend.steps] == [
        ("infer", "classify"),
        ("tool", "look up account"),
        ("tool", "issue refund"),
        ("infer", "draft reply"),
        ("tool", "send reply"),
    ]
    row, attempts = await stack.rows(handle)
    assert row is not None
    assert row.outcome == TaskOutcome.SUCCEEDED and row.steps == 5
    assert_ledger_adds_up(row, attempts, spend.spend_micros)
    await assert_replays(handle, WORKFLOWS)


async def test_rejected_reply_reverses_the_refund_and_the_task_is_compensated(stack: Stack):
    account = _account(stack)
    desk.REJECTED_ADDRESSES.add(account.email)
    task = _ticket(account, disputed=account.recent_charges_cents[1])
    handle = await stack.start(support.WORKFLOW.run, task)
    with pytest.raises(WorkflowFailureError) as failed:
        await handle.result()

    cause = failed.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == errors.TaskErrorType.TOOL_FAILED
    assert "'send reply'" in cause.message and "rejected" in cause.message
    refund = desk.REFUNDS[f"{handle.id}/refund"]
    assert refund.reversed and desk.ACCOUNTS[account.id].credit_cents == 0
    assert not [r for r in desk.OUTBOX if r.ticket_id == task.ticket.ticket_id]

    spend = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
    assert spend.outcome == "compensated"
    assert [(s.kind, s.name, s.outcome) for s in spend.steps[-2:]] == [
        ("tool", "send reply", "failed"),
        ("compensation", "undo issue refund", "ok"),
    ]
    row, attempts = await stack.rows(handle)
    assert row is not None
    assert row.outcome == TaskOutcome.COMPENSATED
    assert_ledger_adds_up(row, attempts, spend.spend_micros)
    await assert_replays(handle, WORKFLOWS)


def _account(stack: Stack) -> desk.Account:
    """A fresh account in the desk's store, so tests do not share credit or refunds."""
    base = desk.example_accounts()[0]
    suffix = uuid.uuid4().hex[:8]
    account = base.model_copy(update={"id": f"ACC-{suffix}", "email": f"{suffix}@example.com"})
    desk.ACCOUNTS[account.id] = account
    return account


def _ticket(account: desk.Account, *, disputed: int) -> support.SupportTask:
    task = support.example_input(random.Random(3), "globex")
    ticket = task.ticket.model_copy(
        update={
            "ticket_id": f"T-{uuid.uuid4().hex[:8]}",
            "account_id": account.id,
            "disputed_charge_cents": disputed,
        }
    )
    return task.model_copy(update={"ticket": ticket})


async def test_code_review_finishes_within_its_tight_budget_and_names_the_models(stack: Stack):
    task = code_review.example_input(random.Random(11), "initech")
    assert len(task.diff.encode()) > 2 * INLINE_LIMIT_BYTES
    assert task.spec.latency_budget_s is not None
    # The sample's tight budget (2.5 s a step) is what is tested; a slow machine stretches it.
    budget = task.spec.latency_budget_s * slowdown()
    task.spec.latency_budget_s = budget
    handle = await stack.start(code_review.WORKFLOW.run, task)
    report = await handle.result()

    assert [r.file for r in report.files] == task.files
    assert all(r.comments for r in report.files) and report.summary
    assert report.models <= {"llama-3.1-8b", "llama-3.2-1b"}

    description = await handle.describe()
    assert description.close_time is not None
    took = (description.close_time - description.start_time).total_seconds()
    print(
        f"\ncode review: {len(task.files)} files, {len(task.diff):,} B diff, {took:.1f} s of "
        f"{budget:g} s; models "
        + ", ".join(f"{r.file}={r.model}@{r.replica}" for r in report.files)
        + f", summary={report.summary_model}"
    )

    # The budget held by the workflow's clock, as the history records it (a bound on this
    # machine's wall clock would measure the shared cores instead): every model call ran under
    # a start-to-close limit cut from what was left of the budget, shrinking step by step; no
    # call outran its limit, and the task closed as completed after the last call.
    events = (await handle.fetch_history()).events
    limits = {
        e.event_id: e.activity_task_scheduled_event_attributes.start_to_close_timeout.ToTimedelta()
        for e in events
        if e.activity_task_scheduled_event_attributes.activity_type.name == "kvflow.infer"
    }
    assert len(limits) >= len(task.files) + 1
    in_order = list(limits.values())
    assert all(timedelta(seconds=1) <= limit <= timedelta(seconds=budget) for limit in in_order)
    assert in_order == sorted(in_order, reverse=True)
    kinds = [e.event_type for e in events]
    assert EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT not in kinds
    completed = [
        e.event_id
        for e in events
        if e.activity_task_completed_event_attributes.scheduled_event_id in limits
    ]
    assert completed and max(completed) > max(limits)
    assert kinds[-1] == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED

    # The ledger bills each step to the model that answered it, and each step's placement
    # reason says when the scheduler degraded it to the fallback to fit the deadline.
    row, attempts = await stack.rows(handle)
    assert row is not None
    assert row.outcome == TaskOutcome.SUCCEEDED
    served = {a.step: a.model for a in attempts if a.outcome == "ok"}
    assert served == {
        **{f"review {r.file}": r.model for r in report.files},
        "summary": report.summary_model,
    }
    spend = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
    for step in spend.steps:
        degraded = "degraded from llama-3.1-8b" in (step.reason or "")
        assert degraded == (served[step.name] == "llama-3.2-1b"), step.reason
    assert_ledger_adds_up(row, attempts, spend.spend_micros)
    await assert_replays(handle, WORKFLOWS)


async def test_code_review_with_an_unmeetable_deadline_fails_fast_without_spending(stack: Stack):
    task = code_review.example_input(random.Random(12), "initech")
    task.spec.latency_budget_s = 0.05
    # A try whose budget was spent before the scheduler was asked cannot show its refusal.
    handle, cause = await fails_for_its_deadline(
        functools.partial(stack.start, code_review.WORKFLOW.run, task),
        started_late=lambda message: "latency budget is spent" in message,
    )
    assert f"step 1/{len(task.files) + 1} 'review {task.files[0]}'" in cause.message
    assert "llama-3.2-1b" in cause.message  # the fallback was tried too
    run_id = (await handle.describe()).run_id or ""
    row = await stack.ledger.task(handle.id, run_id)
    assert row is not None and row.outcome == TaskOutcome.FAILED
    assert row.spend_micros == 0 and not await stack.ledger.attempts_for(handle.id, run_id)


@pytest.mark.parametrize(
    ("sample", "shows"),
    [
        ("research_assistant", "critique round(s)"),
        ("support_triage", "1. infer classify: ok"),
        ("code_review", "Summary"),
    ],
)
async def test_starter_runs_one_task_against_a_running_stack(
    stack: Stack, temporal_client: Client, sample: str, shows: str
):
    address = temporal_client.service_client.config.target_host
    starter = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        f"samples.{sample}.starter",
        "--address",
        address,
        "--task-queue",
        stack.task_queue,
        "--tenant",
        "globex",
        "--context-dir",
        str(stack.context_dir),
        cwd=FLEET_FILE.parent,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "COLUMNS": "200"},
    )
    output, _ = await asyncio.wait_for(starter.communicate(), timeout=60)
    text = output.decode()
    assert starter.returncode == 0, text
    assert shows in text and "$0." in text


def test_example_inputs_are_the_same_for_the_same_seed():
    for sample in SAMPLES:
        first = sample.example_input(random.Random(42), "acme")
        again = sample.example_input(random.Random(42), "acme")
        assert first == again and first.spec.tenant == "acme"


@pytest.mark.timeout(60)
def test_every_sample_imports_only_kvflows_public_api():
    # A sample is copied into a user's project: it must teach `from kvflow import ...`, and
    # the framework adapter by name, never kvflow's own modules (they may move).
    files = sorted((FLEET_FILE.parent / "samples").rglob("*.py"))
    assert len(files) > 15
    found = [hit for path in files for hit in internal_imports(path)]
    assert not found, "samples import below kvflow:\n" + "\n".join(found)


@pytest.mark.timeout(60)
def test_every_sample_starter_connects_through_kvflow_plugin():
    # The starters' shared client and the framework samples' own: KvflowPlugin, as a user's.
    root = FLEET_FILE.parent / "samples"
    for path in [root / "starter.py", *root.glob("*/starter.py"), *root.glob("*/worker.py")]:
        text = path.read_text()
        if "Client.connect(" in text:
            assert "KvflowPlugin(" in text, f"{path} connects without KvflowPlugin"

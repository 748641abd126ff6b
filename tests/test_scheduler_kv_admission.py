"""Admission before a KV collapse: new tasks wait while open tasks' KV outgrows the caches.

With `AdmissionConfig.open_task_kv_by_tier` set, the scheduler counts the tasks it has placed
and not yet seen end (`Scheduler.end_task` when its workflow closes, or
`open_task_idle_s` without a call), each at its last call's prompt and expected output: the
KV that task's next call will come back to. A new task of tier t waits at its first step (`SATURATED`, retryable, `open_task_retry_after_s`)
while that sum and its own prompt exceed the tier's multiple of the KV cache of the replicas
warm for the model. Calls of tasks already running are never held this way.
"""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from kvflow.activities.control_plane import ControlPlaneActivities
from kvflow.ledger import TaskOutcome
from kvflow.scheduler.config import AdmissionConfig, SchedulerConfig
from kvflow.scheduler.core import KV_CAPACITY_REUSE_S, Scheduler
from kvflow.scheduler.placement import Placement, PlacementRequest, RefusalReason
from kvflow.scheduler.state import ReplicaMetrics
from tests.fixtures_ledger import task_record
from tests.test_scheduler_placement import (
    Clock,
    make_fleet,
    placed,
    prompt,
    refused,
    request,
)

BLOCKS, BLOCK = 250, 16
CAPACITY = 4 * BLOCKS * BLOCK
"""KV tokens of the four replicas warm for the 8B model, as each scrape says (16,000)."""
FACTORS = (1.0, 1.0, 0.75, 0.75, 0.75)
"""Tier 1 (acme) starts within the caches' size (16,000 tokens); tier 3 (globex) 12,000."""
PROMPT = 3_000
OUTPUT = 200


def make_scheduler(
    factors: tuple[float, ...] | None = FACTORS, clock: Clock | None = None, **fields: float
) -> Scheduler:
    admission = AdmissionConfig(open_task_kv_by_tier=factors, **fields)
    config = SchedulerConfig(admission=admission)
    scheduler = Scheduler(make_fleet(), config, clock=clock or Clock())
    for name in scheduler.replica_names():
        scheduler.update_metrics(
            name, ReplicaMetrics(running=0, waiting=0, block_size=BLOCK, num_gpu_blocks=BLOCKS)
        )
    return scheduler


def task_call(n: int, tenant: str = "globex", **fields: object) -> PlacementRequest:
    """Task `n`'s first call (of five, unless said): a 3,000-token prompt."""
    values: dict[str, object] = {
        "tenant": tenant,
        "workflow_id": f"task-{n}",
        "steps_remaining": 5,
        "max_output_tokens": OUTPUT,
    }
    values.update(fields)
    return request(prompt(n, PROMPT), **values)


def open_tasks(scheduler: Scheduler, count: int) -> None:
    """Start `count` tier-1 tasks (admitted up to 1×), each holding 3,200 tokens."""
    for n in range(count):
        placed(scheduler.place(task_call(100 + n, tenant="acme")))
    scheduler.settle()


def test_a_new_lower_tier_task_waits_while_open_tasks_hold_its_share_of_the_cache() -> None:
    scheduler = make_scheduler()
    open_tasks(scheduler, 2)  # 6,400 tokens open: with a 3,000-token prompt, within 12,000
    placed(scheduler.place(task_call(1)))
    scheduler.settle()  # 9,600 open: the next one would take it to 12,600, past 12,000
    before = [status.inflight for status in scheduler.status()]
    answer = refused(scheduler.place(task_call(2)))
    assert answer.reason is RefusalReason.SATURATED
    # It waits (the workflow sleeps on a durable timer), at a task's pace, not a batch's.
    assert answer.retryable and answer.retry_after_s == 10.0
    assert "3 open tasks" in answer.message and "9,600 tokens" in answer.message
    assert f"{CAPACITY:,}" in answer.message and "within 0.75×" in answer.message
    assert "nothing was spent" in answer.message
    scheduler.settle()
    assert [status.inflight for status in scheduler.status()] == before
    # Tier 1 is admitted up to the caches' whole size: 12,600 of 16,000.
    placed(scheduler.place(task_call(3, tenant="acme")))


def test_calls_of_a_task_already_running_are_never_held() -> None:
    scheduler = make_scheduler()
    open_tasks(scheduler, 4)  # 12,800 open: past tier 3's 12,000
    refused(scheduler.place(task_call(1)))
    # A running tier-3 task's next call goes on: holding it would waste what it spent.
    placed(scheduler.place(task_call(2, steps_done=1, steps_remaining=4)))
    # So does the retry of a first call that was placed.
    placed(scheduler.place(task_call(3, attempt=2)))


def test_a_task_counts_past_its_declared_last_step_until_it_ends() -> None:
    scheduler = make_scheduler()
    open_tasks(scheduler, 4)
    refused(scheduler.place(task_call(1)))
    for n in range(100, 103):
        # Its declared last step, then one more: the conversation is still coming back.
        for done in (4, 5):
            last = task_call(n, tenant="acme", steps_done=done, steps_remaining=1)
            placed(scheduler.place(last))
    scheduler.settle()
    refused(scheduler.place(task_call(1)))
    for n in range(100, 103):
        scheduler.end_task(f"task-{n}")  # one task open: 3,200 tokens
    placed(scheduler.place(task_call(1)))


def test_a_task_that_placed_nothing_for_a_while_is_no_longer_counted() -> None:
    clock = Clock()
    scheduler = make_scheduler(clock=clock, open_task_idle_s=600.0)
    open_tasks(scheduler, 4)
    clock.advance(599.0)
    refused(scheduler.place(task_call(1)))
    clock.advance(2.0)  # the four went silent 601 s ago: they ended, or their KV is gone
    placed(scheduler.place(task_call(1)))


def test_a_task_that_ended_before_its_last_step_makes_room_at_once() -> None:
    scheduler = make_scheduler()
    open_tasks(scheduler, 4)  # 12,800 open
    refused(scheduler.place(task_call(1)))
    # Task 100 failed at its first step; so did a task this scheduler never placed, twice.
    scheduler.end_task("task-100")
    scheduler.end_task("task-100")
    scheduler.end_task("placed-elsewhere")
    refused(scheduler.place(task_call(1)))  # 9,600 + 3,000: still past 12,000
    scheduler.end_task("task-101")
    placed(scheduler.place(task_call(1)))  # 6,400 + 3,000


def test_a_task_that_ends_before_its_placement_settles_is_not_counted() -> None:
    scheduler = make_scheduler()
    open_tasks(scheduler, 2)  # 6,400 open
    placed(scheduler.place(task_call(200, tenant="acme")))  # its booking is not settled yet
    scheduler.end_task("task-200")
    placed(scheduler.place(task_call(1)))  # 9,600 + 3,000 would be past 12,000 had it counted


async def test_writing_a_tasks_ledger_row_ends_it_in_the_scheduler() -> None:
    fleet = make_fleet()
    scheduler = make_scheduler()
    activities = ControlPlaneActivities(scheduler, fleet=fleet, block_size=BLOCK)
    open_tasks(scheduler, 4)
    refused(scheduler.place(task_call(1)))
    for n in (100, 101):
        # No ledger configured: the row is not written, the task still ended.
        failed = task_record(f"task-{n}", tenant="acme", outcome=TaskOutcome.FAILED)
        assert await asyncio.wait_for(activities.record_task(failed), 10) is False
    placed(scheduler.place(task_call(1)))


def test_a_growing_conversation_counts_at_its_latest_size() -> None:
    scheduler = make_scheduler()
    open_tasks(scheduler, 1)  # 3,200
    placed(scheduler.place(task_call(1)))  # 6,400
    scheduler.settle()
    placed(scheduler.place(task_call(2)))  # 9,600
    scheduler.settle()
    # The first tier-1 task comes back with 4,000 tokens: it counts 4,200, not 3,200 + 4,200.
    grown = request(
        prompt(100, 4_000),
        tenant="acme",
        workflow_id="task-100",
        steps_done=1,
        steps_remaining=4,
        max_output_tokens=OUTPUT,
    )
    placed(scheduler.place(grown))
    scheduler.settle()
    # 4,200 + 3,200 + 3,200 open: a third tier-3 task would take it past 12,000.
    assert "10,600 tokens" in refused(scheduler.place(task_call(3))).message


def test_a_cache_that_grows_is_counted_once_the_sum_is_a_second_old() -> None:
    clock = Clock()
    scheduler = make_scheduler(clock=clock)
    open_tasks(scheduler, 2)
    placed(scheduler.place(task_call(1)))
    scheduler.settle()  # 9,600 open: a tier-3 task's 3,000 more pass 12,000
    refused(scheduler.place(task_call(2)))
    # The engines restart with caches twice the size: 24,000 tokens for tier 3.
    for name in scheduler.replica_names():
        scheduler.update_metrics(
            name, ReplicaMetrics(running=0, waiting=0, block_size=BLOCK, num_gpu_blocks=2 * BLOCKS)
        )
    # The sum of the caches is reused for a second (it visits every replica), then redone.
    refused(scheduler.place(task_call(2)))
    clock.advance(KV_CAPACITY_REUSE_S)
    placed(scheduler.place(task_call(2)))


def test_off_by_default_every_task_starts() -> None:
    scheduler = make_scheduler(factors=None)
    for n in range(8):
        placed(scheduler.place(task_call(n)))  # 8 · 3,200 open at the end: 25,600
        scheduler.settle()


def test_thresholds_that_admit_a_lower_tier_longer_are_rejected() -> None:
    with pytest.raises(ValidationError, match="open_task_kv_by_tier must be positive"):
        AdmissionConfig(open_task_kv_by_tier=(1.0, 1.0, 2.0, 1.0, 1.0))


def test_a_system_prompt_the_tasks_share_is_counted_once() -> None:
    scheduler = make_scheduler()
    system = prompt(7, 2_000)

    def shared_call(n: int) -> PlacementRequest:
        return request(
            system + prompt(n, 1_000),
            tenant="globex",
            workflow_id=f"task-{n}",
            steps_remaining=5,
            max_output_tokens=OUTPUT,
        )

    started = 0
    while isinstance(answer := scheduler.place(shared_call(started)), Placement):
        scheduler.settle()
        started += 1
    # The first task brings the system prompt (3,200 tokens its own); each later one adds its
    # 1,000 tokens and answer (1,200): (12,000 − 3,200) / 1,200 more fit, not 12,000 / 3,200.
    # The index holds whole entries of blocks: the shared part is the system prompt rounded
    # down to one.
    prefix = SchedulerConfig().prefix
    entry = prefix.block_size * prefix.index_stride
    own = 3_200 - 2_000 // entry * entry
    assert started == 1 + (12_000 - 3_200) // own == 8
    assert f"{3_200 + (started - 1) * own:,} tokens" in refused(answer).message


def test_with_slack_holding_starts_at_the_looser_multiple_and_then_holds_to_the_tighter() -> None:
    # Tier 3's multiple 0.75 (12,000 tokens), with slack 1.5: holding starts past 18,000.
    clock = Clock()
    scheduler = make_scheduler(clock=clock, open_task_kv_slack=1.5, open_task_kv_hold_s=300.0)
    open_tasks(scheduler, 4)  # 12,800 open: past 12,000, not past 18,000
    placed(scheduler.place(task_call(1)))  # 15,800 with its prompt
    scheduler.settle()  # 16,000
    answer = refused(scheduler.place(task_call(2)))  # 19,000: past 18,000, holding starts
    assert "within 1.125×" in answer.message
    for n in range(100, 102):  # two tier-1 tasks end: 9,600 open
        scheduler.end_task(f"task-{n}")
    # 12,600 with the next prompt: under the looser multiple, but holding it is the tighter.
    assert "within 0.75×" in refused(scheduler.place(task_call(2))).message
    clock.advance(299.0)
    refused(scheduler.place(task_call(2)))  # held again: the hold runs 300 s from here
    clock.advance(301.0)
    placed(scheduler.place(task_call(2)))  # 300 s without a task held: the looser again

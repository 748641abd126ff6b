"""Task admission: a new task that the fleet's load would make late is refused before it spends.

The scheduler estimates the whole task at its first step (the pick's step estimate times the
steps left, plus the tool time the task declares) and refuses it with `OVERLOADED` when the
load (queues and batches), not the task, takes it past its deadline or its first step past
the step's objective; a task already running is never refused this way, and one that would be
late on an idle fleet too is left to try. Off by default (`LatencyConfig.task_admission`):
these tests switch it on. Under saturation, a task that has run a step can be admitted ahead of
new tasks of its tier (`AdmissionConfig.running_task_tiers`), and lower tiers wait while tier 1's
calls run late (`AdmissionConfig.headroom_by_tier`).
"""

from __future__ import annotations

import pytest

from kvflow.scheduler.config import AdmissionConfig, LatencyConfig, SchedulerConfig
from kvflow.scheduler.core import Scheduler
from kvflow.scheduler.placement import Observation, Placement, Refusal, RefusalReason
from kvflow.scheduler.state import ReplicaMetrics
from tests.test_scheduler_placement import SMALL, Clock, make_fleet, prompt, request
from tests.test_scheduler_placement import make_scheduler as make_default_scheduler

STEPS = 10
ADMITTING = SchedulerConfig(latency=LatencyConfig(task_admission=True))


def make_scheduler() -> Scheduler:
    """A scheduler with task admission on (it is off by default)."""
    return Scheduler(make_fleet(), ADMITTING, clock=Clock())


def with_load(scheduler: Scheduler, running: float, waiting: float) -> Scheduler:
    """Every replica running and holding waiting these fractions of its slots."""
    for name in scheduler.replica_names():
        slots = {"h200": 64, "h100": 48, "l4": 16}[name.split("/")[0]]
        scheduler.update_metrics(
            name, ReplicaMetrics(running=int(slots * running), waiting=int(slots * waiting))
        )
    return scheduler


def loaded(scheduler: Scheduler) -> Scheduler:
    """Every replica running its slots full, with as many calls again waiting."""
    return with_load(scheduler, 1.0, 1.0)


def estimates(scheduler: Scheduler) -> tuple[float, float]:
    """(a 10-step task at this scheduler's load, the same on an idle fleet)."""
    loaded_step = scheduler.place(request(prompt(1, 2000), steps_remaining=STEPS))
    idle_step = make_scheduler().place(request(prompt(1, 2000), steps_remaining=STEPS))
    assert isinstance(loaded_step, Placement) and isinstance(idle_step, Placement)
    return STEPS * loaded_step.est_duration_s, STEPS * idle_step.est_duration_s


@pytest.fixture
def between() -> float:
    """A deadline an idle fleet meets and the loaded one misses."""
    with_queues, without = estimates(loaded(make_scheduler()))
    assert with_queues > 2 * without, "the queues must matter for these tests"
    return (with_queues + without) / 2


def test_a_new_task_the_queues_would_make_late_is_refused_before_it_spends(
    between: float,
) -> None:
    scheduler = loaded(make_scheduler())
    before = [state.load for state in scheduler._replicas]
    answer = scheduler.place(
        request(prompt(2, 2000), steps_remaining=STEPS, deadline_s_remaining=between)
    )
    assert isinstance(answer, Refusal)
    assert answer.reason is RefusalReason.OVERLOADED
    # Final for the task (waiting would spend its deadline), with when to start it again.
    assert not answer.retryable
    assert answer.retry_after_s is not None and answer.retry_after_s >= 2.0
    assert f"{STEPS} steps" in answer.message and "nothing was spent" in answer.message
    # Nothing was booked: no replica's load counts the refused call.
    scheduler.settle()
    assert [state.load for state in scheduler._replicas] == before


def test_the_same_task_is_admitted_on_an_idle_fleet(between: float) -> None:
    answer = make_scheduler().place(
        request(prompt(2, 2000), steps_remaining=STEPS, deadline_s_remaining=between)
    )
    assert isinstance(answer, Placement)


def test_a_task_already_running_is_never_refused_for_the_load(between: float) -> None:
    scheduler = loaded(make_scheduler())
    later_step = request(
        prompt(2, 2000), steps_remaining=STEPS, deadline_s_remaining=between, steps_done=1
    )
    assert isinstance(scheduler.place(later_step), Placement)
    replaced = request(
        prompt(2, 2000), steps_remaining=STEPS, deadline_s_remaining=between, attempt=2
    )
    assert isinstance(scheduler.place(replaced), Placement)


def test_declared_tool_time_counts_toward_the_whole_task() -> None:
    scheduler = loaded(make_scheduler())
    with_queues, _ = estimates(scheduler)
    roomy = with_queues * 1.2
    assert isinstance(
        scheduler.place(
            request(prompt(3, 2000), steps_remaining=STEPS, deadline_s_remaining=roomy)
        ),
        Placement,
    )
    answer = scheduler.place(
        request(
            prompt(3, 2000),
            steps_remaining=STEPS,
            deadline_s_remaining=roomy,
            expected_tool_s=with_queues * 0.5,
        )
    )
    assert isinstance(answer, Refusal) and answer.reason is RefusalReason.OVERLOADED


def test_a_task_late_even_on_an_idle_fleet_is_left_to_try() -> None:
    scheduler = loaded(make_scheduler())
    _, without = estimates(scheduler)
    # Its deadline, not the load, is what to fix: the step is placed as before.
    answer = scheduler.place(
        request(prompt(4, 2000), steps_remaining=STEPS, deadline_s_remaining=without * 0.8)
    )
    assert isinstance(answer, Placement)


def test_task_admission_is_off_by_default(between: float) -> None:
    scheduler = loaded(make_default_scheduler())
    answer = scheduler.place(
        request(prompt(2, 2000), steps_remaining=STEPS, deadline_s_remaining=between)
    )
    assert isinstance(answer, Placement)


def test_a_wider_margin_refuses_only_tasks_that_miss_by_more(between: float) -> None:
    config = SchedulerConfig(latency=LatencyConfig(task_admission=True, task_admission_margin=2.0))
    scheduler = loaded(Scheduler(make_fleet(), config, clock=Clock()))
    answer = scheduler.place(
        request(prompt(2, 2000), steps_remaining=STEPS, deadline_s_remaining=between)
    )
    assert isinstance(answer, Placement)


def test_a_new_task_whose_first_step_the_load_would_make_late_is_refused() -> None:
    scheduler = loaded(make_scheduler())
    loaded_task, idle_task = estimates(scheduler)
    step = (loaded_task + idle_task) / 2 / STEPS
    first = request(prompt(5, 2000), steps_remaining=STEPS, step_deadline_s_remaining=step)
    answer = scheduler.place(first)
    assert isinstance(answer, Refusal) and answer.reason is RefusalReason.OVERLOADED
    assert "per-step objective" in answer.message
    # A step of a task already running is placed, late or not: its task has spent already.
    later = first.model_copy(update={"steps_done": 3})
    assert isinstance(scheduler.place(later), Placement)
    # On an idle fleet the same first step is placed.
    assert isinstance(make_scheduler().place(first), Placement)


def test_under_saturation_a_running_task_is_admitted_before_a_new_one_of_its_tier() -> None:
    config = SchedulerConfig(admission=AdmissionConfig(running_task_tiers=1))
    # 112% of the slots: over tier 5's threshold (100%), under tier 4's (125%).
    scheduler = with_load(Scheduler(make_fleet(), config, clock=Clock()), 1.0, 0.125)
    new = request(prompt(6, 300), model=SMALL, tenant="initech")
    refusal = scheduler.place(new)
    assert isinstance(refusal, Refusal) and refusal.reason is RefusalReason.SATURATED
    assert "tier 5" in refusal.message and "as tier" not in refusal.message
    # The same tenant's task that has already run a step has spent: it goes on.
    assert isinstance(scheduler.place(new.model_copy(update={"steps_done": 2})), Placement)
    # By default every call waits by its own tier.
    default = with_load(make_default_scheduler(), 1.0, 0.125)
    running = default.place(new.model_copy(update={"steps_done": 2}))
    assert isinstance(running, Refusal) and running.reason is RefusalReason.SATURATED


HEADROOM = AdmissionConfig(headroom_by_tier=(4.0, 2.0, 0.05, 0.04, 0.03), headroom_hold_s=60)


def busy(scheduler: Scheduler) -> Scheduler:
    """Every replica running a fifth of its slots: far below saturation, above the headroom."""
    return with_load(scheduler, 0.2, 0.0)


def late_call(scheduler: Scheduler, tenant: str) -> None:
    """A call of `tenant` that ended past its step's objective."""
    placed = scheduler.place(request(prompt(7, 300), tenant=tenant, steps_done=1))
    assert isinstance(placed, Placement)
    scheduler.observe(
        Observation(replica=placed.replica, model=placed.model, tenant=tenant, ok=True, late=True)
    )


def test_a_late_tier_1_call_makes_lower_tiers_wait_for_a_while() -> None:
    clock = Clock()
    scheduler = busy(Scheduler(make_fleet(), SchedulerConfig(admission=HEADROOM), clock=clock))
    tier_3 = request(prompt(8, 300), tenant="globex", steps_done=1)
    assert isinstance(scheduler.place(tier_3), Placement)
    late_call(scheduler, "acme")
    waiting = scheduler.place(tier_3)
    assert isinstance(waiting, Refusal) and waiting.reason is RefusalReason.SATURATED
    assert "below 5%" in waiting.message and "tier 1, whose steps ran late" in waiting.message
    assert waiting.retryable and waiting.retry_after_s
    # Tier 1 itself goes on; after the hold, lower tiers do too.
    assert isinstance(scheduler.place(request(prompt(9, 300), tenant="acme")), Placement)
    clock.advance(61)
    assert isinstance(scheduler.place(tier_3), Placement)


def test_only_tier_1_lateness_turns_the_headroom_on_and_only_where_configured() -> None:
    scheduler = busy(Scheduler(make_fleet(), SchedulerConfig(admission=HEADROOM), clock=Clock()))
    late_call(scheduler, "globex")
    assert isinstance(
        scheduler.place(request(prompt(10, 300), tenant="globex", steps_done=1)), Placement
    )
    default = busy(make_default_scheduler())
    late_call(default, "acme")
    assert isinstance(
        default.place(request(prompt(10, 300), tenant="globex", steps_done=1)), Placement
    )


def test_tier_1_work_with_step_objectives_keeps_headroom_before_any_step_is_late() -> None:
    clock = Clock()
    config = HEADROOM.model_copy(update={"headroom_for_step_objectives": True})
    scheduler = busy(Scheduler(make_fleet(), SchedulerConfig(admission=config), clock=clock))
    tier_3 = request(prompt(8, 300), tenant="globex", steps_done=1)
    # Tier-1 calls without a step objective change nothing.
    assert isinstance(scheduler.place(request(prompt(9, 300), tenant="acme")), Placement)
    assert isinstance(scheduler.place(tier_3), Placement)
    # One with a step objective keeps lower tiers out of the busy replicas from then on.
    urgent = request(prompt(11, 300), tenant="acme", step_deadline_s_remaining=6.0)
    assert isinstance(scheduler.place(urgent), Placement)
    waiting = scheduler.place(tier_3)
    assert isinstance(waiting, Refusal) and waiting.reason is RefusalReason.SATURATED
    assert "tier 1, whose steps have objectives to meet" in waiting.message
    # For the hold, then lower tiers go on again.
    clock.advance(61)
    assert isinstance(scheduler.place(tier_3), Placement)
    # Without headroom thresholds the option does nothing.
    plain = AdmissionConfig(headroom_for_step_objectives=True)
    unset = busy(Scheduler(make_fleet(), SchedulerConfig(admission=plain), clock=Clock()))
    assert isinstance(unset.place(urgent), Placement)
    assert isinstance(unset.place(tier_3), Placement)

"""Circuit breakers and retry budgets, stepped through time by hand."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvflow.scheduler.config import (
    CircuitBreakerConfig,
    LivenessConfig,
    RetryBudgetConfig,
    SchedulerConfig,
)
from kvflow.scheduler.core import Scheduler
from kvflow.scheduler.placement import (
    Observation,
    Placement,
    PlacementRequest,
    Refusal,
    RefusalReason,
)
from kvflow.scheduler.reliability import (
    CircuitBreaker,
    CircuitState,
    ControlPlaneOutages,
    QueueView,
    TenantRetryBudget,
    WorkerLiveness,
    task_retry_allowed,
)
from tests.fleets import one_pool_fleet


def state_of(breaker: CircuitBreaker) -> CircuitState:
    # A function call, so that type checkers do not narrow the state between transitions.
    return breaker.state


def test_five_failures_in_a_row_open_the_circuit_for_thirty_seconds() -> None:
    breaker = CircuitBreaker(CircuitBreakerConfig())
    for i in range(4):
        breaker.record(False, now=float(i))
        assert state_of(breaker) is CircuitState.CLOSED
    assert breaker.record(False, now=4.0)
    assert state_of(breaker) is CircuitState.OPEN
    assert not breaker.allows(now=33.9)
    assert breaker.seconds_until_half_open(now=14.0) == 20.0
    assert breaker.p_success() == 0.0
    assert breaker.allows(now=34.0)
    assert state_of(breaker) is CircuitState.HALF_OPEN


def test_a_success_resets_the_consecutive_count() -> None:
    breaker = CircuitBreaker(CircuitBreakerConfig(min_calls_in_window=1000))
    for i in range(20):
        breaker.record(i % 4 == 3, now=float(i))  # three failures, then a success
    assert state_of(breaker) is CircuitState.CLOSED


def test_an_error_rate_over_the_window_opens_the_circuit() -> None:
    breaker = CircuitBreaker(CircuitBreakerConfig(error_rate=0.5, min_calls_in_window=10))
    for i in range(9):
        breaker.record(i % 2 == 0, now=float(i))  # alternating: never 5 in a row
    assert state_of(breaker) is CircuitState.CLOSED
    breaker.record(False, now=9.0)  # 5 failures in 10 calls
    assert state_of(breaker) is CircuitState.OPEN


def test_old_failures_leave_the_window() -> None:
    breaker = CircuitBreaker(CircuitBreakerConfig(window_s=60.0, min_calls_in_window=4))
    for i in range(3):
        breaker.record(False, now=float(i))
    breaker.record(True, now=3.0)
    assert breaker.p_success() < 1.0
    for i in range(4):
        breaker.record(True, now=100.0 + i)
    assert breaker.p_success() == 1.0


def test_half_open_lets_one_probe_through_and_closes_after_two_successes() -> None:
    breaker = CircuitBreaker(CircuitBreakerConfig())
    for i in range(5):
        breaker.record(False, now=float(i))
    assert breaker.allows(now=40.0)
    breaker.start_probe(now=40.0)
    assert not breaker.allows(now=40.5)  # one probe at a time
    assert breaker.p_success() == 0.5 * (10 / 15)
    breaker.record(True, now=41.0)
    assert state_of(breaker) is CircuitState.HALF_OPEN and breaker.allows(now=41.0)
    breaker.start_probe(now=41.0)
    breaker.record(True, now=42.0)
    assert state_of(breaker) is CircuitState.CLOSED
    assert breaker.p_success() == 1.0


def test_a_failed_probe_opens_the_circuit_again() -> None:
    breaker = CircuitBreaker(CircuitBreakerConfig())
    for i in range(5):
        breaker.record(False, now=float(i))
    breaker.refresh(now=40.0)
    breaker.start_probe(now=40.0)
    breaker.record(False, now=41.0)
    assert state_of(breaker) is CircuitState.OPEN
    assert breaker.seconds_until_half_open(now=41.0) == 30.0


def test_a_probe_that_never_reports_frees_its_slot_after_a_cooldown() -> None:
    breaker = CircuitBreaker(CircuitBreakerConfig())
    for i in range(5):
        breaker.record(False, now=float(i))
    breaker.refresh(now=40.0)
    breaker.start_probe(now=40.0)
    assert not breaker.allows(now=60.0)
    assert breaker.allows(now=70.0)


@given(outcomes=st.lists(st.booleans(), max_size=200))
def test_the_breaker_never_opens_without_failures_and_p_success_is_a_probability(
    outcomes: list[bool],
) -> None:
    breaker = CircuitBreaker(CircuitBreakerConfig())
    for i, ok in enumerate(outcomes):
        breaker.record(ok, now=float(i))
        assert 0.0 <= breaker.p_success() <= 1.0
    if all(outcomes):
        assert state_of(breaker) is CircuitState.CLOSED


@given(retries=st.integers(0, 10), attempt=st.integers(1, 10))
def test_a_task_may_re_place_a_call_at_most_max_task_retries_times(
    retries: int, attempt: int
) -> None:
    config = RetryBudgetConfig(max_task_retries=3)
    allowed = task_retry_allowed(retries, attempt, config)
    assert allowed == (attempt == 1 or retries < 3)


def test_a_tenant_may_retry_a_fraction_of_its_calls_per_window() -> None:
    budget = TenantRetryBudget(
        RetryBudgetConfig(tenant_retry_fraction=0.2, tenant_min_retries=2, tenant_window_s=60.0)
    )
    for i in range(50):
        budget.record(False, now=float(i) / 10)
    for _ in range(10):  # 20 % of 50 calls
        assert budget.allows_retry(now=5.0)
        budget.record(True, now=5.0)
    assert not budget.allows_retry(now=5.0)
    assert budget.seconds_until_retry(now=5.0) == 60.0
    # Once the window has passed, only the minimum is allowed until calls come back.
    assert budget.allows_retry(now=70.0)
    budget.record(True, now=70.0)
    budget.record(True, now=70.0)
    assert not budget.allows_retry(now=70.0)


# ---- GPU workers' liveness: t = 1000 s is "now"; the worker last polled at t = 900 s --------

STALL = LivenessConfig(worker_stall_s=3.0)
IDLE_QUEUE = QueueView(last_poll_at=900.0, backlog=0, backlog_age_s=0.0)


def test_a_call_that_timed_out_unpolled_on_an_idle_engine_means_the_worker_is_gone() -> None:
    liveness = WorkerLiveness(STALL)
    liveness.stalled("a/0", since=995.0)
    assert liveness.assess("a/0", IDLE_QUEUE, engine_idle_since=950.0, now=1000.0) is True
    assert liveness.missing("a/0")
    # Nothing new: still missing. A newer poll (a worker is back): the replica returns.
    assert liveness.assess("a/0", IDLE_QUEUE, engine_idle_since=950.0, now=1001.0) is None
    back = QueueView(last_poll_at=1001.5, backlog=0, backlog_age_s=0.0)
    assert liveness.assess("a/0", back, engine_idle_since=950.0, now=1002.0) is False
    assert not liveness.missing("a/0")


def test_an_old_backlog_on_an_idle_unpolled_queue_means_the_worker_is_gone() -> None:
    liveness = WorkerLiveness(STALL)
    young = QueueView(last_poll_at=900.0, backlog=2, backlog_age_s=2.0)
    assert liveness.assess("a/0", young, engine_idle_since=950.0, now=1000.0) is None
    old = QueueView(last_poll_at=900.0, backlog=2, backlog_age_s=3.0)
    assert liveness.assess("a/0", old, engine_idle_since=950.0, now=1000.0) is True


def test_a_busy_engine_means_the_worker_is_there_with_its_slots_full() -> None:
    liveness = WorkerLiveness(STALL)
    liveness.stalled("a/0", since=990.0)
    backlog = QueueView(last_poll_at=900.0, backlog=5, backlog_age_s=60.0)
    assert liveness.assess("a/0", backlog, engine_idle_since=None, now=1000.0) is None
    assert not liveness.missing("a/0")


def test_a_poll_while_the_call_waited_means_the_worker_is_there() -> None:
    liveness = WorkerLiveness(STALL)
    polled = QueueView(last_poll_at=999.0, backlog=5, backlog_age_s=60.0)
    assert liveness.assess("a/0", polled, engine_idle_since=950.0, now=1000.0) is None


def test_an_engine_idle_for_less_than_the_stall_may_be_between_two_calls() -> None:
    liveness = WorkerLiveness(STALL)
    liveness.stalled("a/0", since=990.0)
    # The worker polled at 900 s; the engine went idle 1 s ago: perhaps between two calls.
    assert liveness.assess("a/0", IDLE_QUEUE, engine_idle_since=999.0, now=1000.0) is None
    # Still idle, and still nobody polled, 3 s later: the evidence was kept.
    assert liveness.assess("a/0", IDLE_QUEUE, engine_idle_since=999.0, now=1002.0) is True


def test_a_queue_without_any_poller_is_not_missing_a_worker_until_a_call_waits() -> None:
    liveness = WorkerLiveness(STALL)
    nobody = QueueView(last_poll_at=None, backlog=0, backlog_age_s=0.0)
    assert liveness.assess("a/0", nobody, engine_idle_since=0.0, now=1000.0) is None
    liveness.stalled("a/0", since=998.0)
    assert liveness.assess("a/0", nobody, engine_idle_since=0.0, now=1000.0) is True
    # Back only once a worker polls.
    assert liveness.assess("a/0", nobody, engine_idle_since=0.0, now=1001.0) is None
    polled = QueueView(last_poll_at=1000.5, backlog=0, backlog_age_s=0.0)
    assert liveness.assess("a/0", polled, engine_idle_since=0.0, now=1001.0) is False


# ---- outages of Temporal, as the control plane's probes saw them -----------------------------


def outage_from_11_to_15() -> ControlPlaneOutages:
    """Probes every second: good up to 10 s, failing 11-14 s, good again at 15 s."""
    outages = ControlPlaneOutages(LivenessConfig(outage_grace_s=30.0))
    for t in range(8, 16):
        outages.record_probe(not 11 <= t <= 14, float(t))
    assert outages.reachable
    return outages


def test_a_timeout_of_a_call_that_was_out_during_an_outage_is_the_outages_fault() -> None:
    outages = outage_from_11_to_15()
    for error in ("TimeoutHeartbeat", "ScheduleToStart", "TimeoutStartToClose"):
        assert outages.explains(error, dispatched_at=9.0, ended_at=16.0, now=16.0)
    # The outage spans from the last good probe (10 s) to the first good one after (15 s).
    assert outages.explains("TimeoutHeartbeat", dispatched_at=14.9, ended_at=15.2, now=16.0)
    assert outages.explains("TimeoutHeartbeat", dispatched_at=2.0, ended_at=10.0, now=16.0)


def test_what_an_outage_does_not_explain() -> None:
    outages = outage_from_11_to_15()
    # The engine's own errors, reported by a GPU worker that reached Temporal.
    assert not outages.explains("StreamCut", dispatched_at=9.0, ended_at=16.0, now=16.0)
    # A call sent after the outage, one that ended before it, one that ended long after it.
    assert not outages.explains("TimeoutHeartbeat", dispatched_at=16.0, ended_at=20.0, now=20.0)
    assert not outages.explains("TimeoutHeartbeat", dispatched_at=2.0, ended_at=9.5, now=20.0)
    assert not outages.explains("TimeoutHeartbeat", dispatched_at=9.0, ended_at=45.1, now=46.0)
    # An observation without times (from a workflow that does not send them).
    assert not outages.explains("TimeoutHeartbeat", dispatched_at=None, ended_at=16.0, now=16.0)


def test_an_outage_going_on_explains_the_timeouts_reported_meanwhile() -> None:
    outages = ControlPlaneOutages(LivenessConfig())
    assert not outages.record_probe(True, 100.0)
    assert outages.record_probe(False, 101.0)
    assert not outages.reachable
    assert outages.explains("TimeoutHeartbeat", dispatched_at=90.0, ended_at=104.0, now=104.0)


# ---- what a control-plane fault costs: nothing but its bill ----------------------------------

MODEL = "tiny"
UNFORGIVING = SchedulerConfig(
    circuit=CircuitBreakerConfig(consecutive_failures=1),
    retries=RetryBudgetConfig(tenant_retry_fraction=0.0, tenant_min_retries=1),
)
"""One failure opens a circuit; a tenant may re-place one call a minute."""


def timeout_on(replica: str, *, control_plane_fault: bool) -> Observation:
    return Observation(
        replica=replica,
        model=MODEL,
        tenant="acme",
        ok=False,
        error="TimeoutHeartbeat",
        replica_fault=not control_plane_fault,
        control_plane_fault=control_plane_fault,
        cost_micros=1_500,
    )


def request(attempt: int, *, after_control_plane_fault: bool = False) -> PlacementRequest:
    return PlacementRequest(
        model=MODEL,
        prompt_tokens=100,
        max_output_tokens=10,
        tenant="acme",
        workflow_id=f"wf-{attempt}",
        attempt=attempt,
        task_retries=attempt - 1,
        after_control_plane_fault=after_control_plane_fault,
    )


def test_control_plane_faults_leave_circuits_closed_and_the_tenants_retries_untouched() -> None:
    scheduler = Scheduler(one_pool_fleet(MODEL, replicas=2), UNFORGIVING)
    for _ in range(3):
        placed = scheduler.place(request(1))
        assert isinstance(placed, Placement)
        scheduler.observe(timeout_on(placed.replica, control_plane_fault=True))
        again = scheduler.place(request(2, after_control_plane_fault=True))
        assert isinstance(again, Placement)
        scheduler.observe(Observation(replica=again.replica, model=MODEL, tenant="acme", ok=True))
    assert {s.circuit for s in scheduler.status()} == {"closed"}
    # Still billed: the tenant's spend counts every attempt.
    assert scheduler.tenant_spend_today("acme") == 3 * 1_500
    # The tenant has retried nothing yet: its one retry of the minute is still there.
    assert isinstance(scheduler.place(request(2)), Placement)
    refusal = scheduler.place(request(2))
    assert isinstance(refusal, Refusal)
    assert refusal.reason is RefusalReason.RETRY_BUDGET_EXHAUSTED


def test_the_same_timeouts_charged_to_replicas_open_their_circuits() -> None:
    scheduler = Scheduler(one_pool_fleet(MODEL, replicas=2), UNFORGIVING)
    placed = scheduler.place(request(1))
    assert isinstance(placed, Placement)
    scheduler.observe(timeout_on(placed.replica, control_plane_fault=False))
    assert {s.replica: s.circuit for s in scheduler.status()}[placed.replica] == "open"
    # A control-plane fault spares the circuit even with `replica_fault` left True.
    other = scheduler.place(request(1))
    assert isinstance(other, Placement) and other.replica != placed.replica
    scheduler.observe(
        timeout_on(other.replica, control_plane_fault=True).model_copy(
            update={"replica_fault": True}
        )
    )
    assert {s.replica: s.circuit for s in scheduler.status()}[other.replica] == "closed"

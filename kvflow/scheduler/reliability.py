"""Reliability inside the scheduler: circuit breakers, retry budgets, GPU workers' liveness.

All are driven by an explicit `now` (seconds from the scheduler's clock), so they never sleep
and tests step time by hand; the control plane feeds them what it sees (`kvflow.workers`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import StrEnum

from kvflow.scheduler.config import CircuitBreakerConfig, LivenessConfig, RetryBudgetConfig

SCHEDULE_TO_START = "ScheduleToStart"
"""`Observation.error` of a call that no worker took before its schedule-to-start timeout."""
TEMPORAL_TIMEOUTS = frozenset(
    {SCHEDULE_TO_START, "TimeoutHeartbeat", "TimeoutStartToClose", "TimeoutScheduleToClose"}
)
"""`Observation.error` of the failures Temporal itself declares: all an outage of the server
can cause. A cut stream or an engine's error is reported by the GPU worker, outage or not."""


class CircuitState(StrEnum):
    """The states of a circuit breaker."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """One replica's breaker: closed → open → half-open → closed.

    - closed → open after `consecutive_failures` failures in a row, or when at least
      `min_calls_in_window` calls in the last `window_s` seconds failed at a share of
      `error_rate` or more;
    - open → half-open once `cooldown_s` has passed: up to `half_open_probes` calls at a time
      are let through;
    - half-open → closed after `half_open_successes` probe successes; any failure while
      half-open opens it again for another cool-down.

    `p_success` = (successes + prior) / (calls + prior) over the window, times
    `half_open_success_probability` while half-open: a replica with a recent error rate is
    less attractive before it is cut off.
    """

    __slots__ = (
        "_config",
        "_consecutive_failures",
        "_half_open_successes",
        "_probe_started",
        "_probes_in_flight",
        "_window",
        "_window_failures",
        "open_until",
        "state",
    )

    def __init__(self, config: CircuitBreakerConfig) -> None:
        self._config = config
        self.state = CircuitState.CLOSED
        self.open_until = 0.0
        self._consecutive_failures = 0
        self._half_open_successes = 0
        self._probes_in_flight = 0
        self._probe_started: deque[float] = deque()
        # Times of the calls and of the failures in the window: two deques of floats rather
        # than one of (time, ok) tuples, so recording a call allocates nothing the garbage
        # collector tracks.
        self._window: deque[float] = deque()
        self._window_failures: deque[float] = deque()

    def refresh(self, now: float) -> bool:
        """Apply time-based transitions (open → half-open); True when the state changed."""
        if self.state is CircuitState.OPEN and now >= self.open_until:
            self.state = CircuitState.HALF_OPEN
            self._half_open_successes = 0
            self._probes_in_flight = 0
            self._probe_started.clear()
            return True
        if self.state is CircuitState.HALF_OPEN:
            # A probe whose outcome never arrived (its worker died) frees its slot after a
            # cool-down, so a half-open replica cannot stay blocked forever.
            while self._probe_started and now - self._probe_started[0] >= self._config.cooldown_s:
                self._probe_started.popleft()
                self._probes_in_flight = max(0, self._probes_in_flight - 1)
        return False

    def allows(self, now: float) -> bool:
        """Whether a call may be placed on the replica now."""
        self.refresh(now)
        if self.state is CircuitState.CLOSED:
            return True
        if self.state is CircuitState.HALF_OPEN:
            return self._probes_in_flight < self._config.half_open_probes
        return False

    def start_probe(self, now: float) -> None:
        """A half-open call was placed: it takes a probe slot until its outcome is recorded."""
        self._probes_in_flight += 1
        self._probe_started.append(now)

    def record(self, ok: bool, now: float, probe: bool = True) -> bool:
        """Record a call's outcome; True when the state changed.

        While half-open, only probes (calls placed since the circuit opened) decide; a call
        placed before it opened that reports late only joins the error window.
        """
        before = self.state
        self.refresh(now)
        self._push_window(ok, now)
        if self.state is CircuitState.HALF_OPEN and not probe:
            return False
        if self.state is CircuitState.HALF_OPEN:
            if self._probes_in_flight:
                self._probes_in_flight -= 1
                if self._probe_started:
                    self._probe_started.popleft()
            if ok:
                self._half_open_successes += 1
                if self._half_open_successes >= self._config.half_open_successes:
                    self._close()
            else:
                self._open(now)
        elif self.state is CircuitState.CLOSED:
            if ok:
                self._consecutive_failures = 0
            else:
                self._consecutive_failures += 1
                if self._consecutive_failures >= self._config.consecutive_failures or (
                    self._rate_tripped()
                ):
                    self._open(now)
        return self.state is not before

    def p_success(self) -> float:
        """Estimated probability that the next call succeeds (see the class docstring)."""
        calls = len(self._window)
        prior = self._config.prior_successes
        p = (calls - len(self._window_failures) + prior) / (calls + prior)
        if self.state is CircuitState.HALF_OPEN:
            p *= self._config.half_open_success_probability
        elif self.state is CircuitState.OPEN:
            p = 0.0
        return p

    def seconds_until_half_open(self, now: float) -> float:
        """Seconds until an open circuit lets a probe through (0 when it already would)."""
        if self.state is CircuitState.OPEN:
            return max(0.0, self.open_until - now)
        return 0.0

    def _push_window(self, ok: bool, now: float) -> None:
        self._window.append(now)
        if not ok:
            self._window_failures.append(now)
        horizon = now - self._config.window_s
        for times in (self._window, self._window_failures):
            while times and times[0] < horizon:
                times.popleft()

    def _rate_tripped(self) -> bool:
        calls = len(self._window)
        return (
            calls >= self._config.min_calls_in_window
            and len(self._window_failures) / calls >= self._config.error_rate
        )

    def _open(self, now: float) -> None:
        self.state = CircuitState.OPEN
        self.open_until = now + self._config.cooldown_s
        self._consecutive_failures = 0
        self._half_open_successes = 0
        self._probes_in_flight = 0
        self._probe_started.clear()

    def _close(self) -> None:
        self.state = CircuitState.CLOSED
        self._consecutive_failures = 0
        self._half_open_successes = 0
        # The failures that opened the circuit are history once probes succeed.
        self._window.clear()
        self._window_failures.clear()


def task_retry_allowed(task_retries: int, attempt: int, config: RetryBudgetConfig) -> bool:
    """Whether a re-placement fits the task's budget: first attempts always do.

    A request with `attempt > 1` spends one re-placement; the task may spend
    `max_task_retries` in total, so it is allowed while `task_retries < max_task_retries`.
    """
    return attempt <= 1 or task_retries < config.max_task_retries


class TenantRetryBudget:
    """Retries of one tenant limited to a fraction of its calls over a sliding window.

    allowed while retries_in_window < max(`tenant_min_retries`,
    `tenant_retry_fraction` · first_attempts_in_window)
    """

    __slots__ = ("_calls", "_config", "_retries")

    def __init__(self, config: RetryBudgetConfig) -> None:
        self._config = config
        self._calls: deque[float] = deque()
        self._retries: deque[float] = deque()

    def _trim(self, now: float) -> None:
        horizon = now - self._config.tenant_window_s
        for times in (self._calls, self._retries):
            while times and times[0] < horizon:
                times.popleft()

    def allows_retry(self, now: float) -> bool:
        """Whether one more retry fits the tenant's budget now."""
        self._trim(now)
        limit = max(
            self._config.tenant_min_retries,
            math.floor(self._config.tenant_retry_fraction * len(self._calls)),
        )
        return len(self._retries) < limit

    def seconds_until_retry(self, now: float) -> float:
        """Seconds until the oldest retry leaves the window (an upper bound on the wait)."""
        self._trim(now)
        if not self._retries:
            return 0.0
        return max(0.0, self._retries[0] + self._config.tenant_window_s - now)

    def record(self, retry: bool, now: float) -> None:
        """Count one placed call (a first attempt) or one re-placement."""
        (self._retries if retry else self._calls).append(now)
        self._trim(now)


@dataclass(frozen=True, slots=True)
class QueueView:
    """Temporal's view of one replica's task queue (DescribeTaskQueue)."""

    last_poll_at: float | None
    """When a worker last polled the queue (the newest poller's last access, epoch seconds);
    None when Temporal lists no poller. An idle live worker's long poll is renewed only about
    once a minute, so an old value alone does not mean the worker is gone."""
    backlog: int
    """Calls waiting in the queue for a worker."""
    backlog_age_s: float
    """How long the oldest of them has waited."""


class WorkerLiveness:
    """Which replicas' GPU workers are missing, from their queues and their engines.

    missing ⇔ a call has waited on the queue since t₀ (the oldest backlog entry, once it has
    waited `worker_stall_s`, or a call that timed out waiting to start) ∧ the replica's engine
    has run and queued nothing since tᵢ, for `worker_stall_s` at least ∧ no worker has polled
    the queue since max(t₀, tᵢ). A live worker with a free slot polls at once and takes the
    call; one whose slots are all busy keeps its engine busy. Back ⇔ a poll newer than the
    newest one seen when the worker was declared missing. See `LivenessConfig`.
    """

    __slots__ = ("_config", "_missing", "_stalls")

    def __init__(self, config: LivenessConfig) -> None:
        self._config = config
        self._missing: dict[str, float | None] = {}
        """Replica → the newest poll seen when its worker was declared missing."""
        self._stalls: dict[str, float] = {}
        """Replica → when the earliest call that timed out unstarted was dispatched."""

    def missing(self, replica: str) -> bool:
        """Whether the replica's GPU worker is missing."""
        return replica in self._missing

    def stalled(self, replica: str, since: float) -> None:
        """A call dispatched to the replica at `since` timed out before a worker took it."""
        self._stalls[replica] = min(since, self._stalls.get(replica, since))

    def assess(
        self, replica: str, view: QueueView, engine_idle_since: float | None, now: float
    ) -> bool | None:
        """Apply one view of the replica's queue; True: its worker went missing, False: back.

        None when nothing changed. `engine_idle_since` is when the engine was first seen
        idle in its current idle spell; None while it is busy or its load is unknown.
        """
        if replica in self._missing:
            seen = self._missing[replica]
            if view.last_poll_at is not None and (seen is None or view.last_poll_at > seen):
                del self._missing[replica]
                self._stalls.pop(replica, None)
                return False
            return None
        waiting_since = self._stalls.get(replica, math.inf)
        stall = self._config.worker_stall_s
        if view.backlog and view.backlog_age_s >= stall:
            waiting_since = min(waiting_since, now - view.backlog_age_s)
        if waiting_since == math.inf:
            return None
        if engine_idle_since is None:
            self._stalls.pop(replica, None)  # the engine is busy: the worker's slots are full
            return None
        if view.last_poll_at is not None and view.last_poll_at >= max(
            waiting_since, engine_idle_since
        ):
            self._stalls.pop(replica, None)  # a worker polled while the call waited
            return None
        if now - engine_idle_since < stall:
            return None  # the engine may be between two calls: ask again later
        self._stalls.pop(replica, None)
        self._missing[replica] = view.last_poll_at
        return True


class ControlPlaneOutages:
    """When this control plane could not reach Temporal, from its own probes of the server.

    An outage spans from the last good probe before the first failed one to the first good
    one after it: the widest window the probes allow. A call's failure is the control plane's
    fault when Temporal declared it (`TEMPORAL_TIMEOUTS`) and the call was out during an
    outage: dispatched before the outage ended, ended after it began and at most
    `outage_grace_s` after it ended (an outage still going on ends now).
    """

    __slots__ = ("_config", "_down_since", "_last_ok", "_outages")

    def __init__(self, config: LivenessConfig) -> None:
        self._config = config
        self._last_ok: float | None = None
        self._down_since: float | None = None
        """Start of the outage going on; None while the server answers."""
        self._outages: deque[tuple[float, float]] = deque()

    @property
    def reachable(self) -> bool:
        """Whether the last probe reached the server."""
        return self._down_since is None

    def record_probe(self, ok: bool, now: float) -> bool:
        """Record one probe of the server; True when it started or ended an outage."""
        if ok:
            self._last_ok = now
            if self._down_since is None:
                return False
            self._outages.append((self._down_since, now))
            self._down_since = None
            horizon = now - self._config.outage_memory_s
            while self._outages and self._outages[0][1] < horizon:
                self._outages.popleft()
            return True
        if self._down_since is not None:
            return False
        self._down_since = self._last_ok if self._last_ok is not None else now
        return True

    def explains(
        self, error: str | None, dispatched_at: float | None, ended_at: float | None, now: float
    ) -> bool:
        """Whether an outage explains a call's failure (see the class docstring)."""
        if error not in TEMPORAL_TIMEOUTS or dispatched_at is None or ended_at is None:
            return False
        grace = self._config.outage_grace_s
        spans = list(self._outages)
        if self._down_since is not None:
            spans.append((self._down_since, now))
        return any(
            dispatched_at <= end and start <= ended_at <= end + grace for start, end in spans
        )

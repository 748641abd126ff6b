"""(d) A replica that answers every call with 503, and one that is slow but healthy.

The broken replica is the fleet's cheapest (a pool of its own at a fifth of the price), so the
schedulers keep preferring it and only its circuit can keep calls off it. Its circuit must open
within the configured count of consecutive failures (nothing but half-open probes placed on it
afterwards, in every scheduler), traffic must move to the other pool, and once the replica is
healthy again (its simulator restarted without faults on the same port) a probe must find it
so and calls must return to it. A replica that is merely busy (its engine ten times slower,
its GPU worker's slots full) must never have its circuit opened.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pytest

from kvflow.ledger.store import AsyncLedger
from kvflow.scheduler.config import CircuitBreakerConfig
from tests.chaos.cluster import ChaosCluster, PoolSpec
from tests.chaos.conftest import ClusterFactory
from tests.chaos.figures import ScenarioFigures
from tests.chaos.scenario import Outcome, assert_no_secret_leaked, finish
from tests.chaos.traces import TaskTrace
from tests.chaos.workload import Workload

pytestmark = pytest.mark.chaos

BREAKER = CircuitBreakerConfig()
"""The workers run the default scheduler configuration."""
POOLS = (
    PoolSpec("cheap", replicas=1, prices=("0.036", "0.0036", "0.108")),
    PoolSpec("main", replicas=3, max_concurrency=3),
)
BROKEN, BUSY = "cheap/0", "main/0"
"""Every call to BROKEN fails with 503 until it is healed; BUSY runs 10x slower."""
RATE_PER_S = 1.5
BROKEN_S = 45.0
"""Long enough for a circuit to open, cool down (30 s) and fail its first probe."""
HEALED_S = 45.0
"""Long enough for the next probe (up to 30 s later) and for calls to return."""
RUN_TIMEOUT_S = 180


@dataclass
class WorkerView:
    """One scheduler process's calls to one replica, in order: (time, kind, flag)."""

    events: list[tuple[datetime, str, bool]] = field(default_factory=list)
    """("place", probe) and ("observe", ok) events."""


@dataclass
class Run:
    outcome: Outcome
    healed_at: datetime
    broken: str
    busy: str
    busy_peak: int
    """The most calls the busy replica's engine held at once (running + waiting)."""
    opened_in_logs: dict[str, int]
    """Replica → how many workflow-worker processes logged opening its circuit."""


def views(traces: dict[str, TaskTrace], replica: str) -> dict[str, WorkerView]:
    """Each scheduler process's placements on and observations of `replica`, in time order."""
    seen: dict[str, WorkerView] = {}
    for task in traces.values():
        for placed in task.placements:
            if placed.replica == replica:
                seen.setdefault(placed.worker, WorkerView()).events.append(
                    (placed.at, "place", placed.probe)
                )
        for observed in task.observations:
            if observed.replica == replica:
                seen.setdefault(observed.worker, WorkerView()).events.append(
                    (observed.at, "observe", observed.ok)
                )
    for view in seen.values():
        view.events.sort()
    return seen


def placed_on_open_circuit(view: WorkerView) -> list[datetime]:
    """Non-probe placements made after `consecutive_failures` failures in a row were seen.

    The circuit must be open from the moment the scheduler observes the last failure of the
    run of `consecutive_failures`, until probes succeed `half_open_successes` times; in that
    span only probes may be placed. (It may open earlier, on the error rate: that is allowed.)
    """
    wrong: list[datetime] = []
    failures = probe_successes = 0
    is_open = False
    for at, kind, flag in view.events:
        if kind == "observe" and not is_open:
            failures = 0 if flag else failures + 1
            if failures >= BREAKER.consecutive_failures:
                is_open, probe_successes = True, 0
        elif kind == "observe" and flag:
            probe_successes += 1
            if probe_successes >= BREAKER.half_open_successes:
                is_open, failures = False, 0
        elif kind == "place" and is_open and not flag:
            wrong.append(at)
    return wrong


async def _busy_peak(cluster: ChaosCluster, name: str, until: asyncio.Event) -> int:
    """Sample the replica's running + waiting requests every 0.1 s; the highest seen.

    Its calls take 1.5 s and more, so a sample every 0.1 s sees every moment its slots fill.
    """
    peak = 0
    while not until.is_set():
        peak = max(peak, await cluster.queued_requests(cluster.replica(name)))
        await asyncio.sleep(0.1)
    return peak


@pytest.fixture(scope="module")
async def run(
    chaos_cluster: ClusterFactory, chaos_ledger: AsyncLedger, request: pytest.FixtureRequest
) -> Run:
    started_at = time.monotonic()
    faults = {
        BROKEN: ["--fault-error-rate", "1.0", "--fault-error-code", "503"],
        BUSY: ["--fault-slowdown", "10"],
    }
    async with chaos_cluster(pools=POOLS, fault_flags=faults) as cluster:
        assert cluster.client is not None
        broken_tasks = int(BROKEN_S * RATE_PER_S)
        healed_tasks = int(HEALED_S * RATE_PER_S / 2)
        run_id = f"d-{uuid.uuid4().hex[:8]}"
        work = Workload(
            cluster.client,
            cluster.task_queue,
            run_id,
            tasks=broken_tasks + healed_tasks,
            groups=8,
        )
        # After the repair, half the tasks bring a prompt no replica has cached (one group
        # each): calls the healed replica can win on price, so that probes are placed. (A
        # half-open replica gets a probe only by winning a placement; with every prompt
        # cached elsewhere it would wait for the cached copies to age out.)
        fresh = Workload(
            cluster.client,
            cluster.task_queue,
            f"{run_id}-new",
            seed=1,
            tasks=healed_tasks,
            groups=healed_tasks,
        )
        done = asyncio.Event()
        sampling = asyncio.create_task(_busy_peak(cluster, BUSY, done))
        await work.start(broken_tasks, rate_per_s=RATE_PER_S)
        # Healthy again: the same server restarted without faults, on the same port.
        await cluster.replace_sim(cluster.replica(BROKEN), [])
        healed_at = datetime.now(UTC)
        # Tasks keep coming past the next cool-down, so a probe has calls to try.
        await asyncio.gather(
            work.start(rate_per_s=RATE_PER_S / 2), fresh.start(rate_per_s=RATE_PER_S / 2)
        )
        await work.wait(RUN_TIMEOUT_S)
        await fresh.wait(RUN_TIMEOUT_S)
        done.set()
        busy_peak = await sampling
        opened = {
            r.name: sum(
                bool(re.search(f"circuit of replica {r.name} opened", w.output()))
                for w in cluster.workflow_workers
            )
            for r in cluster.replicas
        }
        figures = ScenarioFigures(
            scenario="d. circuit breaker",
            faults=f"{BROKEN} (the cheapest) answers 100% 503 for {BROKEN_S:.0f} s, then "
            f"is healthy; {BUSY} 10x slower throughout",
            faults_injected=2,
        )
        outcome = await finish(
            cluster, chaos_ledger, [*work.handles, *fresh.handles], figures, started_at=started_at
        )
    broken, busy = BROKEN, BUSY
    failed_on_broken = sum(
        a.replica == broken and a.outcome == "failed"
        for t in outcome.traces.values()
        for a in t.attempts
    )
    probes = sum(
        p.replica == broken and p.probe for t in outcome.traces.values() for p in t.placements
    )
    returned = sum(
        a.replica == broken and a.outcome == "ok"
        for t in outcome.traces.values()
        for a in t.attempts
    )
    figures.faults_injected = failed_on_broken
    figures.faults = (
        f"{BROKEN} (the cheapest) answers 503 to all {failed_on_broken} calls it gets for "
        f"{BROKEN_S:.0f} s, then heals; {BUSY} 10x slower throughout"
    )
    figures.notes += [
        f"{failed_on_broken} calls failed on {broken}; its circuit opened in "
        f"{opened[broken]} of 3 schedulers; {probes} half-open probes in all, and "
        f"{returned} calls served there once it was healthy",
        f"{busy} held up to {busy_peak} calls at once, its circuit opened in {opened[busy]}",
    ]
    outcome.record(request.node.nodeid)
    return Run(outcome, healed_at, broken, busy, busy_peak, opened)


def test_every_task_completes_while_traffic_moves_off_the_broken_replica(run: Run):
    assert run.outcome.not_completed == {}, run.outcome.not_completed


def test_the_broken_replicas_circuit_opens_within_the_configured_failures(run: Run):
    seen = views(run.outcome.traces, run.broken)
    assert seen, "no scheduler placed a call on the broken replica"
    late = {worker: placed_on_open_circuit(view) for worker, view in seen.items()}
    assert {w: times for w, times in late.items() if times} == {}
    assert run.opened_in_logs[run.broken] >= 1


def test_the_broken_replica_is_probed_and_serves_again_once_healthy(run: Run):
    after = [
        (p, t)
        for t in run.outcome.traces.values()
        for p in t.placements
        if p.replica == run.broken and p.at > run.healed_at
    ]
    assert any(p.probe for p, _ in after), "no probe reached the healed replica"
    served = sum(
        a.replica == run.broken and a.outcome == "ok" and a.scheduled_at > run.healed_at
        for t in run.outcome.traces.values()
        for a in t.attempts
    )
    assert served > BREAKER.half_open_successes, "calls did not return after the probes"


def test_a_busy_but_healthy_replica_keeps_its_circuit_closed(run: Run):
    slots = POOLS[1].max_concurrency
    assert run.busy_peak >= slots, f"the slow replica never filled its {slots} slots"
    probes = [p for t in run.outcome.traces.values() for p in t.placements if p.replica == run.busy]
    assert probes, "no call was placed on the busy replica"
    assert not any(p.probe for p in probes), "the busy replica was probed: its circuit opened"
    assert run.opened_in_logs[run.busy] == 0


def test_every_attempt_is_billed_once_and_every_task_row_matches(run: Run):
    books = run.outcome.books
    assert books.problems() == [], "\n".join(books.problems())
    assert books.billed_once == books.attempts


def test_no_secret_reaches_a_log_or_a_history(run: Run):
    assert_no_secret_leaked(run.outcome)

"""The policy benchmark's harness is fair: no policy sees a task's future, every policy gets
the same mechanisms, a crashed replica gets nothing, and the statistics are right."""

from __future__ import annotations

import copy
import dataclasses
import math
import random
from collections.abc import Callable
from decimal import Decimal

import pytest

from kvflow.bench.policies import (
    DOWN_DETECTION_S,
    Probe,
    measure_capacity,
    policy_factories,
    run_policy,
    search_capacity,
    still_rising,
)
from kvflow.bench.policies.figures import (
    PolicyFigures,
    mean_ci,
    money_ci,
    summarise,
    t975,
)
from kvflow.bench.policies.fleet import FALLBACK_MODEL, bench_fleet, simulated_replicas
from kvflow.bench.policies.router_queue import RouterQueue
from kvflow.bench.policies.task_runner import Decision, TaskRunner
from kvflow.scheduler.fleet import Fleet
from kvflow.scheduler.placement import MIN_RETENTION_S, TIER_PRIORITY_SPAN, engine_priority
from kvflow.simulator.des import FleetRequest, FleetView
from kvflow.simulator.policies.base import (
    DEADLINE_PAUSE,
    DEFAULT_MECHANISMS,
    ENGINE_PRIORITY,
    HINTS,
    KV_RETENTION,
    ROUTER_QUEUE,
    PolicySetup,
    RequestRouter,
    TaskContext,
)
from kvflow.simulator.policies.oracle import GREEDY_REFERENCE
from kvflow.simulator.workloads import WORKLOADS, Call, Step, Task, Workload

pytestmark = pytest.mark.timeout(120)

TENANTS = [("acme", 1), ("globex", 3), ("initech", 5)]
FUTURE = 1
"""The step from which the twin workload's tasks differ."""


def _setup(fleet_name: str, replicas: int, seed: int = 0) -> tuple[Fleet, PolicySetup]:
    fleet = bench_fleet(fleet_name, replicas)
    setup = PolicySetup(
        fleet=fleet,
        replica_names=[n for p in fleet.pools for n in p.replica_names()],
        block_size=16,
        clock=lambda: 0.0,
        tokens_of=lambda parent, h: range(16),
        seed=seed,
        extra={"mechanisms": DEFAULT_MECHANISMS},
    )
    return fleet, setup


def _twin(task: Task, salt: int) -> Task:
    """`task` up to the issue of step `FUTURE`; everything it has not revealed yet changed:
    that step's outputs and pause, and the steps after it (one more of them)."""
    twin = copy.copy(task)
    steps = [copy.copy(s) for s in task.steps]
    changed = steps[FUTURE]
    calls = []
    for call in changed.calls:
        prompt_blocks = call.prompt_tokens // 16
        prompt = call.block_hashes[:prompt_blocks]
        output = call.output_tokens * 2 + 1
        tail = [hash((salt, i, h)) & ((1 << 63) - 1) for i, h in enumerate(prompt[-1:] * 40)]
        chain = prompt + tail[: (call.prompt_tokens + output) // 16 - prompt_blocks]
        calls.append(Call(call.prompt_tokens, output, chain))
    steps[FUTURE] = Step(calls, changed.pause_after_s * 2 + 1.0, changed.tool)
    later = [
        Step([dataclasses.replace(c, output_tokens=c.output_tokens + 7) for c in s.calls], 0.5)
        for s in steps[FUTURE + 1 :]
    ]
    twin.steps = [*steps[:FUTURE], steps[FUTURE], *later, Step([calls[0]], 0.0)]
    twin.steps[-2].pause_after_s = 0.3
    return twin


def _decisions(name: str, tasks: list[Task], *, replicas: int = 2) -> list[Decision]:
    fleet, setup = _setup("agent", replicas)
    policy = policy_factories()[name](setup)
    runner = TaskRunner(
        fleet,
        simulated_replicas(fleet),
        policy,
        max_tokens=512,
        record_decisions=True,
    )
    setup.clock = lambda: runner.sim.now
    runner.run(iter(tasks), lambda sim: None)
    assert runner.decisions is not None
    return runner.decisions


@pytest.mark.parametrize("name", [n for n in policy_factories() if n != GREEDY_REFERENCE])
def test_no_policy_reads_a_tasks_future(name: str) -> None:
    # Two workloads identical up to the issue of each task's second step and different after
    # (outputs, pauses, how many steps): every placement up to the first second step, that
    # one included, must be the same, and so must what the policy was told (the context).
    workload = Workload(WORKLOADS["agent"], TENANTS, tasks=10, task_rate=3.0, seed=4)
    tasks = [t for t in workload if len(t.steps) > FUTURE + 1]
    twins = [_twin(t, salt=i) for i, t in enumerate(tasks)]
    seen = _decisions(name, tasks)
    other = _decisions(name, twins)
    future = min(d.at for d in seen if int(d.request_id.split("/")[1]) >= FUTURE)
    before = [d for d in seen if d.at <= future]
    assert len(before) >= 8, "too few placements before the futures part to test anything"
    assert any(int(d.request_id.split("/")[1]) == FUTURE for d in before)
    assert other[: len(before)] == before


class _Spy(RequestRouter):
    """Round-robin that keeps what it was shown of each call."""

    name = "spy"

    def __init__(self, setup: PolicySetup) -> None:
        self.seen: list[FleetRequest] = []
        self.turn = 0

    def route(self, request: FleetRequest, fleet: FleetView, now: float) -> int | None:
        self.seen.append(request)
        self.turn += 1
        return self.turn % len(fleet)


def test_a_policy_is_shown_the_prompt_and_the_output_cap_never_the_output() -> None:
    fleet, setup = _setup("agent", 2)
    spy = _Spy(setup)
    tasks = list(Workload(WORKLOADS["agent"], TENANTS, tasks=5, task_rate=1.0, seed=3))
    calls = {
        f"task-{t.index}/{n}/{k}": c
        for t in tasks
        for n, s in enumerate(t.steps)
        for k, c in enumerate(s.calls)
    }
    runner = TaskRunner(fleet, simulated_replicas(fleet), spy, max_tokens=512)
    runner.run(iter(tasks), lambda sim: None)
    assert len(spy.seen) == len(calls)
    for request in spy.seen:
        call = calls[request.request_id.split("#")[0]]
        assert len(call.block_hashes) > call.prompt_tokens // 16  # the output has blocks
        assert request.block_hashes == call.block_hashes[: call.prompt_tokens // 16]
        assert request.output_tokens == request.max_tokens == 512


def test_what_a_task_declares_depends_on_its_tier_only() -> None:
    # Budgets and expected calls come from the workload's rule, not from the task's own steps
    # and pauses (which the harness keeps from every policy until it issues them).
    for name in ("agent", "long-agent", "overload"):
        tasks = list(Workload(WORKLOADS[name], TENANTS, tasks=30, task_rate=1.0, seed=1))
        declared: dict[int, set[tuple[float, int, float | None]]] = {}
        for task in tasks:
            declared.setdefault(task.tier, set()).add(
                (round(task.deadline_at - task.arrival, 9), task.expected_calls,
                 task.step_allowance_s)
            )  # fmt: skip
        assert all(len(values) == 1 for values in declared.values()), name
        calls = {t.calls for t in tasks}
        assert len(calls) > 3, name  # the tasks differ; what they declare does not


def test_steps_remaining_is_the_declared_estimate_not_the_truth() -> None:
    workload = Workload(WORKLOADS["agent"], TENANTS, tasks=6, task_rate=1.0, seed=2)
    tasks = list(workload)
    decisions = _decisions("round-robin", tasks)
    fields = [f.name for f in dataclasses.fields(TaskContext)]
    remaining_at = fields.index("steps_remaining")
    for decision in decisions:
        task = tasks[int(decision.request_id.split("/")[0].removeprefix("task-"))]
        step = int(decision.request_id.split("/")[1].split("#")[0])
        done = sum(len(s.calls) for s in task.steps[:step])
        assert decision.context[remaining_at] == max(1, task.expected_calls - done)


@pytest.mark.parametrize("mechanisms", [DEFAULT_MECHANISMS, frozenset()])
@pytest.mark.parametrize("name", ["kvflow", "llm-d", "round-robin"])
def test_engine_priority_and_hints_are_the_same_for_every_policy(
    name: str, mechanisms: frozenset[str]
) -> None:
    spec = WORKLOADS["agent"]
    run = run_policy(
        name, spec=spec, fleet=bench_fleet("agent", 2), task_rate=2.0, tasks=8, seed=5,
        mechanisms=mechanisms, record_decisions=True,
    )  # fmt: skip
    tiers = {f"task-{s.task.index}": s.task.tier for s in run.runner.states}
    arrivals = {f"task-{s.task.index}": s.task.arrival for s in run.runner.states}
    decisions = run.runner.decisions
    assert decisions
    hinted = HINTS in mechanisms
    for decision in decisions:
        workflow = decision.request_id.split("/")[0]
        if ENGINE_PRIORITY not in mechanisms:
            assert decision.priority == 0
        elif name == "kvflow":
            # kvflow refines the order within a tier: its oldest task first.
            assert decision.priority == engine_priority(tiers[workflow], arrivals[workflow])
        else:
            # The tier's band, every call of a tier alike (first come, first served in it).
            assert decision.priority == engine_priority(tiers[workflow], None)
        if ENGINE_PRIORITY in mechanisms:
            assert decision.priority // TIER_PRIORITY_SPAN == tiers[workflow]
        fields = [f.name for f in dataclasses.fields(TaskContext)]
        session = decision.context[fields.index("session_id")]
        output = decision.context[fields.index("expected_output_tokens")]
        assert (session == workflow) is hinted
        assert (isinstance(output, int) and output > 0) is hinted
    assert (run.runner.queue is not None) is (ROUTER_QUEUE in mechanisms)
    policies = {r.config.scheduling_policy for r in run.runner.sim.replicas}
    assert policies == {"priority" if ENGINE_PRIORITY in mechanisms else "fcfs"}


@pytest.mark.parametrize("name", ["kvflow", "llm-d-tuned"])
def test_deadline_pause_gives_every_policys_engines_its_calls_step_deadlines(name: str) -> None:
    # The mechanism is the engines' and the workload's (its step allowances), not a
    # policy's: every policy's calls carry their step's deadline to engines that pause by it.
    spec = WORKLOADS["overload"]
    fleet = bench_fleet("overload", 2)
    run = run_policy(
        name, spec=spec, fleet=fleet, task_rate=2.0, tasks=8, seed=5,
        mechanisms=DEFAULT_MECHANISMS, record_decisions=True,
    )  # fmt: skip
    # The comparison's default: it acts only where a workload declares step deadlines.
    assert DEADLINE_PAUSE in DEFAULT_MECHANISMS
    configs = [engine.config for r in run.runner.sim.replicas for engine in r.engines.values()]
    assert configs
    assert all(c.deadline_pause for c in configs)
    assert {c.deadline_priority_span for c in configs} == {TIER_PRIORITY_SPAN}
    plain = run_policy(
        name, spec=spec, fleet=fleet, task_rate=2.0, tasks=8, seed=5,
        mechanisms=DEFAULT_MECHANISMS - {DEADLINE_PAUSE},
    )  # fmt: skip
    assert not any(
        engine.config.deadline_pause
        for r in plain.runner.sim.replicas
        for engine in r.engines.values()
    )


@pytest.mark.parametrize("retention", [True, False])
def test_kv_retention_is_asked_only_by_the_policies_that_document_it(retention: bool) -> None:
    spec = WORKLOADS["long-agent"]
    mechanisms = DEFAULT_MECHANISMS | {KV_RETENTION} if retention else DEFAULT_MECHANISMS
    asked: dict[str, set[tuple[int | None, float | None]]] = {}
    runs: dict[str, dict[str, object]] = {
        "kvflow": {"kv_retention": True},
        "kvflow-default": {},
        "dynamo-tuned": {},
        "llm-d-tuned": {},
        "sglang-tuned": {},
    }
    for label, extra in runs.items():
        run = run_policy(
            label.removesuffix("-default"), spec=spec, fleet=bench_fleet("long-agent", 2),
            task_rate=0.05, tasks=3, seed=2, mechanisms=mechanisms, extra=extra,
            record_decisions=True,
        )  # fmt: skip
        assert run.runner.decisions
        asked[label] = {d.retention for d in run.runner.decisions}
        assert all(r.config.kv_retention is retention for r in run.runner.sim.replicas)
    if not retention:
        assert all(values == {(None, None)} for values in asked.values()), asked
        return
    assert asked["llm-d-tuned"] == asked["sglang-tuned"] == {(None, None)}
    # kvflow's lever is off by default: it did not pay on long-agent.
    assert asked["kvflow-default"] == {(None, None)}
    # Dynamo's priority hint carries no duration; kvflow's lasts twice the expected pause
    # once one has been observed.
    assert {d for _, d in asked["dynamo-tuned"]} == {None}
    assert all(p is not None and p > 35 for p, _ in asked["kvflow"] | asked["dynamo-tuned"])
    durations = {d for _, d in asked["kvflow"] if d is not None}
    assert durations and min(durations) >= MIN_RETENTION_S


class _Fleet:
    """A stand-in for `FleetView`: scraped metrics only."""

    def __init__(self, waiting: list[int], usage: list[float]) -> None:
        from kvflow.simulator.des import ScrapedMetrics

        self.metrics = [
            ScrapedMetrics(waiting=w, kv_cache_usage=u) for w, u in zip(waiting, usage, strict=True)
        ]
        self.up = [True] * len(waiting)
        self.scraped_at = 1.0

    def serves(self, index: int, model: str) -> bool:
        return True


def test_router_queue_holds_calls_while_saturated_and_releases_the_best_tier_first() -> None:
    queue = RouterQueue()
    for tier, name in [(5, "batch"), (1, "first"), (3, "standard"), (1, "second")]:
        queue.push(FleetRequest(0.0, "m", 10, 1, request_id=name), tier, 0.0)
    sent: list[str] = []
    # Every replica has a full KV cache or 5 waiting: nothing passes.
    full = _Fleet([5, 0], [0.1, 0.85])
    assert queue.dispatch(full, lambda r: sent.append(r.request_id), lambda r: True) == 0  # type: ignore[arg-type]
    # Two free places: tier 1 first, in arrival order.
    room = _Fleet([3, 5], [0.5, 0.5])
    room.scraped_at = 2.0
    queue.dispatch(room, lambda r: sent.append(r.request_id), lambda r: True)  # type: ignore[arg-type]
    assert sent == ["first", "second"]
    # The same scrape: the places were used, nothing more until the metrics refresh.
    assert queue.dispatch(room, lambda r: sent.append(r.request_id), lambda r: True) == 0  # type: ignore[arg-type]
    room.scraped_at = 3.0
    queue.dispatch(room, lambda r: sent.append(r.request_id), lambda r: r.request_id != "standard")  # type: ignore[arg-type]
    assert sent == ["first", "second", "batch"]
    assert len(queue) == 0


class _DegradeEverything(RequestRouter):
    """A policy that sends every call to the fallback model's replica."""

    name = "degrade"

    def __init__(self, setup: PolicySetup) -> None:
        self.names = setup.replica_names

    def route(self, request: FleetRequest, fleet: FleetView, now: float) -> int | None:
        request.model = FALLBACK_MODEL
        return next(i for i in range(len(fleet)) if fleet.serves(i, FALLBACK_MODEL))


def test_a_task_answered_by_the_fallback_model_is_not_a_success() -> None:
    fleet, setup = _setup("heterogeneous", 4)
    tasks = list(Workload(WORKLOADS["agent"], TENANTS, tasks=4, task_rate=1.0, seed=0))
    runner = TaskRunner(
        fleet,
        simulated_replicas(fleet),
        _DegradeEverything(setup),
        max_tokens=512,
    )
    outcome = runner.run(iter(tasks), lambda sim: None)
    assert outcome.tasks == 4
    assert outcome.degraded == 4
    assert outcome.successes == 0
    assert outcome.spend_micros > 0


@pytest.mark.parametrize("name", ["kvflow", "llm-d", "sglang", "round-robin", "dynamo"])
def test_the_crashed_replica_of_the_faults_workload_takes_no_attempt_after_its_crash(
    name: str,
) -> None:
    spec = WORKLOADS["faults"]
    run = run_policy(
        name, spec=spec, fleet=bench_fleet("faults", 4), task_rate=2.0, tasks=40, seed=2,
        record_decisions=True,
    )  # fmt: skip
    crash = run.crash_at
    assert crash is not None
    attempts = run.runner.attempt_log
    assert any(r == 0 and ok and at < crash for at, r, ok in attempts), "no work before"
    assert not any(r == 0 and ok and at > crash for at, r, ok in attempts)
    decisions = run.runner.decisions or []
    assert any(d.at > crash + DOWN_DETECTION_S for d in decisions)
    assert not any(d.replica == 0 and d.at > crash + DOWN_DETECTION_S for d in decisions)


# ---------------------------------------------------------------------------- statistics


def test_student_t_quantiles() -> None:
    assert t975(1) == 12.706
    assert t975(4) == 2.776
    assert t975(30) == 2.042
    assert t975(60) == pytest.approx(2.000, abs=0.001)
    assert t975(10_000) == pytest.approx(1.960, abs=0.001)


def test_mean_and_95_percent_interval_of_five_seeds() -> None:
    interval = mean_ci([1.0, 2.0, 3.0, 4.0, 5.0])
    assert interval is not None
    # s = √2.5, half-width = t(4) · s / √5 = 2.776 · 0.7071 = 1.963.
    half = 2.776 * math.sqrt(2.5) / math.sqrt(5)
    assert interval.mean == 3.0
    assert interval.low == pytest.approx(3.0 - half)
    assert interval.high == pytest.approx(3.0 + half)
    single = mean_ci([7.0])
    assert single is not None and single.low is None and single.as_pair() is None
    money = money_ci([Decimal("0.001"), Decimal("0.002"), Decimal("0.003")])
    assert money is not None
    # s = 0.001, half-width = 4.303 · 0.001 / √3 = 0.002484338 (to the nano-dollar).
    assert money.mean == Decimal("0.002000000")
    assert money.low == Decimal("-0.000484338")
    assert money.high == Decimal("0.004484338")


def _run(policy: str, seed: int, cost: str, goodput: float) -> PolicyFigures:
    return PolicyFigures(
        policy=policy,
        seed=seed,
        tasks=10,
        successes=10,
        spend_micros=0,
        wasted_micros=0,
        cost_per_successful_task_usd=Decimal(cost),
        success_rate=1.0,
        slo_attainment={"1": 1.0},
        goodput_tasks_per_s=goodput,
        ttft_p50_s=0.0,
        ttft_p90_s=0.0,
        ttft_p99_s=0.0,
        prefix_hit_rate=0.5,
        reference_prefix_hit_rate=0.5,
        wasted_spend_share=0.0,
        utilisation=0.5,
        max_replica_load_share=0.5,
        max_replica_load_over_mean=1.0,
        refusals=0,
        failed_attempts=0,
    )


def test_ratios_to_kvflow_are_paired_by_seed() -> None:
    # Seed by seed kvflow costs 0.5, 0.8 and 0.5 of the other; averaging the costs first
    # would give 0.6 / 0.95 = 0.63 instead of the paired mean 0.6.
    kvflow = [
        _run("kvflow", 0, "1", 1.0),
        _run("kvflow", 1, "1.6", 1.0),
        _run("kvflow", 2, "0.2", 1.0),
    ]
    other = [_run("o", 2, "0.4", 2.0), _run("o", 0, "2", 2.0), _run("o", 1, "2", 0.5)]
    summary = summarise(other, kvflow)
    ratio = summary.ratios["cost_per_successful_task_usd"]
    assert ratio is not None
    assert ratio.mean == pytest.approx(0.6)
    half = (
        t975(2)
        * math.sqrt(((0.5 - 0.6) ** 2 + (0.8 - 0.6) ** 2 + (0.5 - 0.6) ** 2) / 2)
        / math.sqrt(3)
    )
    assert ratio.low == pytest.approx(0.6 - half)
    assert ratio.high == pytest.approx(0.6 + half)
    goodput = summary.ratios["goodput_tasks_per_s"]
    assert goodput is not None and goodput.mean == pytest.approx((0.5 + 2.0 + 0.5) / 3)
    assert summary.cost is not None and summary.cost.mean == Decimal("1.466666667")


def test_random_seeds_give_intervals_that_cover_the_mean_most_of_the_time() -> None:
    # 200 samples of 5 draws from N(10, 2): the 95% interval covers 10 in about 95% of them.
    rng = random.Random(7)
    covered = 0
    for _ in range(200):
        interval = mean_ci([rng.gauss(10.0, 2.0) for _ in range(5)])
        assert interval is not None and interval.low is not None and interval.high is not None
        covered += interval.low <= 10.0 <= interval.high
    assert 180 <= covered <= 200


def _saturating(knee: float, slo_knee: float) -> Callable[[float, Probe | None], Probe]:
    """A fleet whose goodput stops rising at `knee` and whose tier-1 SLO breaks past
    `slo_knee` (tasks per second)."""

    def probe(rate: float, last: Probe | None) -> Probe:
        goodput = min(rate, knee * (1 + 0.1 * math.log(max(rate / knee, 1.0))))
        tier1 = 1.0 if rate <= slo_knee else 0.95
        return Probe(rate, goodput, tier1, 1.0, still_rising(rate, goodput, tier1, 1.0, last))

    return probe


@pytest.mark.parametrize(
    ("knee", "slo_knee", "capacity"),
    [
        # Probes at 0.4, 0.6, 0.9, then 1.35 adds 3% goodput for 50% more load; the middle of
        # 0.9 and 1.35 (1.10) still adds enough.
        (1.0, 9.0, math.sqrt(0.9 * 1.35)),
        # Tier-1 SLO breaks past 0.65: 0.9 fails, and so does the middle of 0.6 and 0.9.
        (9.0, 0.65, 0.4 * 1.5),
        # Even the first probe is past the knee (53% of tasks succeed): the search steps down
        # to 0.18, then the middle of 0.18 and 0.27 still rises.
        (0.2, 9.0, math.sqrt(0.4 / 1.5**2 * 0.4 / 1.5)),
    ],
)
def test_capacity_is_where_goodput_stops_rising_or_the_tier1_slo_breaks(
    knee: float, slo_knee: float, capacity: float
) -> None:
    found, probes = search_capacity(0.4, _saturating(knee, slo_knee), max_probes=8)
    assert found == pytest.approx(capacity)
    good = [p for p in probes if p.rising]
    assert found == max(p.task_rate for p in good)
    assert all(p.task_rate > found for p in probes if not p.rising)


def test_capacity_probes_every_seed_with_the_greedy_reference() -> None:
    spec = WORKLOADS["overload"]
    fleet = bench_fleet("overload", 2)
    capacity = measure_capacity(
        spec, fleet, seeds=(0, 1), lifetime_s=60.0, window_lifetimes=1.0, max_probes=3
    )
    assert capacity.seeds == [0, 1]
    assert capacity.policy == GREEDY_REFERENCE
    assert len(capacity.probes) >= 3
    assert capacity.tasks_per_s in {p.task_rate for p in capacity.probes if p.rising}


def test_a_call_that_waits_for_admission_carries_how_long_it_has_waited() -> None:
    # Tier headroom refuses lower tiers with a retry-after under load: the call waits in the
    # router queue, and each retry tells the scheduler how long it has waited so far, as the
    # workflow does (PlacementRequest.queued_s), so that a tier's longest wait can end it.
    run = run_policy(
        "kvflow", spec=WORKLOADS["overload"], fleet=bench_fleet("overload", 2), task_rate=20.0,
        tasks=60, seed=3, extra={"tier_headroom": True}, record_decisions=True,
    )  # fmt: skip
    decisions = run.runner.decisions
    assert decisions is not None
    fields = [f.name for f in dataclasses.fields(TaskContext)]
    queued_at = fields.index("queued_s")
    waits: dict[str, list[tuple[float, float]]] = {}
    for d in decisions:
        call = d.request_id.split("#")[0]
        waits.setdefault(call, []).append((d.at, float(d.context[queued_at])))  # type: ignore[arg-type]
    retried = {call: seen for call, seen in waits.items() if len(seen) > 1}
    assert run.outcome.refusals > 0 and retried
    for seen in retried.values():
        first_at = seen[0][0]
        assert seen[0][1] == 0.0
        for at, queued in seen[1:]:
            assert queued == pytest.approx(at - first_at)

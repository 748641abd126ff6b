"""`kvflow bench policies`: kvflow's placement against the routers platform teams run today.

Every policy (`kvflow.simulator.policies`) runs the same seeded workload
(`kvflow.simulator.workloads`) on the same discrete-event fleet; only placement differs:

- **Tasks drive calls.** A task's first step arrives with the task; each next step is issued
  when every call of the step before has finished, plus its tool pause. A task succeeds when
  all its steps finish before its deadline; when the deadline passes first, its calls in
  flight are cancelled (billed for what they processed) and the task fails.
- **Same failure handling for all.** A call that fails on a replica (crash, or sent to a
  replica that is down) is re-placed with that replica excluded, up to `RETRY_BUDGET`
  re-placements per task (kvflow's `max_task_retries` default); then the task fails. A
  policy that refuses a call fails it, unless the refusal carries a retry-after (kvflow's
  admission under saturation), after which the call is placed again.
- **Same telemetry for all.** Routers read the replicas' metrics scraped every 50 ms
  (`FleetView.metrics`, llm-d's refresh interval), or the engines' caches for policies fed by
  KV events; kvflow gets scrapes every second and the engines' KV events, as its control
  plane does.
- **Money is exact.** Each attempt is billed in integer micro-dollars at its pool's token
  prices (`ExactPrices`): uncached input, cached input and output tokens, failed and
  cancelled attempts included (the input was processed). Cost per successful task is total
  spend / successful tasks, a `Decimal`.

**Offered load** is the task arrival rate over the fleet's capacity: what every replica
could serve if each call reused its whole conversation from cache (prefill of the new tokens
only) and decoded in a full batch (as many sequences of the workload's mean context as its
KV cache holds, at most 128). 100% is then beyond what any real policy sustains.
"""

from __future__ import annotations

import functools
import logging
import math
import statistics
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from kvflow.scheduler.config import REQUIRED_AXIS, SchedulerConfig
from kvflow.scheduler.fleet import (
    MICROS_PER_USD,
    ExactPrices,
    Fleet,
    ModelSpec,
    Pool,
    Tenant,
    TokenPrices,
)
from kvflow.scheduler.gpus import GpuGeneration
from kvflow.simulator.des import DiscreteEventFleet, FleetRequest, FleetView, RequestRecord
from kvflow.simulator.engine import EngineConfig, SimReplica, SimRequest, StepResult
from kvflow.simulator.models import BUILTIN_MODELS
from kvflow.simulator.perf import PerfModel
from kvflow.simulator.policies import (
    ALL_POLICIES,
    ORACLE,
    POLICIES,
    AttemptEnd,
    PlacementPolicy,
    PolicySetup,
    TaskContext,
)
from kvflow.simulator.workloads import WORKLOADS, Task, Workload, WorkloadSpec

logger = logging.getLogger(__name__)

RETRY_BUDGET = 3
"""Re-placements per task after failed calls, for every policy."""
DOWN_DETECTION_S = 2.0
"""A crashed replica is seen down this long after it crashed (two missed 1 s scrapes)."""
MAX_DECODE_BATCH = 128
WARMUP_SHARE = 0.25
"""The first quarter of a run's tasks only load the fleet: no figure counts them."""
CAPACITY_PROBES = 3
"""Oracle runs that find the capacity behind offered load (`capacity_tasks_per_s`)."""
PROBE_START = 0.1
"""The first probe's rate, as a share of the optimistic capacity."""
ANCHORS = ("llm-d", "llm-d-precise", "sglang", "dynamo", "aibrix")
"""The routers the production systems run (the goals compare kvflow with the best of them)."""
MODEL = "llama-3.1-8b"
FALLBACK = "llama-3.2-1b"


# ---------------------------------------------------------------------------- fleets


_TENANTS = [
    Tenant(name="acme", tier=1, fairness_weight=3.0),
    Tenant(name="globex", tier=3, fairness_weight=2.0),
    Tenant(name="initech", tier=5, fairness_weight=1.0),
]


def bench_fleet(workload: str, replicas: int) -> Fleet:
    """The default fleet of a workload: H100s, or for `heterogeneous` H200/H100/L4 pools.

    Heterogeneous: 3/8 H200, 3/8 H100, 1/8 L4 serving the model and 1/8 L4 serving its
    cheaper fallback (at least one replica each).
    """
    models = [BUILTIN_MODELS[MODEL], BUILTIN_MODELS[FALLBACK]]
    if workload != "heterogeneous":
        pools = [
            Pool(
                name="h100",
                gpu=GpuGeneration.H100,
                replicas=replicas,
                price_per_gpu_hour_usd=Decimal("2.90"),
                token_prices=TokenPrices.per_mtok("0.18", "0.018", "0.54"),
                warm_models=[MODEL],
                max_concurrency=256,
            )
        ]
        return Fleet(models=models, pools=pools, tenants=_TENANTS)
    if replicas < 4:
        raise ValueError("the heterogeneous fleet needs at least 4 replicas")
    h200 = max(1, replicas * 3 // 8)
    h100 = max(1, replicas * 3 // 8)
    l4 = max(1, (replicas - h200 - h100) // 2)
    small = replicas - h200 - h100 - l4
    pools = [
        Pool(
            name="h200",
            gpu=GpuGeneration.H200,
            replicas=h200,
            price_per_gpu_hour_usd=Decimal("3.80"),
            token_prices=TokenPrices.per_mtok("0.20", "0.02", "0.60"),
            warm_models=[MODEL],
            max_concurrency=256,
        ),
        Pool(
            name="h100",
            gpu=GpuGeneration.H100,
            replicas=h100,
            price_per_gpu_hour_usd=Decimal("2.90"),
            token_prices=TokenPrices.per_mtok("0.18", "0.018", "0.54"),
            warm_models=[MODEL],
            max_concurrency=256,
        ),
        Pool(
            name="l4",
            gpu=GpuGeneration.L4,
            replicas=l4,
            price_per_gpu_hour_usd=Decimal("0.80"),
            token_prices=TokenPrices.per_mtok("0.10", "0.01", "0.40"),
            warm_models=[MODEL],
            max_concurrency=64,
        ),
        Pool(
            name="l4-small",
            gpu=GpuGeneration.L4,
            replicas=small,
            price_per_gpu_hour_usd=Decimal("0.80"),
            token_prices=TokenPrices.per_mtok("0.03", "0.003", "0.10"),
            warm_models=[FALLBACK],
            max_concurrency=128,
        ),
    ]
    return Fleet(models=models, pools=pools, tenants=_TENANTS)


ENGINE = EngineConfig(max_model_len=16384, enable_kv_events=True)


def simulated_replicas(fleet: Fleet, *, slow: dict[int, float] | None = None) -> list[SimReplica]:
    """One simulated replica per replica of `fleet`, pool by pool (the scheduler's order).

    `slow` maps replica indexes to a slowdown factor (a fault: every step takes longer).
    """
    specs = {m.name: m for m in fleet.models}
    replicas: list[SimReplica] = []
    for pool in fleet.pools:
        models = [specs[name] for name in pool.warm_models]
        for name in pool.replica_names():
            factor = (slow or {}).get(len(replicas))
            config = ENGINE if factor is None else ENGINE.model_copy(update={"slowdown": factor})
            config = config.model_copy(update={"tensor_parallel": pool.gpus_per_replica})
            replicas.append(SimReplica(pool.gpu, models, config, name=name))
    return replicas


def optimistic_capacity_tasks_per_s(workload: Workload, fleet: Fleet, sample: int = 200) -> float:
    """An upper bound on the tasks per second the fleet serves (the probe's starting point).

    Every call reuses its whole conversation from cache and decodes in a full batch (as many
    sequences of the workload's mean context as the KV cache holds, at most 128): 6–9× what
    the fleet sustains, since batches are rarely full and caches are evicted in tool pauses.
    """
    tasks = [workload.task(i, 0.0) for i in range(sample)]
    contexts = [c.prompt_tokens for t in tasks for s in t.steps for c in s.calls]
    mean_context = statistics.fmean(contexts) + workload.spec.output_median
    specs = {m.name: m for m in fleet.models}
    total = 0.0
    for pool in fleet.pools:
        model: ModelSpec = specs[pool.warm_models[0]]
        perf = PerfModel(
            gpu=SimReplica(pool.gpu, [model], ENGINE).gpu,
            model=model,
            tensor_parallel=pool.gpus_per_replica,
            mfu=ENGINE.mfu,
            bandwidth_efficiency=ENGINE.bandwidth_efficiency,
            step_overhead_s=ENGINE.step_overhead_s,
        )
        kv_tokens = (
            SimReplica(pool.gpu, [model], ENGINE).engine(model.name).num_gpu_blocks
            * ENGINE.block_size
        )
        batch = max(1, min(MAX_DECODE_BATCH, int(kv_tokens / mean_context)))
        per_token = perf.decode_step_seconds(batch, int(mean_context)) / batch
        seconds = 0.0
        for task in tasks:
            seen = 0
            for step in task.steps:
                for call in step.calls:
                    new = max(1, call.prompt_tokens - seen)
                    seconds += perf.prefill_seconds(new, call.prompt_tokens - new)
                    seconds += call.output_tokens * per_token
                seen = step.calls[0].prompt_tokens + step.calls[0].output_tokens
        total += pool.replicas / (seconds / len(tasks))
    return total


def capacity_tasks_per_s(
    spec: WorkloadSpec, fleet: Fleet, *, tasks: int, seed: int, probes: int = CAPACITY_PROBES
) -> float:
    """Tasks per second at which the oracle keeps every engine busy: offered load 100%.

    A fixed point found by simulation: run the oracle (the best placement) at rate λ, measure
    the engines' busy fraction u over the steady-state window, and try λ / u next, the rate
    that would keep them busy if each task cost as much engine time. Batching makes a task
    cheaper as load grows, so from below the rates rise towards the fixed point; `probes`
    runs, fewer once u is within 5% of 1.
    """
    probe = Workload(spec, fleet_tenants(fleet), tasks=tasks, task_rate=1.0, seed=seed)
    rate = optimistic_capacity_tasks_per_s(probe, fleet) * PROBE_START
    for _ in range(probes):
        outcome = run_policy(
            ORACLE,
            spec=spec,
            fleet=fleet,
            task_rate=rate,
            tasks=tasks,
            seed=seed,
            warmup_tasks=int(tasks * WARMUP_SHARE),
        )
        busy = outcome.busy_s / (outcome.replicas * outcome.span_s) if outcome.span_s else 0.0
        if busy <= 0:
            break
        rate /= busy
        if abs(busy - 1.0) < 0.05:
            break
    return rate


@dataclass(frozen=True)
class ZeroMissFloor:
    """What no placement can beat on a workload (`zero_miss_floor`)."""

    cost_per_task_usd: Decimal | None
    """None when no task is counted."""
    prefix_hit_rate: float


def zero_miss_floor(
    tasks: Iterable[Task], fleet: Fleet, *, block_size: int, warmup_tasks: int, model: str = MODEL
) -> ZeroMissFloor:
    """A lower bound on cost per successful task, and the hit rate behind it.

    `tasks` in arrival order (a `Workload`). Every call of the counted tasks (index ≥
    `warmup_tasks`) is billed as if it found cached
    every full block that an earlier call had computed (its own task's earlier steps and
    sibling calls, and a system prompt some earlier-arriving task sent first), with an
    unbounded cache, at the cheapest prices of a pool serving `model`, and every task
    succeeds at its first attempt. A call can only reuse blocks already computed, so only the
    blocks new to the whole fleet are billed at the input price: what remains is output and
    cached input, which placement cannot change. (Degrading calls to a cheaper fallback
    model can cost less: that changes the answer, not only where it is computed.)
    """
    # A call degraded to a cheaper fallback model is a different call (another model's
    # answer), so only the pools serving the model asked for set the floor.
    serving = [pool for pool in fleet.pools if model in pool.warm_models] or fleet.pools
    prices = {pool.token_prices.exact() for pool in serving}
    size = block_size
    seen: set[int] = set()
    micros = counted = prompt_tokens = cached_tokens = 0
    for task in tasks:
        for step in task.steps:
            for call in step.calls:
                matched = 0
                for block in call.block_hashes:
                    if block not in seen:
                        break
                    matched += 1
                cached = min(matched * size, call.prompt_tokens)
                if task.index >= warmup_tasks:
                    prompt_tokens += call.prompt_tokens
                    cached_tokens += cached
                    micros += min(
                        p.cost_micros(call.prompt_tokens, cached, call.output_tokens)
                        for p in prices
                    )
                # A fan-out's calls run at once, but an engine caches a block as soon as one
                # of them has computed it, so a sibling may find it: count them in turn.
                seen.update(call.block_hashes)
        counted += task.index >= warmup_tasks
    return ZeroMissFloor(
        cost_per_success(micros, counted), cached_tokens / prompt_tokens if prompt_tokens else 0.0
    )


# ---------------------------------------------------------------------------- tasks


@dataclass(slots=True)
class _TaskState:
    task: Task
    step: int = 0
    pending: int = 0
    spent_micros: int = 0
    retries: int = 0
    previous: int | None = None
    done: bool = False
    ok: bool = False
    end: float = 0.0
    inflight: dict[str, tuple[int, FleetRequest]] = field(default_factory=dict)
    counted: bool = True
    """False for warm-up tasks: they load the fleet but no figure counts them."""


@dataclass
class Outcome:
    """Everything measured in one run of one policy (figures come from `figures`)."""

    policy: str
    replicas: int
    tasks: int
    successes: int
    tasks_by_tier: dict[int, int]
    successes_by_tier: dict[int, int]
    spend_micros: int
    wasted_micros: int
    ttfts: list[float]
    prompt_tokens: int
    cached_tokens: int
    span_s: float
    busy_s: float
    attempts_by_replica: list[int]
    failed_attempts: int
    refusals: int
    warmup_s: float = 0.0
    """From the first arrival to the first counted one: how long the fleet had to fill."""
    mean_task_s: float = 0.0
    """Mean time from arrival to end of the counted tasks."""


class TaskRunner:
    """Runs a workload's tasks on a fleet with one policy (module docstring)."""

    def __init__(
        self,
        fleet: Fleet,
        replicas: Sequence[SimReplica],
        policy: PlacementPolicy,
        *,
        max_tokens: int,
        retry_budget: int = RETRY_BUDGET,
        warmup_tasks: int = 0,
        last_task: int | None = None,
    ) -> None:
        self.policy = policy
        self.warmup_tasks = warmup_tasks
        self.last_task = last_task
        """Index of the last task to arrive: the steady-state window ends at its arrival."""
        self._window: list[tuple[float, float]] = []
        self._first_arrival: float | None = None
        """(time, engine busy seconds) when the window opens and when it closes."""
        self.max_tokens = max_tokens
        self.retry_budget = retry_budget
        self.name = policy.name
        self.sim = DiscreteEventFleet(
            replicas,
            self,
            on_step=self._on_step,
            on_finish=self._on_finish,
            on_fail=self._on_fail,
            on_scrape=self._on_scrape,
        )
        prices: list[ExactPrices] = []
        for pool in fleet.pools:
            prices.extend([pool.token_prices.exact()] * pool.replicas)
        self.prices = prices
        self.states: list[_TaskState] = []
        self.spend_micros = 0
        self.wasted_micros = 0
        self.ttfts: list[float] = []
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.attempts = [0] * len(replicas)
        self.failed_attempts = 0
        self.refusals = 0
        self._ids = 0
        self._tasks: Iterator[Task] = iter(())
        self._owner: dict[str, _TaskState] = {}
        """Request id of every attempt in flight → its task."""

    # ---- driving

    def run(self, tasks: Iterator[Task], faults: Callable[[DiscreteEventFleet], None]) -> Outcome:
        """Run every task to its end; `faults` may schedule crashes on the fleet first."""
        faults(self.sim)
        self._tasks = tasks
        self._next_task()
        result = self.sim.run()
        return self._outcome(result.simulated_seconds)

    def _next_task(self) -> None:
        """Schedule the next task's arrival (tasks are generated as they arrive)."""
        task = next(self._tasks, None)
        if task is not None:
            self.sim.schedule(task.arrival, functools.partial(self._arrive, task))

    def _arrive(self, task: Task) -> None:
        if self._first_arrival is None:
            self._first_arrival = self.sim.now
        state = _TaskState(task, counted=task.index >= self.warmup_tasks)
        self.states.append(state)
        if task.index == self.warmup_tasks or task.index == self.last_task:
            self._window.append((self.sim.now, self._busy_s()))
        self.sim.schedule(task.deadline_at, functools.partial(self._deadline, state))
        self._issue_step(state)
        self._next_task()

    def _issue_step(self, state: _TaskState) -> None:
        if state.done:
            return
        step = state.task.steps[state.step]
        state.pending = len(step.calls)
        for number, call in enumerate(step.calls):
            self._submit(
                state,
                FleetRequest(
                    arrival_time=self.sim.now,
                    model=MODEL,
                    prompt_tokens=call.prompt_tokens,
                    output_tokens=call.output_tokens,
                    block_hashes=call.block_hashes,
                    tenant=state.task.tenant,
                    session=f"task-{state.task.index}",
                    request_id=f"task-{state.task.index}/{state.step}/{number}",
                ),
            )

    def _submit(self, state: _TaskState, request: FleetRequest, *, attempt: int = 1) -> None:
        if state.done:
            return
        task = state.task
        self._ids += 1
        request.request_id = f"{request.request_id.split('#')[0]}#{self._ids}"
        request.attempt = attempt
        request.arrival_time = self.sim.now
        request.context = TaskContext(
            workflow_id=f"task-{task.index}",
            tenant=task.tenant,
            tier=task.tier,
            deadline_at=task.deadline_at,
            steps_remaining=len(task.steps) - state.step,
            max_tokens=self.max_tokens,
            spent_micros=state.spent_micros,
            previous_replica=state.previous,
            task_retries=state.retries,
        )
        state.inflight[request.request_id] = (-1, request)
        self._owner[request.request_id] = state
        self.sim.submit(request)

    def _deadline(self, state: _TaskState) -> None:
        if state.done:
            return
        self._finish_task(state, ok=False)
        for request_id, (replica, request) in list(state.inflight.items()):
            self._owner.pop(request_id, None)
            if replica < 0:
                continue
            sim = self.sim.abort(replica, request.model, request_id)
            if sim is not None:
                self._bill_partial(state, replica, request, sim, replica_fault=False)
        state.inflight.clear()

    def _finish_task(self, state: _TaskState, *, ok: bool) -> None:
        state.task.steps = []  # the conversation's blocks are not needed any more
        state.done = True
        state.ok = ok
        state.end = self.sim.now
        if not ok and state.counted:
            self.wasted_micros += state.spent_micros

    # ---- fleet callbacks

    def route(self, request: FleetRequest, fleet: FleetView, now: float) -> int | None:
        """The policy's choice, noted so that a deadline can cancel the attempt."""
        state = self._owner.get(request.request_id)
        if state is None or state.done:
            return None
        if isinstance(request.context, TaskContext):
            # What the workflow knows when the call is placed, not when it was issued.
            request.context.spent_micros = state.spent_micros
            request.context.previous_replica = state.previous
        index = self.policy.route(request, fleet, now)
        if index is not None:
            state.inflight[request.request_id] = (index, request)
        return index

    def _on_scrape(self, now: float) -> None:
        self.policy.on_scrape(self.sim.view, now)

    def _on_step(self, replica: int, result: StepResult) -> None:
        self.policy.on_step(replica, result)

    def _bill(self, state: _TaskState, micros: int) -> None:
        state.spent_micros += micros
        if not state.counted:
            return
        self.spend_micros += micros
        if state.done and not state.ok:
            self.wasted_micros += micros

    def _on_finish(self, record: RequestRecord) -> None:
        request = record.request
        state = self._owner.pop(request.request_id)
        state.inflight.pop(request.request_id, None)
        replica = record.replica
        cost = self.prices[replica].cost_micros(
            request.prompt_tokens, record.cached_tokens, record.output_tokens
        )
        self._bill(state, cost)
        if state.counted:
            self.attempts[replica] += 1
            self.ttfts.append(record.ttft)
            self.prompt_tokens += request.prompt_tokens
            self.cached_tokens += record.cached_tokens
        self.policy.on_attempt_end(
            AttemptEnd(
                request=request,
                replica=replica,
                ok=True,
                queue_s=record.queue_time,
                ttft_s=record.ttft,
                duration_s=record.e2e_latency,
                prompt_tokens=request.prompt_tokens,
                cached_tokens=record.cached_tokens,
                completion_tokens=record.output_tokens,
                cost_micros=cost,
            )
        )
        if state.done:
            return
        state.previous = replica
        state.pending -= 1
        if state.pending:
            return
        state.step += 1
        if state.step == len(state.task.steps):
            self._finish_task(state, ok=True)
            return
        pause = state.task.steps[state.step - 1].pause_after_s
        self.sim.schedule(self.sim.now + pause, lambda: self._issue_step(state))

    def _bill_partial(
        self,
        state: _TaskState,
        replica: int,
        request: FleetRequest,
        sim: SimRequest | None,
        *,
        replica_fault: bool,
    ) -> None:
        """An attempt that did not finish: bill what it processed, tell the policy."""
        if state.counted:
            self.failed_attempts += 1
        prompt = cached = output = 0
        if sim is not None and sim.first_scheduled_time is not None:
            prompt = min(max(sim.num_computed_tokens, 0), request.prompt_tokens)
            cached = min(max(sim.num_cached_tokens, 0), prompt)
            output = sim.num_output_tokens
            if output:
                prompt = request.prompt_tokens
        cost = self.prices[replica].cost_micros(prompt, cached, output) if replica >= 0 else 0
        self._bill(state, cost)
        if replica >= 0 and state.counted:
            self.attempts[replica] += 1
        self.policy.on_attempt_end(
            AttemptEnd(
                request=request,
                replica=replica,
                ok=False,
                replica_fault=replica_fault,
                prompt_tokens=prompt,
                cached_tokens=cached,
                completion_tokens=output,
                cost_micros=cost,
            )
        )

    def _on_fail(self, request: FleetRequest, replica: int, sim: SimRequest | None) -> None:
        state = self._owner.pop(request.request_id, None)
        if state is None:
            return
        state.inflight.pop(request.request_id, None)
        if replica < 0:
            wait = self.policy.retry_after(request)
            if state.done:
                return
            if state.counted:
                self.refusals += 1
            if wait is not None and self.sim.now + wait < state.task.deadline_at:
                self.sim.schedule(
                    self.sim.now + wait,
                    lambda: self._submit(state, request, attempt=request.attempt),
                )
                return
            self._finish_task(state, ok=False)
            return
        self._bill_partial(state, replica, request, sim, replica_fault=True)
        if state.done:
            return
        if state.retries >= self.retry_budget:
            self._finish_task(state, ok=False)
            return
        state.retries += 1
        request.exclude = request.exclude | {replica}
        self._submit(state, request, attempt=request.attempt + 1)

    def _busy_s(self) -> float:
        return sum(e.stats.busy_seconds for r in self.sim.replicas for e in r.engines.values())

    def _outcome(self, span: float) -> Outcome:
        tasks_by_tier: dict[int, int] = {}
        successes_by_tier: dict[int, int] = {}
        counted = 0
        lifetimes = 0.0
        for state in self.states:
            if not state.done:
                logger.warning("task %d never ended", state.task.index)
            if not state.counted:
                continue
            counted += 1
            lifetimes += state.end - state.task.arrival
            tier = state.task.tier
            tasks_by_tier[tier] = tasks_by_tier.get(tier, 0) + 1
            if state.ok:
                successes_by_tier[tier] = successes_by_tier.get(tier, 0) + 1
        busy = self._busy_s()
        if len(self._window) == 2 and self._window[1][0] > self._window[0][0]:
            # Steady state: from the first counted arrival to the last arrival.
            (opened, busy_then), (closed, busy_now) = self._window
            span, busy = closed - opened, busy_now - busy_then
        return Outcome(
            policy=self.policy.name,
            replicas=len(self.sim.replicas),
            tasks=counted,
            successes=sum(successes_by_tier.values()),
            tasks_by_tier=tasks_by_tier,
            successes_by_tier=successes_by_tier,
            spend_micros=self.spend_micros,
            wasted_micros=self.wasted_micros,
            ttfts=self.ttfts,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            span_s=span,
            busy_s=busy,
            attempts_by_replica=self.attempts,
            failed_attempts=self.failed_attempts,
            refusals=self.refusals,
            warmup_s=(
                self._window[0][0] - self._first_arrival
                if self._window and self._first_arrival is not None
                else 0.0
            ),
            mean_task_s=lifetimes / counted if counted else 0.0,
        )


# ---------------------------------------------------------------------------- figures


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank `q` percentile (0 < q ≤ 1) of `values`; 0 when there are none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class PolicyFigures:
    """The figures of one policy on one workload (see `figures`)."""

    policy: str
    tasks: int
    successes: int
    spend_micros: int
    wasted_micros: int
    cost_per_successful_task_usd: Decimal | None
    """Total spend / successful tasks, exact; None when no task succeeded."""
    success_rate: float
    slo_attainment: dict[str, float]
    """Tier → successful tasks of that tier / its tasks."""
    goodput_tasks_per_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    prefix_hit_rate: float
    oracle_prefix_hit_rate: float
    wasted_spend_share: float
    utilisation: float
    max_replica_load_share: float
    max_replica_load_over_mean: float
    refusals: int
    failed_attempts: int
    mean_task_s: float = 0.0
    """Mean time from a counted task's arrival to its end."""
    warmup_lifetimes: float = 0.0
    """The warm-up's arrivals span this many mean task lifetimes: below 1, the counted tasks
    arrive while the fleet is still filling, and the load they see is a ramp."""

    def as_json(self) -> dict[str, Any]:
        """The issue's JSON shape: money as an exact decimal string."""
        cost = self.cost_per_successful_task_usd
        return {
            "cost_per_successful_task_usd": None if cost is None else str(cost),
            "success_rate": round(self.success_rate, 6),
            "slo_attainment": {k: round(v, 6) for k, v in self.slo_attainment.items()},
            "goodput_tasks_per_s": round(self.goodput_tasks_per_s, 6),
            "ttft_p50_s": round(self.ttft_p50_s, 6),
            "ttft_p90_s": round(self.ttft_p90_s, 6),
            "ttft_p99_s": round(self.ttft_p99_s, 6),
            "prefix_hit_rate": round(self.prefix_hit_rate, 6),
            "oracle_prefix_hit_rate": round(self.oracle_prefix_hit_rate, 6),
            "wasted_spend_share": round(self.wasted_spend_share, 6),
            "utilisation": round(self.utilisation, 6),
            "max_replica_load_share": round(self.max_replica_load_share, 6),
            "max_replica_load_over_mean": round(self.max_replica_load_over_mean, 6),
            "tasks": self.tasks,
            "successful_tasks": self.successes,
            "spend_micros": self.spend_micros,
            "wasted_spend_micros": self.wasted_micros,
            "refusals": self.refusals,
            "failed_attempts": self.failed_attempts,
            "mean_task_s": round(self.mean_task_s, 3),
            "warmup_task_lifetimes": round(self.warmup_lifetimes, 3),
        }


def cost_per_success(spend_micros: int, successes: int) -> Decimal | None:
    """Spend / successes in dollars, exact to the nano-dollar (rounded half even)."""
    if not successes:
        return None
    return (Decimal(spend_micros) / successes / MICROS_PER_USD).quantize(Decimal("1e-9"))


def figures(outcome: Outcome, oracle_hit_rate: float) -> PolicyFigures:
    """The figures of one run (`oracle_hit_rate`: the oracle policy's, on the same workload).

    - cost per successful task = all spend (failed attempts and failed tasks included) /
      successful tasks;
    - SLO attainment of a tier = its successful tasks / its tasks (success: every step ended
      before the deadline);
    - goodput = successful tasks / simulated seconds;
    - TTFT over every finished attempt, from its placement to its first token;
    - prefix hit rate = cached prompt tokens / prompt tokens, over finished attempts;
    - wasted-spend share = spend of failed tasks / all spend;
    - utilisation = engine busy seconds / (replicas × simulated seconds);
    - busiest replica's load share = its attempts / all attempts (and over the mean).
    """
    attempts = outcome.attempts_by_replica
    total_attempts = sum(attempts)
    busiest = max(attempts) if attempts else 0
    span = outcome.span_s
    return PolicyFigures(
        policy=outcome.policy,
        tasks=outcome.tasks,
        successes=outcome.successes,
        spend_micros=outcome.spend_micros,
        wasted_micros=outcome.wasted_micros,
        cost_per_successful_task_usd=cost_per_success(outcome.spend_micros, outcome.successes),
        success_rate=outcome.successes / outcome.tasks if outcome.tasks else 0.0,
        slo_attainment={
            str(tier): outcome.successes_by_tier.get(tier, 0) / count
            for tier, count in sorted(outcome.tasks_by_tier.items())
        },
        goodput_tasks_per_s=outcome.successes / span if span > 0 else 0.0,
        ttft_p50_s=percentile(outcome.ttfts, 0.50),
        ttft_p90_s=percentile(outcome.ttfts, 0.90),
        ttft_p99_s=percentile(outcome.ttfts, 0.99),
        prefix_hit_rate=(
            outcome.cached_tokens / outcome.prompt_tokens if outcome.prompt_tokens else 0.0
        ),
        oracle_prefix_hit_rate=oracle_hit_rate,
        wasted_spend_share=(
            outcome.wasted_micros / outcome.spend_micros if outcome.spend_micros else 0.0
        ),
        utilisation=outcome.busy_s / (outcome.replicas * span) if span > 0 else 0.0,
        max_replica_load_share=busiest / total_attempts if total_attempts else 0.0,
        max_replica_load_over_mean=(
            busiest * len(attempts) / total_attempts if total_attempts else 0.0
        ),
        refusals=outcome.refusals,
        failed_attempts=outcome.failed_attempts,
        mean_task_s=outcome.mean_task_s,
        warmup_lifetimes=(
            outcome.warmup_s / outcome.mean_task_s if outcome.mean_task_s > 0 else 0.0
        ),
    )


# ---------------------------------------------------------------------------- runs


def fleet_tenants(fleet: Fleet) -> list[tuple[str, int]]:
    """The fleet's tenants as (name, tier)."""
    return [(t.name, t.tier) for t in fleet.tenants]


def run_policy(
    name: str,
    *,
    spec: WorkloadSpec,
    fleet: Fleet,
    task_rate: float,
    tasks: int,
    seed: int,
    extra: dict[str, object] | None = None,
    warmup_tasks: int = 0,
) -> Outcome:
    """Run one policy on one workload (faults included for `faults`).

    The first `warmup_tasks` tasks load the fleet but no figure counts them; utilisation and
    goodput are measured from the first counted arrival to the last arrival.
    """
    if name not in ALL_POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(ALL_POLICIES)}")
    slow = {1: 4.0} if spec.name == "faults" and sum(p.replicas for p in fleet.pools) > 2 else {}
    replicas = simulated_replicas(fleet, slow=slow)
    block_size = replicas[0].config.block_size
    workload = Workload(
        spec,
        fleet_tenants(fleet),
        tasks=tasks,
        task_rate=task_rate,
        seed=seed,
        block_size=block_size,
    )
    runner_box: list[TaskRunner] = []
    setup = PolicySetup(
        fleet=fleet,
        replica_names=[n for p in fleet.pools for n in p.replica_names()],
        block_size=block_size,
        clock=lambda: runner_box[0].sim.now,
        tokens_of=workload.tokens_of,
        seed=seed,
        extra=dict(extra or {}),
    )
    policy = ALL_POLICIES[name](setup)
    runner = TaskRunner(
        fleet,
        replicas,
        policy,
        max_tokens=spec.max_tokens,
        warmup_tasks=warmup_tasks,
        last_task=tasks - 1,
    )
    runner_box.append(runner)

    def faults(sim: DiscreteEventFleet) -> None:
        if spec.name != "faults" or len(sim.replicas) < 2:
            return
        crash_at = tasks / task_rate / 3

        def found_down() -> None:
            sim.mark_down(0)
            policy.on_replica_down(0)

        sim.schedule(crash_at, lambda: sim.crash(0))
        sim.schedule(crash_at + DOWN_DETECTION_S, found_down)

    return runner.run(iter(workload), faults)


@dataclass
class Goal:
    """One goal of the benchmark and whether kvflow met it in this run."""

    text: str
    met: bool
    detail: str


@dataclass
class WorkloadResult:
    """Every policy's figures on one workload, the sweep over offered load, and the goals."""

    name: str
    description: str
    replicas: int
    tasks: int
    offered_load: float
    seed: int
    task_rate: float
    policies: dict[str, PolicyFigures]
    oracle: PolicyFigures
    warmup_tasks: int = 0
    sweep: dict[float, dict[str, PolicyFigures]] = field(default_factory=dict)
    floor: ZeroMissFloor | None = None
    """`zero_miss_floor`: the cost per successful task no placement can go below."""
    ablations: dict[str, PolicyFigures] = field(default_factory=dict)
    """kvflow with one axis switched off, by that axis (`run_workload(ablate=True)`)."""
    goals: list[Goal] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        """The issue's JSON shape, plus the sweep, the goals and kvflow's ratios."""
        kvflow = self.policies.get("kvflow")
        ratios: dict[str, float | None] = {}
        if kvflow is not None and kvflow.cost_per_successful_task_usd is not None:
            for name, fig in self.policies.items():
                cost = fig.cost_per_successful_task_usd
                ratios[name] = (
                    None if not cost else float(kvflow.cost_per_successful_task_usd / cost)
                )
        return {
            "policies": {name: fig.as_json() for name, fig in self.policies.items()},
            "oracle": self.oracle.as_json(),
            "workload": {
                "name": self.name,
                "replicas": self.replicas,
                "tasks": self.tasks,
                "offered_load": self.offered_load,
                "seed": self.seed,
                "task_rate_per_s": round(self.task_rate, 6),
                "warmup_tasks": self.warmup_tasks,
                "oracle_utilisation": round(self.oracle.utilisation, 6),
                "zero_miss_floor": None
                if self.floor is None
                else {
                    "cost_per_successful_task_usd": (
                        None
                        if self.floor.cost_per_task_usd is None
                        else str(self.floor.cost_per_task_usd)
                    ),
                    "prefix_hit_rate": round(self.floor.prefix_hit_rate, 6),
                },
            },
            "kvflow_cost_ratio": ratios,
            "ablations": {axis: fig.as_json() for axis, fig in self.ablations.items()},
            "sweep": {
                f"{load:.2f}": {
                    name: {
                        "cost_per_successful_task_usd": (
                            None
                            if fig.cost_per_successful_task_usd is None
                            else str(fig.cost_per_successful_task_usd)
                        ),
                        "slo_attainment": fig.slo_attainment,
                        "success_rate": round(fig.success_rate, 6),
                    }
                    for name, fig in figs.items()
                }
                for load, figs in sorted(self.sweep.items())
            },
            "goals": [{"goal": g.text, "met": g.met, "detail": g.detail} for g in self.goals],
        }


def run_workload(
    name: str,
    *,
    fleet: Fleet | None = None,
    replicas: int = 8,
    tasks: int = 200,
    load: float = 0.8,
    seed: int = 0,
    policies: Sequence[str] = tuple(POLICIES),
    sweep_loads: Sequence[float] = (),
    extra: dict[str, dict[str, object]] | None = None,
    progress: Callable[[str], None] | None = None,
    ablate: bool = False,
) -> WorkloadResult:
    """Run every policy (and the oracle) on workload `name` at `load`, and the sweep.

    `extra` maps a policy name to its `PolicySetup.extra`. `ablate` also runs kvflow once per
    axis of its configuration with that axis switched off (`REQUIRED_AXIS` excepted: without
    it placement cannot run), at `load`.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if load <= 0:
        raise ValueError(f"offered load must be positive, got {load}")
    spec = WORKLOADS[name]
    fleet = fleet or bench_fleet(name, replicas)
    count = sum(p.replicas for p in fleet.pools)
    capacity = capacity_tasks_per_s(spec, fleet, tasks=tasks, seed=seed)
    warmup = int(tasks * WARMUP_SHARE)

    def run_all(at: float, names: Sequence[str]) -> dict[str, Outcome]:
        outcomes: dict[str, Outcome] = {}
        for policy in names:
            if progress is not None:
                progress(f"{name} at {at:.0%} load: {policy}")
            outcomes[policy] = run_policy(
                policy,
                spec=spec,
                fleet=fleet,
                task_rate=at * capacity,
                tasks=tasks,
                seed=seed,
                extra=(extra or {}).get(policy),
                warmup_tasks=warmup,
            )
        return outcomes

    main = run_all(load, [*policies, ORACLE])
    oracle_outcome = main.pop(ORACLE)
    oracle_hit = figures(oracle_outcome, 0.0).prefix_hit_rate
    result = WorkloadResult(
        name=name,
        description=spec.description,
        replicas=count,
        tasks=tasks,
        offered_load=load,
        seed=seed,
        task_rate=load * capacity,
        policies={p: figures(o, oracle_hit) for p, o in main.items()},
        oracle=figures(oracle_outcome, oracle_hit),
        warmup_tasks=warmup,
    )
    result.sweep[load] = result.policies
    for at in sweep_loads:
        if math.isclose(at, load):
            continue
        outcomes = run_all(at, policies)
        result.sweep[at] = {p: figures(o, oracle_hit) for p, o in outcomes.items()}
    result.floor = zero_miss_floor(
        Workload(
            spec,
            fleet_tenants(fleet),
            tasks=tasks,
            task_rate=load * capacity,
            seed=seed,
            block_size=ENGINE.block_size,
        ),
        fleet,
        block_size=ENGINE.block_size,
        warmup_tasks=warmup,
    )
    if ablate:
        base = (extra or {}).get("kvflow", {})
        config = base.get("scheduler_config") or SchedulerConfig()
        if not isinstance(config, SchedulerConfig):
            raise TypeError("scheduler_config must be a SchedulerConfig")
        for axis in config.axes:
            if axis == REQUIRED_AXIS:
                continue
            if progress is not None:
                progress(f"{name} at {load:.0%} load: kvflow without {axis}")
            without = SchedulerConfig.model_validate(
                {**config.model_dump(), "axes": [a for a in config.axes if a != axis]}
            )
            outcome = run_policy(
                "kvflow",
                spec=spec,
                fleet=fleet,
                task_rate=load * capacity,
                tasks=tasks,
                seed=seed,
                extra={**base, "scheduler_config": without},
                warmup_tasks=warmup,
            )
            result.ablations[axis] = figures(outcome, oracle_hit)
    result.goals = goals(result)
    return result


def goals(result: WorkloadResult) -> list[Goal]:
    """The issue's goals for this workload, evaluated on kvflow's figures (never assumed)."""
    kvflow = result.policies.get("kvflow")
    if kvflow is None:
        return []
    found: list[Goal] = []
    hit, oracle = kvflow.prefix_hit_rate, kvflow.oracle_prefix_hit_rate
    hit_goal = Goal(
        "prefix hit rate ≥ 0.9× oracle",
        hit >= 0.9 * oracle,
        f"{hit:.1%} vs oracle {oracle:.1%} ({hit / oracle if oracle else 0:.2f}×)",
    )
    if result.name == "agent":
        cost = kvflow.cost_per_successful_task_usd

        def ratio(other: str) -> float | None:
            fig = result.policies.get(other)
            if cost is None or fig is None or not fig.cost_per_successful_task_usd:
                return None
            return float(cost / fig.cost_per_successful_task_usd)

        floor = None if result.floor is None else result.floor.cost_per_task_usd

        def floor_note(other: str) -> str:
            """How close to `other` any placement could come at best (the zero-miss floor)."""
            cost = result.policies[other].cost_per_successful_task_usd
            if floor is None or not cost:
                return ""
            return (
                f"; no placement can go below {float(floor / cost):.3f}× {other} "
                f"(the zero-miss floor, ${floor:.6f})"
            )

        rr = ratio("round-robin")
        found.append(
            Goal(
                "cost per successful task ≤ 0.5× round-robin",
                rr is not None and rr <= 0.5,
                "no comparison" if rr is None else f"{rr:.3f}×" + floor_note("round-robin"),
            )
        )
        anchors = {a: r for a in ANCHORS if (r := ratio(a)) is not None}
        if anchors:
            # The anchor kvflow compares worst with: the cheapest one.
            best = max(anchors, key=lambda a: anchors[a])
            detail = f"{anchors[best]:.3f}× {best}" + floor_note(best)
            found.append(
                Goal(
                    "cost per successful task ≤ 0.85× the best of llm-d, llm-d-precise, "
                    "SGLang, Dynamo, AIBrix",
                    anchors[best] <= 0.85,
                    detail,
                )
            )
        found.append(hit_goal)
        tier1 = kvflow.slo_attainment.get("1")
        at80 = math.isclose(result.offered_load, 0.8)
        found.append(
            Goal(
                "tier-1 SLO attainment ≥ 99% at 80% load",
                tier1 is not None and tier1 >= 0.99 and at80,
                ("no tier-1 tasks" if tier1 is None else f"{tier1:.1%}")
                + ("" if at80 else f" (run at {result.offered_load:.0%}, not 80%)"),
            )
        )
    elif result.name == "hotspot":
        over = kvflow.max_replica_load_over_mean
        found.append(
            Goal(
                "no replica above 1.5× the mean load, hit rate ≥ 0.9× oracle",
                over <= 1.5 and hit >= 0.9 * oracle,
                f"busiest {over:.2f}× mean; hit {hit:.1%} vs oracle {oracle:.1%}",
            )
        )
    return found


def default_sizes(quick: bool) -> tuple[int, int, tuple[float, ...]]:
    """(replicas, tasks, sweep loads) of a quick or a full run."""
    if quick:
        return 8, 400, (0.5, 1.1)
    return 64, 20_000, (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1)


__all__ = [
    "ANCHORS",
    "Goal",
    "PolicyFigures",
    "WorkloadResult",
    "ZeroMissFloor",
    "bench_fleet",
    "cost_per_success",
    "figures",
    "run_policy",
    "run_workload",
    "zero_miss_floor",
]

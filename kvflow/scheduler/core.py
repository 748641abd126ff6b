"""`Scheduler`: filter → score → pick over the fleet's replicas, with a reason for every answer.

A decision, for one `PlacementRequest`:

1. **Tenant checks**: the task's and the tenant's retry budgets, the tenant's daily quota.
2. **Model**: the model asked for, then (if it cannot be placed and the request allows it) its
   fallback chain. A model's candidates are the replicas that are up, whose circuit is not
   open, and that hold its weights (warm) or, when no warm replica fits, could load them
   (cold). Tier admission refuses low tiers first when those replicas are saturated.
3. **Filters** per replica, in order: excluded, not warm, down, circuit open (or its half-open
   probe slot busy), too small, KV cache too full (would preempt), deadline, spend cap. When
   nothing passes, the refusal reports the furthest filter any replica reached.
4. **Objective** (see `kvflow.scheduler.axes`): the lowest expected cost per successful call,
   J = (cost + λ · spent · (1 − p)) / p × penalties × sticky.
5. **Pick**: the lowest J; but when no feasible replica holds any of the prompt's prefix,
   rendezvous hashing of the prefix key over the replicas whose bound is within
   `rendezvous_tolerance` of the lowest, with bounded load, computed from shared telemetry
   only, so that every scheduler process sends a new prefix to the same replica.

Speed: a replica's request-independent factor (penalties / P(success), from scraped load and
its circuit) is kept in per-pool lists sorted by factor, updated when telemetry changes. Since
J ≥ cost · factor (`ReplicaState.objective_bound` adds the sunk-cost term) for every replica
but the previous one, replicas are scored best-first by that bound (the deepest prefix
holders with their own depth, the rest pool by pool) until the bound reaches the best J found
or `search_width` replicas were examined. Before scoring one, its own bound (with the
sunk-cost term, and the quickest it could meet the deadline) is checked, so replicas that
cannot win are passed over unscored.
Matching the prompt against the prefix index is O(levels · log blocks).

A decision answers first: what it changes (the replica's load and probe slot, the prefix
index, the workflow's last replica, the tenant's retry window) is queued and applied by
`settle`, which the control plane calls right after answering and every method calls before
it reads state. Evicting prefix entries a replica's cache can no longer hold happens when its
telemetry arrives (`update_metrics`, `observe`). No I/O happens here: telemetry is pushed in
by `update_metrics`, `set_replica_up`, `apply_kv_events` and `observe`.

All methods are thread-safe (one lock): Temporal may run local activities in threads while
the telemetry loops run on the event loop.

Deployments run this module, the axes, the prefix index, replica state, rendezvous and the
circuit breakers compiled with mypyc (`make compiled`, pyproject.toml): the classes defined
here become native classes there, whose methods cannot be replaced at run time, and code the
compiler cannot type runs as slowly as interpreted Python. The scheduler's tests run against
both builds.
"""

from __future__ import annotations

import heapq
import logging
import math
import threading
import time
from bisect import bisect_left, bisect_right, insort
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvflow.scheduler.axes import (
    GpuGenerationAxis,
    KvCacheAxis,
    LatencyBudget,
    MemoryHeadroom,
    PoolPrices,
    QueueLoad,
    TenantPriority,
    WarmWeights,
    WorkflowContext,
)
from kvflow.scheduler.config import SchedulerConfig
from kvflow.scheduler.fleet import (
    Fleet,
    ModelSpec,
    Pool,
    Tenant,
    format_usd,
    replica_name,
    task_queue_for,
)
from kvflow.scheduler.placement import (
    Observation,
    Placement,
    PlacementInputError,
    PlacementRequest,
    Refusal,
    RefusalReason,
    ReplicaScore,
    ReplicaStatus,
)
from kvflow.scheduler.prefix_index import KvEvent, PrefixIndex, replicas_in
from kvflow.scheduler.reliability import (
    CircuitState,
    TenantRetryBudget,
    task_retry_allowed,
)
from kvflow.scheduler.rendezvous import (
    bounded_capacity,
    rendezvous_key,
    rendezvous_order,
    replica_seed,
)
from kvflow.scheduler.state import ReplicaMetrics, ReplicaState

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
"""Seconds; wall-clock (`time.time`) by default, so tenant quotas follow UTC days."""

SECONDS_PER_DAY = 86_400

# Filters in pipeline order. When nothing fits, the refusal reports the furthest filter any
# replica reached: "3 replicas too slow, 1 excluded" is a deadline problem, not an exclusion.
_FILTER_ORDER = (
    "excluded",
    "not_warm",
    "down",
    "circuit_open",
    "too_small",
    "memory",
    "deadline",
    "spend",
)
_FILTER_REASON = {
    "excluded": RefusalReason.NO_REPLICA,
    "down": RefusalReason.NO_REPLICA,
    "not_warm": RefusalReason.MODEL_NOT_WARM,
    "circuit_open": RefusalReason.ALL_CIRCUITS_OPEN,
    "too_small": RefusalReason.NO_REPLICA,
    "memory": RefusalReason.SATURATED,
    "deadline": RefusalReason.DEADLINE,
    "spend": RefusalReason.OVER_BUDGET,
}
_DOWN_RETRY_AFTER_S = 5.0
_NOTHING_EXCLUDED: frozenset[int] = frozenset()


# The records one decision creates (`_Request`, `_Candidate`, `_Booking`) are plain classes
# with their own `__init__`, not dataclasses or named tuples: in the compiled build (`make
# compiled`) their constructors become C, where a dataclass's generated `__init__` would still
# run as interpreted Python, and uncompiled they cost the same.


class _Candidate:
    """One replica scored for one request."""

    __slots__ = (
        "cached_tokens",
        "cold_load_s",
        "cost",
        "depth",
        "duration_s",
        "objective",
        "p_success",
        "queue_wait_s",
        "rid",
        "ttft_s",
    )

    def __init__(
        self,
        rid: int,
        depth: int,
        cached_tokens: int,
        queue_wait_s: float,
        cold_load_s: float,
        ttft_s: float,
        duration_s: float,
        cost: float,
        p_success: float,
        objective: float,
    ) -> None:
        self.rid = rid
        self.depth = depth
        self.cached_tokens = cached_tokens
        self.queue_wait_s = queue_wait_s
        self.cold_load_s = cold_load_s
        self.ttft_s = ttft_s
        self.duration_s = duration_s
        self.cost = cost
        self.p_success = p_success
        self.objective = objective


@dataclass(slots=True)
class _ModelView:
    """The replicas that can serve one model, per pool, sorted by their static factor."""

    model: ModelSpec
    warm: list[list[tuple[float, int]]]
    cold: list[list[tuple[float, int]]]
    member: dict[
        int, tuple[list[tuple[float, int]], tuple[float, int], tuple[int, int, int] | None]
    ] = field(default_factory=dict)
    """Replica id → (its ranking list, its key there, its (load, slots, scraped) if warm)."""
    load: int = 0
    slots: int = 0
    shared_load: int = 0
    warm_count: int = 0


class _Booking:
    """What an answered placement changes, applied by `Scheduler.settle`."""

    __slots__ = (
        "block_hashes",
        "held_depth",
        "model",
        "now",
        "probe",
        "retry",
        "rid",
        "tenant",
        "workflow_id",
    )

    def __init__(
        self,
        rid: int,
        model: str,
        block_hashes: list[int],
        held_depth: int,
        workflow_id: str,
        tenant: str,
        retry: bool,
        probe: bool,
        now: float,
    ) -> None:
        self.rid = rid
        self.model = model
        self.block_hashes = block_hashes
        self.held_depth = held_depth
        self.workflow_id = workflow_id
        self.tenant = tenant
        self.retry = retry
        self.probe = probe
        self.now = now


class _Request:
    """Per-request constants, computed once per decision."""

    __slots__ = (
        "block_hashes",
        "budget_micros",
        "budget_s",
        "can_load",
        "cold_load_s",
        "excluded",
        "levels",
        "model",
        "most_cached",
        "now",
        "output",
        "previous",
        "prompt",
        "request",
        "spec",
        "spent",
        "tenant",
        "workflow_id",
    )

    def __init__(
        self,
        request: PlacementRequest,
        now: float,
        budget_s: float | None,
        excluded: frozenset[int],
        previous: int,
        prompt: int,
        output: int,
        spent: int,
        budget_micros: int | None,
        block_hashes: list[int],
        workflow_id: str,
        tenant: str,
    ) -> None:
        self.request = request
        self.now = now
        self.budget_s = budget_s
        self.excluded = excluded
        self.previous = previous
        self.prompt = prompt
        self.output = output
        self.spent = spent
        self.budget_micros = budget_micros
        self.block_hashes = block_hashes
        self.workflow_id = workflow_id
        self.tenant = tenant
        # Set by `Scheduler._for_model`, for the model being placed:
        self.spec: ModelSpec
        self.model: str
        """`spec.name`."""
        self.levels: list[tuple[int, int]]
        """The prompt's prefix holders: (depth in index entries, replica bit mask), deepest
        first."""
        self.can_load: list[bool]
        """Per pool: whether a cold replica there may load the model."""
        self.cold_load_s: float
        self.most_cached: int
        """The most prompt tokens any replica has cached: the deepest holder's."""


class Scheduler:
    """Places model calls on replicas of a `Fleet`; see the module docstring."""

    def __init__(
        self,
        fleet: Fleet,
        config: SchedulerConfig | None = None,
        *,
        clock: Clock = time.time,
    ) -> None:
        self.fleet = fleet
        self.config = config = config or SchedulerConfig()
        self._clock = clock
        self._lock = threading.RLock()
        self.block_size = config.prefix.block_size
        """Tokens per block of the hashes a `PlacementRequest` must carry."""
        self._entry_tokens = self.block_size * config.prefix.index_stride

        self.gpu = GpuGenerationAxis(config.speed)
        self.queue = QueueLoad(config.weights, config.speed)
        self.memory = MemoryHeadroom(config.memory, config.weights)
        self.kv = KvCacheAxis()
        self.warm = WarmWeights(config.speed, config.memory)
        self.tenants = TenantPriority(config.admission)
        self.latency = LatencyBudget(config.latency)
        self.context = WorkflowContext(config.weights)
        self.indexes: dict[str, PrefixIndex] = {
            m.name: PrefixIndex(
                self.block_size,
                config.prefix.speculative_ttl_s,
                config.prefix.index_stride,
                config.prefix.eviction_slack,
            )
            for m in fleet.models
        }
        """One prefix index per model: a KV cache holds one model's blocks."""

        self._models = {m.name: m for m in fleet.models}
        self._tenants = {t.name: t for t in fleet.tenants}
        self._pools: list[Pool] = list(fleet.pools)
        self._prices = [PoolPrices.of(p.token_prices) for p in self._pools]
        self._replicas: list[ReplicaState] = []
        self._by_name: dict[str, ReplicaState] = {}
        for position, pool in enumerate(self._pools):
            for i in range(pool.replicas):
                name = replica_name(pool.name, i)
                state = ReplicaState.create(
                    rid=len(self._replicas),
                    pool=pool,
                    pool_position=position,
                    index=i,
                    task_queue=task_queue_for(pool.name, i),
                    name=name,
                    circuit=config.circuit,
                )
                self._replicas.append(state)
                self._by_name[name] = state
                for model_name, index in self.indexes.items():
                    index.add_replica(
                        self.warm.kv_capacity_blocks(
                            pool, self._models[model_name], self._entry_tokens
                        )
                    )
        self._seeds = [replica_seed(r.name) for r in self._replicas]
        # Configuration read on every decision, copied out of the pydantic models, whose
        # attribute reads go through a slow `__getattr__` hook (see `kvflow.scheduler.axes`).
        self._allow_cold_start = config.allow_cold_start
        self._sunk_cost = config.weights.sunk_cost
        self._cold_start_factor = 1.0 + config.weights.cold_start
        self._rendezvous_tolerance = 1.0 + config.prefix.rendezvous_tolerance
        self._rendezvous_prefix_blocks = config.prefix.rendezvous_prefix_blocks
        self._bounded_load_factor = config.prefix.bounded_load_factor
        self._remembered_workflows = config.prefix.remembered_workflows
        self._tenant_keys = {t.name: self.tenants.keys(t) for t in fleet.tenants}
        self._search_width = config.prefix.search_width or max(16, len(self._replicas) // 16)
        self._load_s = {m.name: self.warm.load_s(m) for m in fleet.models}
        self._can_load = {
            m.name: [self.warm.can_load(p, m) for p in self._pools] for m in fleet.models
        }
        self._views: dict[str, _ModelView] = {
            m.name: _ModelView(
                model=m,
                warm=[[] for _ in self._pools],
                cold=[[] for _ in self._pools],
            )
            for m in fleet.models
        }
        self._open: dict[int, float] = {}
        self._next_wake = math.inf
        self._tenant_retries = {t.name: TenantRetryBudget(config.retries) for t in fleet.tenants}
        self._tenant_spend: dict[str, tuple[int, int]] = {}
        self._last_replica: OrderedDict[str, int] = OrderedDict()
        self._unsettled: deque[_Booking] = deque()
        """Placements answered whose bookkeeping `settle` has not applied yet."""
        for state in self._replicas:
            self._refresh(state)

    # ------------------------------------------------------------------ telemetry in

    def update_metrics(self, replica: str, metrics: ReplicaMetrics) -> None:
        """Apply one scrape of the replica's `/metrics`; the replica answered, so it is up."""
        with self._lock:
            self._settle()
            state = self._state(replica)
            if metrics.kv_cache_usage is not None:
                state.kv_usage = min(1.0, max(0.0, metrics.kv_cache_usage))
            if metrics.running is not None:
                state.running = max(0, metrics.running)
            if metrics.waiting is not None:
                state.waiting = max(0, metrics.waiting)
            resized = False
            if metrics.block_size is not None and metrics.block_size != state.engine_block_size:
                state.engine_block_size = metrics.block_size
                resized = True
            if metrics.num_gpu_blocks is not None and (
                metrics.num_gpu_blocks != state.num_gpu_blocks
            ):
                state.num_gpu_blocks = metrics.num_gpu_blocks
                resized = True
            if resized and state.num_gpu_blocks is not None:
                engine_block = state.engine_block_size or self.block_size
                entries = state.num_gpu_blocks * engine_block // self._entry_tokens
                for index in self.indexes.values():
                    index.set_capacity(state.rid, entries)
            self._trim(state)
            if metrics.models:
                served = {m for m in metrics.models if m in self._models}
                if served:
                    state.warm_models = served
                elif not state.unknown_models_logged:
                    # A served name the fleet does not know is a configuration mistake; the
                    # fleet file's warm models stay in force.
                    state.unknown_models_logged = True
                    logger.warning(
                        "replica %s serves %s, none of which fleet.toml lists under [[models]]",
                        replica,
                        ", ".join(metrics.models),
                    )
            state.placed_since_scrape = 0
            state.metrics_at = self._clock()
            if not state.up:
                logger.info("replica %s answers again", replica)
                state.up = True
            self._refresh(state)

    def set_replica_up(self, replica: str, up: bool) -> None:
        """Mark a replica up or down; a replica that goes down is assumed to lose its cache."""
        with self._lock:
            self._settle()
            state = self._state(replica)
            if state.up and not up:
                logger.warning("replica %s is down; its prefix entries are dropped", replica)
                for index in self.indexes.values():
                    index.clear(state.rid)
            state.up = up
            self._refresh(state)

    def set_warm_models(self, replica: str, models: Iterable[str]) -> None:
        """The models whose weights the replica holds now."""
        with self._lock:
            self._settle()
            state = self._state(replica)
            state.warm_models = set(models)
            self._refresh(state)

    def apply_kv_events(
        self, replica: str, events: Iterable[KvEvent], model: str | None = None
    ) -> None:
        """Apply the replica's KV-cache events; its prefix entries become precise.

        `model` is the model the engine serves; it may be left out when the replica has
        exactly one warm model (a vLLM server serves one).
        """
        with self._lock:
            self._settle()
            state = self._state(replica)
            if model is None:
                if len(state.warm_models) != 1:
                    raise PlacementInputError(
                        f"replica {replica} has {len(state.warm_models)} warm models "
                        f"({', '.join(sorted(state.warm_models)) or 'none'}); say which model "
                        "its KV events belong to"
                    )
                (model,) = state.warm_models
            index = self.indexes.get(model)
            if index is None:
                raise PlacementInputError(f"unknown model {model!r} in KV events of {replica}")
            index.apply(state.rid, events)

    def observe(self, observation: Observation) -> None:
        """Fold a finished call into estimates, the replica's circuit and the tenant's spend."""
        with self._lock:
            self._settle()
            now = self._clock()
            state = self._state(observation.replica)
            state.inflight = max(0, state.inflight - 1)
            if observation.ok or observation.replica_fault:
                state.breaker.record(observation.ok, now, probe=observation.probe)
                self._track_circuit(state)
            spec = self._models.get(observation.model)
            if observation.ok and spec is not None:
                self._observe_timings(state, spec, observation)
            if observation.cost_micros:
                self._add_tenant_spend(observation.tenant, observation.cost_micros, now)
            self._refresh(state)
            self._trim(state)

    def settle(self) -> None:
        """Apply the bookkeeping of placements already answered (see `place`)."""
        with self._lock:
            self._settle()

    def set_tenant_spend_today(self, tenant: str, micros: int) -> None:
        """Seed a tenant's spend for the current UTC day (e.g. from the ledger at start-up)."""
        with self._lock:
            self._settle()
            day = int(self._clock() // SECONDS_PER_DAY)
            self._tenant_spend[tenant] = (day, micros)

    def tenant_spend_today(self, tenant: str) -> int:
        """The tenant's spend seen today (UTC), in micro-dollars."""
        with self._lock:
            self._settle()
            day = int(self._clock() // SECONDS_PER_DAY)
            spent_day, micros = self._tenant_spend.get(tenant, (day, 0))
            return micros if spent_day == day else 0

    # ------------------------------------------------------------------ status out

    def replica_names(self) -> list[str]:
        """All replica names, pool by pool."""
        return [r.name for r in self._replicas]

    def scores(self, request: PlacementRequest) -> list[ReplicaScore]:
        """Score every replica for the request, without placing it: what `place` would weigh.

        For operators asking "why not that replica?" and for measuring how close the search's
        pick comes to the best objective; it scores the whole fleet, so it is not fast.
        """
        with self._lock:
            if self._unsettled:
                self._settle()
            spec = self._models.get(request.model)
            if spec is None:
                raise PlacementInputError(f"unknown model {request.model!r}")
            ctx = self._context(request, spec, self._clock())
            result = []
            for state in self._replicas:
                found = self._evaluate(state.rid, ctx)
                if isinstance(found, _Candidate):
                    result.append(
                        ReplicaScore(
                            replica=state.name,
                            objective=found.objective,
                            cold_start=found.cold_load_s > 0,
                        )
                    )
                else:
                    result.append(
                        ReplicaScore(replica=state.name, objective=None, rejected_by=found)
                    )
            return result

    def status(self) -> list[ReplicaStatus]:
        """A snapshot of every replica's state."""
        with self._lock:
            self._settle()
            now = self._clock()
            result = []
            for state in self._replicas:
                state.breaker.refresh(now)
                result.append(
                    ReplicaStatus(
                        replica=state.name,
                        pool=state.pool.name,
                        gpu=state.pool.gpu.value,
                        task_queue=state.task_queue,
                        up=state.up,
                        circuit=state.breaker.state.value,
                        warm_models=sorted(state.warm_models),
                        kv_cache_usage=state.kv_usage,
                        running=state.running,
                        waiting=state.waiting,
                        inflight=state.inflight,
                        block_size=state.engine_block_size,
                        num_gpu_blocks=state.num_gpu_blocks,
                        blocks_indexed=sum(
                            index.blocks_held(state.rid) for index in self.indexes.values()
                        ),
                        precise=any(index.is_precise(state.rid) for index in self.indexes.values()),
                    )
                )
            return result

    # ------------------------------------------------------------------ decisions

    def place(self, request: PlacementRequest) -> Placement | Refusal:
        """Choose a replica for the call, or say why none fits (see the module docstring).

        The answer comes first: what the placement changes (the replica's load and probe
        slot, the prefix index, the workflow's last replica, the tenant's retry window) is
        queued and applied by `settle`, which every method runs before it reads any state, so
        no decision sees a stale fleet. Call `settle` when idle to keep that work off the next
        decision too.
        """
        with self._lock:
            if self._unsettled:
                self._settle()
            now = self._clock()
            spec = self._models.get(request.model)
            if spec is None:
                raise PlacementInputError(
                    f"unknown model {request.model!r}; the fleet serves: "
                    + ", ".join(sorted(self._models))
                )
            tenant = self._tenants.get(request.tenant)
            if tenant is None:
                raise PlacementInputError(
                    f"unknown tenant {request.tenant!r}; fleet tenants: "
                    + ", ".join(sorted(self._tenants))
                )
            if now >= self._next_wake:
                self._wake_circuits(now)
            refusal = self._tenant_refusal(request, tenant, now)
            if refusal is not None:
                return refusal
            ctx = self._context(request, spec, now)
            outcome = self._place_model(ctx)
            if isinstance(outcome, tuple):
                return self._commit(ctx, *outcome, degraded_from=None)
            primary = outcome
            fallback = spec.fallback
            seen = {spec.name}
            failed: list[str] = []
            while fallback is not None and fallback not in seen:
                seen.add(fallback)
                fallback_spec = self._models[fallback]
                self._for_model(ctx, fallback_spec)
                attempt = self._place_model(ctx)
                if isinstance(attempt, tuple):
                    if request.allow_fallback:
                        return self._commit(ctx, *attempt, degraded_from=spec.name)
                    return primary.model_copy(
                        update={
                            "alternative_model": fallback,
                            "message": f"{primary.message}; the fallback {fallback} would fit "
                            "(the request does not allow fallback)",
                        }
                    )
                failed.append(f"{fallback}: {attempt.reason.value}")
                fallback = fallback_spec.fallback
            if failed:
                return primary.model_copy(
                    update={
                        "message": f"{primary.message}; the fallback does not fit either ("
                        + "; ".join(failed)
                        + ")"
                    }
                )
            return primary

    # ------------------------------------------------------------------ internals

    def _context(self, request: PlacementRequest, spec: ModelSpec, now: float) -> _Request:
        """The request's constants for one decision, for `spec` (see `_for_model`)."""
        previous = request.previous_replica
        previous_state = self._by_name.get(previous) if previous else None
        if previous_state is None and request.workflow_id:
            remembered = self._last_replica.get(request.workflow_id)
            previous_state = self._replicas[remembered] if remembered is not None else None
        excluded = (
            frozenset(self._by_name[name].rid for name in request.exclude if name in self._by_name)
            if request.exclude
            else _NOTHING_EXCLUDED
        )
        ctx = _Request(
            request=request,
            now=now,
            budget_s=self.latency.step_budget_s(
                request.deadline_s_remaining, request.steps_remaining
            ),
            excluded=excluded,
            previous=previous_state.rid if previous_state is not None else -1,
            prompt=request.prompt_tokens,
            output=request.max_output_tokens,
            spent=request.spent_micros,
            budget_micros=request.budget_micros,
            block_hashes=request.block_hashes,
            workflow_id=request.workflow_id,
            tenant=request.tenant,
        )
        self._for_model(ctx, spec)
        return ctx

    def _for_model(self, ctx: _Request, spec: ModelSpec) -> None:
        """Set the model-dependent constants of a request."""
        ctx.spec = spec
        ctx.model = model = spec.name
        ctx.levels = levels = self.indexes[model].match_levels(ctx.block_hashes, ctx.now)
        # vLLM always computes the prompt's last token.
        longest = ctx.prompt - 1 if ctx.prompt > 0 else 0
        ctx.most_cached = min(levels[0][0] * self._entry_tokens, longest) if levels else 0
        if self._allow_cold_start:
            ctx.can_load = self._can_load[model]
        else:
            ctx.can_load = [False] * len(self._pools)
        ctx.cold_load_s = self._load_s[model]

    def _state(self, replica: str) -> ReplicaState:
        state = self._by_name.get(replica)
        if state is None:
            raise PlacementInputError(
                f"unknown replica {replica!r}; replicas are named pool/index, e.g. "
                f"{self._replicas[0].name}"
            )
        return state

    def _refresh(self, state: ReplicaState) -> None:
        """Recompute the replica's static factor and its place in every model's ranking."""
        p = state.breaker.p_success()
        slots = state.pool.max_concurrency
        load = state.load
        shared = state.shared_load
        # Request-independent parts of the objective, computed once per telemetry change
        # instead of once per scored request. The penalty (and so the ranking) uses the load
        # every scheduler process sees alike, so that processes fed the same telemetry rank
        # replicas alike; this process's newer calls count in the queue-wait estimate.
        state.p_static = p
        state.penalty = (1.0 + self.queue.penalty(shared, slots)) * (
            1.0 + self.memory.penalty(state.kv_usage)
        )
        state.load_fraction = self.queue.load_fraction(load, slots)
        state.wait_s = self.queue.wait_s(
            load - state.waiting, state.waiting, slots, state.service_s
        )
        state.decode_slowdown = self.gpu.decode_slowdown(state.load_fraction)
        state.free_blocks = self.memory.free_blocks(state.num_gpu_blocks, state.kv_usage)
        state.max_blocks = self.memory.max_blocks(state.num_gpu_blocks)
        state.static_factor = math.inf if p <= 0.0 else state.penalty / p
        eligible = state.up and state.breaker.state is not CircuitState.OPEN
        rid = state.rid
        key = (state.static_factor, rid)
        allow_cold = self.config.allow_cold_start
        for name, view in self._views.items():
            old = view.member.pop(rid, None)
            if old is not None:
                ranked, old_key, contribution = old
                del ranked[bisect_left(ranked, old_key)]
                if contribution is not None:
                    view.load -= contribution[0]
                    view.slots -= contribution[1]
                    view.shared_load -= contribution[2]
                    view.warm_count -= 1
            if not eligible:
                continue
            if name in state.warm_models:
                ranked = view.warm[state.pool_position]
                contribution = (load, slots, shared)
                view.load += load
                view.slots += slots
                view.shared_load += shared
                view.warm_count += 1
            elif allow_cold and self._can_load[name][state.pool_position]:
                ranked = view.cold[state.pool_position]
                contribution = None
            else:
                continue
            insort(ranked, key)
            view.member[rid] = (ranked, key, contribution)

    def _trim(self, state: ReplicaState) -> None:
        """Evict the replica's prefix entries beyond its cache size.

        Placements only add entries (up to `prefix.eviction_slack` over the size); evicting
        happens here, when telemetry about the replica arrives (a scrape or a finished call),
        instead of inside `place`.
        """
        for index in self.indexes.values():
            index.trim(state.rid)

    def _settle(self) -> None:
        """Apply the bookkeeping of answered placements, oldest first (under the lock)."""
        unsettled = self._unsettled
        while unsettled:
            booking = unsettled.popleft()
            state = self._replicas[booking.rid]
            if booking.probe:
                state.breaker.start_probe(booking.now)
            state.placed_since_scrape += 1
            state.inflight += 1
            self.indexes[booking.model].record_placement(
                booking.rid, booking.block_hashes, booking.now, held_depth=booking.held_depth
            )
            if booking.workflow_id and self._remembered_workflows:
                remembered = self._last_replica
                remembered[booking.workflow_id] = booking.rid
                remembered.move_to_end(booking.workflow_id)
                if len(remembered) > self._remembered_workflows:
                    remembered.popitem(last=False)
            self._tenant_retries[booking.tenant].record(booking.retry, booking.now)
            self._refresh_load(state)

    def _refresh_load(self, state: ReplicaState) -> None:
        """After a placement: only the load-dependent estimates of the replica change.

        Its static factor and ranking depend on the shared (scraped) load, which a placement
        does not change once the replica has been scraped; before that, refresh everything.
        """
        if state.metrics_at is None:
            self._refresh(state)
            return
        slots = state.pool.max_concurrency
        load = state.load
        state.load_fraction = self.queue.load_fraction(load, slots)
        state.decode_slowdown = self.gpu.decode_slowdown(state.load_fraction)
        state.wait_s = self.queue.wait_s(
            load - state.waiting, state.waiting, slots, state.service_s
        )
        rid = state.rid
        for view in self._views.values():
            member = view.member.get(rid)
            if member is None:
                continue
            ranked, key, contribution = member
            if contribution is None:
                continue
            old_load, old_slots, shared = contribution
            view.load += load - old_load
            view.member[rid] = (ranked, key, (load, old_slots, shared))

    def _track_circuit(self, state: ReplicaState) -> None:
        breaker = state.breaker
        if breaker.state is CircuitState.OPEN:
            if state.rid not in self._open:
                logger.warning(
                    "circuit of replica %s opened for %.0f s",
                    state.name,
                    self.config.circuit.cooldown_s,
                )
            self._open[state.rid] = breaker.open_until
        else:
            self._open.pop(state.rid, None)
        self._next_wake = min(self._open.values(), default=math.inf)

    def _wake_circuits(self, now: float) -> None:
        if now < self._next_wake:
            return
        for rid in list(self._open):
            state = self._replicas[rid]
            if state.breaker.refresh(now):
                logger.info("circuit of replica %s is half-open: one probe allowed", state.name)
                self._track_circuit(state)
                self._refresh(state)
        self._next_wake = min(self._open.values(), default=math.inf)

    def _observe_timings(self, state: ReplicaState, spec: ModelSpec, obs: Observation) -> None:
        slots = state.pool.max_concurrency
        prefill_s = None
        if obs.ttft_s is not None and not obs.cold_start:
            # A cold start's first token waited for the weights to load; it says nothing
            # about prefill speed.
            prefill_s = obs.ttft_s - (obs.queue_s or 0.0)
        decode_s = None
        if obs.duration_s is not None and obs.ttft_s is not None:
            decode_s = obs.duration_s - obs.ttft_s
        self.gpu.observe(
            state.name,
            state.pool,
            spec,
            uncached_tokens=max(0, obs.prompt_tokens - obs.cached_tokens),
            prefill_s=prefill_s,
            output_tokens=obs.completion_tokens,
            decode_s=decode_s,
            load_fraction=self.queue.load_fraction(state.load, slots),
        )
        if obs.duration_s is not None:
            alpha = self.config.speed.ewma_alpha
            old = state.service_s
            state.service_s = (
                obs.duration_s if old is None else old + alpha * (obs.duration_s - old)
            )

    def _add_tenant_spend(self, tenant: str, micros: int, now: float) -> None:
        day = int(now // SECONDS_PER_DAY)
        spent_day, spent = self._tenant_spend.get(tenant, (day, 0))
        self._tenant_spend[tenant] = (day, (spent if spent_day == day else 0) + micros)

    def _tenant_refusal(
        self, request: PlacementRequest, tenant: Tenant, now: float
    ) -> Refusal | None:
        def refuse(
            reason: RefusalReason, message: str, retry_after: float | None = None
        ) -> Refusal:
            return Refusal(
                reason=reason,
                message=message,
                model=request.model,
                tenant=tenant.name,
                retry_after_s=retry_after,
                retryable=retry_after is not None,
            )

        if request.attempt <= 1 and tenant.daily_budget_usd is None:
            return None  # a first attempt of a tenant without a quota: nothing to check
        retries = self.config.retries
        if not task_retry_allowed(request.task_retries, request.attempt, retries):
            return refuse(
                RefusalReason.RETRY_BUDGET_EXHAUSTED,
                f"the task has used all {retries.max_task_retries} re-placements its retry "
                "budget allows; it fails here instead of spending more",
            )
        budget = self._tenant_retries[tenant.name]
        if request.attempt > 1 and not budget.allows_retry(now):
            wait = budget.seconds_until_retry(now)
            return refuse(
                RefusalReason.RETRY_BUDGET_EXHAUSTED,
                f"tenant {tenant.name} has retried more than "
                f"{retries.tenant_retry_fraction:.0%} of its calls in the last "
                f"{retries.tenant_window_s:.0f} s; retries resume in {wait:.1f} s",
                retry_after=wait,
            )
        day = int(now // SECONDS_PER_DAY)
        spent_day, spent = self._tenant_spend.get(tenant.name, (day, 0))
        spent_today = spent if spent_day == day else 0
        if self.tenants.over_quota(tenant, spent_today):
            wait = (day + 1) * SECONDS_PER_DAY - now
            return refuse(
                RefusalReason.TENANT_OVER_QUOTA,
                f"tenant {tenant.name} has spent ${format_usd(spent_today, 2)} today, its daily "
                f"budget is ${tenant.daily_budget_usd}; calls resume at 00:00 UTC",
                retry_after=wait,
            )
        return None

    def _place_model(self, ctx: _Request) -> tuple[_Candidate, bool] | Refusal:
        """Choose a replica for `ctx.spec`; (candidate, chosen by rendezvous) or a refusal."""
        request, spec = ctx.request, ctx.spec
        view = self._views[ctx.model]
        tier = self._tenant_keys[ctx.tenant][0]
        if ctx.prompt + ctx.output > spec.context_length:
            return self._refusal(
                ctx,
                RefusalReason.NO_REPLICA,
                f"{request.prompt_tokens} prompt + {request.max_output_tokens} output tokens "
                f"exceed {spec.name}'s context of {spec.context_length} tokens",
                retryable=False,
            )
        if view.slots and not self.tenants.admits(tier, view.load / view.slots):
            retry = self.config.admission.retry_after_s
            return self._refusal(
                ctx,
                RefusalReason.SATURATED,
                f"replicas serving {spec.name} are at {view.load / view.slots:.0%} of their "
                f"slots; tier {tier} calls wait until load falls below "
                f"{self.config.admission.saturation_by_tier[tier - 1]:.0%}",
                retry_after=retry,
                retryable=True,
            )

        evaluated: dict[int, _Candidate | str] = {}
        best: list[_Candidate] = []  # one element: the best so far
        cache_hit = False  # some feasible replica holds part of the prompt

        def consider(rid: int) -> _Candidate | str:
            nonlocal cache_hit
            found = evaluated.get(rid)
            if found is None:
                found = self._evaluate(rid, ctx)
                evaluated[rid] = found
                if isinstance(found, _Candidate):
                    if found.cached_tokens:
                        cache_hit = True
                    if not best or found.objective < best[0].objective:
                        best[:] = [found]
            return found

        if ctx.previous >= 0:
            consider(ctx.previous)
        for cold in (False, True):
            self._search(ctx, view, cold, best, consider)
            if best:
                break
        if not best:
            return self._no_fit(ctx, view, evaluated)
        chosen = best[0]
        if not ctx.block_hashes and not ctx.workflow_id:
            return chosen, False
        if cache_hit:
            return chosen, False
        return self._rendezvous(ctx, view, chosen, consider)

    def _search(
        self,
        ctx: _Request,
        view: _ModelView,
        cold: bool,
        best: list[_Candidate],
        consider: Callable[[int], _Candidate | str],
    ) -> None:
        """Score replicas best-first by a lower bound on their objective.

        A replica's objective is at least cost(its cached tokens) · its static factor. The
        deepest prefix holders enter with their own depth; every other replica of a pool
        enters, in static order, with the depth of the next-deepest holder. The search stops
        when the next bound reaches the best objective found, or after `search_width`
        replicas were examined (once one is feasible).
        """
        prompt, output = ctx.prompt, ctx.output
        block = self._entry_tokens
        prices = self._prices
        replicas = self._replicas
        limit = self._search_width
        # λ · spent, for each replica's `objective_bound`.
        sunk = self._sunk_cost * ctx.spent
        deadline = ctx.budget_s is not None
        longest = prompt - 1 if prompt > 0 else 0  # vLLM always computes the prompt's last token
        heap: list[tuple[float, int, int, list[tuple[float, int]] | None, float]] = []
        bulk_depth = 0
        if not cold:
            # The deepest `limit` holders (levels come deepest first), each with its own cost;
            # the next holder's depth bounds what any other replica has cached.
            taken = 0
            for depth, mask in ctx.levels:
                cached = min(depth * block, longest)
                level_costs: dict[int, float] = {}  # per pool, computed when first needed
                for rid in replicas_in(mask):
                    if taken == limit:
                        bulk_depth = depth
                        break
                    state = replicas[rid]
                    position = state.pool_position
                    cost = level_costs.get(position)
                    if cost is None:
                        cost = level_costs[position] = prices[position].cost(prompt, cached, output)
                    bound = state.objective_bound(cost, sunk)
                    heap.append((bound, rid, -1, None, cost))
                    taken += 1
                if bulk_depth:
                    break
        cached_bound = min(bulk_depth * block, longest)
        for position, pool_ranking in enumerate(view.cold if cold else view.warm):
            if pool_ranking:
                cost = prices[position].cost(prompt, cached_bound, output)
                factor, rid = pool_ranking[0]
                heap.append((cost * factor, rid, 0, pool_ranking, cost))
        heapq.heapify(heap)
        examined = 0
        while heap:
            bound, rid, at, ranked, cost = heapq.heappop(heap)
            if best and bound >= best[0].objective:
                break
            examined += 1
            if examined > limit and best:
                break
            if ranked is not None and at + 1 < len(ranked):
                factor, following = ranked[at + 1]
                heapq.heappush(heap, (cost * factor, following, at + 1, ranked, cost))
            # The heap's bound leaves out what is not ordered along a pool's ranking (the
            # sunk-cost term, the deadline); with them, this replica alone may be out of
            # reach, which costs a fraction of scoring it.
            state = replicas[rid]
            if best and state.objective_bound(cost, sunk) >= best[0].objective:
                continue
            if deadline:
                floor = self._objective_floor(state, ctx, cost)
                if floor == math.inf or (best and floor >= best[0].objective):
                    continue
            consider(rid)

    def _objective_floor(self, state: ReplicaState, ctx: _Request, cost: float) -> float:
        """A lower bound on the objective `_evaluate` would give the replica; inf if late.

        `cost` is at most the call's cost there, and `ctx.most_cached` is at least its cached
        tokens. The quickest the call could finish (its queue, no cold load, that many tokens
        cached) bounds P(on time) from above, so the objective from below; a replica that
        misses the step's budget even then cannot be placed at all. Cheaper than scoring, and
        it never rules out a replica `_evaluate` would rank below the bound.
        """
        p = state.p_static
        budget = ctx.budget_s
        if budget is not None:
            gpu = self.gpu
            speed = gpu.speed(state.name, state.pool, ctx.spec)
            quickest = (
                state.wait_s
                + gpu.prefill_s(speed, ctx.prompt - ctx.most_cached)
                + ctx.output * speed.decode_s_per_token * state.decode_slowdown
            )
            if quickest > budget:
                return math.inf
            p *= self.latency.p_on_time(quickest, budget)
        return self.context.objective(cost, p, ctx.spent) * state.penalty

    def _rendezvous(
        self,
        ctx: _Request,
        view: _ModelView,
        chosen: _Candidate,
        consider: Callable[[int], _Candidate | str],
    ) -> tuple[_Candidate, bool]:
        """The highest rendezvous weight among near-best replicas, under the load bound.

        The group and the bound come from shared state only (static factors and scraped
        loads), so processes fed the same telemetry form the same group: replicas whose lower
        bound cost · static factor is within `rendezvous_tolerance` of the lowest bound. The
        first in weight order that passes the filters, holds no more than the bounded-load
        capacity and whose objective is within the tolerance of the best found wins.
        """
        tolerance = self._rendezvous_tolerance
        lists = view.cold if chosen.cold_load_s else view.warm
        costs = [
            self._prices[position].cost(ctx.prompt, 0, ctx.output) for position in range(len(lists))
        ]
        lowest = math.inf
        for position, ranked in enumerate(lists):
            if ranked and costs[position] * ranked[0][0] < lowest:
                lowest = costs[position] * ranked[0][0]
        if not math.isfinite(lowest):
            return chosen, False
        group: list[int] = []
        for position, ranked in enumerate(lists):
            if not ranked:
                continue
            if costs[position] <= 0:
                group.extend([rid for _, rid in ranked])
                continue
            end = bisect_right(ranked, (lowest * tolerance / costs[position], math.inf))
            group.extend([rid for _, rid in ranked[:end]])
        key = rendezvous_key(ctx.block_hashes, ctx.workflow_id, self._rendezvous_prefix_blocks)
        seeds = self._seeds
        capacity = bounded_capacity(view.shared_load, view.warm_count, self._bounded_load_factor)
        replicas = self._replicas
        limit = chosen.objective * tolerance * tolerance
        for position in rendezvous_order(key, [seeds[rid] for rid in group]):
            rid = group[position]
            if replicas[rid].shared_load + 1 > capacity:
                continue
            candidate = consider(rid)
            if isinstance(candidate, _Candidate) and candidate.objective <= limit:
                return candidate, True
        return chosen, False

    def _evaluate(self, rid: int, ctx: _Request) -> _Candidate | str:
        """Run the filters on one replica and score it; a filter name when it is rejected."""
        if rid in ctx.excluded:
            return "excluded"
        state = self._replicas[rid]
        warm = ctx.model in state.warm_models
        if not warm and not ctx.can_load[state.pool_position]:
            return "not_warm"
        if not state.up:
            return "down"
        breaker = state.breaker
        if breaker.state is not CircuitState.CLOSED and not breaker.allows(ctx.now):
            return "circuit_open"
        prompt = ctx.prompt
        engine_block = state.engine_block_size or self.block_size
        depth = 0
        for level_depth, mask in ctx.levels:
            if mask >> rid & 1:
                depth = level_depth
                break
        cached = self.kv.expected_cached_tokens(depth, prompt, self._entry_tokens, engine_block)
        # The memory and speed terms that depend only on the replica's telemetry are computed
        # when it changes (`_refresh`), through the same axis methods; here they are compared.
        if state.num_gpu_blocks is not None:
            memory = self.memory
            need = memory.blocks_needed(prompt, ctx.output, cached, engine_block)
            if not memory.fits(need, state.max_blocks):
                return "too_small"
            if not memory.admits(need, state.free_blocks):
                return "memory"
        gpu = self.gpu
        speed = gpu.speed(state.name, state.pool, ctx.spec)
        wait = state.wait_s
        cold_load = 0.0 if warm else ctx.cold_load_s
        ttft = wait + cold_load + gpu.prefill_s(speed, prompt - cached)
        duration = ttft + ctx.output * speed.decode_s_per_token * state.decode_slowdown
        budget = ctx.budget_s
        if not self.latency.admits(duration, budget):
            return "deadline"
        cost = self._prices[state.pool_position].cost(prompt, cached, ctx.output)
        if ctx.budget_micros is not None and ctx.spent + cost > ctx.budget_micros:
            return "spend"
        p = state.p_static
        if budget is not None:
            p *= self.latency.p_on_time(duration, budget)
        objective = self.context.objective(cost, p, ctx.spent) * state.penalty
        if not warm:
            objective *= self._cold_start_factor
        if rid == ctx.previous:
            objective *= self.context.sticky_factor(True)
        # Positional: keyword arguments cost a fifth of the whole evaluation.
        return _Candidate(rid, depth, cached, wait, cold_load, ttft, duration, cost, p, objective)

    def _no_fit(
        self, ctx: _Request, view: _ModelView, evaluated: dict[int, _Candidate | str]
    ) -> Refusal:
        """Explain why no replica fits: the furthest filter any replica reached decides."""
        spec = ctx.spec
        counts: Counter[str] = Counter()
        open_waits: list[float] = []
        for state in self._replicas:
            found = evaluated.get(state.rid)
            if found is None:
                found = self._evaluate(state.rid, ctx)
            if isinstance(found, str):
                counts[found] += 1
                if found == "circuit_open" and state.rid not in ctx.excluded:
                    open_waits.append(state.breaker.seconds_until_half_open(ctx.now))
        furthest = max(counts, key=_FILTER_ORDER.index)
        reason = _FILTER_REASON[furthest]
        summary = ", ".join(
            f"{counts[f]} {f.replace('_', ' ')}" for f in _FILTER_ORDER if counts[f]
        )
        retry_after: float | None = None
        retryable = False
        request = ctx.request
        if furthest == "circuit_open":
            retry_after = max(0.0, min(open_waits, default=self.config.circuit.cooldown_s))
            retryable = True
            message = (
                f"every replica that could serve {spec.name} has an open circuit breaker "
                f"({summary}); the next probe is allowed in {retry_after:.1f} s"
            )
        elif furthest == "memory":
            retry_after = self.config.memory.saturated_retry_after_s
            retryable = True
            message = (
                f"every replica's KV cache is too full for {request.prompt_tokens} + "
                f"{request.max_output_tokens} tokens of {spec.name} without preempting running "
                f"calls ({summary})"
            )
        elif furthest == "deadline":
            message = (
                f"no replica can run {spec.name} within this step's "
                f"{_seconds(ctx.budget_s or 0.0)} share of the remaining "
                f"{_seconds(request.deadline_s_remaining or 0.0)} deadline ({summary}); a fallback "
                "model, fewer output tokens or a longer deadline would help"
            )
        elif furthest == "spend":
            message = (
                f"the call would take the task over its spend cap of "
                f"${format_usd(request.budget_micros or 0, 4)} (spent "
                f"${format_usd(request.spent_micros, 4)}) on every replica ({summary})"
            )
        elif furthest == "not_warm":
            message = (
                f"no replica holds {spec.name}'s weights"
                + ("" if self.config.allow_cold_start else " and cold starts are disabled")
                + f" ({summary})"
            )
        elif furthest == "too_small":
            message = (
                f"{request.prompt_tokens} + {request.max_output_tokens} tokens do not fit any "
                f"replica's KV cache for {spec.name} ({summary})"
            )
        elif furthest == "down":
            retry_after = _DOWN_RETRY_AFTER_S
            retryable = True
            message = f"every replica that could serve {spec.name} is down ({summary})"
        else:
            message = f"every replica that could serve {spec.name} is excluded ({summary})"
        return self._refusal(
            ctx,
            reason,
            message,
            retry_after=retry_after,
            retryable=retryable,
            rejections=dict(counts),
        )

    def _refusal(
        self,
        ctx: _Request,
        reason: RefusalReason,
        message: str,
        *,
        retryable: bool,
        retry_after: float | None = None,
        rejections: dict[str, int] | None = None,
    ) -> Refusal:
        return Refusal(
            reason=reason,
            message=message,
            model=ctx.spec.name,
            tenant=ctx.request.tenant,
            retry_after_s=retry_after,
            retryable=retryable,
            rejections=rejections or {},
        )

    def _commit(
        self,
        ctx: _Request,
        chosen: _Candidate,
        rendezvous: bool,
        *,
        degraded_from: str | None,
    ) -> Placement:
        """Describe the decision, and queue its bookkeeping for `settle`."""
        state = self._replicas[chosen.rid]
        ahead = state.load
        probe = state.breaker.state is CircuitState.HALF_OPEN
        self._unsettled.append(
            _Booking(
                chosen.rid,
                ctx.model,
                ctx.block_hashes,
                chosen.depth,
                ctx.workflow_id,
                ctx.tenant,
                ctx.request.attempt > 1,
                probe,
                ctx.now,
            )
        )
        cost = self._prices[state.pool_position].exact.cost_micros(
            ctx.prompt, chosen.cached_tokens, ctx.output
        )
        budget = ctx.budget_s
        priority, fairness_key, fairness_weight = self._tenant_keys[ctx.tenant]
        run_s = chosen.duration_s - chosen.queue_wait_s
        reason = (
            f"{state.name}: {_tokens(chosen.cached_tokens)} of {_tokens(ctx.prompt)} "
            f"prompt tokens cached, queue {ahead}, est {_seconds(chosen.duration_s)}"
            + (f" of {_seconds(budget)} budget" if budget is not None else " (no deadline)")
            + f", ${format_usd(cost, 4)}"
        )
        notes = []
        if degraded_from is not None:
            notes.append(f"degraded from {degraded_from}")
        if chosen.cold_load_s:
            notes.append(f"cold start +{chosen.cold_load_s:.0f} s")
        if probe:
            notes.append("half-open probe")
        if rendezvous:
            notes.append("new prefix, rendezvous pick")
        elif chosen.rid == ctx.previous:
            notes.append("sticky")
        if notes:
            reason += " (" + "; ".join(notes) + ")"
        # Positional, like `_Candidate`: the fields are the scheduler's own values.
        return Placement(
            state.name,
            state.task_queue,
            state.pool_name,
            state.gpu,
            ctx.model,
            degraded_from,
            state.engine_block_size or self.block_size,
            chosen.cached_tokens,
            chosen.queue_wait_s,
            chosen.ttft_s,
            chosen.duration_s,
            cost,
            chosen.p_success,
            budget,
            priority,
            fairness_key,
            fairness_weight,
            self.latency.schedule_to_start_s(chosen.queue_wait_s, run_s, budget),
            chosen.cold_load_s > 0,
            probe,
            rendezvous,
            reason,
        )


# The reason line is built for every placement: its numbers are rounded with integer
# arithmetic, which costs a fraction of float formatting.


def _seconds(value: float) -> str:
    """1.234 → "1.2 s", 0.042 → "42 ms" (rounded half up)."""
    if value < 0.1:
        return f"{int(value * 1000 + 0.5)} ms"
    tenths = int(value * 10 + 0.5)
    return f"{tenths // 10}.{tenths % 10} s"


def _tokens(count: int) -> str:
    """3100 → "3.1k", 512 → "512" (rounded half up)."""
    if count < 1000:
        return str(count)
    hundreds = (count + 50) // 100
    return f"{hundreds // 10}.{hundreds % 10}k"

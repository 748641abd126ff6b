"""`Scheduler`: filter → score → pick over the fleet's replicas, with a reason for every answer.

A decision, for one `PlacementRequest`:

1. **Tenant checks** (`kvflow.scheduler.tenancy`): the task's and the tenant's retry budgets,
   the tenant's daily quota.
2. **Admission before a KV collapse**, at a task's first step only and where
   `admission.open_task_kv_by_tier` is set (`_open_task_refusal`): a new task waits while the
   KV its model's open tasks will come back to, with its prompt, exceeds its tier's multiple
   of the model's KV cache (looser by `open_task_kv_slack` until a task is held).
3. **Model**: the model asked for, then (if it cannot be placed and the request allows it) its
   fallback chain. A model's candidates are the replicas that are up, whose circuit is not
   open, and that hold its weights (warm) or, when no warm replica fits, could load them
   (cold). The axes may refuse the call before any replica is scored (tier admission refuses
   low tiers first when the model's replicas are saturated).
4. **Axes** (`kvflow.scheduler.axes`, run by `kvflow.scheduler.policy`): each replica examined
   passes the configured axes in order; the first `Filter` that turns it down is its verdict,
   otherwise its objective is J = (cost + at risk) / p × penalties × factors. When nothing
   passes, the refusal (`kvflow.scheduler.reasons`) reports the furthest filter any replica
   reached.
5. **Pick** (`kvflow.scheduler.search`): the lowest J, searched best-first by a lower bound; but
   when no feasible replica holds any of the prompt's prefix, rendezvous hashing of the prefix
   key over the near-best replicas, with bounded load, so that every scheduler process sends a
   new prefix to the same replica.
6. **Task admission**, at a task's first step only and where `latency.task_admission` is on
   (`_task_refusal`): the task is refused before it spends when the pick's estimate, over its
   expected steps and tool time, misses its deadline or its first step's objective though
   the same call on an idle replica would not (`RefusalReason.OVERLOADED`).

This class is the front: it takes telemetry in, answers placements and reports status, and
never names an axis. A decision answers first: what it changes (the replica's load and probe
slot, the prefix index, the workflow's last replica, the tenant's retry window) is queued and
applied by `settle`, which the control plane calls right after answering and every method
calls before it reads state. Evicting prefix entries a replica's cache can no longer hold
happens when its telemetry arrives (`update_metrics`, `observe`). No I/O happens here:
telemetry is pushed in by `update_metrics`, `set_replica_up`, `apply_kv_events` and `observe`.

All methods are thread-safe (one lock): Temporal may run local activities in threads while
the telemetry loops run on the event loop.

Deployments run the decision path compiled with mypyc (`make compiled`; the modules are listed
in pyproject.toml): the classes defined there become native classes, whose methods cannot be
replaced at run time, and code the compiler cannot type runs as slowly as interpreted Python.
The scheduler's tests run against both builds.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping

from kvflow.scheduler import reasons
from kvflow.scheduler.axes import PoolPrices, configured_axes, kv_capacity_blocks
from kvflow.scheduler.config import SchedulerConfig
from kvflow.scheduler.decision import Decision, Estimate
from kvflow.scheduler.fleet import (
    Fleet,
    ModelSpec,
    Pool,
    replica_name,
    task_queue_for,
)
from kvflow.scheduler.placement import (
    Observation,
    Placement,
    PlacementInputError,
    PlacementRequest,
    Refusal,
    ReplicaScore,
    ReplicaStatus,
    engine_priority,
)
from kvflow.scheduler.policy import Policy
from kvflow.scheduler.prefix_index import KvEvent, PrefixIndex
from kvflow.scheduler.reliability import CircuitState
from kvflow.scheduler.search import Search
from kvflow.scheduler.state import ReplicaMetrics, ReplicaState
from kvflow.scheduler.tenancy import SECONDS_PER_DAY, TenantAccounts

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
"""Seconds; wall-clock (`time.time`) by default, so tenant quotas follow UTC days."""

__all__ = ["SECONDS_PER_DAY", "Clock", "Scheduler"]

KV_CAPACITY_REUSE_S = 1.0
"""How long KV admission reuses its sum of a model's KV caches (`Scheduler._kv_capacity_tokens`)
before it visits the replicas again."""

_NOTHING_EXCLUDED: frozenset[int] = frozenset()
_NOTHING_LOADABLE: frozenset[str] = frozenset()


class _Booking:
    """What an answered placement changes, applied by `Scheduler.settle`.

    A plain class with its own `__init__`, like the records of `kvflow.scheduler.decision`.
    """

    __slots__ = (
        "block_hashes",
        "held_depth",
        "model",
        "now",
        "probe",
        "retry",
        "rid",
        "shared",
        "tenant",
        "tokens",
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
        tokens: int,
        shared: int,
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
        self.tokens = tokens
        """Prompt + expected output: the KV the call's decode steps will read."""
        self.shared = shared
        """At a task's first step, the prompt tokens some cache already held (a system prompt
        other tasks share); −1 at a later step."""


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
        self._task_admission = config.latency.task_admission
        """Whether first steps are admitted as whole tasks (`_task_refusal`); read once, since
        a decision should not pay for a lever that is off."""
        self._open_task_kv = config.admission.open_task_kv_by_tier
        self._open_task_idle_s = config.admission.open_task_idle_s
        self._open_task_slack = config.admission.open_task_kv_slack
        self._open_task_hold_s = config.admission.open_task_kv_hold_s
        self._holding_until: dict[str, float] = {m.name: -math.inf for m in fleet.models}
        """Model → until when its tight multiples apply: `open_task_kv_hold_s` after the last
        task of the model held."""
        self._open_tasks: OrderedDict[str, tuple[str, int, float, int]] = OrderedDict()
        """With `open_task_kv_by_tier`: workflow id → (model, the KV tokens its next call will
        come back to: its last call's prompt and expected output less what it shares, when
        that call was placed, the tokens it shares), least recently placed first."""
        self._open_kv: dict[str, int] = {m.name: 0 for m in fleet.models}
        """Model → the KV tokens of its open tasks (`_open_tasks`)."""
        self._clock = clock
        self._lock = threading.RLock()
        self.block_size = config.prefix.block_size
        """Tokens per block of the hashes a `PlacementRequest` must carry."""
        self._entry_tokens = self.block_size * config.prefix.index_stride
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
        self._fleet_tenants = {t.name: t for t in fleet.tenants}
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
                        kv_capacity_blocks(
                            pool, self._models[model_name], self._entry_tokens, config
                        )
                    )
        self._kv_estimate_tokens: dict[str, list[int]] = {
            name: [kv_capacity_blocks(pool, m, self.block_size, config) * self.block_size
                   for pool in self._pools]
            for name, m in self._models.items()
        }  # fmt: skip
        """Model → KV-cache tokens a replica of each pool holds for it before a scrape says."""
        self._kv_capacity: dict[str, tuple[float, int]] = {}
        """Model → (when it was summed, the KV-cache tokens warm for it): `_kv_capacity_tokens`
        sums every replica, so KV admission reuses the sum for `KV_CAPACITY_REUSE_S`."""
        self.policy = Policy(configured_axes(fleet, config), self._replicas)
        """The configured axes, run in order on every replica examined."""
        self._search = Search(self.policy, self._replicas, self._prices, list(fleet.models), config)
        self._tenants = TenantAccounts(fleet.tenants, config)
        self._remembered_workflows = config.prefix.remembered_workflows
        self._open: dict[int, float] = {}
        self._next_wake = math.inf
        self._last_replica: OrderedDict[str, int] = OrderedDict()
        self._unsettled: deque[_Booking] = deque()
        """Placements answered whose bookkeeping `settle` has not applied yet."""
        self._listed: set[int] = set()
        """Replicas whose scrape named the models they serve: they serve those and no other."""
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
                    self._listed.add(state.rid)
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
        """Mark a replica up or down; a replica that goes down loses its cache and its calls."""
        with self._lock:
            self._settle()
            state = self._state(replica)
            if state.up and not up:
                logger.warning("replica %s is down; its prefix entries are dropped", replica)
                for index in self.indexes.values():
                    index.clear(state.rid)
                # Its engine's calls died with it: left counted, they would keep the replica
                # looking busy once it is back, until each lost call's failure is reported,
                # and for good where the worker that ran it died without reporting.
                state.running = state.waiting = state.placed_since_scrape = 0
                state.inflight = state.inflight_tokens = 0
                state.kv_usage = 0.0
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
            if state.inflight:
                # An observation does not say which placement it ends, and the engine counts
                # tokens its own way: the call takes the mean of the calls in flight with it,
                # so that the sum cannot drift on a replica that is never idle.
                state.inflight_tokens -= state.inflight_tokens // state.inflight
                state.inflight -= 1
            if observation.ok or (
                observation.replica_fault and not observation.control_plane_fault
            ):
                state.breaker.record(observation.ok, now, probe=observation.probe)
                self._track_circuit(state)
            spec = self._models.get(observation.model)
            if observation.ok and spec is not None:
                self.policy.record(state, spec, observation)
            self.policy.observed(observation, now)
            if observation.cost_micros:
                self._tenants.add_spend(observation.tenant, observation.cost_micros, now)
            self._refresh(state)
            self._trim(state)

    def settle(self) -> None:
        """Apply the bookkeeping of placements already answered (see `place`)."""
        with self._lock:
            self._settle()

    def end_task(self, workflow_id: str) -> bool:
        """The task ended, whatever its outcome: its conversation will not come back.

        With `admission.open_task_kv_by_tier` it stops counting among the open tasks at once,
        not `open_task_idle_s` after its last call: a task that failed frees its share for a
        new one. The workflow calls it as it closes (the control plane's `end_task` local
        activity). A task this scheduler did not place, or already ended, is ignored.
        Returns whether the task was counted here.
        """
        with self._lock:
            self._settle()  # its last placement may still be unsettled
            task = self._open_tasks.pop(workflow_id, None)
            if task is None:
                return False
            self._open_kv[task[0]] -= task[1]
            return True

    def idle_open_tasks(self, idle_s: float) -> list[str]:
        """The tasks counted open that placed no call for `idle_s` seconds, oldest first.

        Counted open: with `admission.open_task_kv_by_tier` (`OpenTaskWatch` looks them up).
        """
        with self._lock:
            self._settle()
            horizon = self._clock() - idle_s
            idle = []
            for workflow_id, task in self._open_tasks.items():
                if task[2] > horizon:
                    break  # ordered by their latest placement
                idle.append(workflow_id)
            return idle

    def last_replica(self, workflow_id: str) -> str | None:
        """The replica this scheduler placed the task's latest call on, while it is up.

        None if it forgot (only the most recent workflows are remembered, `SchedulerConfig`'s
        bound on them) or the replica is down: its cache went with it.
        """
        with self._lock:
            self._settle()  # the latest placement may still be unsettled
            index = self._last_replica.get(workflow_id)
            if index is None or not self._replicas[index].up:
                return None
            return self._replicas[index].name

    def set_tenant_spend_today(self, tenant: str, micros: int) -> None:
        """Seed a tenant's spend for the current UTC day (e.g. from the ledger at start-up)."""
        with self._lock:
            self._settle()
            self._tenants.set_spend_today(tenant, micros, self._clock())

    def tenant_spend_today(self, tenant: str) -> int:
        """The tenant's spend seen today (UTC), in micro-dollars."""
        with self._lock:
            self._settle()
            return self._tenants.spend_today(tenant, self._clock())

    def utc_day(self) -> int:
        """Today by the scheduler's clock, as whole UTC days since the epoch."""
        return int(self._clock() // SECONDS_PER_DAY)

    def merge_tenant_spend(self, spent: Mapping[str, int], day: int) -> bool:
        """Raise each tenant's spend to what a ledger read for UTC `day` found.

        The day is the read's, not the merge's: a read that began before midnight and ends
        after it counts yesterday, which must not be carried into today. Such a result is
        dropped whole (False). Otherwise each tenant keeps the larger of the ledger's figure
        and its own count (the latter may include calls not yet written to the ledger).
        """
        with self._lock:
            self._settle()
            now = self._clock()
            if int(now // SECONDS_PER_DAY) != day:
                return False
            for tenant, micros in spent.items():
                known = self._tenants.spend_today(tenant, now)
                self._tenants.set_spend_today(tenant, max(micros, known), now)
            return True

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
                found = self.policy.evaluate(state.rid, ctx)
                if isinstance(found, Estimate):
                    result.append(
                        ReplicaScore(
                            replica=state.name,
                            objective=found.objective,
                            cold_start=found.cold_load_s > 0,
                        )
                    )
                else:
                    result.append(
                        ReplicaScore(replica=state.name, objective=None, rejected_by=found.value)
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
            tenant = self._fleet_tenants.get(request.tenant)
            if tenant is None:
                raise PlacementInputError(
                    f"unknown tenant {request.tenant!r}; fleet tenants: "
                    + ", ".join(sorted(self._fleet_tenants))
                )
            if now >= self._next_wake:
                self._wake_circuits(now)
            refusal = self._tenants.refusal(request, tenant, now)
            if refusal is not None:
                return refusal
            ctx = self._context(request, spec, now)
            if self._open_task_kv is not None:
                waits = self._open_task_refusal(ctx)
                if waits is not None:
                    return waits
            outcome = self._place_model(ctx)
            if isinstance(outcome, tuple):
                if self._task_admission:
                    refused = self._task_refusal(ctx, outcome[0])
                    if refused is not None:
                        return refused
                return self._commit(ctx, *outcome, degraded_from=None)
            primary = outcome
            fallback = spec.fallback
            seen = {spec.name}
            failed: list[str] = []
            while fallback is not None and fallback not in seen:
                seen.add(fallback)
                fallback_spec = self._models[fallback]
                if not self._served_anywhere(fallback):
                    # Listed in the fleet, but no replica holds it or may load it: degrading
                    # to it would send the call where nothing can run it.
                    failed.append(f"{fallback}: served by no replica")
                    fallback = fallback_spec.fallback
                    continue
                self._for_model(ctx, fallback_spec)
                attempt = self._place_model(ctx)
                if isinstance(attempt, tuple):
                    if request.allow_fallback:
                        if self._task_admission:
                            refused = self._task_refusal(ctx, attempt[0])
                            if refused is not None:
                                return refused
                        return self._commit(ctx, *attempt, degraded_from=spec.name)
                    return reasons.fallback_would_fit(primary, fallback)
                failed.append(f"{fallback}: {attempt.reason.value}")
                fallback = fallback_spec.fallback
            if failed:
                return reasons.fallbacks_failed(primary, failed)
            return primary

    # ------------------------------------------------------------------ internals

    def _context(self, request: PlacementRequest, spec: ModelSpec, now: float) -> Decision:
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
        ctx = Decision(
            request=request,
            now=now,
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
        self.policy.prepare(ctx)
        self._for_model(ctx, spec)
        return ctx

    def _for_model(self, ctx: Decision, spec: ModelSpec) -> None:
        """Set the model-dependent constants of a request."""
        ctx.spec = spec
        ctx.model = model = spec.name
        ctx.levels = levels = self.indexes[model].match_levels(ctx.block_hashes, ctx.now)
        # vLLM always computes the prompt's last token.
        longest = ctx.prompt - 1 if ctx.prompt > 0 else 0
        ctx.most_cached = min(levels[0][0] * self._entry_tokens, longest) if levels else 0
        self.policy.prepare_model(ctx)

    def _served_anywhere(self, model: str) -> bool:
        """Whether some replica holds the model's weights or may load them (up or not)."""
        return any(model in s.warm_models or model in s.loadable for s in self._replicas)

    def _state(self, replica: str) -> ReplicaState:
        state = self._by_name.get(replica)
        if state is None:
            raise PlacementInputError(
                f"unknown replica {replica!r}; replicas are named pool/index, e.g. "
                f"{self._replicas[0].name}"
            )
        return state

    def _refresh(self, state: ReplicaState) -> None:
        """Recompute the replica's request-independent terms and its place in every ranking.

        A replica whose scrape named the models it serves (vLLM's `model_name` labels and
        `/v1/models`; a simulated replica names the models it may load cold too) is placed
        only those: they are its warm models, and nothing else is loadable there.
        """
        self.policy.refresh(state)
        if state.rid in self._listed:
            state.loadable = _NOTHING_LOADABLE
        self._search.rank(state)

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
            state.inflight_tokens += booking.tokens
            self.indexes[booking.model].record_placement(
                booking.rid, booking.block_hashes, booking.now, held_depth=booking.held_depth
            )
            if booking.workflow_id and self._remembered_workflows:
                remembered = self._last_replica
                remembered[booking.workflow_id] = booking.rid
                remembered.move_to_end(booking.workflow_id)
                if len(remembered) > self._remembered_workflows:
                    remembered.popitem(last=False)
            self._tenants.record_call(booking.tenant, booking.retry, booking.now)
            if self._open_task_kv is not None and booking.workflow_id:
                self._track_open_task(booking)
            self._refresh_load(state)

    def _track_open_task(self, booking: _Booking) -> None:
        """The task's KV is now its latest call's, less what it shares, until the task ends.

        Its last declared step does not end it: a task that runs past its `expected_steps`
        still comes back to its conversation, the longest of all by then. `end_task` ends
        it, or `open_task_idle_s` without a call.

        What the task's first call found cached anywhere (a system prompt) is held once for
        every task that shares it, so it is not the task's own: counting it per task would
        call a fleet whose tasks share one long prompt full when its caches are not.
        """
        tasks = self._open_tasks
        old = tasks.pop(booking.workflow_id, None)
        if old is not None:
            self._open_kv[old[0]] -= old[1]
            shared = old[3]
        else:
            shared = booking.shared if booking.shared > 0 else 0
        own = booking.tokens - shared if booking.tokens > shared else 0
        tasks[booking.workflow_id] = (booking.model, own, booking.now, shared)
        self._open_kv[booking.model] += own

    def _expire_open_tasks(self, now: float) -> None:
        """Forget tasks that placed nothing for `open_task_idle_s` (least recent first)."""
        tasks = self._open_tasks
        horizon = now - self._open_task_idle_s
        while tasks:
            workflow_id = next(iter(tasks))
            model, tokens, placed_at, _ = tasks[workflow_id]
            if placed_at > horizon:
                return
            del tasks[workflow_id]
            self._open_kv[model] -= tokens

    def _kv_capacity_tokens(self, model: ModelSpec, now: float) -> int:
        """The KV-cache tokens of the replicas warm for `model` that may take calls.

        Scraped: `num_gpu_blocks` · the engine's block size; before that, the estimate from
        the GPU's memory and the model's weights (`kv_capacity_blocks`). The sum visits every
        replica of the model, so it is reused for `KV_CAPACITY_REUSE_S`: the caches change
        size only as replicas come, go or load weights, and a threshold a second late moves
        no admission.
        """
        cached = self._kv_capacity.get(model.name)
        if cached is not None and now - cached[0] < KV_CAPACITY_REUSE_S:
            return cached[1]
        total = 0
        estimates = self._kv_estimate_tokens[model.name]
        for rid, member in self._search.rankings[model.name].member.items():
            if member[2] is None:
                continue  # cold: it holds no KV for the model until it loads the weights
            state = self._replicas[rid]
            if state.num_gpu_blocks is not None:
                total += state.num_gpu_blocks * (state.engine_block_size or self.block_size)
            else:
                total += estimates[state.pool_position]
        self._kv_capacity[model.name] = (now, total)
        return total

    def _open_task_refusal(self, ctx: Decision) -> Refusal | None:
        """A new task waits while the KV its model's open tasks will come back to is too much.

        refused iff open tasks' KV + its prompt > open_task_kv_by_tier[tier − 1] · the KV
        cache of the replicas warm for the model

        each counted without the prefix some cache already held at the task's first step (a
        system prompt its tasks share, held once). While no task was held for
        `open_task_kv_hold_s`, the multiple is `open_task_kv_slack` times looser: at capacity
        the open tasks' KV swings about its mean below it, past capacity it crosses at once.
        Each model holds on its own.

        Past that multiple, conversations coming back from their tools find their KV evicted
        and recompute it, evicting each other's: admitting one more task slows every task
        already running and makes some fail having spent. Waiting before its first step, it
        spends nothing and holds nothing (`AdmissionConfig.open_task_kv_by_tier`).
        """
        thresholds = self._open_task_kv
        request = ctx.request
        if (
            thresholds is None
            or request.steps_done
            or request.attempt > 1
            or not request.workflow_id
            or request.workflow_id in self._open_tasks
        ):
            return None
        self._expire_open_tasks(ctx.now)
        tier = self._tenants.keys(ctx.tenant)[0]
        factor = thresholds[tier - 1]
        if ctx.now >= self._holding_until[ctx.model]:
            factor *= self._open_task_slack
        committed = self._open_kv[ctx.model]
        capacity = self._kv_capacity_tokens(ctx.spec, ctx.now)
        own = ctx.prompt - ctx.most_cached  # a prompt some cache holds is shared, not added
        if not capacity or committed + own <= factor * capacity:
            return None
        self._holding_until[ctx.model] = ctx.now + self._open_task_hold_s
        return reasons.kv_committed(
            ctx,
            sum(1 for task in self._open_tasks.values() if task[0] == ctx.model),
            committed,
            capacity,
            factor,
            tier,
            own,
            self.config.admission.open_task_retry_after_s,
        )

    def _refresh_load(self, state: ReplicaState) -> None:
        """After a placement: only the load-dependent estimates of the replica change.

        Its static factor and ranking depend on the shared (scraped) load, which a placement
        does not change once the replica has been scraped; before that, refresh everything.
        """
        if state.metrics_at is None:
            self._refresh(state)
            return
        self.policy.refresh_load(state)
        self._search.rank_load(state)

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

    def _place_model(self, ctx: Decision) -> tuple[Estimate, bool] | Refusal:
        """Choose a replica for `ctx.spec`; (estimate, chosen by rendezvous) or a refusal."""
        if ctx.prompt + ctx.max_output > ctx.spec.context_length:
            return reasons.context_too_long(ctx)
        ranking = self._search.rankings[ctx.model]
        if ranking.slots:
            load_fraction = ranking.load / ranking.slots
            if not self.policy.accepts(ctx, load_fraction):
                tier = self._tenants.keys(ctx.tenant)[0]
                return reasons.saturated(ctx, load_fraction, tier, self.config)
        found = self._search.find(ctx)
        if isinstance(found, tuple):
            return found
        # Nothing fits: every replica's verdict explains why.
        for state in self._replicas:
            if state.rid not in found:
                found[state.rid] = self.policy.evaluate(state.rid, ctx)
        return reasons.no_fit(ctx, found, self._replicas, self.config)

    def _task_refusal(self, ctx: Decision, chosen: Estimate) -> Refusal | None:
        """At a task's first step: refuse it when the load, not the task, makes it miss.

        whole task = steps remaining · step estimate + expected tool time
        refused iff whole task > margin · remaining deadline,
                 or step estimate > margin · the step's objective (where declared),
                and the same estimate on an idle replica (`Policy.idle_duration_s`) is not

        Before it has spent anything, a task that the load would make late is worth more
        started later than started now: admitted, it would hold KV and batch slots that the
        tasks already running need to finish, and fail having spent. A task that would miss
        on an idle fleet too is left to try (its deadline, not the load, is what to fix).
        """
        request = ctx.request
        latency = self.config.latency
        remaining = request.deadline_s_remaining
        step_remaining = request.step_deadline_s_remaining
        if (
            (remaining is None and step_remaining is None)
            or request.steps_done
            or request.attempt > 1
        ):
            return None
        margin = latency.task_admission_margin
        steps = request.steps_remaining
        tools = request.expected_tool_s
        loaded = chosen.duration_s
        late_task = remaining is not None and steps * loaded + tools > margin * remaining
        late_step = step_remaining is not None and loaded > margin * step_remaining
        if not (late_task or late_step):
            return None
        idle = self.policy.idle_duration_s(ctx, chosen)
        if late_task and remaining is not None and steps * idle + tools > margin * remaining:
            return None
        if late_step and step_remaining is not None and idle > margin * step_remaining:
            return None
        retry_after = max(self.config.admission.retry_after_s, chosen.queue_wait_s)
        return reasons.overloaded(ctx, loaded, idle, retry_after, whole_task=late_task)

    def _commit(
        self,
        ctx: Decision,
        chosen: Estimate,
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
                ctx.request.attempt > 1 and not ctx.request.after_control_plane_fault,
                probe,
                ctx.now,
                ctx.prompt + ctx.output,
                -1 if ctx.request.steps_done else ctx.most_cached,
            )
        )
        self.policy.finish(state, ctx, chosen)
        cost = self._prices[state.pool_position].exact.cost_micros(
            ctx.prompt, chosen.cached_tokens, ctx.output
        )
        priority, fairness_key, fairness_weight = self._tenants.keys(ctx.tenant)
        return Placement(
            replica=state.name,
            task_queue=state.task_queue,
            pool=state.pool_name,
            gpu=state.gpu,
            model=ctx.model,
            degraded_from=degraded_from,
            block_size=state.engine_block_size or self.block_size,
            expected_cached_tokens=chosen.cached_tokens,
            est_queue_wait_s=chosen.queue_wait_s,
            est_ttft_s=chosen.ttft_s,
            est_duration_s=chosen.duration_s,
            est_cost_micros=cost,
            p_success=chosen.p_success,
            step_budget_s=ctx.budget_s,
            priority_key=priority,
            fairness_key=fairness_key,
            fairness_weight=fairness_weight,
            schedule_to_start_s=chosen.schedule_to_start_s,
            cold_start=chosen.cold_load_s > 0,
            probe=probe,
            rendezvous=rendezvous,
            engine_priority=engine_priority(priority, ctx.request.task_started_at),
            reason=reasons.placement_reason(
                state,
                ctx,
                chosen,
                cost,
                ahead=ahead,
                degraded_from=degraded_from,
                probe=probe,
                rendezvous=rendezvous,
            ),
        )

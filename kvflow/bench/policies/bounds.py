"""Bounds of the policy benchmark: what no placement can beat, and what an idle fleet reaches.

- the zero-miss floor (`zero_miss_floor`): the cost per successful task with every block an
  earlier call computed found cached, at the cheapest prices;
- the KV-capacity floor (`kv_capacity_floor`): the same with the fleet's KV cache as it is,
  for every policy that cannot see how long a tool call will run;
- the success ceiling (`success_ceiling`): the share of tasks an idle fleet finishes within
  their declared budgets;
- the batching bound (`batching_bound`): the least mean time per output token with which a
  fleet serves the load, whatever the order and placement, and the model time it implies;
- idle-fleet lifetimes (`lifetime_estimate_s`), behind the runs' warm-up, and the compute
  bound (`compute_bound_tasks_per_s`), where the capacity probes start;
- model time at a hit rate (`at_hit_rate`), read between runs on larger KV caches: the model
  time of a policy that reached the KV-capacity floor's hit rate, which has no closed form.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction

from kvflow.bench.policies.figures import cost_per_success, percentile
from kvflow.bench.policies.fleet import (
    MODEL,
    engine_config,
    fastest_perf,
    fleet_tenants,
    perf_model,
)
from kvflow.scheduler.fleet import Fleet
from kvflow.simulator.engine import SimReplica
from kvflow.simulator.perf import PerfModel
from kvflow.simulator.workloads import Call, Step, Task, WorkloadSpec, calibration_sample

LIFETIME_MARGIN = 1.5
"""Estimated lifetime = idle-fleet lifetime × this (queueing under load)."""


def idle_call_s(call: Call, perf: PerfModel, cached: int) -> float:
    """Model time of `call` alone on an idle replica with `cached` tokens of it cached.

    Prefill of what `cached` does not cover, then decode at a batch of one.
    """
    hit = min(cached, call.prompt_tokens - 1)
    seconds = perf.prefill_seconds(call.prompt_tokens - hit, hit)
    return seconds + call.output_tokens * perf.decode_step_seconds(1, call.prompt_tokens)


def idle_step_s(step: Step, perf: PerfModel, cached: int) -> float:
    """Model time of `step` on an idle replica: its slowest call (`idle_call_s`)."""
    return max(idle_call_s(call, perf, cached) for call in step.calls)


def idle_lifetime_s(steps: Sequence[Step], perf: PerfModel) -> tuple[float, list[float]]:
    """(arrival to end on an idle fleet, each step's model time) of a task of `steps`."""
    cached = 0
    total = 0.0
    per_step: list[float] = []
    for step in steps:
        seconds = idle_step_s(step, perf, cached)
        per_step.append(seconds)
        total += seconds + step.pause_after_s
        first = step.calls[0]
        cached = first.prompt_tokens + first.output_tokens
    return total, per_step


def lifetime_estimate_s(spec: WorkloadSpec, fleet: Fleet) -> float:
    """A task's mean lifetime on an idle fleet (calibration sample) × `LIFETIME_MARGIN`."""
    perf = fastest_perf(fleet, engine_config(spec))
    sample = calibration_sample(spec, tuple(fleet_tenants(fleet)))
    lifetimes = [idle_lifetime_s(steps, perf)[0] for _, steps in sample]
    return LIFETIME_MARGIN * sum(lifetimes) / len(lifetimes)


@dataclass(frozen=True)
class ZeroMissFloor:
    """What no placement can beat on a workload (`zero_miss_floor`)."""

    cost_per_task_usd: Decimal | None
    """None when no task is counted."""
    prefix_hit_rate: float
    per_task_micros: dict[int, int] = field(default_factory=dict)
    """Counted task index → its floor cost (for the floor of a policy's own successes)."""

    def of(self, indexes: Iterable[int]) -> Decimal | None:
        """The floor's cost per task over the tasks `indexes` (a policy's successes)."""
        chosen = [self.per_task_micros[i] for i in indexes if i in self.per_task_micros]
        return cost_per_success(sum(chosen), len(chosen))


def _cached_blocks(chain: Sequence[int], seen: set[int]) -> int:
    """Leading blocks of `chain` in `seen`; `seen` holds whole prefixes, so a binary search."""
    low, high = 0, len(chain)
    while low < high:
        middle = (low + high + 1) // 2
        if chain[middle - 1] in seen:
            low = middle
        else:
            high = middle - 1
    return low


def zero_miss_floor(
    tasks: Iterable[Task],
    fleet: Fleet,
    *,
    block_size: int,
    counted: Callable[[Task], bool] = lambda task: True,
    model: str = MODEL,
) -> ZeroMissFloor:
    """A lower bound on cost per successful task, and the hit rate behind it.

    `tasks` in arrival order (a `Workload`). Every call of the `counted` tasks is billed as if
    it found cached every full block that an earlier call had computed (its own task's
    earlier steps and sibling calls, and a system prompt some earlier-arriving task sent
    first), with an unbounded cache, at the cheapest prices of a pool serving `model`, and
    every task succeeds at its first attempt. A call can only reuse blocks already computed,
    so only the blocks new to the whole fleet are billed at the input price: what remains is
    output and cached input, which placement cannot change. (Degrading calls to a cheaper
    fallback model can cost less: that changes the answer, not only where it is computed.)

    A policy that fails tasks is compared with the floor of the tasks it completed
    (`ZeroMissFloor.of`), so that finishing only cheap tasks does not pass for a low cost.
    """
    # A call degraded to a cheaper fallback model is a different call (another model's
    # answer), so only the pools serving the model asked for set the floor.
    serving = [pool for pool in fleet.pools if model in pool.warm_models] or fleet.pools
    prices = {pool.token_prices.exact() for pool in serving}
    size = block_size
    seen: set[int] = set()
    micros = prompt_tokens = cached_tokens = 0
    per_task: dict[int, int] = {}
    for task in tasks:
        counts = counted(task)
        own = 0
        for step in task.steps:
            for call in step.calls:
                chain = call.block_hashes
                matched = _cached_blocks(chain, seen)
                cached = min(matched * size, call.prompt_tokens)
                if counts:
                    prompt_tokens += call.prompt_tokens
                    cached_tokens += cached
                    own += min(
                        p.cost_micros(call.prompt_tokens, cached, call.output_tokens)
                        for p in prices
                    )
                # A fan-out's calls run at once, but an engine caches a block as soon as one
                # of them has computed it, so a sibling may find it: count them in turn.
                seen.update(chain[matched:])
        if counts:
            per_task[task.index] = own
            micros += own
    return ZeroMissFloor(
        cost_per_success(micros, len(per_task)),
        cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        per_task,
    )


# ------------------------------------------------------------------ the KV-capacity floor


@dataclass(frozen=True)
class KvCapacityFloor:
    """What no policy blind to a tool call's duration can beat with the fleet's KV cache.

    `kv_capacity_floor` builds it; the hit rates beside it say what knowledge would be worth.
    """

    cost_per_task_usd: Decimal | None
    """None when no task is counted."""
    prefix_hit_rate: float
    demand_over_cache: float
    """Token-seconds the counted tasks' paused conversations would hold, over what the cache
    offers them (below 1: the cache holds every pause, and the floor is the zero-miss floor)."""
    clairvoyant_hit_rate: float
    """The hit rate with every pause's length known in advance (no engine knows it)."""
    one_keep_time_hit_rate: float
    """The hit rate keeping every paused conversation for one and the same time, whatever its
    tool: the fluid model of least-recently-used eviction."""
    recompute_s_per_task: float
    """Seconds per counted task to recompute the tokens the floor misses, at the fastest
    replica's full prefill speed: the least it adds to model time."""
    per_task_micros: dict[int, int] = field(default_factory=dict)

    def of(self, indexes: Iterable[int]) -> Decimal | None:
        """The floor's cost per task over the tasks `indexes` (a policy's successes)."""
        chosen = [self.per_task_micros[i] for i in indexes if i in self.per_task_micros]
        return cost_per_success(sum(chosen), len(chosen))


@dataclass(frozen=True, slots=True)
class _Pause:
    """A paused conversation: keeping it costs `tokens` × the pause, and saves `saves` tokens."""

    kind: str
    seconds: float
    tokens: int
    saves: int
    task: int


def _hull(pauses: Sequence[_Pause]) -> list[tuple[float, float, float]]:
    """The segments (token-seconds, tokens saved, keep time reached) of one kind's best keeps.

    Keeping every conversation of the kind for τ costs Σ tokens × min(pause, τ) and saves
    the conversations back by τ. Mixing two keep times gives any point between them, so the
    frontier is the upper concave hull of those points; its segments come in falling slope.
    """
    ordered = sorted(pauses, key=lambda p: p.seconds)
    remaining = sum(p.tokens for p in ordered)
    points = [(0.0, 0.0, 0.0)]
    held = saved = 0.0
    for pause in ordered:
        # Raising τ to this pause: everyone still out holds longer, this one comes back.
        held += remaining * (pause.seconds - points[-1][2])
        remaining -= pause.tokens
        saved += pause.saves
        points.append((held, saved, pause.seconds))
    hull: list[tuple[float, float, float]] = [points[0]]
    for point in points[1:]:
        while len(hull) >= 2:
            (x0, y0, _), (x1, y1, _) = hull[-2], hull[-1]
            # Drop the middle point when it lies on or under the chord to the new one.
            if (y1 - y0) * (point[0] - x0) <= (point[1] - y0) * (x1 - x0):
                hull.pop()
            else:
                break
        hull.append(point)
    return [(b[0] - a[0], b[1] - a[1], b[2]) for a, b in itertools.pairwise(hull) if b[1] > a[1]]


def _keep_times(
    pauses: Sequence[_Pause], budget: float, *, by_kind: bool
) -> dict[str, tuple[float, float, float]]:
    """Per kind, (keep time, next keep time, the share of conversations kept that long).

    Segments of every kind in falling order of tokens saved per token-second, each taken
    while the budget lasts, the last one in part: the fractional knapsack over the hulls.
    """
    kinds: dict[str, list[_Pause]] = {}
    for pause in pauses:
        kinds.setdefault(pause.kind if by_kind else "", []).append(pause)
    segments = [
        (cost, gain, tau, kind) for kind, its in kinds.items() for cost, gain, tau in _hull(its)
    ]
    segments.sort(key=lambda s: s[1] / s[0] if s[0] > 0 else math.inf, reverse=True)
    chosen = {kind: (0.0, 0.0, 0.0) for kind in kinds}
    left = budget
    for cost, _, tau, kind in segments:
        reached = chosen[kind][0]
        if cost <= left:
            chosen[kind] = (tau, tau, 0.0)
            left -= cost
            continue
        if left > 0:
            chosen[kind] = (reached, tau, left / cost)
        break
    return chosen


def _saved_share(pause: _Pause, keep: tuple[float, float, float]) -> float:
    below, above, share = keep
    if pause.seconds <= below:
        return 1.0
    return share if pause.seconds <= above else 0.0


def kv_cache_tokens(fleet: Fleet, spec: WorkloadSpec, model: str = MODEL) -> int:
    """Tokens of KV cache all replicas serving `model` hold together."""
    engine = engine_config(spec)
    total = 0
    for pool in fleet.pools:
        if model not in pool.warm_models:
            continue
        spec_of = perf_model(fleet, pool, engine).model
        blocks = SimReplica(pool.gpu, [spec_of], engine).engine(spec_of.name).num_gpu_blocks
        total += pool.replicas * blocks * engine.block_size
    return total


def kv_capacity_floor(
    tasks: Iterable[Task],
    fleet: Fleet,
    spec: WorkloadSpec,
    *,
    task_rate: float,
    counted: Callable[[Task], bool] = lambda task: True,
    model: str = MODEL,
    running_time_scale: float = 1.0,
) -> KvCapacityFloor:
    """A lower bound on cost per successful task for every policy that cannot see the future.

    The zero-miss floor with the cache the fleet has. A paused conversation is found again
    only if its blocks were kept for the whole pause, and keeping them takes cache: tokens ×
    seconds. In steady state (Little's law) the counted tasks' conversations can hold at most
    the fleet's KV tokens × (counted tasks / `task_rate`) token-seconds, less what their
    running calls hold (each call's prompt for its idle-fleet model time).

    No policy knows how long a tool call will run, only its kind (the workload's tool, or the
    task's tier where it has none) and how long it has run so far. Two conversations of the
    same kind that have waited as long are alike to it, so the most it can do is keep each
    kind's conversations for a chosen time, or mix two such times. The best keep times under
    the budget give the floor: a fractional knapsack over each kind's frontier (`_hull`). It
    is a relaxation, so a bound: the budget is an average, not a limit at every instant; a
    conversation may be kept in part and split across replicas; shared system prompts and a
    fan-out sibling's fresh blocks are always found; a pause lasts only the tool's time,
    never a queue's.

    `clairvoyant_hit_rate` knows every pause (keep the shortest first) and
    `one_keep_time_hit_rate` keeps all kinds alike: the fluid model of least recently used.

    `running_time_scale` holds each running call's prompt that many times its idle-fleet
    model time. Only 1 gives a bound; a fleet's measured model time over the idle fleet's
    gives the floor at the KV its running calls really hold, an estimate
    (`kvflow.bench.policies.relaxations`).
    """
    if running_time_scale < 1:
        raise ValueError(
            f"running_time_scale must be at least 1 (no call runs faster than on an idle "
            f"fleet), got {running_time_scale}"
        )
    block_size = engine_config(spec).block_size
    serving = [pool for pool in fleet.pools if model in pool.warm_models] or fleet.pools
    prices = {pool.token_prices.exact() for pool in serving}
    # A missed token costs at least the smallest gap between an input and a cached token.
    per_missed = min(Fraction(p.input - p.cached_input, p.scale) for p in prices)
    perf = fastest_perf(fleet, engine_config(spec))
    seen: set[int] = set()
    pauses: list[_Pause] = []
    micros: dict[int, int] = {}
    running = 0.0
    prompt_tokens = cached_tokens = 0
    for task in tasks:
        counts = counted(task)
        own: set[int] = set()
        before: Step | None = None
        task_micros = 0
        for step in task.steps:
            reused: list[int] = []
            computed: list[int] = []
            for call in step.calls:
                chain = call.block_hashes
                matched = _cached_blocks(chain, seen)
                if counts:
                    cached = min(matched * block_size, call.prompt_tokens)
                    prompt_tokens += call.prompt_tokens
                    cached_tokens += cached
                    task_micros += min(
                        p.cost_micros(call.prompt_tokens, cached, call.output_tokens)
                        for p in prices
                    )
                    # Only what the task's earlier steps computed had to last through the
                    # pause: a shared system prompt, or a block a sibling of this fan-out
                    # just computed, is found as in the zero-miss floor.
                    mine = sum(1 for h in chain[:matched] if h in own) * block_size
                    reused.append(min(mine, call.prompt_tokens))
                    running += (
                        call.prompt_tokens * idle_call_s(call, perf, cached) * running_time_scale
                    )
                seen.update(chain[matched:])
                computed.extend(chain[matched:])
            own.update(computed)
            if counts and before is not None and any(reused):
                # Siblings of a fan-out share the prefix: holding the shortest one is charged,
                # all of them are credited, which can only loosen the bound.
                kind = before.tool or f"tier {task.tier}"
                held = min(r for r in reused if r)
                pauses.append(_Pause(kind, before.pause_after_s, held, sum(reused), task.index))
            before = step
        if counts:
            micros[task.index] = task_micros
    count = len(micros)
    budget = kv_cache_tokens(fleet, spec, model) * count / task_rate - running
    budget = max(0.0, budget)
    demand = sum(p.tokens * p.seconds for p in pauses)

    def missed(by_kind: bool) -> tuple[float, dict[int, float]]:
        keeps = _keep_times(pauses, budget, by_kind=by_kind)
        per_task: dict[int, float] = {}
        for pause in pauses:
            lost = pause.saves * (1 - _saved_share(pause, keeps[pause.kind if by_kind else ""]))
            per_task[pause.task] = per_task.get(pause.task, 0.0) + lost
        return sum(per_task.values()), per_task

    informed, per_task = missed(True)
    one_time, _ = missed(False)
    clairvoyant = 0.0
    left = budget
    for pause in sorted(pauses, key=lambda p: p.seconds):
        need = pause.tokens * pause.seconds
        kept = 1.0 if need <= left else max(0.0, left / need) if need else 1.0
        left = max(0.0, left - need)
        clairvoyant += pause.saves * (1 - kept)
    for index, lost in per_task.items():
        micros[index] += int(Fraction(lost) * per_missed)

    def hit(lost: float) -> float:
        return (cached_tokens - lost) / prompt_tokens if prompt_tokens else 0.0

    seconds_per_token = 2 * perf.parameters / perf.flops_per_second
    return KvCapacityFloor(
        cost_per_success(sum(micros.values()), count),
        hit(informed),
        demand / budget if budget else math.inf if demand else 0.0,
        hit(clairvoyant),
        hit(one_time),
        informed * seconds_per_token / count if count else 0.0,
        micros,
    )


@dataclass(frozen=True)
class SuccessCeiling:
    """The share of tasks an idle fleet finishes in time, overall and per tier; its model time."""

    overall: float
    by_tier: dict[str, float]
    mean_model_s: float = 0.0
    """Mean model time of the counted tasks on an idle fleet, each conversation cached: no
    placement makes a task's model time shorter."""
    p99_model_s: float = 0.0
    """The 99th percentile of the same."""


def success_ceiling(
    tasks: Iterable[Task],
    fleet: Fleet,
    spec: WorkloadSpec,
    *,
    counted: Callable[[Task], bool] = lambda task: True,
) -> SuccessCeiling:
    """The share of `counted` tasks an idle fleet could finish within their deadlines.

    Each step on the fastest replica serving the model, alone, with the conversation so far
    cached (`idle_lifetime_s`), plus the task's tool pauses; per-step deadlines too, where the
    workload has them. A task beyond it fails whatever the placement.
    """
    perf = fastest_perf(fleet, engine_config(spec))
    totals: dict[int, int] = {}
    feasible: dict[int, int] = {}
    model_s: list[float] = []
    for task in tasks:
        if not counted(task):
            continue
        lifetime, steps = idle_lifetime_s(task.steps, perf)
        model_s.append(sum(steps))
        ok = task.arrival + lifetime <= task.deadline_at
        if task.step_allowance_s is not None:
            ok = ok and all(s <= task.step_allowance_s for s in steps)
        totals[task.tier] = totals.get(task.tier, 0) + 1
        feasible[task.tier] = feasible.get(task.tier, 0) + ok
    count = sum(totals.values())
    return SuccessCeiling(
        sum(feasible.values()) / count if count else 1.0,
        {str(t): feasible[t] / n for t, n in sorted(totals.items())},
        mean_model_s=sum(model_s) / len(model_s) if model_s else 0.0,
        p99_model_s=percentile(model_s, 0.99),
    )


@dataclass(frozen=True)
class BatchingBound:
    """How fast a loaded fleet can answer: the floor under batching (`batching_bound`)."""

    tpot_s: float
    """The least mean time a call waits per step it takes part in (a step per output token),
    over the counted tasks: the bound on model time over their steps taken."""
    idle_tpot_s: float
    """The mean time per output token of each call alone on a replica."""
    prefill_share: float
    """Share of the replicas' time the prefills' compute takes (every earlier block cached)."""
    kv_read_share: float
    """Share of the replicas' time the steps spend reading the sequences' KV."""
    mean_model_s: float
    """The least mean model time of the counted tasks (the bound)."""
    p99_model_s: float = 0.0
    """The 99th percentile of model time with every step at `tpot_s`: an estimate at the
    mean pace, not a bound (a schedule may speed the slowest tasks at the others' cost)."""
    in_time_by_tier: dict[str, float] = field(default_factory=dict)
    """Per tier, the share of the counted tasks whose every step fits its allowance (where
    the workload declares one) and whose task fits its deadline at `tpot_s`: where it reaches
    a tier's goal, the load's pace does not rule the goal out; batches above the mean do."""
    per_task: dict[int, tuple[float, float, float, float, float]] = field(default_factory=dict)
    """Counted task index → its (weighted steps, Σ √(w·κ), Σ w·κ, Σ κ, compute seconds), to
    bound the mean over a subset (`of`)."""
    counted: int = 0
    """Tasks counted."""
    task_rate: float = 0.0
    replicas: int = 0
    weights_s: float = 0.0
    """a: a step's weight read and overhead."""
    kv_s: float = 0.0
    """β: seconds to read one token's KV."""
    overhead_s: float = 0.0

    def of(self, indexes: Iterable[int]) -> float | None:
        """The bound on mean model time over the counted tasks `indexes` (a policy's successes).

        Only their work is counted as load, the least the fleet must have done for them; None
        when none is counted or their work alone exceeds the replicas' time.
        """
        chosen = [self.per_task[i] for i in indexes if i in self.per_task]
        if not chosen or not self.counted:
            return None
        totals = [sum(column) for column in zip(*chosen, strict=True)]
        seconds = _least_model_seconds(
            totals,
            scale=self.task_rate / self.counted,
            replicas=self.replicas,
            weights_s=self.weights_s,
            kv_s=self.kv_s,
            overhead_s=self.overhead_s,
        )
        return None if seconds is None else seconds / len(chosen)


def _least_model_seconds(
    totals: Sequence[float],
    *,
    scale: float,
    replicas: int,
    weights_s: float,
    kv_s: float,
    overhead_s: float,
) -> float | None:
    """The least total model time of tasks whose summed participations are `totals`.

    `totals` = (Σ w, Σ √(w·κ), Σ w·κ, Σ κ, compute seconds) over the tasks; `scale` turns
    them into their work per second. None when that work exceeds the replicas' time.
    Derivation: `batching_bound`.
    """
    weighted, roots, linear, context, compute = totals
    # The most steps a second the replicas have time for: (6) and (7) of `batching_bound`.
    steps = (replicas - kv_s * context * scale) / weights_s
    if overhead_s > 0:
        steps = min(steps, (replicas - compute * scale) / overhead_s)
    if steps <= 0:
        return None
    # (5): per second, a·Σw + β·max(Σ w·κ, (Σ √(w·κ))² / steps); over `scale`, per task set.
    per_second = weights_s * weighted * scale + kv_s * max(
        linear * scale, (roots * scale) ** 2 / steps
    )
    return per_second / scale


def batching_bound(
    tasks: Iterable[Task],
    fleet: Fleet,
    spec: WorkloadSpec,
    *,
    task_rate: float,
    counted: Callable[[Task], bool] = lambda task: True,
    model: str = MODEL,
) -> BatchingBound | None:
    """The least mean model time with which the fleet serves `task_rate`, any policy.

    The simulated engine (`kvflow.simulator.engine`) runs steps one after another on a
    replica; a step holds decoding sequences and prefill chunks (chunked prefill) and lasts

        d_s = (max(compute_s, memory_s) + o) · slowdown,
        memory_s = W + β · K_s,   compute_s = φ · T_s + attention,

    with W the weights' read time, β the time to read one token's KV, K_s the step's
    context plus new tokens over its sequences, T_s its new tokens and o the overhead
    (`PerfModel`). Write a = W + o. Every inequality below holds for every policy (order,
    placement, admission, priorities, retries, preemption):

    1. d_s ≥ a + β·K_s, since max(c, m) ≥ m and slowdown ≥ 1.
    2. A call takes part in at least `output_tokens` steps (within the output cap and the
       model's length): the step computing its prompt's last token (and giving the first
       token) and one decode step per later token. In the
       first, its computed plus new tokens are its prompt (κ = prompt); in the decode step for
       token k + 1, prompt + k (κ = prompt + k). Earlier prefill chunks, preemptions and
       retries only add steps. K_s ≥ Σ κ_j over the participations j in step s.
    3. A call lasts at least the sum of the steps it takes part in (a replica runs one step
       at a time); a task step (its calls at once) lasts at least the longest of them, so at
       least their mean: weight w_j = 1/k for each participation of a step of k calls. The
       task's model time (arrival to end less its tool pauses) is at least the sum of its
       steps' times, queues only adding. So Σ model time ≥ Σ_s W_s · d_s, W_s = Σ_{j∈s} w_j.
    4. By (1), Σ_s W_s·d_s ≥ a·Σ_j w_j + β·Σ_s W_s·K_s, and W_s·K_s ≥ (Σ_{j∈s} √(w_j·κ_j))²
       (Cauchy–Schwarz within the step), so by Cauchy–Schwarz over the n steps
       Σ_s W_s·K_s ≥ (Σ_j √(w_j·κ_j))² / n. Also W_s·K_s ≥ Σ_{j∈s} w_j·κ_j.
    5. Hence Σ model time ≥ a·Σ w + β·max(Σ w·κ, (Σ √(w·κ))² / n): the fewer steps, the
       more sequences each holds and the longer each lasts.
    6. The replicas' time bounds n: per second, in steady state, R replicas give
       R ≥ Σ_s d_s ≥ n·a + β·Σ_s K_s ≥ n·a + β·Σ_j κ_j, so n ≤ (R − β·Σκ) / a, with Σκ over
       every participation (weight 1).
    7. And R ≥ Σ_s d_s ≥ n·o + Σ_s compute_s ≥ n·o + φ·(new tokens), so
       n ≤ (R − φ·new) / o, new tokens at least every block new to the fleet (as in the
       zero-miss floor: the total of blocks ever computed does not depend on the order) plus
       one per later output token.

    Putting the least n's bound into (5) bounds the mean model time (`mean_model_s`). It
    assumes steady state (the counted tasks' work per second is the load's) and one GPU kind
    serving `model` (None otherwise, and when the load needs more than the replicas' time).
    What it leaves out can only make a policy slower: prefill compute beyond the memory
    time, queues, tool pauses beyond their own, recomputed misses.

    `tpot_s` is that bound per weighted participation; `p99_model_s` and `in_time_by_tier`
    price each call's steps at `tpot_s` (an estimate at the mean pace, not a bound).
    A policy's mean is over its successful tasks: `BatchingBound.of` bounds that subset.
    """
    serving = [pool for pool in fleet.pools if model in pool.warm_models]
    if not serving or len({(p.gpu, p.gpus_per_replica) for p in serving}) != 1:
        return None
    replicas = sum(pool.replicas for pool in serving)
    engine = engine_config(spec)
    perf = perf_model(fleet, serving[0], engine)
    block_size = engine.block_size
    overhead_s = perf.step_overhead_s
    weights_s = perf.weight_bytes / perf.bytes_per_second + overhead_s
    kv_s = perf.kv_bytes_per_token / perf.bytes_per_second
    flop_s = 2.0 * perf.parameters / perf.flops_per_second
    seen: set[int] = set()
    prefill = idle_decode = decoded_tokens = 0.0
    per_task: dict[int, tuple[float, float, float, float, float]] = {}
    shapes: dict[int, list[list[int]]] = {}
    counted_tasks: list[Task] = []
    for task in tasks:
        counts = counted(task)
        totals = [0.0, 0.0, 0.0, 0.0, 0.0]
        steps: list[list[int]] = []
        for step in task.steps:
            weight = 1.0 / len(step.calls)
            outputs: list[int] = []
            for call in step.calls:
                chain = call.block_hashes
                matched = _cached_blocks(chain, seen)
                seen.update(chain[matched:])
                if not counts:
                    continue
                hit = min(matched * block_size, call.prompt_tokens - 1)
                prompt = call.prompt_tokens
                # The engine stops a call at its output cap or the model's length.
                cap = min(spec.max_tokens, spec.max_model_len - prompt)
                out = max(1, min(call.output_tokens, cap))
                outputs.append(out)
                # κ = prompt + k for k = 0 (the prefill's last step) .. out − 1.
                kappa_sum = out * prompt + out * (out - 1) / 2
                roots = sum(math.sqrt(weight * (prompt + k)) for k in range(out))
                totals[0] += weight * out
                totals[1] += roots
                totals[2] += weight * kappa_sum
                totals[3] += kappa_sum
                totals[4] += flop_s * (prompt - hit + out - 1)
                prefill += perf.prefill_seconds(prompt - hit, hit)
                idle_decode += (out - 1) * perf.decode_step_seconds(1, prompt)
                decoded_tokens += out - 1
            steps.append(outputs)
        if counts:
            per_task[task.index] = (totals[0], totals[1], totals[2], totals[3], totals[4])
            shapes[task.index] = steps
            counted_tasks.append(task)
    if not per_task or not decoded_tokens:
        return None
    count = len(per_task)
    scale = task_rate / count
    sums = [sum(column) for column in zip(*per_task.values(), strict=True)]
    least = _least_model_seconds(
        sums, scale=scale, replicas=replicas, weights_s=weights_s, kv_s=kv_s,
        overhead_s=overhead_s,
    )  # fmt: skip
    if least is None:
        return None
    tpot = least / sums[0]
    step_s = {
        index: [max((out * tpot for out in outputs), default=0.0) for outputs in steps]
        for index, steps in shapes.items()
    }
    tiers: dict[int, list[bool]] = {}
    for task in counted_tasks:
        times = step_s[task.index]
        allowance = task.step_allowance_s
        pauses = sum(step.pause_after_s for step in task.steps)
        fits = task.arrival + sum(times) + pauses <= task.deadline_at and (
            allowance is None or all(seconds <= allowance for seconds in times)
        )
        tiers.setdefault(task.tier, []).append(fits)
    return BatchingBound(
        tpot_s=tpot,
        idle_tpot_s=idle_decode / decoded_tokens,
        prefill_share=prefill * scale / replicas,
        kv_read_share=kv_s * sums[3] * scale / replicas,
        mean_model_s=least / count,
        p99_model_s=percentile([sum(times) for times in step_s.values()], 0.99),
        in_time_by_tier={str(t): sum(f) / len(f) for t, f in sorted(tiers.items())},
        per_task=per_task,
        counted=count,
        task_rate=task_rate,
        replicas=replicas,
        weights_s=weights_s,
        kv_s=kv_s,
        overhead_s=overhead_s,
    )


def compute_bound_tasks_per_s(spec: WorkloadSpec, fleet: Fleet) -> float:
    """An upper bound on tasks per second: every replica computing only new tokens.

    In full batches: as many sequences of the mean context as its KV cache holds, at most 128.
    """
    engine = engine_config(spec)
    sample = [steps for _, steps in calibration_sample(spec, tuple(fleet_tenants(fleet)))]
    contexts = [c.prompt_tokens for steps in sample for s in steps for c in s.calls]
    mean_context = sum(contexts) / len(contexts) + spec.output_median
    total = 0.0
    for pool in fleet.pools:
        perf = perf_model(fleet, pool, engine)
        model = perf.model
        kv_tokens = SimReplica(pool.gpu, [model], engine).engine(model.name).num_gpu_blocks
        kv_tokens *= engine.block_size
        batch = max(1, min(128, int(kv_tokens / mean_context)))
        per_token = perf.decode_step_seconds(batch, int(mean_context)) / batch
        seconds = 0.0
        for steps in sample:
            seen = 0
            for step in steps:
                for call in step.calls:
                    new = max(1, call.prompt_tokens - seen)
                    seconds += perf.prefill_seconds(new, call.prompt_tokens - new)
                    seconds += call.output_tokens * per_token
                seen = step.calls[0].prompt_tokens + step.calls[0].output_tokens
        total += pool.replicas / (seconds / len(sample))
    return total


def at_hit_rate(points: Sequence[tuple[float, float]], hit: float) -> float | None:
    """Model time at `hit`, linear between the measured (hit rate, model time) around it.

    None outside the range measured: no extrapolation.
    """
    ordered = sorted(points)
    for (h0, m0), (h1, m1) in itertools.pairwise(ordered):
        if h0 <= hit <= h1:
            return m0 if h1 == h0 else m0 + (m1 - m0) * (hit - h0) / (h1 - h0)
    return None

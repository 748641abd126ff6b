"""Bounds of the policy benchmark: what no placement can beat, and what an idle fleet reaches.

- the zero-miss floor (`zero_miss_floor`): the cost per successful task with every block an
  earlier call computed found cached, at the cheapest prices;
- the success ceiling (`success_ceiling`): the share of tasks an idle fleet finishes within
  their declared budgets;
- idle-fleet lifetimes (`lifetime_estimate_s`), behind the runs' warm-up, and the compute
  bound (`compute_bound_tasks_per_s`), where the capacity probes start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal

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
from kvflow.simulator.workloads import Step, Task, WorkloadSpec, calibration_sample

LIFETIME_MARGIN = 1.5
"""Estimated lifetime = idle-fleet lifetime × this (queueing under load)."""


def idle_step_s(step: Step, perf: PerfModel, cached: int) -> float:
    """Model time of `step` on an idle replica: its slowest call.

    Prefill of what `cached` does not cover, then decode at a batch of one.
    """
    longest = 0.0
    for call in step.calls:
        hit = min(cached, call.prompt_tokens - 1)
        seconds = perf.prefill_seconds(call.prompt_tokens - hit, hit)
        seconds += call.output_tokens * perf.decode_step_seconds(1, call.prompt_tokens)
        longest = max(longest, seconds)
    return longest


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

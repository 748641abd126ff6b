"""What a decision says: the one-line reason of a placement and the message of each refusal.

Every answer explains itself to an operator reading the Temporal UI: a `Placement` carries one
line (the replica, cached tokens, queue, estimate, price and any special case), a `Refusal`
says what is wrong and what would help.
"""

from __future__ import annotations

from collections import Counter

from kvflow.scheduler.config import SchedulerConfig
from kvflow.scheduler.decision import FILTER_ORDER, Decision, Estimate, Filter
from kvflow.scheduler.fleet import Tenant, format_usd
from kvflow.scheduler.placement import PlacementRequest, Refusal, RefusalReason
from kvflow.scheduler.state import ReplicaState

_FILTER_REASON = {
    Filter.EXCLUDED: RefusalReason.NO_REPLICA,
    Filter.DOWN: RefusalReason.NO_REPLICA,
    Filter.NOT_WARM: RefusalReason.MODEL_NOT_WARM,
    Filter.CIRCUIT_OPEN: RefusalReason.ALL_CIRCUITS_OPEN,
    Filter.TOO_SMALL: RefusalReason.NO_REPLICA,
    Filter.MEMORY: RefusalReason.SATURATED,
    Filter.DEADLINE: RefusalReason.DEADLINE,
    Filter.SPEND: RefusalReason.OVER_BUDGET,
}
DOWN_RETRY_AFTER_S = 5.0
"""Retry-after of a refusal because every replica is down: about one scrape interval."""


def placement_reason(
    state: ReplicaState,
    decision: Decision,
    chosen: Estimate,
    cost_micros: int,
    *,
    ahead: int,
    degraded_from: str | None,
    probe: bool,
    rendezvous: bool,
) -> str:
    """One line: the replica, cached tokens, queue, estimate, price and special cases."""
    budget = decision.budget_s
    reason = (
        f"{state.name}: {tokens(chosen.cached_tokens)} of {tokens(decision.prompt)} "
        f"prompt tokens cached, queue {ahead}, est {seconds(chosen.duration_s)}"
        + (f" of {seconds(budget)} budget" if budget is not None else " (no deadline)")
        + f", ${format_usd(cost_micros, 4)}"
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
    elif chosen.rid == decision.previous:
        notes.append("sticky")
    if notes:
        reason += " (" + "; ".join(notes) + ")"
    return reason


def refusal(
    decision: Decision,
    reason: RefusalReason,
    message: str,
    *,
    retryable: bool,
    retry_after: float | None = None,
    rejections: dict[str, int] | None = None,
) -> Refusal:
    """A refusal of the decision's model."""
    return Refusal(
        reason=reason,
        message=message,
        model=decision.spec.name,
        tenant=decision.request.tenant,
        retry_after_s=retry_after,
        retryable=retryable,
        rejections=rejections or {},
    )


def overloaded(
    decision: Decision, step_s: float, idle_step_s: float, retry_after: float, *, whole_task: bool
) -> Refusal:
    """A new task refused at its first step: the load, not the task, would make it late."""
    request = decision.request
    steps = request.steps_remaining
    tools = request.expected_tool_s
    if whole_task:
        late = (
            f"the task's {steps} steps of {decision.spec.name} and "
            f"{seconds(tools)} of tools are estimated at {seconds(steps * step_s + tools)} "
            f"at the fleet's current load ({seconds(steps * idle_step_s + tools)} on idle "
            f"replicas), past the {seconds(request.deadline_s_remaining or 0.0)} left before "
            "its deadline"
        )
    else:
        late = (
            f"the task's first step of {decision.spec.name} is estimated at "
            f"{seconds(step_s)} at the fleet's current load ({seconds(idle_step_s)} on an idle "
            f"replica), past its per-step objective of "
            f"{seconds(request.step_deadline_s_remaining or 0.0)}"
        )
    return refusal(
        decision,
        RefusalReason.OVERLOADED,
        f"{late}; nothing was spent: start it again in {retry_after:.0f} s, or give it a "
        "longer latency budget",
        retry_after=retry_after,
        retryable=False,
    )


def context_too_long(decision: Decision) -> Refusal:
    """The prompt and output do not fit the model's context."""
    request, spec = decision.request, decision.spec
    return refusal(
        decision,
        RefusalReason.NO_REPLICA,
        f"{request.prompt_tokens} prompt + {request.max_output_tokens} output tokens "
        f"exceed {spec.name}'s context of {spec.context_length} tokens",
        retryable=False,
    )


def saturated(
    decision: Decision, load_fraction: float, tier: int, config: SchedulerConfig
) -> Refusal:
    """The model's replicas are too loaded for the tenant's tier."""
    admission = config.admission
    admitted_as = admission.admission_tier(tier, decision.request.steps_done)
    threshold = decision.admission_threshold
    notes = []
    if admitted_as != tier:
        notes.append(f"as tier {admitted_as}: its task has run")
    if threshold != admission.saturation_by_tier[admitted_as - 1]:
        notes.append(
            "headroom for tier 1, whose steps have objectives to meet"
            if admission.headroom_for_step_objectives
            else "headroom for tier 1, whose steps ran late"
        )
    return refusal(
        decision,
        RefusalReason.SATURATED,
        f"replicas serving {decision.spec.name} are at {load_fraction:.0%} of their "
        f"slots; tier {tier} calls wait until load falls below {threshold:.0%}"
        + (f" ({'; '.join(notes)})" if notes else "")
        + ", or for "
        f"{admission.max_wait_s_by_tier[tier - 1]:g} s at most",
        retry_after=admission.retry_after_s,
        retryable=True,
    )


def kv_committed(
    decision: Decision,
    open_tasks: int,
    committed: int,
    capacity: int,
    factor: float,
    tier: int,
    own: int,
    retry_after: float,
) -> Refusal:
    """A new task waits: the model's open tasks will come back to more KV than it may add to."""
    return refusal(
        decision,
        RefusalReason.SATURATED,
        f"the {open_tasks} open tasks of this scheduler will come back to {committed:,} tokens "
        f"of {decision.spec.name} KV cache, {committed / capacity:.2f}× the {capacity:,} its "
        f"warm replicas hold; a new tier-{tier} task starts while they and its "
        f"{own:,} prompt tokens no cache holds stay within {factor:g}× "
        "(`admission.open_task_kv_by_tier`), so that returning conversations keep their "
        f"cache: nothing was spent, it waits {retry_after:g} s",
        retry_after=retry_after,
        retryable=True,
    )


def no_fit(
    decision: Decision,
    verdicts: dict[int, Estimate | Filter],
    replicas: list[ReplicaState],
    config: SchedulerConfig,
) -> Refusal:
    """Explain why no replica fits: the furthest filter any replica reached decides.

    `verdicts` holds every replica's verdict.
    """
    spec = decision.spec
    counts: Counter[Filter] = Counter()
    open_waits: list[float] = []
    for state in replicas:
        found = verdicts[state.rid]
        if isinstance(found, Filter):
            counts[found] += 1
            if found is Filter.CIRCUIT_OPEN:
                open_waits.append(state.breaker.seconds_until_half_open(decision.now))
    furthest = max(counts, key=FILTER_ORDER.index)
    summary = ", ".join(
        f"{counts[f]} {f.value.replace('_', ' ')}" for f in FILTER_ORDER if counts[f]
    )
    retry_after: float | None = None
    retryable = False
    request = decision.request
    if furthest is Filter.CIRCUIT_OPEN:
        retry_after = max(0.0, min(open_waits, default=config.circuit.cooldown_s))
        retryable = True
        message = (
            f"every replica that could serve {spec.name} has an open circuit breaker "
            f"({summary}); the next probe is allowed in {retry_after:.1f} s"
        )
    elif furthest is Filter.MEMORY:
        retry_after = config.memory.saturated_retry_after_s
        retryable = True
        message = (
            f"every replica's KV cache is too full for {request.prompt_tokens} + "
            f"{request.max_output_tokens} tokens of {spec.name} without preempting running "
            f"calls ({summary})"
        )
    elif furthest is Filter.DEADLINE:
        message = (
            f"no replica can run {spec.name} within the task's remaining "
            f"{seconds(request.deadline_s_remaining or 0.0)} before its deadline ({summary}); "
            "a fallback model, fewer output tokens or a longer deadline would help"
        )
    elif furthest is Filter.SPEND:
        message = (
            f"the call would take the task over its spend cap of "
            f"${format_usd(request.budget_micros or 0, 4)} (spent "
            f"${format_usd(request.spent_micros, 4)}) on every replica ({summary})"
        )
    elif furthest is Filter.NOT_WARM:
        message = (
            f"no replica holds {spec.name}'s weights"
            + ("" if config.allow_cold_start else " and cold starts are disabled")
            + f" ({summary})"
        )
    elif furthest is Filter.TOO_SMALL:
        message = (
            f"{request.prompt_tokens} + {request.max_output_tokens} tokens do not fit any "
            f"replica's KV cache for {spec.name} ({summary})"
        )
    elif furthest is Filter.DOWN:
        retry_after = DOWN_RETRY_AFTER_S
        retryable = True
        message = f"every replica that could serve {spec.name} is down ({summary})"
    else:
        message = f"every replica that could serve {spec.name} is excluded ({summary})"
    return refusal(
        decision,
        _FILTER_REASON[furthest],
        message,
        retry_after=retry_after,
        retryable=retryable,
        rejections={f.value: n for f, n in counts.items()},
    )


def fallback_would_fit(primary: Refusal, fallback: str) -> Refusal:
    """The model's refusal, naming the fallback the request did not allow."""
    return primary.model_copy(
        update={
            "alternative_model": fallback,
            "message": f"{primary.message}; the fallback {fallback} would fit "
            "(the request does not allow fallback)",
        }
    )


def fallbacks_failed(primary: Refusal, failed: list[str]) -> Refusal:
    """The model's refusal, with why each fallback did not fit either."""
    return primary.model_copy(
        update={
            "message": f"{primary.message}; the fallback does not fit either ("
            + "; ".join(failed)
            + ")"
        }
    )


def tenant_refusal(
    request: PlacementRequest,
    tenant: Tenant,
    reason: RefusalReason,
    message: str,
    retry_after: float | None = None,
) -> Refusal:
    """A refusal for the tenant rather than the model: retryable when it says when."""
    return Refusal(
        reason=reason,
        message=message,
        model=request.model,
        tenant=tenant.name,
        retry_after_s=retry_after,
        retryable=retry_after is not None,
    )


# The reason line is built for every placement: its numbers are rounded with integer
# arithmetic, which costs a fraction of float formatting.


def seconds(value: float) -> str:
    """1.234 → "1.2 s", 0.042 → "42 ms" (rounded half up)."""
    if value < 0.1:
        return f"{int(value * 1000 + 0.5)} ms"
    tenths = int(value * 10 + 0.5)
    return f"{tenths // 10}.{tenths % 10} s"


def tokens(count: int) -> str:
    """3100 → "3.1k", 512 → "512" (rounded half up)."""
    if count < 1000:
        return str(count)
    hundreds = (count + 50) // 100
    return f"{hundreds // 10}.{hundreds % 10}k"

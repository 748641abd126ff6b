"""The scheduler's wire types: what a placement asks, what it answers, and what is observed.

These types cross Temporal as activity inputs and outputs (pydantic data converter): pydantic
models, and `Placement`, a dataclass pydantic validates when it reads one. They hold plain
types only: `str`, `int`, `float` seconds, integer micro-dollars and
`list[int]` block hashes.

`Scheduler.place` returns either a `Placement` or a `Refusal`; it never raises for a request
that is well formed but cannot be served. It raises `PlacementInputError` (a `ValueError`) only
for a request that can never be served as written (unknown model or tenant).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

BlockHash = Annotated[int, Field(ge=0, lt=1 << 64)]
"""A 64-bit block hash (`kvflow.scheduler.blocks.hash_block`)."""


TIER_PRIORITY_SPAN = 10**13
"""Engine priorities of one tier span this many milliseconds of task start (about 317 years
from the epoch), so that every tier-1 call sorts before every tier-2 call."""


def engine_priority(tier: int, task_started_at: float | None) -> int:
    """The engine priority of a call (lower first): tier first, then task-level FCFS.

    `tier · 10¹³ + the task's start in POSIX milliseconds`, so that an engine scheduling by
    priority (vLLM `--scheduling-policy priority`) serves a tier's oldest task first: a task
    deep into its work finishes before a newer one of the same tier takes its place (the
    program-level order of Continuum and, by arrival, of Autellix). A task that did not say
    when it began sorts last in its tier.
    """
    if task_started_at is None:
        started_ms = TIER_PRIORITY_SPAN - 1
    else:
        started_ms = min(TIER_PRIORITY_SPAN - 1, max(0, int(task_started_at * 1000)))
    return tier * TIER_PRIORITY_SPAN + started_ms


RETENTION_BY_TIER = (90, 80, 70, 60, 50)
"""KV retention priority (TensorRT-LLM's 0–100, default 35) of a paused conversation, by
tier: a higher tier's conversation is evicted after a lower tier's."""
RETENTION_PAUSE_MULTIPLE = 2.0
"""A paused conversation keeps its retention for this many times its expected pause."""
MIN_RETENTION_S = 5.0


def kv_retention(tier: int, expected_pause_s: float | None) -> tuple[int, float | None]:
    """The KV retention a call asks the engine for: (priority, seconds it holds after the call).

    Evict the conversation that returns last: a paused conversation outranks the engine's
    default (35) by its tier (`RETENTION_BY_TIER`) for `RETENTION_PAUSE_MULTIPLE` × the
    pause its workflow type's tools usually take (at least `MIN_RETENTION_S`); past that it is
    overdue, falls back to the default, and goes before every conversation still expected
    back (a finished task's conversation never comes back, so it is the first of those).
    Without an expected pause the priority holds until the blocks are evicted. The blocks
    stay free in the engine's accounting: retention orders eviction, it does not pin, so it
    never reads as load to a scheduler.
    """
    priority = RETENTION_BY_TIER[min(max(tier, 1), 5) - 1]
    if expected_pause_s is None:
        return priority, None
    return priority, max(MIN_RETENTION_S, RETENTION_PAUSE_MULTIPLE * expected_pause_s)


class PlacementInputError(ValueError):
    """A placement request that no fleet state could serve: fix the request or the fleet."""


class _Wire(BaseModel):
    """A type that crosses a task queue or a process: read by another release during a rollout."""

    # Ignore, not forbid: a field a newer release adds must not fail an older reader.
    model_config = ConfigDict(extra="ignore", frozen=True)


class _Recorded(BaseModel):
    """A type recorded in workflow history (a local activity's result), so it must evolve.

    A history is replayed by whatever version runs the workflow next: unknown fields (from a
    newer writer) are ignored, and every field added later needs a default (for older ones).
    """

    model_config = ConfigDict(extra="ignore", frozen=True)


class PlacementRequest(_Wire):
    """One model call to place, with what the workflow knows about its task."""

    model: str = Field(min_length=1, description="the model asked for")
    block_hashes: list[BlockHash] = Field(
        default_factory=list,
        description=(
            "hash chain of the prompt's full blocks (`scheduler.blocks.block_hashes` with the "
            "scheduler's block size)"
        ),
    )
    prompt_tokens: int = Field(ge=0, description="estimated prompt length in tokens")
    max_output_tokens: int = Field(ge=0, description="estimated output length in tokens")
    tenant: str = Field(min_length=1)
    deadline_s_remaining: float | None = Field(
        default=None, description="seconds left for the whole task; None when it has no deadline"
    )
    step_deadline_s_remaining: float | None = Field(
        default=None,
        description=(
            "seconds left for this call under the task's per-step objective "
            "(`TaskSpec.step_slo_s`); None when the task declares none"
        ),
    )
    steps_remaining: int = Field(default=1, ge=1, description="model calls left, this one included")
    previous_replica: str | None = Field(
        default=None, description="the replica that served this workflow's previous call"
    )
    spent_micros: int = Field(default=0, ge=0, description="the task's spend so far")
    budget_micros: int | None = Field(
        default=None, ge=0, description="the task's spend cap; this call must fit under it"
    )
    exclude: list[str] = Field(
        default_factory=list, description="replicas not to use (e.g. ones that just failed)"
    )
    workflow_id: str = Field(default="", description="for stickiness and the rendezvous key")
    queued_s: float = Field(
        default=0.0,
        ge=0,
        description=(
            "seconds this call has waited for admission so far (refusals with a retry-after): "
            "past its tier's `admission.max_wait_s_by_tier` it is admitted at any load"
        ),
    )
    task_started_at: float | None = Field(
        default=None,
        description=(
            "when the task began (POSIX seconds): orders its calls in the engine behind older "
            "tasks of the same tier (`Placement.engine_priority`); None sorts last"
        ),
    )
    steps_done: int = Field(
        default=0,
        ge=0,
        description=(
            "model calls the task has completed: at 0 the whole task is admitted or refused "
            "(`LatencyConfig.task_admission`)"
        ),
    )
    expected_tool_s: float = Field(
        default=0.0,
        ge=0,
        description=(
            "tool time the task still expects before its deadline (declared, or learned from "
            "its workflow type's history); part of the whole task's estimate at its first step"
        ),
    )
    attempt: int = Field(default=1, ge=1, description="1, or 2+ when this call is re-placed")
    task_retries: int = Field(
        default=0, ge=0, description="re-placements the task made before this request"
    )
    allow_fallback: bool = Field(
        default=True, description="the scheduler may degrade to the model's fallback"
    )
    after_control_plane_fault: bool = Field(
        default=False,
        description=(
            "the call is re-placed because an outage of Temporal cut it "
            "(`ObservationVerdict.control_plane_fault`): it spends no retry budget"
        ),
    )


@dataclass(slots=True)
class Placement:
    """Where a model call goes, what it is expected to cost and take, and why.

    A plain dataclass, not a pydantic model like the other wire types: the scheduler builds one
    per decision from values it computed itself, and validating 22 fields it already knows
    would cost an eighth of a decision. Pydantic still validates it (types and the bounds
    below) wherever it is read back from JSON, as Temporal's pydantic converter does.

    Recorded in history (inside `PlaceAnswer`): unknown fields are ignored on read, and a
    field added later must come last and have a default, so histories recorded before it
    still replay.
    """

    __pydantic_config__ = ConfigDict(extra="ignore")

    replica: Annotated[str, Field(description='e.g. "h200/1"')]
    task_queue: Annotated[str, Field(description="the GPU worker's task queue")]
    pool: str
    gpu: Annotated[str, Field(description="GPU generation, e.g. H200")]
    model: Annotated[str, Field(description="the model to call (the fallback when degraded)")]
    degraded_from: Annotated[
        str | None, Field(description="the model asked for, when `model` is its fallback")
    ]
    block_size: Annotated[int, Field(ge=1, description="the replica's KV block size in tokens")]
    expected_cached_tokens: Annotated[int, Field(ge=0)]
    est_queue_wait_s: float
    est_ttft_s: Annotated[
        float, Field(description="queue wait + cold load + prefill of uncached tokens")
    ]
    est_duration_s: Annotated[float, Field(description="TTFT + decode of the estimated output")]
    est_cost_micros: Annotated[int, Field(ge=0)]
    p_success: Annotated[
        float, Field(ge=0, le=1, description="estimated probability that the call succeeds")
    ]
    step_budget_s: Annotated[
        float | None, Field(description="the share of the deadline this step may use")
    ]
    priority_key: Annotated[int, Field(ge=1, le=5, description="Temporal priority (tenant tier)")]
    fairness_key: Annotated[str, Field(description="Temporal fairness key (the tenant)")]
    fairness_weight: float
    schedule_to_start_s: float
    cold_start: Annotated[bool, Field(description="the replica must load the model first")]
    probe: Annotated[bool, Field(description="a half-open circuit's trial call")]
    rendezvous: Annotated[
        bool, Field(description="no replica held the prefix; chosen by rendezvous hashing")
    ]
    reason: Annotated[str, Field(description="one line a human reads in the Temporal UI")]
    engine_priority: Annotated[
        int | None,
        Field(
            description=(
                "vLLM's request `priority` (lower first): the tier, then the task's start, so "
                "that an engine scheduling by priority serves tier 1 first and, within a tier, "
                "the oldest task first; None in placements recorded before it existed"
            )
        ),
    ] = None


class RefusalReason(StrEnum):
    """Why nothing could be placed."""

    OVER_BUDGET = "over_budget"
    """The call would take the task over its spend cap on every replica."""
    DEADLINE = "deadline"
    """No replica can finish the call within the step's share of the deadline."""
    MODEL_NOT_WARM = "model_not_warm"
    """No replica serves the model (and no fallback or cold load is possible)."""
    TENANT_OVER_QUOTA = "tenant_over_quota"
    """The tenant has used its daily budget."""
    ALL_CIRCUITS_OPEN = "all_circuits_open"
    """Every replica that could serve the call has an open circuit breaker."""
    RETRY_BUDGET_EXHAUSTED = "retry_budget_exhausted"
    """The task or the tenant has no re-placements left."""
    SATURATED = "saturated"
    """The fleet is too full for this tenant's tier, or every KV cache is too full."""
    NO_REPLICA = "no_replica"
    """Every replica is excluded, down, or too small for the request."""
    OVERLOADED = "overloaded"
    """At the task's first step: at the fleet's load the whole task would miss its deadline,
    or its first step its per-step objective, though on an idle fleet it would not. Nothing
    was spent; start the task again after `retry_after_s`. Final for the task (waiting would
    spend its deadline)."""


class Refusal(_Recorded):
    """Nothing fits: why, in words and as a code, and the best alternative when there is one.

    Recorded in history (inside `PlaceAnswer`): see `_Recorded` for how it may change.
    """

    reason: RefusalReason
    message: str = Field(description="what is wrong and what would help, for an operator")
    model: str
    tenant: str
    alternative_model: str | None = Field(
        default=None, description="a fallback model that would fit (when fallback was not allowed)"
    )
    retry_after_s: float | None = Field(
        default=None, description="seconds after which the same request may fit"
    )
    retryable: bool = Field(
        description="whether the same request may be placed later (after `retry_after_s`)"
    )
    rejections: dict[str, int] = Field(
        default_factory=dict, description="replicas turned down, by filter"
    )


class Observation(_Wire):
    """How one call on a replica ended, for estimates, circuit breakers and tenant spend."""

    replica: str
    model: str
    tenant: str
    ok: bool
    replica_fault: bool = Field(
        default=True,
        description=(
            "False for a failure caused by the request itself (bad input, cancelled): it does "
            "not count against the replica's circuit"
        ),
    )
    error: str | None = Field(default=None, description="error type, for logs")
    queue_s: float | None = Field(default=None, ge=0)
    ttft_s: float | None = Field(default=None, ge=0, description="includes the queue wait")
    duration_s: float | None = Field(default=None, ge=0, description="whole call")
    late: bool | None = Field(
        default=None,
        description=(
            "the call ended past its step's objective (`TaskSpec.step_slo_s`), or was cut "
            "there; None when the task declares none. A late tier-1 call turns on "
            "`admission.headroom_by_tier`"
        ),
    )
    prompt_tokens: int = Field(default=0, ge=0)
    cached_tokens: int = Field(default=0, ge=0)
    completion_tokens: int = Field(default=0, ge=0)
    cost_micros: int = Field(default=0, ge=0, description="billed for this attempt")
    probe: bool = Field(
        default=False,
        description=(
            "the placement was a half-open probe (`Placement.probe`): only probes decide whether "
            "a half-open circuit closes"
        ),
    )
    cold_start: bool = Field(
        default=False,
        description="the placement was a cold start: its TTFT includes the model load",
    )
    dispatched_at: float | None = Field(
        default=None,
        description="when the workflow sent the call to the replica's queue (epoch seconds)",
    )
    ended_at: float | None = Field(
        default=None, description="when the workflow learned how it ended (epoch seconds)"
    )
    control_plane_fault: bool = Field(
        default=False,
        description=(
            "the call failed because the control plane could not reach Temporal (an outage): "
            "it counts against neither the replica's circuit nor the tenant's retries"
        ),
    )


class ObservationVerdict(_Recorded):
    """What the control plane made of how a call ended: the `observe` activity's answer.

    Recorded in history: see `_Recorded` for how it may change. Histories recorded before the
    activity answered hold None in its place.
    """

    control_plane_fault: bool = Field(
        default=False,
        description="an outage of Temporal, not the replica, failed the call (`Observation`)",
    )


class ReplicaStatus(_Wire):
    """What the scheduler knows about one replica, for status pages and logs."""

    replica: str
    pool: str
    gpu: str
    task_queue: str
    up: bool
    circuit: str = Field(description="closed, open or half_open")
    warm_models: list[str]
    kv_cache_usage: float
    running: int
    waiting: int
    inflight: int = Field(description="calls this scheduler placed that have not reported back")
    block_size: int | None
    num_gpu_blocks: int | None
    blocks_indexed: int = Field(
        description="prefix-index entries of the replica (one per `index_stride` blocks)"
    )
    precise: bool = Field(description="the prefix index is fed by the engine's KV events")


class ReplicaScore(_Wire):
    """How one replica scores for one request: its objective, or the filter that rejects it."""

    replica: str
    objective: float | None = Field(
        description="expected cost per successful call, as the scheduler ranks it; None if rejected"
    )
    rejected_by: str | None = Field(
        default=None, description="the first filter the replica fails, e.g. deadline"
    )
    cold_start: bool = Field(
        default=False, description="the replica would load the model first (tried last)"
    )

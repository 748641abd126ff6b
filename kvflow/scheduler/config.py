"""Weights and thresholds of the scheduler, one pydantic model per concern.

Every number the placement policy uses lives here with its default and what it means, so an
operator tunes placement in configuration rather than in code. The defaults follow the systems
kvflow is measured against where they publish one (SGLang's circuit breaker: open after 5
consecutive failures, half-open after 30 s, closed after 2 successes) and are otherwise chosen
to be conservative.
"""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SpeedConfig(_Config):
    """The roofline speed model used until a replica has reported its own timings.

    prefill seconds = 2 · parameters · uncached tokens / (TFLOP/s · GPUs · `prefill_mfu`)
    decode seconds per token = weight bytes / (bandwidth · GPUs · `decode_bandwidth_efficiency`)
    """

    prefill_mfu: float = Field(
        default=0.4, gt=0, le=1, description="fraction of peak BF16 FLOP/s prefill reaches"
    )
    decode_bandwidth_efficiency: float = Field(
        default=0.6, gt=0, le=1, description="fraction of peak memory bandwidth decode reaches"
    )
    weight_bytes_per_parameter: float = Field(default=2.0, gt=0, description="2 for BF16")
    ttft_overhead_s: float = Field(
        default=0.02, ge=0, description="fixed cost of a request before its first token"
    )
    decode_batch_slowdown: float = Field(
        default=0.5,
        ge=0,
        description="time per output token grows by this factor at full concurrency",
    )
    ewma_alpha: float = Field(
        default=0.2, gt=0, le=1, description="weight of the newest observation in the EWMAs"
    )
    observation_clamp: float = Field(
        default=1e4,
        gt=1,
        description=(
            "a measured time per token counts within [roofline / clamp, roofline · clamp], so "
            "one absurd report cannot wreck an estimate"
        ),
    )
    default_service_s: float = Field(
        default=5.0,
        gt=0,
        description="mean call duration assumed for queue estimates before any is observed",
    )
    load_bandwidth_gbps: float = Field(
        default=2.0, gt=0, description="GB/s at which a cold replica reads model weights"
    )
    load_overhead_s: float = Field(
        default=20.0, ge=0, description="engine start-up time of a cold model load"
    )
    output_min_observations: int = Field(
        default=5,
        ge=1,
        description=(
            "finished calls of a model (and tenant) before their mean output length replaces "
            "max_tokens in time and cost estimates; memory and context checks keep max_tokens"
        ),
    )


class WeightsConfig(_Config):
    """Multiplicative preferences applied to a replica's expected cost per success.

    A replica's objective is multiplied by `(1 + queue · load fraction)`,
    `(1 + kv_usage · KV-cache usage)` and `(1 + cold_start)` when it must load the model; the
    workflow's previous replica is multiplied by `(1 − sticky)`. Unset, `kv_usage` is derived
    per pool (`MemoryHeadroom` in `kvflow.scheduler.axes`).
    """

    queue: float = Field(default=0.5, ge=0, description="weight of running+waiting / slots")
    kv_usage: float | None = Field(
        default=None,
        ge=0,
        description=(
            "weight of KV-cache usage (0..1); unset, each pool's KV-cache bytes over its "
            "model's weight bytes (what a full cache adds to a decode step's reads)"
        ),
    )
    cold_start: float = Field(default=1.0, ge=0, description="penalty for loading weights")
    sticky: float = Field(
        default=0.1, ge=0, lt=1, description="discount for the workflow's previous replica"
    )
    sunk_cost: float = Field(
        default=0.5,
        ge=0,
        description=(
            "share of the task's spend so far that a failure of this call is assumed to waste "
            "(λ in (cost + λ·spent·(1−p)) / p)"
        ),
    )


class MemoryConfig(_Config):
    """When a replica's KV cache is too full for a request (it would preempt others)."""

    reserve_fraction: float = Field(
        default=0.05,
        ge=0,
        lt=1,
        description="share of a replica's KV blocks kept free for running requests to grow",
    )
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0, le=1, description="as vLLM's flag; sizes the KV cache before scraping"
    )
    saturated_retry_after_s: float = Field(
        default=2.0, gt=0, description="retry-after of a refusal because every cache is full"
    )
    max_wait_s: float | None = Field(
        default=0.0,
        ge=0,
        description=(
            "how long a call waits for a replica with free KV blocks (`PlacementRequest."
            "queued_s`, refused with `saturated_retry_after_s` meanwhile) before it is placed "
            "on one whose cache would hold it empty, where its engine queues it until blocks "
            "free, in the engine's own order. 0: at once; None: refused until it fits"
        ),
    )
    count_shared_reads: bool = Field(
        default=True,
        description=(
            "weigh the KV that this scheduler's calls in flight read, each call its whole "
            "context, where it exceeds the cache's usage (which counts a block many calls "
            "share once): a decode step reads a shared block once per call"
        ),
    )


class LatencyConfig(_Config):
    """How much of a task's remaining deadline one step may use, and how risky a tight fit is.

    step budget = min(remaining, `step_share_multiplier` · remaining / steps remaining)
    P(on time) = 1 / (1 + (estimate / step budget) ^ `deadline_shape`)
    """

    step_share_multiplier: float = Field(
        default=1.5,
        ge=1,
        description="a step may use this multiple of an even share of the remaining deadline",
    )
    deadline_shape: float = Field(
        default=4.0,
        gt=0,
        description="shape of the log-logistic run-time distribution; larger = estimates trusted",
    )
    schedule_to_start_margin_s: float = Field(
        default=5.0, gt=0, description="added to twice the queue estimate for schedule_to_start"
    )
    min_schedule_to_start_s: float = Field(default=1.0, gt=0)
    max_schedule_to_start_s: float = Field(default=300.0, gt=0)
    task_admission: bool = Field(
        default=False,
        description=(
            "refuse a task at its first step, before it spends, when the fleet's load and not "
            "the task itself makes it miss its deadline or its first step's objective "
            "(`RefusalReason.OVERLOADED`). Off by default: the refusal is only as good as the "
            "duration estimate, and on the overload benchmark the estimate refused tasks "
            "that would have finished (benchmarks/README.md)"
        ),
    )
    task_admission_margin: float = Field(
        default=1.0,
        gt=0,
        description=(
            "a task is refused when its estimate exceeds this multiple of its remaining "
            "deadline: above 1 refuses only the tasks that miss by more"
        ),
    )


class CircuitBreakerConfig(_Config):
    """Per-replica circuit breaker: closed → open → half-open → closed."""

    consecutive_failures: int = Field(
        default=5, ge=1, description="failures in a row that open the circuit"
    )
    error_rate: float = Field(
        default=0.5, gt=0, le=1, description="failure share over the window that opens it"
    )
    window_s: float = Field(default=60.0, gt=0, description="the error-rate window")
    min_calls_in_window: int = Field(
        default=10, ge=1, description="calls needed in the window before the rate counts"
    )
    cooldown_s: float = Field(default=30.0, gt=0, description="open time before a probe")
    half_open_successes: int = Field(
        default=2, ge=1, description="probe successes that close the circuit again"
    )
    half_open_probes: int = Field(
        default=1, ge=1, description="calls allowed at once while half-open"
    )
    half_open_success_probability: float = Field(
        default=0.5, gt=0, le=1, description="P(success) assumed for a half-open replica"
    )
    prior_successes: float = Field(
        default=10.0,
        gt=0,
        description=(
            "pseudo-successes added to a replica's window: P(ok) = (ok + prior) / (calls + prior)"
        ),
    )


class RetryBudgetConfig(_Config):
    """Limits on re-placements, so a failing fleet cannot multiply spend."""

    max_task_retries: int = Field(
        default=3, ge=0, description="re-placements one task may make in total"
    )
    tenant_retry_fraction: float = Field(
        default=0.2, ge=0, le=1, description="retries a tenant may make per call over the window"
    )
    tenant_min_retries: int = Field(
        default=10, ge=0, description="retries always allowed per window (small tenants)"
    )
    tenant_window_s: float = Field(default=60.0, gt=0)


class LivenessConfig(_Config):
    """How the control plane tells that a replica's GPU worker, or Temporal itself, is gone.

    A replica serves calls only while its engine answers and a GPU worker polls its task queue.
    The worker is taken to be missing when a call waited on the queue, for `worker_stall_s` in
    Temporal's backlog or until its schedule-to-start timeout, while no worker polled the queue
    and the replica's engine ran and queued nothing: a live worker with a free slot takes a
    call within milliseconds, and one whose slots are all busy keeps its engine busy. The
    replica is up again once a worker polls the queue after that.

    Detection delay: at the schedule-to-start timeout of the first call the dead worker leaves
    waiting (the queue is described at once then), or, when that timeout is longer,
    `worker_stall_s` + up to 5 s (Temporal refreshes its backlog figures about every 5 s) +
    up to `worker_check_interval_s`. Until then calls keep being placed on the replica.

    Temporal itself: the control plane checks the server's health every
    `server_probe_interval_s`. A call that Temporal timed out (schedule-to-start, heartbeat,
    start-to-close) while it was out during an outage the probes saw, ending at most
    `outage_grace_s` after the outage, is the control plane's fault: it opens no replica's
    circuit and its re-placement spends no retry budget, but it is billed.
    """

    worker_check_interval_s: float = Field(
        default=5.0, gt=0, description="seconds between two DescribeTaskQueue of every replica"
    )
    worker_stall_s: float = Field(
        default=3.0,
        gt=0,
        description="how long the oldest call in a replica's backlog may wait unpolled",
    )
    server_probe_interval_s: float = Field(
        default=1.0,
        gt=0,
        description=(
            "seconds between two health checks of Temporal by the control plane; shorter than "
            "the inference heartbeat timeout (2 s), so an outage that cuts calls is seen"
        ),
    )
    outage_grace_s: float = Field(
        default=30.0,
        ge=0,
        description=(
            "how long after an outage of Temporal ended a timeout of a call that was out during "
            "it is still put down to it (timers fire, workers reconnect, workflows catch up)"
        ),
    )
    outage_memory_s: float = Field(
        default=3600.0, gt=0, description="how long the control plane remembers an outage"
    )


class PrefixConfig(_Config):
    """The prefix index and the rendezvous fallback."""

    block_size: int = Field(
        default=16,
        ge=1,
        description=(
            "tokens per block of the hashes in a PlacementRequest; must divide every engine's "
            "block size for KV events to be matched"
        ),
    )
    index_stride: int = Field(
        default=4,
        ge=1,
        description=(
            "index every n-th block of a prompt: matches are exact to n blocks (64 tokens by "
            "default) and the index does n times less work and holds n times fewer entries"
        ),
    )
    speculative_ttl_s: float = Field(
        default=10.0,
        gt=0,
        description="how long a placement's blocks count as cached before a KV event confirms",
    )
    eviction_slack: float = Field(
        default=0.25,
        ge=0,
        description=(
            "a replica's index entries may exceed its cache size by this fraction between two "
            "scrapes: placements only add entries, and each scrape of the replica evicts the "
            "excess, so eviction stays off the decision path"
        ),
    )
    default_capacity_blocks: int = Field(
        default=200_000,
        ge=1,
        description="LRU size of a replica's index entries before its cache size is scraped",
    )
    rendezvous_prefix_blocks: int = Field(
        default=4,
        ge=1,
        description="the rendezvous key is the hash of this many leading blocks (or fewer)",
    )
    rendezvous_tolerance: float = Field(
        default=0.25,
        ge=0,
        description="replicas within this share of the best objective are rendezvous candidates",
    )
    bounded_load_factor: float = Field(
        default=1.25,
        ge=1,
        description=(
            "a rendezvous pick may hold at most this multiple of the mean load (and at least "
            "affinity_min_load calls)"
        ),
    )
    affinity_load_factor: float = Field(
        # 1.25 rather than 1.5: on the policy benchmark's hotspot, agent and heterogeneous
        # workloads (seeds 0 and 1) the busiest replica fell from 1.77–2.51× to 1.55–2.17× the
        # mean, cost per successful task within -3.3%..+1.1% (benchmarks/README.md).
        default=1.25,
        ge=1,
        description=(
            "a prefix holder with more than this multiple of the mean load (and more than "
            "affinity_min_load calls) is passed over for the best replica within the bound"
        ),
    )
    affinity_load_factor_with_objective: float = Field(
        # A call whose step must end by an objective waits on every decode step of its
        # batch, and a batch above the mean decodes each token slower. On the policy
        # benchmark's overload (every step due within its tier's allowance, 1.5x capacity),
        # 1.0 here against 1.25 kept tier 1 in time on 98.3% of tasks against 97.4% over seeds
        # 0-19 (paired: +0.9 points [-0.0, +1.8]), at 0.999x the cost; the tier-1 tasks lost
        # were each one long answer decoding beside 10-16 sequences on a replica above the
        # mean, which was still taking new tasks (benchmarks/README.md).
        # Continuing conversations stay put under `affinity_keeps_conversation`: moving
        # them instead cost 1.06-1.18x and lost more tier-1 tasks than it saved.
        default=1.0,
        ge=1,
        description=(
            "affinity_load_factor for calls whose step has an objective "
            "(`PlacementRequest.step_deadline_s_remaining`): such a call leaves a prefix "
            "holder above this multiple of the mean load for the best replica within it"
        ),
    )
    affinity_min_load: int = Field(
        default=8,
        ge=1,
        description="calls a replica may hold before the affinity load bound applies",
    )
    affinity_keeps_conversation: bool = Field(
        # Moving a conversation recomputes all of it on the new replica and leaves a dead copy
        # on the old one, on every call the bound moves; spreading a shared prefix copies it
        # once. On the policy benchmark's agent workload at 0.8x the bound moved 3-5% of
        # conversations' calls, which cost 3-4% per successful task (benchmarks/README.md).
        default=True,
        description=(
            "the workflow's previous replica keeps its calls past the affinity load bound while "
            "its engine has a free slot and no call waiting; the bound still spreads new tasks"
        ),
    )
    search_width: int | None = Field(
        default=None,
        ge=1,
        description=(
            "most replicas one decision examines, best-first by a lower bound on their "
            "objective; the search usually stops well before, when no replica left can beat "
            "the best found. None: one in 16 of the fleet's replicas, at least 16. Measured by "
            "`kvflow bench scheduler` (placement quality): that misses the best-scoring "
            "replica in about 1 decision in 100 at 64 to 1,024 replicas, where a fixed 16 "
            "missed it in 1 in 7 at 1,024 and a cap of 4 scored replicas in 1 in 11 at 64"
        ),
    )
    remembered_workflows: int = Field(
        default=65_536, ge=0, description="workflows whose last replica is remembered"
    )


class AdmissionConfig(_Config):
    """Admission under saturation: low tiers wait before high tiers do.

    A tenant of tier t is refused (with a retry-after) when the load fraction of the replicas
    serving the model, (running + waiting) / slots, is at least `saturation_by_tier[t − 1]`,
    until the call has waited `max_wait_s_by_tier[t − 1]` (then it is admitted at any load).
    """

    saturation_by_tier: tuple[float, float, float, float, float] = (4.0, 2.0, 1.5, 1.25, 1.0)
    retry_after_s: float = Field(default=2.0, gt=0)
    max_wait_s_by_tier: tuple[float, float, float, float, float] = Field(
        default=(5.0, 10.0, 10.0, 30.0, 60.0),
        description=(
            "a call that has waited this long for admission (`PlacementRequest.queued_s`) is "
            "admitted at any load: waiting keeps a lower tier's calls out of the batches that "
            "slow a higher tier's, and this bound keeps its own steps from running out of time"
        ),
    )

    headroom_by_tier: tuple[float, float, float, float, float] | None = Field(
        default=None,
        description=(
            "the thresholds used instead of `saturation_by_tier` for `headroom_hold_s` after a "
            "tier-1 call ended past its step's objective (`Observation.late`): lower tiers "
            "then wait while the replicas are busy, so that they do not slow tier 1's steps. "
            "None: never"
        ),
    )
    headroom_hold_s: float = Field(
        default=60.0,
        gt=0,
        description=(
            "how long `headroom_by_tier` holds after the last late tier-1 call (or the last "
            "tier-1 call with a step objective, with `headroom_for_step_objectives`)"
        ),
    )
    headroom_for_step_objectives: bool = Field(
        default=False,
        description=(
            "also hold `headroom_by_tier` for `headroom_hold_s` after a tier-1 call with a "
            "step objective (`PlacementRequest.step_deadline_s_remaining`) is placed: while "
            "latency-sensitive tier-1 work runs, lower tiers keep out of its batches before a "
            "burst makes it late, rather than after"
        ),
    )
    running_task_tiers: int = Field(
        default=0,
        ge=0,
        le=4,
        description=(
            "a call of a task that has completed a step is admitted as if its tier were this "
            "many tiers better (at best tier 1): under saturation new tasks wait before tasks "
            "that have already spent (sunk cost). 0: every call by its own tier"
        ),
    )

    open_task_kv_by_tier: tuple[float, float, float, float, float] | None = Field(
        default=None,
        description=(
            "admission before a KV collapse: a new task of tier t waits at its first step "
            "(`RefusalReason.SATURATED`, retryable after `open_task_retry_after_s`) while the "
            "KV its model's open tasks will come back to (each task's last prompt and expected "
            "output, less the prefix its first call found cached: a shared system prompt "
            "counts once), with its own uncached prompt, exceeds this multiple of the KV cache "
            "of the replicas warm for the model (looser by `open_task_kv_slack` until one "
            "waits). Past a multiple, conversations returning from their tools find their KV "
            "evicted, recompute it and evict each other's: tasks already running slow down "
            "and fail having spent. A task counts from its first call until it ends "
            "(`Scheduler.end_task`, which the workflow calls as it closes, by a local "
            "activity on the worker that placed its calls) or places no call for "
            "`open_task_idle_s`, whatever steps it declared. Each scheduler process counts "
            "the tasks it placed. None: never"
        ),
    )
    open_task_kv_slack: float = Field(
        default=1.0,
        ge=1.0,
        description=(
            "`open_task_kv_by_tier` times this is where holding new tasks starts; once one "
            "is held, the multiples themselves apply until `open_task_kv_hold_s` passes "
            "without a task held. At capacity the open tasks' KV swings about its mean and "
            "seldom reaches the looser multiples; past capacity it does at once, and the "
            "tighter ones then keep the caches from thrashing. 1: the multiples always"
        ),
    )
    open_task_kv_hold_s: float = Field(
        default=300.0,
        gt=0,
        description="how long the tighter multiples hold after the last task held",
    )
    open_task_retry_after_s: float = Field(
        default=10.0,
        gt=0,
        description=(
            "the retry-after of a task refused by `open_task_kv_by_tier`: room comes back as "
            "open tasks end, on the scale of a task's lifetime, not of a batch's"
        ),
    )
    open_task_idle_s: float = Field(
        default=900.0,
        gt=0,
        description=(
            "a task that placed no call for this long is no longer counted open "
            "(`open_task_kv_by_tier`): it ended where this scheduler did not hear of it "
            "(another workflow worker wrote its ledger row), or its KV is evicted by now"
        ),
    )
    open_task_check_s: float = Field(
        default=10.0,
        gt=0,
        description=(
            "how often the control plane asks Temporal whether the tasks counted open "
            "(`open_task_kv_by_tier`) that placed no call for this long still run: one "
            "terminated, timed out or ended on another workflow worker stops counting then, "
            "not `open_task_idle_s` after its last call (`kvflow.workers.control_plane."
            "OpenTaskWatch`)"
        ),
    )

    def admission_tier(self, tier: int, steps_done: int) -> int:
        """The tier a call is admitted as: `running_task_tiers` better once its task ran."""
        return max(1, tier - self.running_task_tiers) if steps_done else tier

    @model_validator(mode="after")
    def _tiers_ordered(self) -> Self:
        named = [("saturation_by_tier", self.saturation_by_tier)]
        if self.headroom_by_tier is not None:
            named.append(("headroom_by_tier", self.headroom_by_tier))
        if self.open_task_kv_by_tier is not None:
            named.append(("open_task_kv_by_tier", self.open_task_kv_by_tier))
        for name, thresholds in named:
            if any(t <= 0 for t in thresholds) or list(thresholds) != sorted(
                thresholds, reverse=True
            ):
                raise ValueError(
                    f"{name} must be positive and non-increasing from tier 1 to tier 5 "
                    f"(tier 1 is admitted longest); got {list(thresholds)}"
                )
        return self


DEFAULT_AXES = (
    "warm_weights",
    "replica_health",
    "kv_cache",
    "queue_load",
    "memory_headroom",
    "gpu_generation",
    "latency_budget",
    "tenant_priority",
    "workflow_context",
)
"""The registered axes (`kvflow.scheduler.axes`), in the order they filter and score."""

REQUIRED_AXIS = "warm_weights"
"""The axis every configuration must run (`SchedulerConfig.axes`)."""


class SchedulerConfig(_Config):
    """All of the scheduler's weights and thresholds, with documented defaults."""

    axes: tuple[str, ...] = Field(
        default=DEFAULT_AXES,
        min_length=1,
        description=(
            "the axes a placement runs, in order: a replica is turned down by the first filter "
            "it fails, and an axis reads the estimates of the axes before it (the queue wait "
            "before the GPU's duration, the duration before the deadline, the cost before the "
            "spend cap)"
        ),
    )

    speed: SpeedConfig = SpeedConfig()
    weights: WeightsConfig = WeightsConfig()
    memory: MemoryConfig = MemoryConfig()
    latency: LatencyConfig = LatencyConfig()
    circuit: CircuitBreakerConfig = CircuitBreakerConfig()
    retries: RetryBudgetConfig = RetryBudgetConfig()
    prefix: PrefixConfig = PrefixConfig()
    admission: AdmissionConfig = AdmissionConfig()
    liveness: LivenessConfig = LivenessConfig()
    allow_cold_start: bool = Field(
        default=True,
        description="place on a replica that must load the model when no warm one fits",
    )

    @model_validator(mode="after")
    def _axes_runnable(self) -> Self:
        axes = self.axes
        unknown = [name for name in axes if name not in DEFAULT_AXES]
        if unknown:
            raise ValueError(f"unknown axes {', '.join(unknown)}; known: {', '.join(DEFAULT_AXES)}")
        repeated = sorted({name for name in axes if axes.count(name) > 1})
        if repeated:
            raise ValueError(f"axes listed more than once: {', '.join(repeated)}")
        # The search only ranks replicas that hold or may load the model, and it is this
        # axis that turns the others down; without it a call could land where the model is not.
        if REQUIRED_AXIS not in axes:
            raise ValueError(
                f"axes must include {REQUIRED_AXIS!r}: it keeps calls off replicas that neither "
                "hold nor may load the model's weights (to forbid cold starts set "
                "allow_cold_start = false; to drop their penalty set weights.cold_start = 0)"
            )
        return self

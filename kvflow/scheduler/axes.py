"""The seven axes of placement: one small filter or scorer each, with its formula.

Each class is pure: it reads configuration and the numbers it is given and returns a number or
a yes/no. The methods a placement calls read the configuration values they need from plain
attributes copied at construction: a pydantic model answers every attribute read through a
`__getattr__` hook, several times slower than a plain object, and these run for every replica
scored. `kvflow.scheduler.core.Scheduler` composes them into the objective

    J = (cost + λ · spent · (1 − p)) / p  ×  Π (1 + wₖ · penaltyₖ)  ×  sticky

where `cost` is the call's expected price on the replica (after cached tokens), `p` the
probability that it succeeds in time, `spent` the task's spend so far, and the penalties the
replica's queue, KV-cache usage and cold start. The lowest J among replicas that pass every
filter wins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import ROUND_CEILING
from typing import NamedTuple

from kvflow.scheduler.config import (
    AdmissionConfig,
    LatencyConfig,
    MemoryConfig,
    SpeedConfig,
    WeightsConfig,
)
from kvflow.scheduler.fleet import ExactPrices, ModelSpec, Pool, Tenant, TokenPrices
from kvflow.scheduler.gpus import GPU_PROFILES, GpuGeneration


class Speed(NamedTuple):
    """Seconds per uncached prompt token (prefill) and per output token (decode)."""

    prefill_s_per_token: float
    decode_s_per_token: float


@dataclass(frozen=True, slots=True)
class PoolPrices:
    """A pool's token prices in micro-dollars per token.

    Floats rank replicas; the exact integers (`TokenPrices.exact`) price a placement.
    """

    input: float
    cached_input: float
    output: float
    exact: ExactPrices

    @classmethod
    def of(cls, prices: TokenPrices) -> PoolPrices:
        """Per-token micro-dollar prices of a pool (a $/Mtok price is a µ$/token price)."""
        return cls(
            float(prices.input_per_mtok_usd),
            float(prices.cached_input_per_mtok_usd),
            float(prices.output_per_mtok_usd),
            prices.exact(),
        )

    def cost(self, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> float:
        """(prompt − cached) · input + cached · cached_input + output · output, in µ$."""
        return (
            (prompt_tokens - cached_tokens) * self.input
            + cached_tokens * self.cached_input
            + output_tokens * self.output
        )


class GpuGenerationAxis:
    """Speed of a model on a pool's GPUs: the roofline until observations take over.

    roofline prefill s/token = 2 · parameters / (BF16 FLOP/s · GPUs · prefill_mfu)
    roofline decode s/token  = parameters · bytes per weight / (bandwidth · GPUs · efficiency)

    Observed calls update an EWMA (weight `ewma_alpha`) per replica and per GPU generation;
    an estimate uses the replica's EWMA, else its generation's, else the roofline.

    prefill_s = overhead + uncached tokens · prefill s/token
    decode_s  = output tokens · decode s/token · (1 + decode_batch_slowdown · load fraction)
    """

    def __init__(self, config: SpeedConfig) -> None:
        self.config = config
        self._ttft_overhead_s = config.ttft_overhead_s
        self._decode_batch_slowdown = config.decode_batch_slowdown
        self._roofline: dict[tuple[GpuGeneration, int, str], Speed] = {}
        self._replica: dict[tuple[str, str], Speed] = {}
        self._generation: dict[tuple[GpuGeneration, str], Speed] = {}

    def roofline(self, pool: Pool, model: ModelSpec) -> Speed:
        """The datasheet speed of `model` on one replica of `pool`."""
        key = (pool.gpu, pool.gpus_per_replica, model.name)
        speed = self._roofline.get(key)
        if speed is None:
            profile = GPU_PROFILES[pool.gpu]
            params = model.parameters_b * 1e9
            gpus = pool.gpus_per_replica
            flops = profile.bf16_tflops * 1e12 * gpus * self.config.prefill_mfu
            bandwidth = (
                profile.memory_bandwidth_tbps
                * 1e12
                * gpus
                * self.config.decode_bandwidth_efficiency
            )
            speed = Speed(
                2 * params / flops,
                params * self.config.weight_bytes_per_parameter / bandwidth,
            )
            self._roofline[key] = speed
        return speed

    def speed(self, replica: str, pool: Pool, model: ModelSpec) -> Speed:
        """The best-informed speed: replica EWMA, else generation EWMA, else roofline."""
        speed = self._replica.get((replica, model.name))
        if speed is not None:
            return speed
        speed = self._generation.get((pool.gpu, model.name))
        if speed is not None:
            return speed
        return self.roofline(pool, model)

    def prefill_s(self, speed: Speed, uncached_tokens: int) -> float:
        """Seconds from the start of a call to its first token, without queueing."""
        return self._ttft_overhead_s + uncached_tokens * speed.prefill_s_per_token

    def decode_s(self, speed: Speed, output_tokens: int, load_fraction: float) -> float:
        """Seconds to decode `output_tokens` on a replica at `load_fraction` of its slots."""
        return output_tokens * speed.decode_s_per_token * self.decode_slowdown(load_fraction)

    def decode_slowdown(self, load_fraction: float) -> float:
        """1 + decode_batch_slowdown · load fraction (at most 1): batching slows decode."""
        return 1.0 + self._decode_batch_slowdown * min(load_fraction, 1.0)

    def observe(
        self,
        replica: str,
        pool: Pool,
        model: ModelSpec,
        *,
        uncached_tokens: int,
        prefill_s: float | None,
        output_tokens: int,
        decode_s: float | None,
        load_fraction: float,
    ) -> None:
        """Fold one call's measured prefill and decode times into the EWMAs."""
        base = self.speed(replica, pool, model)
        prefill = base.prefill_s_per_token
        decode = base.decode_s_per_token
        roofline = self.roofline(pool, model)
        clamp = self.config.observation_clamp
        # Clock skew or a cancelled call can report nonsense; only positive times teach, and
        # within a factor of the roofline.
        if prefill_s is not None and prefill_s > 0 and uncached_tokens >= 16:
            prefill = max(0.0, prefill_s - self.config.ttft_overhead_s) / uncached_tokens
            low = roofline.prefill_s_per_token / clamp
            prefill = min(max(prefill, low), roofline.prefill_s_per_token * clamp)
        if decode_s is not None and decode_s > 0 and output_tokens >= 2:
            decode = decode_s / (output_tokens - 1) / self.decode_slowdown(load_fraction)
            low = roofline.decode_s_per_token / clamp
            decode = min(max(decode, low), roofline.decode_s_per_token * clamp)
        alpha = self.config.ewma_alpha

        def blend(old: Speed) -> Speed:
            return Speed(
                old.prefill_s_per_token + alpha * (prefill - old.prefill_s_per_token),
                old.decode_s_per_token + alpha * (decode - old.decode_s_per_token),
            )

        generation_key = (pool.gpu, model.name)
        self._replica[(replica, model.name)] = blend(base)
        self._generation[generation_key] = blend(
            self._generation.get(generation_key) or self.roofline(pool, model)
        )


class QueueLoad:
    """The replica's queue: expected wait and a load penalty.

    load fraction = load / slots, where load = running + waiting (+ calls placed since the
    last scrape) and slots = the pool's `max_concurrency`
    wait_s = (waiting + max(0, running + 1 − slots)) · mean call duration / slots
    penalty = weights.queue · load fraction
    """

    def __init__(self, weights: WeightsConfig, speed: SpeedConfig) -> None:
        self._default_service_s = speed.default_service_s
        self._weight = weights.queue

    def load_fraction(self, load: int, slots: int) -> float:
        """Calls on the replica per slot."""
        return load / slots

    def wait_s(self, running: int, waiting: int, slots: int, service_s: float | None) -> float:
        """Expected seconds before a new call starts on the replica."""
        mean = service_s if service_s is not None else self._default_service_s
        ahead = waiting + max(0, running + 1 - slots)
        return ahead * mean / slots

    def penalty(self, load: int, slots: int) -> float:
        """weights.queue · load / slots."""
        return self._weight * load / slots


class MemoryHeadroom:
    """KV-cache headroom: filter replicas where a request would preempt others.

    need blocks = ⌈(prompt + output) / block size⌉ − cached blocks
    free blocks = total blocks · (1 − usage) − reserve_fraction · total blocks
    admits iff need ≤ free (always, before the cache size is known)
    penalty = weights.kv_usage · usage
    """

    def __init__(self, config: MemoryConfig, weights: WeightsConfig) -> None:
        self._reserve = config.reserve_fraction
        self._weight = weights.kv_usage

    def blocks_needed(
        self, prompt_tokens: int, output_tokens: int, cached_tokens: int, block_size: int
    ) -> int:
        """Blocks the request will allocate beyond those it finds cached."""
        need = -(-(prompt_tokens + output_tokens) // block_size) - cached_tokens // block_size
        # Not max(0, need): the builtin parses keyword arguments on every call, and this runs
        # for every replica scored.
        return need if need > 0 else 0

    def free_blocks(self, total_blocks: int | None, usage: float) -> float | None:
        """Blocks that can be allocated without eating into the reserve; None if unknown."""
        if total_blocks is None:
            return None
        return total_blocks * (1.0 - usage) - self._reserve * total_blocks

    def admits(self, need: int, free: float | None) -> bool:
        """Whether the request fits without preempting running requests."""
        return free is None or need <= free

    def fits(self, need: int, max_blocks: float | None) -> bool:
        """Whether the request fits in the replica's whole cache (even an empty one).

        `max_blocks` is `max_blocks(total)`, computed when the cache size is scraped.
        """
        return max_blocks is None or need <= max_blocks

    def max_blocks(self, total_blocks: int | None) -> float | None:
        """The most blocks one request may take: total · (1 − reserve); None if unknown."""
        if total_blocks is None:
            return None
        return total_blocks * (1 - self._reserve)

    def penalty(self, usage: float) -> float:
        """weights.kv_usage · usage."""
        return self._weight * usage


class KvCacheAxis:
    """Expected cached tokens from the prefix index.

    cached = min(depth · index block size, ⌊(prompt − 1) / engine block⌋ · engine block),
    rounded down to whole engine blocks: vLLM hits come in whole blocks and it always
    computes the prompt's last token.
    """

    def expected_cached_tokens(
        self, depth: int, prompt_tokens: int, index_block_size: int, engine_block_size: int
    ) -> int:
        """Prompt tokens the replica is expected to serve from its cache."""
        if depth <= 0 or prompt_tokens <= 1:
            return 0
        cached = depth * index_block_size
        if cached >= prompt_tokens:  # min(), without the builtin's cost (see blocks_needed)
            cached = prompt_tokens - 1
        return cached // engine_block_size * engine_block_size


class WarmWeights:
    """Warm or cold weights: a cold replica pays the load time.

    load_s = parameters · bytes per weight / load bandwidth + load overhead
    can load iff the weights fit in the replica's GPU memory (× gpu_memory_utilization)
    """

    def __init__(self, speed: SpeedConfig, memory: MemoryConfig) -> None:
        self.speed = speed
        self.memory = memory

    def weight_bytes(self, model: ModelSpec) -> float:
        """Bytes of the model's weights."""
        return model.parameters_b * 1e9 * self.speed.weight_bytes_per_parameter

    def load_s(self, model: ModelSpec) -> float:
        """Seconds for a cold replica to load the model and start serving."""
        return (
            self.weight_bytes(model) / (self.speed.load_bandwidth_gbps * 1e9)
            + self.speed.load_overhead_s
        )

    def can_load(self, pool: Pool, model: ModelSpec) -> bool:
        """Whether the model's weights fit on one replica of the pool."""
        memory = GPU_PROFILES[pool.gpu].memory_gb * 1e9 * pool.gpus_per_replica
        return self.weight_bytes(model) < memory * self.memory.gpu_memory_utilization

    def kv_capacity_blocks(self, pool: Pool, model: ModelSpec, block_size: int) -> int:
        """KV blocks a replica of the pool holds for the model (before scraping says so).

        (GPU memory · utilization − weights) / (KV bytes per token · block size)
        """
        memory = GPU_PROFILES[pool.gpu].memory_gb * 1e9 * pool.gpus_per_replica
        free = memory * self.memory.gpu_memory_utilization - self.weight_bytes(model)
        return max(1, int(free / (model.kv_bytes_per_token() * block_size)))


class TenantPriority:
    """Tenant tier and fairness, and admission under saturation.

    priority_key = tier (1 first), fairness_key = tenant name, fairness_weight = tenant weight
    admits iff load fraction < saturation_by_tier[tier − 1]
    over quota iff the tenant's spend today ≥ its daily budget
    """

    def __init__(self, config: AdmissionConfig) -> None:
        self._saturation = tuple(config.saturation_by_tier)
        self._budget_micros: dict[str, int | None] = {}

    def keys(self, tenant: Tenant) -> tuple[int, str, float]:
        """Temporal `Priority` fields for the tenant's calls."""
        return tenant.tier, tenant.name, tenant.fairness_weight

    def admits(self, tier: int, load_fraction: float) -> bool:
        """Whether a tier-`tier` call is admitted at this fleet load fraction."""
        return load_fraction < self._saturation[tier - 1]

    def over_quota(self, tenant: Tenant, spent_today_micros: int) -> bool:
        """Whether the tenant has used its daily budget."""
        name = tenant.name
        if name not in self._budget_micros:
            budget = tenant.daily_budget_usd
            # Whole micro-dollars: spend reaches a budget of 0.5 µ$ at 1 µ$.
            self._budget_micros[name] = (
                None
                if budget is None
                else int((budget * 1_000_000).to_integral_value(rounding=ROUND_CEILING))
            )
        limit = self._budget_micros[name]
        return limit is not None and spent_today_micros >= limit


class LatencyBudget:
    """The step's share of the task deadline, and the chance of finishing within it.

    step budget = min(remaining, step_share_multiplier · remaining / steps remaining)
    admits iff estimate ≤ step budget
    P(on time) = 1 / (1 + (estimate / step budget) ^ deadline_shape)   (1 without a deadline)
    """

    def __init__(self, config: LatencyConfig) -> None:
        self._share = config.step_share_multiplier
        self._shape = config.deadline_shape
        self._margin_s = config.schedule_to_start_margin_s
        self._min_schedule_to_start_s = config.min_schedule_to_start_s
        self._max_schedule_to_start_s = config.max_schedule_to_start_s

    def step_budget_s(self, remaining_s: float | None, steps_remaining: int) -> float | None:
        """Seconds this step may use, or None when the task has no deadline."""
        if remaining_s is None:
            return None
        remaining = max(0.0, remaining_s)
        share = self._share * remaining / max(1, steps_remaining)
        return min(remaining, share)

    def admits(self, estimate_s: float, budget_s: float | None) -> bool:
        """Whether the estimate fits the step budget."""
        return budget_s is None or estimate_s <= budget_s

    def p_on_time(self, estimate_s: float, budget_s: float | None) -> float:
        """Probability that a call estimated at `estimate_s` finishes within the budget."""
        if budget_s is None:
            return 1.0
        if budget_s <= 0:
            return 0.0
        ratio = estimate_s / budget_s
        if ratio <= 0.0:
            return 1.0
        # (estimate / budget)^shape in log space: tiny budgets must not overflow.
        exponent = self._shape * math.log(ratio)
        if exponent > 700.0:
            return 0.0
        return 1.0 / (1.0 + math.exp(exponent))

    def schedule_to_start_s(
        self, queue_wait_s: float, run_s: float, budget_s: float | None
    ) -> float:
        """Temporal schedule_to_start limit: 2 · queue estimate + margin, within the budget."""
        limit = 2.0 * queue_wait_s + self._margin_s
        if budget_s is not None:
            limit = min(limit, budget_s - run_s)
        return min(self._max_schedule_to_start_s, max(self._min_schedule_to_start_s, limit))


class WorkflowContext:
    """The workflow's context: stickiness and protection of sunk cost.

    J = (cost + sunk_cost · spent · (1 − p)) / p, then × (1 − sticky) on the previous replica.
    cost / p is the expected price of one success when failures are retried; the second term
    is the task's spend that a failure here would put at risk, so the more a task has spent
    the more a reliable replica is worth.
    """

    def __init__(self, weights: WeightsConfig) -> None:
        self._sunk_cost = weights.sunk_cost
        self._sticky_factor = 1.0 - weights.sticky

    def objective(self, cost: float, p_success: float, spent: float) -> float:
        """Expected cost per successful call, including the sunk cost at risk."""
        if p_success <= 0.0:
            return math.inf
        return (cost + self._sunk_cost * spent * (1.0 - p_success)) / p_success

    def sticky_factor(self, is_previous: bool) -> float:
        """(1 − sticky) for the workflow's previous replica, 1 otherwise."""
        return self._sticky_factor if is_previous else 1.0

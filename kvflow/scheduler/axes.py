"""The axes of placement: one small class each, behind one `Axis` protocol.

Every axis implements the hooks of `Axis` it needs (the others do nothing): a per-replica
`refresh` when the replica's telemetry changes, and per decision an `evaluate` that turns the
replica down with a `Filter` or adds its estimate, term or factor. `kvflow.scheduler.policy`
runs the axes `SchedulerConfig.axes` names, in that order, and composes the objective

    J = (cost + at risk) / p  ×  Π (1 + wₖ · penaltyₖ)  ×  Π factorₖ

where `cost` is the call's expected price on the replica (after cached tokens), `p` the
probability that it succeeds in time, `at risk` the task's spend a failure would waste, the
penalties the replica's request-independent ones (queue, KV-cache usage, kept in
`ReplicaState.penalty`) and the factors the per-decision ones (cold start, stickiness). The
lowest J among replicas that pass every filter wins. Adding an axis is one class here, one
entry in `_registered` and its name in `SchedulerConfig.axes`; its weights and thresholds live
in `kvflow.scheduler.config`.

Each class is pure: it reads configuration and the numbers it is given and returns a number or
a yes/no. The methods a placement calls read the configuration values they need from plain
attributes copied at construction: a pydantic model answers every attribute read through a
`__getattr__` hook, several times slower than a plain object, and these run for every replica
scored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import ROUND_CEILING
from typing import NamedTuple

from kvflow.scheduler.config import (
    AdmissionConfig,
    LatencyConfig,
    MemoryConfig,
    SchedulerConfig,
    SpeedConfig,
    WeightsConfig,
)
from kvflow.scheduler.decision import Decision, Estimate, Filter, cost_per_success
from kvflow.scheduler.fleet import ExactPrices, Fleet, ModelSpec, Pool, Tenant, TokenPrices
from kvflow.scheduler.gpus import GPU_PROFILES, GpuGeneration
from kvflow.scheduler.placement import Observation
from kvflow.scheduler.reliability import CircuitState
from kvflow.scheduler.state import ReplicaState


class Axis:
    """The protocol every axis implements; each hook's default leaves the decision alone.

    A plain base class rather than a `typing.Protocol`: the compiled build calls its methods
    through a native method table, where a protocol's calls would be Python attribute lookups,
    and an axis overrides only the hooks it uses.

    Per replica, when telemetry changes:
      `refresh`       request-independent terms (multiply `state.penalty` by 1 + w · penalty)
      `refresh_load`  after this scheduler placed a call there: the load-dependent terms
      `record`        a finished call's measurements
    Per decision:
      `prepare`       the axis's constants of the request, on the `Decision`
      `prepare_model` the same for the model being placed (the asked one, then fallbacks)
      `accepts`       whether the model's replicas may take the call at their load at all
      `evaluate`      a `Filter` that turns the replica down, or None after filling in the
                      estimate fields the axis owns (the axes run in configuration order, so an
                      axis reads what earlier ones filled in)
      `bound`         the same, for the best the replica could do (at most its cost, the most
                      cached tokens anywhere, no cold load): a lower bound the search prunes by
      `factor`        the axis's factor on the objective (1 when it has none)
      `finish`        on the chosen replica's estimate: what only the placement needs
      `idle`          the chosen replica's duration had it nothing else to run (task admission)
      `observed`      any call that ended, successful or not
    """

    def refresh(self, state: ReplicaState) -> None:
        """Recompute the axis's request-independent terms of the replica."""

    def refresh_load(self, state: ReplicaState) -> None:
        """Recompute the terms that depend on the replica's load, after a placement there."""

    def record(self, state: ReplicaState, model: ModelSpec, observation: Observation) -> None:
        """Fold a successful call on the replica into the axis's estimates."""

    def observed(self, observation: Observation, now: float) -> None:
        """Any call that ended, successful or not (after `record` for a successful one)."""

    def prepare(self, decision: Decision) -> None:
        """Set the axis's per-request constants on the decision."""

    def prepare_model(self, decision: Decision) -> None:
        """Set the axis's constants of the request for `decision.model` (fallbacks change it)."""

    def accepts(self, decision: Decision, load_fraction: float) -> bool:
        """Whether the call may be placed while the model's replicas are this loaded."""
        return True

    def evaluate(
        self, state: ReplicaState, decision: Decision, estimate: Estimate
    ) -> Filter | None:
        """The filter that turns the replica down, or None after filling in the estimate."""
        return None

    def bound(self, state: ReplicaState, decision: Decision, estimate: Estimate) -> Filter | None:
        """Like `evaluate`, for the best case; axes that only add cost leave it alone."""
        return None

    def factor(self, state: ReplicaState, decision: Decision, estimate: Estimate) -> float:
        """The axis's factor on the replica's objective."""
        return 1.0

    def finish(self, state: ReplicaState, decision: Decision, estimate: Estimate) -> None:
        """Complete the estimate of the replica chosen, for the placement."""

    def idle(self, state: ReplicaState, decision: Decision, estimate: Estimate) -> None:
        """Set `estimate.duration_s` to the call's duration on the replica were it idle."""


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


class GpuGenerationAxis(Axis):
    """GPU generation: speed and price of a model on a pool's GPUs.

    Inputs: the pool's GPU generation and price list, the replica's load, measured call times.
    Config: `speed.*` (roofline efficiencies, `ewma_alpha`, `observation_clamp`, overhead).
    Estimates: TTFT, duration and cost of the call; no filter, no factor.

    roofline prefill s/token = 2 · parameters / (BF16 FLOP/s · GPUs · prefill_mfu)
    roofline decode s/token  = parameters · bytes per weight / (bandwidth · GPUs · efficiency)

    Observed calls update an EWMA (weight `ewma_alpha`) per replica and per GPU generation;
    an estimate uses the replica's EWMA, else its generation's, else the roofline.

    output tokens = EWMA of the completion tokens of the tenant's calls of the model, else of
    all the model's calls (after `output_min_observations` of them), at most max_tokens;
    max_tokens itself until then. Time and cost use it; memory and context checks the bound.

    prefill_s = overhead + uncached tokens · prefill s/token
    decode_s  = output tokens · decode s/token · (1 + decode_batch_slowdown · load fraction)
    ttft      = queue wait + cold load + prefill_s;  duration = ttft + decode_s
    cost      = (prompt − cached) · input + cached · cached input + output · output price
    """

    def __init__(self, config: SpeedConfig, prices: tuple[PoolPrices, ...] = ()) -> None:
        self.config = config
        self._prices = prices
        """Per pool, in fleet order."""
        self._ttft_overhead_s = config.ttft_overhead_s
        self._decode_batch_slowdown = config.decode_batch_slowdown
        self._roofline: dict[tuple[GpuGeneration, int, str], Speed] = {}
        self._replica: dict[tuple[str, str], Speed] = {}
        self._generation: dict[tuple[GpuGeneration, str], Speed] = {}
        self._min_outputs = config.output_min_observations
        self._outputs: dict[tuple[str, str], tuple[int, float]] = {}
        """(model, tenant), and (model, "") for all tenants → (calls seen, EWMA of output)."""

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

    def expected_output(self, model: str, tenant: str, max_tokens: int) -> int:
        """Output tokens to expect: the tenant's mean, else the model's, else `max_tokens`."""
        for key in ((model, tenant), (model, "")):
            seen = self._outputs.get(key)
            if seen is not None and seen[0] >= self._min_outputs:
                mean = math.ceil(seen[1])
                return mean if mean < max_tokens else max_tokens
        return max_tokens

    def observe_output(self, model: str, tenant: str, completion_tokens: int) -> None:
        """Fold a finished call's output length into the model's and the tenant's EWMAs."""
        alpha = self.config.ewma_alpha
        for key in ((model, tenant), (model, "")):
            seen = self._outputs.get(key)
            if seen is None:
                self._outputs[key] = (1, float(completion_tokens))
            else:
                count, mean = seen
                self._outputs[key] = (count + 1, mean + alpha * (completion_tokens - mean))

    def prepare_model(self, decision: Decision) -> None:
        """The output length time and cost estimates assume for this model."""
        if decision.output_model != decision.model:
            decision.output_model = decision.model
            decision.output = self.expected_output(
                decision.model, decision.tenant, decision.max_output
            )

    def refresh(self, state: ReplicaState) -> None:
        """The replica's decode slowdown at its load (after `QueueLoad` set the fraction)."""
        self.refresh_load(state)

    def refresh_load(self, state: ReplicaState) -> None:
        """As `refresh`: the slowdown follows the load."""
        state.decode_slowdown = self.decode_slowdown(state.load_fraction)

    def record(self, state: ReplicaState, model: ModelSpec, observation: Observation) -> None:
        """Learn the replica's prefill and decode speed, and the output length, from a call."""
        self.observe_output(model.name, observation.tenant, observation.completion_tokens)
        prefill_s = None
        if observation.ttft_s is not None and not observation.cold_start:
            # A cold start's first token waited for the weights to load; it says nothing
            # about prefill speed.
            prefill_s = observation.ttft_s - (observation.queue_s or 0.0)
        decode_s = None
        if observation.duration_s is not None and observation.ttft_s is not None:
            decode_s = observation.duration_s - observation.ttft_s
        self.observe(
            state.name,
            state.pool,
            model,
            uncached_tokens=max(0, observation.prompt_tokens - observation.cached_tokens),
            prefill_s=prefill_s,
            output_tokens=observation.completion_tokens,
            decode_s=decode_s,
            load_fraction=state.load / state.pool.max_concurrency,
        )

    def evaluate(
        self, state: ReplicaState, decision: Decision, estimate: Estimate
    ) -> Filter | None:
        """TTFT, duration and cost of the call on the replica."""
        self.bound(state, decision, estimate)
        estimate.cost = self._prices[state.pool_position].cost(
            decision.prompt, estimate.cached_tokens, decision.output
        )
        return None

    def bound(self, state: ReplicaState, decision: Decision, estimate: Estimate) -> Filter | None:
        """TTFT and duration (the bound's cost is given)."""
        speed = self.speed(state.name, state.pool, decision.spec)
        ttft = (
            estimate.queue_wait_s
            + estimate.cold_load_s
            + self.prefill_s(speed, decision.prompt - estimate.cached_tokens)
        )
        estimate.ttft_s = ttft
        estimate.duration_s = (
            ttft + decision.output * speed.decode_s_per_token * state.decode_slowdown
        )
        return None

    def idle(self, state: ReplicaState, decision: Decision, estimate: Estimate) -> None:
        """No queue and no batch: the datasheet speed (`roofline`), alone on the replica.

        Not the observed speed: what the replica was seen to do was done beside its other
        calls, which is the load this estimate leaves out.
        """
        speed = self.roofline(state.pool, decision.spec)
        estimate.duration_s = (
            estimate.cold_load_s
            + self.prefill_s(speed, decision.prompt - estimate.cached_tokens)
            + decision.output * speed.decode_s_per_token
        )


class QueueLoad(Axis):
    """The replica's queue: expected wait and a load penalty.

    Inputs: scraped running and waiting calls, calls placed since, mean call duration.
    Config: `weights.queue`, `speed.default_service_s`, `speed.ewma_alpha`.
    Estimates: the queue wait; penalty: 1 + weights.queue · shared load / slots.

    load fraction = load / slots, where load = running + waiting (+ calls placed since the
    last scrape) and slots = the pool's `max_concurrency`
    wait_s = (waiting + max(0, running + 1 − slots)) · mean call duration / slots
    penalty = weights.queue · load fraction
    """

    def __init__(self, weights: WeightsConfig, speed: SpeedConfig) -> None:
        self._default_service_s = speed.default_service_s
        self._weight = weights.queue
        self._alpha = speed.ewma_alpha

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

    def refresh(self, state: ReplicaState) -> None:
        """Load fraction and queue wait; the penalty from the load every process sees alike.

        The penalty (and so the ranking) uses the scraped load, so that processes fed the
        same telemetry rank replicas alike; this process's newer calls count in the wait.
        """
        state.penalty *= 1.0 + self.penalty(state.shared_load, state.pool.max_concurrency)
        self.refresh_load(state)

    def refresh_load(self, state: ReplicaState) -> None:
        """Load fraction and queue wait with the calls this scheduler placed."""
        slots = state.pool.max_concurrency
        load = state.load
        state.load_fraction = self.load_fraction(load, slots)
        state.wait_s = self.wait_s(load - state.waiting, state.waiting, slots, state.service_s)

    def record(self, state: ReplicaState, model: ModelSpec, observation: Observation) -> None:
        """EWMA of whole-call durations, the mean the queue wait assumes."""
        duration = observation.duration_s
        if duration is not None:
            old = state.service_s
            state.service_s = duration if old is None else old + self._alpha * (duration - old)

    def evaluate(
        self, state: ReplicaState, decision: Decision, estimate: Estimate
    ) -> Filter | None:
        """The queue wait a new call expects."""
        estimate.queue_wait_s = state.wait_s
        return None

    def bound(self, state: ReplicaState, decision: Decision, estimate: Estimate) -> Filter | None:
        """The same wait: it does not depend on the request."""
        return self.evaluate(state, decision, estimate)


class MemoryHeadroom(Axis):
    """KV-cache headroom: a penalty for the KV running calls hold; calls that cannot fit.

    Inputs: `vllm:kv_cache_usage_perc`, the cache size and block size, the cached tokens.
    Config: `memory.reserve_fraction`, `memory.max_wait_s`, `weights.kv_usage`,
    `prefix.block_size`.
    Filters: `too_small` (the call would not fit the whole cache); `memory` (not its free
    part) only while the call has waited less than `memory.max_wait_s`, so never at the
    default 0; penalty: 1 + weight · usage; factor: the read factor.

    need blocks = ⌈(prompt + output) / block size⌉ − cached blocks
    free blocks = total blocks · (1 − usage) − reserve_fraction · total blocks
    admits iff need ≤ free (always, before the cache size is known),
               or the call has waited ≥ memory.max_wait_s (`queued_s`) and the cache would
               hold it empty
    penalty = weight · usage, where weight = weights.kv_usage if set, else the pool's
              KV-cache bytes / weight bytes (`WarmWeights.kv_read_ratio`)
    read    = this scheduler's calls in flight, Σ (prompt + expected output) / cache tokens
    factor  = (1 + weight · read) / (1 + weight · usage) where read > usage, else 1
              (`memory.count_shared_reads`)

    Why that ratio: decode is bound by memory reads, and a step reads the weights once and
    the KV of every running call, so a replica whose cache is a fraction u full takes
    (1 + ratio · u) times an idle replica's time per token: 3.5 for Llama 3.1 8B on an H100,
    6.9 on an H200, 0.35 on an L4. Usage is the cache held by running calls (vLLM counts
    cached blocks that no call holds as free), so a replica is penalised for the batch that
    slows each step, not for the prefixes it keeps.

    Why the read factor: vLLM counts a block that many running calls share once, but each
    call's decode steps read it, so a replica whose calls all continue one long system prompt
    reads as lightly used while its steps read that prompt once per call; and calls waiting
    in the engine's queue hold no blocks yet, so usage misses them where the read counts
    them, which is what a full cache's replica needs (long-agent at 2×, seeds 0–4: $0.2247
    → $0.2156 a successful task, tier 1 in time 79.4% → 88.6%). The factor counts
    this process's calls only, so it stays out of the static factor that ranks replicas
    alike in every process (`QueueLoad.refresh`); at least 1, it keeps the search's bound.
    Seeds 0–4, without → with it: hotspot at 0.8×, mean model time 2.57 → 2.48 s and the
    busiest replica 1.37 → 1.24× the mean, at 0.4% more cost (97.3% of prompt tokens cached
    against 97.4%); long-agent at 1×, 163.7 → 156.8 s at 0.6% less cost; agent, overload,
    faults and heterogeneous within 0.9%.

    Why a call is not held back because every cache is full (`memory.max_wait_s` 0): under
    overload the caches stay full, and a call held at the router waits out its retry-after
    while the engine frees and refills blocks; long-agent steps are due within 15–120 s.
    Long-agent at 2× capacity (seeds 0–4): refusing until a call fits made 1,863 refusals a
    run, a TTFT p99 of 503 s and 52% of tier-1 tasks in time at $0.2534 a successful task,
    10 s of wait at most $0.2560, and placing at once 79% at $0.2247 (llm-d-precise 87%,
    $0.2218); every other workload is unchanged within 0.4% (there caches have room). An
    engine's own queue admits its waiting calls as blocks free, in its order (priority, then
    arrival), and the KV-usage penalty still steers calls to the emptier caches.

    Why not filter full caches while some other replica has room (a second search only when
    none has): measured, it moves a long conversation off the replica that holds it to
    recompute it elsewhere, where the engine would have queued it for a few seconds.
    Long-agent at 2× (seeds 0–4, with the read factor): $0.2230 a successful task, 77.7% of
    tier 1 and 53.2% of tasks succeeding, against $0.2156, 88.6% and 54.9% without it; on
    every other workload, where caches have room, it changed nothing (long-agent at 1×:
    +0.1% of cost).
    """

    def __init__(
        self,
        config: MemoryConfig,
        weights: WeightsConfig,
        block_size: int = 16,
        pool_weights: tuple[float, ...] = (),
    ) -> None:
        self._reserve = config.reserve_fraction
        self._shared_reads = config.count_shared_reads
        self._max_wait_s = math.inf if config.max_wait_s is None else config.max_wait_s
        self._weight = weights.kv_usage
        self._pool_weights = pool_weights
        """Per pool, in fleet order: the derived weight, used where `weights.kv_usage` is
        unset (then one per pool is needed)."""
        self._block_size = block_size
        """Tokens per block when the replica has not said its own."""

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

    def weight(self, pool_position: int) -> float:
        """The KV-usage weight on the pool at `pool_position` (class docstring)."""
        if self._weight is not None:
            return self._weight
        return self._pool_weights[pool_position]

    def penalty(self, usage: float, pool_position: int = 0) -> float:
        """The pool's weight · usage."""
        return self.weight(pool_position) * usage

    def refresh(self, state: ReplicaState) -> None:
        """Free and largest allocations from the scraped cache; the KV-usage penalty."""
        state.penalty *= 1.0 + self.penalty(state.kv_usage, state.pool_position)
        state.free_blocks = self.free_blocks(state.num_gpu_blocks, state.kv_usage)
        state.max_blocks = self.max_blocks(state.num_gpu_blocks)
        self.refresh_load(state)

    def read_factor(self, state: ReplicaState) -> float:
        """(1 + w · read) / (1 + w · usage), where read = in-flight tokens / cache tokens.

        1 where the read is not more than the usage, or the cache size is unknown.
        """
        blocks = state.num_gpu_blocks
        if not self._shared_reads or not blocks:
            return 1.0
        read = state.inflight_tokens / (blocks * (state.engine_block_size or self._block_size))
        usage = state.kv_usage
        if read <= usage:
            return 1.0
        weight = self.weight(state.pool_position)
        return (1.0 + weight * read) / (1.0 + weight * usage)

    def refresh_load(self, state: ReplicaState) -> None:
        """The read factor, after a placement or a call's end changed the calls in flight."""
        state.read_factor = self.read_factor(state)

    def factor(self, state: ReplicaState, decision: Decision, estimate: Estimate) -> float:
        """The read factor (`read_factor`), kept out of the static factor (class docstring)."""
        return state.read_factor

    def evaluate(
        self, state: ReplicaState, decision: Decision, estimate: Estimate
    ) -> Filter | None:
        """`too_small` if the call cannot fit the whole cache, `memory` if not its free part.

        `memory` only while the call has waited less than `memory.max_wait_s`.
        """
        if state.num_gpu_blocks is None:
            return None
        need = self.blocks_needed(
            decision.prompt,
            decision.max_output,
            estimate.cached_tokens,
            state.engine_block_size or self._block_size,
        )
        if not self.fits(need, state.max_blocks):
            return Filter.TOO_SMALL
        if decision.request.queued_s < self._max_wait_s and not self.admits(
            need, state.free_blocks
        ):
            return Filter.MEMORY
        return None


class KvCacheAxis(Axis):
    """KV-cache state: expected cached tokens from the prefix index.

    Inputs: the prompt's prefix holders (`Decision.levels`, from the prefix index fed by this
    scheduler's placements and the engines' KV events), the replica's block size.
    Config: `prefix.block_size`, `prefix.index_stride`. Estimates: depth and cached tokens.

    cached = min(depth · index block size, ⌊(prompt − 1) / engine block⌋ · engine block),
    rounded down to whole engine blocks: vLLM hits come in whole blocks and it always
    computes the prompt's last token.
    """

    def __init__(self, block_size: int = 16, entry_tokens: int = 64) -> None:
        self._block_size = block_size
        """Tokens per block when the replica has not said its own."""
        self._entry_tokens = entry_tokens
        """Tokens per prefix-index entry: block size · index stride."""

    def evaluate(
        self, state: ReplicaState, decision: Decision, estimate: Estimate
    ) -> Filter | None:
        """The replica's depth in the prompt's prefix, and the tokens that saves."""
        rid = state.rid
        depth = 0
        for level_depth, mask in decision.levels:
            if mask >> rid & 1:
                depth = level_depth
                break
        estimate.depth = depth
        estimate.cached_tokens = self.expected_cached_tokens(
            depth, decision.prompt, self._entry_tokens, state.engine_block_size or self._block_size
        )
        return None

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


class WarmWeights(Axis):
    """Warm or cold weights: a cold replica pays the load time.

    load_s = parameters · bytes per weight / load bandwidth + load overhead
    can load iff the weights fit in the replica's GPU memory (× gpu_memory_utilization)
             and the pool's replicas are simulated (a vLLM server serves only the model it
             was started with, so a pool of vLLM endpoints loads nothing cold)
    factor = 1 + weights.cold_start on a replica that must load the model

    Inputs: the models each replica serves (scraped, or the fleet file's warm models).
    Config: `speed.load_bandwidth_gbps`, `speed.load_overhead_s`,
    `memory.gpu_memory_utilization`, `weights.cold_start`, `allow_cold_start`.
    Filter: `not_warm` (not warm, and cold starts disabled or the weights do not fit).
    """

    def __init__(
        self,
        speed: SpeedConfig,
        memory: MemoryConfig,
        *,
        cold_start: float = 0.0,
        pools: tuple[Pool, ...] = (),
        models: tuple[ModelSpec, ...] = (),
        allow_cold_start: bool = True,
    ) -> None:
        self.speed = speed
        self.memory = memory
        self._cold_start_factor = 1.0 + cold_start
        self._load_s = {m.name: self.load_s(m) for m in models}
        self._loadable = [
            frozenset(
                m.name
                for m in models
                if allow_cold_start and p.endpoints == "simulated" and self.can_load(p, m)
            )
            for p in pools
        ]
        """Per pool: the models a cold replica there may load."""

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

    def kv_read_ratio(self, pool: Pool, models: Sequence[ModelSpec]) -> float:
        """KV-cache bytes over weight bytes on one replica of `pool` holding `models`.

        (GPU memory · utilization − their weights) / the largest model's weights, at least
        0: what a full cache adds to the bytes a decode step reads, as a multiple of the
        weights it reads anyway (the largest model's: the smallest such multiple).
        """
        memory = GPU_PROFILES[pool.gpu].memory_gb * 1e9 * pool.gpus_per_replica
        weights = [self.weight_bytes(m) for m in models]
        free = memory * self.memory.gpu_memory_utilization - sum(weights)
        return max(0.0, free) / max(weights)

    def kv_capacity_blocks(self, pool: Pool, model: ModelSpec, block_size: int) -> int:
        """KV blocks a replica of the pool holds for the model (before scraping says so).

        (GPU memory · utilization − weights) / (KV bytes per token · block size)
        """
        memory = GPU_PROFILES[pool.gpu].memory_gb * 1e9 * pool.gpus_per_replica
        free = memory * self.memory.gpu_memory_utilization - self.weight_bytes(model)
        return max(1, int(free / (model.kv_bytes_per_token() * block_size)))

    def refresh(self, state: ReplicaState) -> None:
        """The models the replica may load cold, which the search ranks it for."""
        state.loadable = self._loadable[state.pool_position]

    def evaluate(
        self, state: ReplicaState, decision: Decision, estimate: Estimate
    ) -> Filter | None:
        """`not_warm` unless the replica holds the weights or may load them (then cold)."""
        model = decision.model
        if model not in state.warm_models:
            if model not in state.loadable:
                return Filter.NOT_WARM
            estimate.warm = False
            estimate.cold_load_s = self._load_s[model]
        return None

    def factor(self, state: ReplicaState, decision: Decision, estimate: Estimate) -> float:
        """1 + weights.cold_start when the replica must load the model, else 1."""
        return 1.0 if estimate.warm else self._cold_start_factor


class ReplicaHealth(Axis):
    """Replica health: up or down, and its circuit breaker.

    P(success) = (successes + prior) / (calls + prior) over the breaker's window,
    × half_open_success_probability while half-open (`kvflow.scheduler.reliability`)

    Inputs: scrapes that answer or fail, call outcomes. Config: `circuit.*`.
    Filters: `down`, `circuit_open` (open, or its half-open probe slot taken).
    """

    def refresh(self, state: ReplicaState) -> None:
        """The replica's P(success) from its breaker."""
        state.p_static = state.breaker.p_success()

    def evaluate(
        self, state: ReplicaState, decision: Decision, estimate: Estimate
    ) -> Filter | None:
        """`down`, or `circuit_open` unless the breaker lets a call through now."""
        if not state.up:
            return Filter.DOWN
        breaker = state.breaker
        if breaker.state is not CircuitState.CLOSED and not breaker.allows(decision.now):
            return Filter.CIRCUIT_OPEN
        return None


class TenantPriority(Axis):
    """Tenant tier and fairness, and admission under saturation.

    priority_key = tier (1 first), fairness_key = tenant name, fairness_weight = tenant weight
    admission tier = max(1, tier − running_task_tiers) once the task has completed a step,
                     else tier
    thresholds = headroom_by_tier for headroom_hold_s after a late tier-1 call (and, with
                 headroom_for_step_objectives, after a tier-1 call with a step objective is
                 placed), where set, else saturation_by_tier
    admits iff load fraction < thresholds[admission tier − 1]
               or the call has waited ≥ max_wait_s_by_tier[tier − 1] (`queued_s`)
    over quota iff the tenant's spend today ≥ its daily budget

    Inputs: the fleet's tenants; the load fraction of the replicas serving the model; the
    task's completed steps; tier-1 calls that ended late (`Observation.late`). Config:
    `admission.*`. Quota and retry budgets: `kvflow.scheduler.tenancy`.
    """

    def __init__(self, config: AdmissionConfig, tenants: tuple[Tenant, ...] = ()) -> None:
        self._saturation = tuple(config.saturation_by_tier)
        self._headroom = None if config.headroom_by_tier is None else tuple(config.headroom_by_tier)
        self._hold_s = config.headroom_hold_s
        self._headroom_until = -math.inf
        """Until when `headroom_by_tier` applies: `hold_s` after the last late tier-1 call."""
        self._for_step_objectives = self._headroom is not None and (
            config.headroom_for_step_objectives
        )
        self._max_wait_s = tuple(config.max_wait_s_by_tier)
        self._running_bonus = config.running_task_tiers
        self._budget_micros: dict[str, int | None] = {}
        self._tiers = {t.name: t.tier for t in tenants}

    def tier(self, tenant: str) -> int:
        """The tier of a fleet tenant."""
        return self._tiers[tenant]

    def accepts(self, decision: Decision, load_fraction: float) -> bool:
        """Whether the tier is admitted at this load (`admits`) or the call waited long enough.

        Runs for every call about to be placed, so it is also where a tier-1 call with a step
        objective holds the headroom on (`headroom_for_step_objectives`): the call's arrival,
        not its placement, is the signal, and a refused tier-1 call is latency-sensitive work
        waiting all the same.
        """
        tier = self._tiers[decision.tenant]
        request = decision.request
        if (
            tier == 1
            and self._for_step_objectives
            and request.step_deadline_s_remaining is not None
        ):
            # Latency-sensitive tier-1 work is running: keep the headroom for it from now on,
            # not from when a burst has made one of its steps late (`headroom_by_tier`).
            self._headroom_until = decision.now + self._hold_s
        thresholds = self._saturation
        if self._headroom is not None and decision.now < self._headroom_until:
            thresholds = self._headroom
        # `AdmissionConfig.admission_tier`, inline: this runs on every decision.
        bonus = self._running_bonus
        admitted_as = max(1, tier - bonus) if bonus and request.steps_done else tier
        threshold = thresholds[admitted_as - 1]
        decision.admission_threshold = threshold
        return load_fraction < threshold or request.queued_s >= self._max_wait_s[tier - 1]

    def observed(self, observation: Observation, now: float) -> None:
        """A tier-1 call past its step's objective holds the headroom thresholds on."""
        if observation.late and self._tiers.get(observation.tenant) == 1:
            self._headroom_until = now + self._hold_s

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


class LatencyBudget(Axis):
    """The step's share of the task deadline, and the chance of finishing within it.

    step budget = min(remaining, step_share_multiplier · remaining / steps remaining)
    admits iff estimate ≤ remaining
    P(on time) = 1 / (1 + (estimate / step budget) ^ deadline_shape)   (1 without a deadline)

    A step that overruns its share can still leave the task on time (later steps may be
    shorter, or find their prefix cached), so only a call that cannot end before the task's
    deadline is refused; the share prices the risk through P(on time). Refusing at the share
    failed tier-1 tasks in bursts that the routers without a deadline then served in time.

    Inputs: the request's remaining deadline and steps, the estimated duration.
    Config: `latency.*`. Filter: `deadline`; term: P(success) × P(on time).
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

    def admits(self, estimate_s: float, remaining_s: float | None) -> bool:
        """Whether the estimate ends before the task's deadline (`remaining_s` from now)."""
        return remaining_s is None or estimate_s <= max(0.0, remaining_s)

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

    def prepare(self, decision: Decision) -> None:
        """The step's budget."""
        request = decision.request
        decision.budget_s = self.step_budget_s(
            request.deadline_s_remaining, request.steps_remaining
        )

    def finish(self, state: ReplicaState, decision: Decision, estimate: Estimate) -> None:
        """The Temporal schedule-to-start limit of the placement."""
        estimate.schedule_to_start_s = self.schedule_to_start_s(
            estimate.queue_wait_s, estimate.duration_s - estimate.queue_wait_s, decision.budget_s
        )

    def evaluate(
        self, state: ReplicaState, decision: Decision, estimate: Estimate
    ) -> Filter | None:
        """`deadline` when the estimate misses the task's deadline; else P(on time) into p."""
        budget = decision.budget_s
        if budget is None:
            return None
        duration = estimate.duration_s
        if not self.admits(duration, decision.request.deadline_s_remaining):
            return Filter.DEADLINE
        estimate.p_success *= self.p_on_time(duration, budget)
        return None

    def bound(self, state: ReplicaState, decision: Decision, estimate: Estimate) -> Filter | None:
        """As `evaluate`: the quickest duration gives the highest P(on time)."""
        return self.evaluate(state, decision, estimate)


class WorkflowContext(Axis):
    """The workflow's context: stickiness and protection of sunk cost.

    J = (cost + sunk_cost · spent · (1 − p)) / p, then × (1 − sticky) on the previous replica.
    cost / p is the expected price of one success when failures are retried; the second term
    is the task's spend that a failure here would put at risk, so the more a task has spent
    the more a reliable replica is worth.

    Inputs: the task's spend so far and its cap, the workflow's previous replica.
    Config: `weights.sunk_cost`, `weights.sticky`. Filter: `spend` (the call would take the
    task over its cap); term: at risk = sunk_cost · spent · (1 − p); factor: sticky.
    """

    def __init__(self, weights: WeightsConfig) -> None:
        self._sunk_cost = weights.sunk_cost
        self._sticky_factor = 1.0 - weights.sticky

    def objective(self, cost: float, p_success: float, spent: float) -> float:
        """Expected cost per successful call, including the sunk cost at risk."""
        return cost_per_success(cost, self.at_risk(spent, p_success), p_success)

    def at_risk(self, spent: float, p_success: float) -> float:
        """sunk_cost · spent · (1 − p): the task's spend a failure here is assumed to waste."""
        return self._sunk_cost * spent * (1.0 - p_success)

    def sticky_factor(self, is_previous: bool) -> float:
        """(1 − sticky) for the workflow's previous replica, 1 otherwise."""
        return self._sticky_factor if is_previous else 1.0

    def evaluate(
        self, state: ReplicaState, decision: Decision, estimate: Estimate
    ) -> Filter | None:
        """`spend` when the call would break the task's cap; else the sunk cost at risk."""
        cap = decision.budget_micros
        if cap is not None and decision.spent + estimate.cost > cap:
            return Filter.SPEND
        return self.bound(state, decision, estimate)

    def bound(self, state: ReplicaState, decision: Decision, estimate: Estimate) -> Filter | None:
        """The sunk cost at risk at the estimate's P(success)."""
        estimate.at_risk = self.at_risk(decision.spent, estimate.p_success)
        return None

    def factor(self, state: ReplicaState, decision: Decision, estimate: Estimate) -> float:
        """(1 − sticky) on the workflow's previous replica."""
        return self.sticky_factor(state.rid == decision.previous)


def kv_capacity_blocks(
    pool: Pool, model: ModelSpec, block_size: int, config: SchedulerConfig
) -> int:
    """KV blocks a replica of the pool holds for the model, before scraping says so.

    See `WarmWeights.kv_capacity_blocks`: the GPU memory the weights leave free.
    """
    return WarmWeights(config.speed, config.memory).kv_capacity_blocks(pool, model, block_size)


def _served_models(fleet: Fleet, pool: Pool) -> list[ModelSpec]:
    """The models whose weights a replica of `pool` holds: its warm models.

    At least one, each a fleet model: `Fleet` checks both.
    """
    names = set(pool.warm_models)
    return [m for m in fleet.models if m.name in names]


def configured_axes(fleet: Fleet, config: SchedulerConfig) -> list[Axis]:
    """The axes `config.axes` names, in that order (the order filters and terms apply in)."""
    registered = _registered(fleet, config)
    unknown = [name for name in config.axes if name not in registered]
    if unknown:
        raise ValueError(
            f"unknown axes {', '.join(unknown)} in the scheduler configuration; known: "
            + ", ".join(registered)
        )
    return [registered[name] for name in config.axes]


def _registered(fleet: Fleet, config: SchedulerConfig) -> dict[str, Axis]:
    """Every axis, by the name `SchedulerConfig.axes` lists it under, built for the fleet."""
    pools = tuple(fleet.pools)
    block_size = config.prefix.block_size
    warm = WarmWeights(
        config.speed,
        config.memory,
        cold_start=config.weights.cold_start,
        pools=pools,
        models=tuple(fleet.models),
        allow_cold_start=config.allow_cold_start,
    )
    return {
        "warm_weights": warm,
        "replica_health": ReplicaHealth(),
        "kv_cache": KvCacheAxis(block_size, block_size * config.prefix.index_stride),
        "queue_load": QueueLoad(config.weights, config.speed),
        "memory_headroom": MemoryHeadroom(
            config.memory,
            config.weights,
            block_size,
            tuple(warm.kv_read_ratio(p, _served_models(fleet, p)) for p in pools),
        ),
        "gpu_generation": GpuGenerationAxis(
            config.speed, tuple(PoolPrices.of(p.token_prices) for p in pools)
        ),
        "latency_budget": LatencyBudget(config.latency),
        "tenant_priority": TenantPriority(config.admission, tuple(fleet.tenants)),
        "workflow_context": WorkflowContext(config.weights),
    }

"""Live state of one replica, as the scheduler knows it from telemetry and its own decisions."""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.scheduler.config import CircuitBreakerConfig
from kvflow.scheduler.fleet import Pool
from kvflow.scheduler.reliability import CircuitBreaker


@dataclass(frozen=True, slots=True)
class ReplicaMetrics:
    """One scrape of a replica's `/metrics`; None where the server did not say."""

    kv_cache_usage: float | None = None
    """`vllm:kv_cache_usage_perc`, 0..1."""
    running: int | None = None
    """`vllm:num_requests_running`."""
    waiting: int | None = None
    """`vllm:num_requests_waiting`."""
    block_size: int | None = None
    """`block_size` label of `vllm:cache_config_info`."""
    num_gpu_blocks: int | None = None
    """`num_gpu_blocks` label of `vllm:cache_config_info`."""
    models: tuple[str, ...] = ()
    """Served model names (`model_name` labels)."""


@dataclass(slots=True, eq=False)
class ReplicaState:
    """What the scheduler knows about one replica right now."""

    rid: int
    name: str
    pool: Pool
    pool_name: str
    """`pool.name`, and `gpu` the pool's GPU generation: read for every placement, and a
    pydantic model's attribute reads are slow (see `kvflow.scheduler.axes`)."""
    gpu: str
    pool_position: int
    index: int
    task_queue: str
    warm_models: set[str]
    breaker: CircuitBreaker
    up: bool = True
    kv_usage: float = 0.0
    running: int = 0
    waiting: int = 0
    engine_block_size: int | None = None
    num_gpu_blocks: int | None = None
    metrics_at: float | None = None
    placed_since_scrape: int = 0
    inflight: int = 0
    inflight_tokens: int = 0
    """Prompt + expected output tokens of the `inflight` calls: the KV their steps read."""
    service_s: float | None = None
    """EWMA of whole-call durations on this replica."""
    # Request-independent terms the axes derive from telemetry (`Axis.refresh`), computed once
    # per telemetry change instead of once per scored request.
    p_static: float = 1.0
    """P(success) from the circuit breaker and recent errors."""
    penalty: float = 1.0
    """Π (1 + wₖ · penaltyₖ) of the axes (queue, KV usage), from the shared load."""
    load_fraction: float = 0.0
    wait_s: float = 0.0
    """Expected queue wait of a new call."""
    free_blocks: float | None = None
    """KV blocks free beyond the reserve; None before the cache size is known."""
    unknown_models_logged: bool = False
    static_factor: float = 1.0
    """penalty / p_static: the objective of a call costing 1 µ$ with no deadline."""
    max_blocks: float | None = None
    """The most KV blocks one request may take; None before the cache size is known."""
    read_factor: float = 1.0
    """(1 + w · KV read) / (1 + w · KV usage): what the KV-usage penalty misses of the KV
    that running calls read, counting a block many calls share once per call."""
    decode_slowdown: float = 1.0
    """Factor on time per output token at the replica's current load."""
    loadable: frozenset[str] = frozenset()
    """Models the replica may load cold (`WarmWeights`)."""

    @classmethod
    def create(
        cls,
        rid: int,
        pool: Pool,
        pool_position: int,
        index: int,
        task_queue: str,
        name: str,
        circuit: CircuitBreakerConfig,
    ) -> ReplicaState:
        """A replica as the fleet file describes it, before any telemetry."""
        return cls(
            rid=rid,
            name=name,
            pool=pool,
            pool_name=pool.name,
            gpu=pool.gpu.value,
            pool_position=pool_position,
            index=index,
            task_queue=task_queue,
            warm_models=set(pool.warm_models),
            breaker=CircuitBreaker(circuit),
        )

    def objective_bound(self, cost: float, sunk: float) -> float:
        """A lower bound on the objective of a call costing `cost` µ$ here, with no deadline.

        cost · static factor + sunk · penalty · (1 / p − 1), where `sunk` is λ · the task's
        spend: the objective with P(success) at its most (the breaker's, on time for sure).
        """
        return cost * self.static_factor + sunk * (self.static_factor - self.penalty)

    @property
    def load(self) -> int:
        """Calls on the replica: scraped running + waiting plus this scheduler's newer ones."""
        seen = self.running + self.waiting + self.placed_since_scrape
        return seen if seen > self.inflight else self.inflight

    @property
    def shared_load(self) -> int:
        """The load every scheduler process agrees on: running + waiting as last scraped.

        Before the first scrape, the calls this process has in flight.
        """
        if self.metrics_at is None:
            return self.inflight
        return self.running + self.waiting

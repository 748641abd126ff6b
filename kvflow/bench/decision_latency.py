"""Decision latency of `Scheduler.place` on fleets of 16 to 1,024 replicas.

Each fleet has four pools (H200, H100, A100, L4) and two models (an 8B with a 1B fallback;
the L4 pool serves only the 1B). Before timing, the fleet gets realistic telemetry (KV-cache
usage, running and waiting calls, cache sizes, observed timings, a few failing replicas) and a
realistic prefix index: agent workflows that share a handful of long system prompts, each with
its own conversation, placed through the scheduler itself until the replicas' caches are full
and evicting. The timed requests mix workflows
continuing their conversation (60 %), new workflows on a known system prompt (25 %) and
unseen prompts (15 %), half of them with a deadline. Telemetry keeps arriving between
decisions (not timed), as it would from the scrape loop.

Only `place()` is timed for the decision latency, with `time.perf_counter_ns`, one call at a
time. `place()` answers first and leaves the placement's bookkeeping (load, prefix index,
stickiness, retry window) to `settle()`, which the control plane runs right after sending the
answer; the harness does the same and times `settle()` on its own, so the figures show both
what a caller waits for and the whole CPU cost of a decision. The harness keeps
its thousands of conversations as `array`s of hashes, which the garbage collector does not
walk: as lists they would make every collection, and so the decisions it interrupts, pay for
the harness's memory rather than the scheduler's.
"""

from __future__ import annotations

import random
import statistics
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from decimal import Decimal

from kvflow.scheduler.blocks import hash_block
from kvflow.scheduler.config import PrefixConfig, SchedulerConfig
from kvflow.scheduler.core import Scheduler
from kvflow.scheduler.fleet import Fleet, ModelSpec, Pool, Tenant, TokenPrices
from kvflow.scheduler.gpus import GpuGeneration
from kvflow.scheduler.placement import Observation, Placement, PlacementRequest
from kvflow.scheduler.state import ReplicaMetrics

DEFAULT_SIZES = (16, 64, 256, 1024)
SYSTEM_PROMPTS = 8
SYSTEM_PROMPT_BLOCKS = (32, 128)
"""A system prompt is 32 to 128 blocks (512 to 2,048 tokens at 16 tokens per block)."""
WORKFLOWS_PER_REPLICA = 16
CACHE_BLOCKS = (4_000, 8_000)
"""KV-cache size of a replica in blocks of 16 tokens (64k to 128k tokens): small enough that the
workflows placed before timing fill most of it, so timed decisions see a busy fleet, with
evictions on the fuller replicas."""


@dataclass(frozen=True)
class LatencyResult:
    """Decision latency of one fleet size, in microseconds."""

    replicas: int
    decisions: int
    placed: int
    refused: int
    p50_us: float
    p90_us: float
    p99_us: float
    max_us: float
    mean_us: float
    cpu_p50_us: float
    """The same decisions in CPU time of the deciding thread: on a machine shared with other
    work, wall-clock figures include time the process waited for a core."""
    cpu_p99_us: float
    settle_p50_us: float
    """`settle()` after each decision: the bookkeeping that follows the answer."""
    settle_p99_us: float
    total_p99_us: float
    """p99 of place() + settle() per decision: the CPU a decision costs, answer and upkeep."""
    reference_p50_us: float
    """A fixed piece of pure-Python work as long as the median decision, timed between the
    decisions: the same work every time, so its tail is the machine's, not the scheduler's."""
    reference_p99_us: float


def bench_fleet(replicas: int) -> Fleet:
    """Four pools sharing `replicas` between them, two models, three tenants."""
    if replicas < 4 or replicas % 4:
        raise ValueError(f"replicas must be a positive multiple of 4, got {replicas}")
    per_pool = replicas // 4

    both = ["llama-3.1-8b", "llama-3.2-1b"]
    return Fleet(
        models=[
            ModelSpec(
                name="llama-3.1-8b",
                parameters_b=8.0,
                layers=32,
                kv_heads=8,
                head_dim=128,
                context_length=32768,
                fallback="llama-3.2-1b",
            ),
            ModelSpec(
                name="llama-3.2-1b",
                parameters_b=1.2,
                layers=16,
                kv_heads=8,
                head_dim=64,
                context_length=32768,
            ),
        ],
        pools=[
            Pool(
                name="h200",
                gpu=GpuGeneration.H200,
                replicas=per_pool,
                price_per_gpu_hour_usd=Decimal("3.80"),
                token_prices=TokenPrices.per_mtok("0.20", "0.02", "0.60"),
                warm_models=both,
                max_concurrency=64,
            ),
            Pool(
                name="h100",
                gpu=GpuGeneration.H100,
                replicas=per_pool,
                price_per_gpu_hour_usd=Decimal("2.90"),
                token_prices=TokenPrices.per_mtok("0.18", "0.018", "0.54"),
                warm_models=both,
                max_concurrency=48,
            ),
            Pool(
                name="a100",
                gpu=GpuGeneration.A100,
                replicas=per_pool,
                price_per_gpu_hour_usd=Decimal("1.60"),
                token_prices=TokenPrices.per_mtok("0.15", "0.015", "0.45"),
                warm_models=both,
                max_concurrency=32,
            ),
            Pool(
                name="l4",
                gpu=GpuGeneration.L4,
                replicas=per_pool,
                price_per_gpu_hour_usd=Decimal("0.80"),
                token_prices=TokenPrices.per_mtok("0.10", "0.01", "0.40"),
                warm_models=["llama-3.2-1b"],
                max_concurrency=16,
            ),
        ],
        tenants=[
            Tenant(name="acme", tier=1, fairness_weight=3.0),
            Tenant(name="globex", tier=3, fairness_weight=2.0),
            Tenant(name="initech", tier=5, fairness_weight=1.0),
        ],
    )


SCRAPE_INTERVAL_S = 1.0
"""Every replica's /metrics is scraped once a second, as `MetricsScraper` does by default."""
DECISION_INTERVAL_S = 0.005
"""Simulated time between two decisions (200 decisions a second)."""


class _Scrapes:
    """Round-robin scrapes at `SCRAPE_INTERVAL_S` per replica, as simulated time passes."""

    def __init__(self, scheduler: Scheduler, rng: random.Random) -> None:
        self.scheduler = scheduler
        self.rng = rng
        self.names = scheduler.replica_names()
        self.due = 0.0
        self.next = 0

    def advance(self, seconds: float) -> None:
        self.due += len(self.names) * seconds / SCRAPE_INTERVAL_S
        while self.due >= 1.0:
            self.due -= 1.0
            _scrape(self.scheduler, self.rng, self.names[self.next])
            self.next = (self.next + 1) % len(self.names)


class _Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class _Workflow:
    workflow_id: str
    chain: array[int]
    model: str
    tenant: str
    replica: str | None = None


def _scrape(scheduler: Scheduler, rng: random.Random, name: str) -> None:
    pool = scheduler.fleet.pool(name.split("/")[0])
    slots = pool.max_concurrency
    # A replica's cache size is fixed by its GPU; load and usage move between scrapes.
    low, high = CACHE_BLOCKS
    blocks = low + hash_block(0, list(name.encode())) % (high - low)
    running = rng.randint(0, int(slots * 0.8))
    scheduler.update_metrics(
        name,
        ReplicaMetrics(
            kv_cache_usage=round(rng.uniform(0.05, 0.7), 3),
            running=running,
            waiting=rng.choice((0, 0, 0, 0, 1, 3)),
            block_size=16,
            num_gpu_blocks=blocks,
        ),
    )


def _observe(
    scheduler: Scheduler,
    rng: random.Random,
    request: PlacementRequest,
    placement: Placement,
    ok: bool,
) -> None:
    # The call took about what was estimated (±20 %), for the tokens that were asked for.
    jitter = rng.uniform(0.8, 1.2)
    scheduler.observe(
        Observation(
            replica=placement.replica,
            model=placement.model,
            tenant=request.tenant,
            ok=ok,
            queue_s=placement.est_queue_wait_s,
            ttft_s=placement.est_ttft_s * jitter,
            duration_s=placement.est_duration_s * jitter,
            prompt_tokens=request.prompt_tokens,
            cached_tokens=placement.expected_cached_tokens,
            completion_tokens=request.max_output_tokens,
            cost_micros=placement.est_cost_micros,
            cold_start=placement.cold_start,
        )
    )


def _chain(rng: random.Random, prefix: Sequence[int], new_blocks: int) -> array[int]:
    """`prefix` followed by `new_blocks` blocks no other prompt has."""
    chain = array("Q", prefix)
    chain.extend(rng.getrandbits(64) for _ in range(new_blocks))
    return chain


def _request(
    rng: random.Random,
    workflow: _Workflow,
    blocks: Sequence[int],
    block_size: int,
) -> PlacementRequest:
    deadline = rng.choice((None, rng.uniform(10.0, 90.0)))
    return PlacementRequest(
        model=workflow.model,
        block_hashes=list(blocks),
        prompt_tokens=len(blocks) * block_size + rng.randint(0, block_size - 1),
        max_output_tokens=rng.randint(50, 500),
        tenant=workflow.tenant,
        deadline_s_remaining=deadline,
        steps_remaining=rng.randint(1, 5),
        previous_replica=workflow.replica,
        spent_micros=rng.randint(0, 20_000),
        workflow_id=workflow.workflow_id,
    )


def _setup(
    replicas: int, seed: int, config: SchedulerConfig | None = None
) -> tuple[Scheduler, _Clock, random.Random, list[list[int]], list[_Workflow], _Scrapes]:
    rng = random.Random(seed)
    clock = _Clock()
    scheduler = Scheduler(bench_fleet(replicas), config or SchedulerConfig(), clock=clock)
    names = scheduler.replica_names()
    scrapes = _Scrapes(scheduler, rng)
    for name in names:
        _scrape(scheduler, rng, name)
    # A few replicas with recent failures: lower P(success), one or two with open circuits.
    for name in rng.sample(names, max(1, replicas // 32)):
        for _ in range(rng.randint(1, 6)):
            scheduler.observe(
                Observation(replica=name, model="llama-3.1-8b", tenant="acme", ok=False)
            )
    systems = [
        [rng.getrandbits(64) for _ in range(rng.randint(*SYSTEM_PROMPT_BLOCKS))]
        for _ in range(SYSTEM_PROMPTS)
    ]
    tenants = ["acme", "globex", "initech"]
    workflows: list[_Workflow] = []
    block_size = scheduler.block_size
    for i in range(WORKFLOWS_PER_REPLICA * replicas):
        system = rng.choice(systems)
        chain = _chain(rng, system, rng.randint(10, 150))
        workflow = _Workflow(
            workflow_id=f"wf-{i}",
            chain=chain,
            model=rng.choice(("llama-3.1-8b", "llama-3.1-8b", "llama-3.2-1b")),
            tenant=rng.choice(tenants),
        )
        request = _request(rng, workflow, chain, block_size)
        placed = scheduler.place(request)
        if isinstance(placed, Placement):
            workflow.replica = placed.replica
            _observe(scheduler, rng, request, placed, ok=rng.random() > 0.02)
        workflows.append(workflow)
        scrapes.advance(DECISION_INTERVAL_S)
        clock.now += DECISION_INTERVAL_S
    return scheduler, clock, rng, systems, workflows, scrapes


def _stream(
    rng: random.Random,
    systems: list[list[int]],
    workflows: list[_Workflow],
    block_size: int,
    count: int,
) -> Iterator[tuple[_Workflow, PlacementRequest]]:
    """The requests of the workload, one decision at a time.

    60 % continue a conversation, 25 % start one on a shared system prompt and 15 % on a
    prompt nobody has seen; new workflows join `workflows`.
    """
    counter = len(workflows)
    for _ in range(count):
        roll = rng.random()
        if roll < 0.60:
            workflow = rng.choice(workflows)
            workflow.chain = _chain(rng, workflow.chain, rng.randint(2, 20))
        else:
            counter += 1
            prefix: Sequence[int] = rng.choice(systems) if roll < 0.85 else ()
            workflow = _Workflow(
                workflow_id=f"wf-{counter}",
                chain=_chain(rng, prefix, rng.randint(10, 120)),
                model=rng.choice(("llama-3.1-8b", "llama-3.1-8b", "llama-3.2-1b")),
                tenant=rng.choice(("acme", "globex", "initech")),
            )
            workflows.append(workflow)
        yield workflow, _request(rng, workflow, workflow.chain, block_size)


@dataclass(frozen=True)
class QualityResult:
    """How close the search's picks come to the best-scoring replica."""

    replicas: int
    decisions: int
    off_best: int
    """Placements (rendezvous picks aside) not on the replica with the lowest objective."""
    mean_regret: float
    """Mean of objective(pick) / lowest objective − 1, rendezvous picks included (they may
    be up to `rendezvous_tolerance`² above the best by design)."""
    p99_regret: float


UNBOUNDED_AFFINITY = SchedulerConfig(
    prefix=PrefixConfig(affinity_load_factor=1e9, affinity_load_factor_with_objective=1e9)
)
"""The default configuration with the affinity load bound lifted: every pick off the best
objective is then the search's own miss, not the bound passing a busy prefix holder over."""


def measure_quality(
    replicas: int, decisions: int = 500, seed: int = 11, config: SchedulerConfig | None = None
) -> QualityResult:
    """Score the whole fleet before each decision and compare the pick with the best score.

    The same workload as `measure`, untimed: the search prunes replicas by bounds and stops
    after `search_width`, and this says what that costs in placement quality. The objective
    does not see the affinity load bound, so under the default `config` a pick the bound moved
    off a busy prefix holder counts as not the best, on purpose; under `UNBOUNDED_AFFINITY`
    only the search's misses do.
    """
    scheduler, clock, rng, systems, workflows, scrapes = _setup(replicas, seed, config)
    regrets: list[float] = []
    off_best = 0
    for workflow, request in _stream(rng, systems, workflows, scheduler.block_size, decisions):
        scores = scheduler.scores(request)
        result = scheduler.place(request)
        scheduler.settle()
        if isinstance(result, Placement):
            workflow.replica = result.replica
            _observe(scheduler, rng, request, result, ok=rng.random() > 0.02)
            feasible = [s for s in scores if s.objective is not None]
            # Replicas that must load the model are tried only when no warm one fits.
            warm = [s for s in feasible if not s.cold_start] or feasible
            by_name = {s.replica: s.objective for s in warm}
            picked = by_name.get(result.replica)
            if result.model == request.model and picked is not None:
                best = min(o for o in by_name.values() if o is not None)
                regret = picked / best - 1 if best > 0 else 0.0
                regrets.append(regret)
                if regret > 1e-9 and not result.rendezvous:
                    off_best += 1
        scrapes.advance(DECISION_INTERVAL_S)
        clock.now += DECISION_INTERVAL_S
    regrets.sort()
    return QualityResult(
        replicas=replicas,
        decisions=len(regrets),
        off_best=off_best,
        mean_regret=statistics.fmean(regrets) if regrets else 0.0,
        p99_regret=regrets[min(len(regrets) - 1, int(0.99 * len(regrets)))] if regrets else 0.0,
    )


def _reference_work(rounds: int) -> int:
    """The same pure-Python work every call: `rounds` multiply-adds, no allocation kept."""
    total = 0
    for k in range(rounds):
        total += k * k
    return total


def _reference_rounds(target_us: float) -> int:
    """Rounds of `_reference_work` that take about `target_us` on this machine."""
    rounds = 1000
    typical = statistics.median(_timed(_reference_work, rounds) for _ in range(21))
    return max(1, round(rounds * target_us / typical))


def _timed(work: Callable[[int], object], rounds: int) -> float:
    start = time.perf_counter_ns()
    work(rounds)
    return (time.perf_counter_ns() - start) / 1000


def measure(
    replicas: int, decisions: int = 2000, warmup: int = 200, seed: int = 7
) -> LatencyResult:
    """Time `decisions` placements on a fleet of `replicas` (after `warmup` untimed ones).

    Between two decisions the harness also times a fixed piece of work as long as the
    median warm-up decision (`reference_*`): on a shared machine, that is the tail the
    scheduler would have if every decision did the same work.
    """
    scheduler, clock, rng, systems, workflows, scrapes = _setup(replicas, seed)
    block_size = scheduler.block_size
    warmup_samples: list[float] = []
    reference_rounds = 0
    reference_samples: list[float] = []
    samples: list[float] = []
    cpu_samples: list[float] = []
    settle_samples: list[float] = []
    total_samples: list[float] = []
    placed = refused = 0
    stream = _stream(rng, systems, workflows, block_size, warmup + decisions)
    for i, (workflow, request) in enumerate(stream):
        cpu_start = time.thread_time_ns()
        start = time.perf_counter_ns()
        result = scheduler.place(request)
        elapsed = time.perf_counter_ns() - start
        cpu_elapsed = time.thread_time_ns() - cpu_start
        settle_start = time.perf_counter_ns()
        scheduler.settle()
        settle_elapsed = time.perf_counter_ns() - settle_start
        if isinstance(result, Placement):
            workflow.replica = result.replica
            _observe(scheduler, rng, request, result, ok=rng.random() > 0.02)
        if i < warmup:
            warmup_samples.append(elapsed / 1000)
        elif i == warmup or not reference_rounds:
            reference_rounds = _reference_rounds(statistics.median(warmup_samples or [50.0]))
        if i >= warmup:
            reference_samples.append(_timed(_reference_work, reference_rounds))
            samples.append(elapsed / 1000)
            cpu_samples.append(cpu_elapsed / 1000)
            settle_samples.append(settle_elapsed / 1000)
            total_samples.append((elapsed + settle_elapsed) / 1000)
            if isinstance(result, Placement):
                placed += 1
            else:
                refused += 1
        scrapes.advance(DECISION_INTERVAL_S)
        clock.now += DECISION_INTERVAL_S
    for values in (samples, cpu_samples, settle_samples, total_samples, reference_samples):
        values.sort()

    def percentile(q: float, values: list[float] = samples) -> float:
        return values[min(len(values) - 1, int(q * len(values)))]

    return LatencyResult(
        replicas=replicas,
        decisions=decisions,
        placed=placed,
        refused=refused,
        p50_us=percentile(0.50),
        p90_us=percentile(0.90),
        p99_us=percentile(0.99),
        max_us=samples[-1],
        mean_us=statistics.fmean(samples),
        cpu_p50_us=percentile(0.50, cpu_samples),
        cpu_p99_us=percentile(0.99, cpu_samples),
        settle_p50_us=percentile(0.50, settle_samples),
        settle_p99_us=percentile(0.99, settle_samples),
        total_p99_us=percentile(0.99, total_samples),
        reference_p50_us=percentile(0.50, reference_samples),
        reference_p99_us=percentile(0.99, reference_samples),
    )

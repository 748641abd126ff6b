"""One policy's run, and one seed's runs, of the policy benchmark.

`run_policy` builds the fleet, the workload's arrivals and the policy, and drives them through
the harness (`kvflow.bench.policies.task_runner`) with the faults of the `faults` workload; a
`RunPlan` says how long arrivals last and which of them count. `run_seed` runs every policy of
a `SeedJob` on one seed at each of its loads, with the bounds of that seed's tasks; `run_seeds`
spreads seeds over processes.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import multiprocessing
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvflow.bench.policies.bounds import (
    BatchingBound,
    KvCapacityFloor,
    SuccessCeiling,
    ZeroMissFloor,
    at_hit_rate,
    batching_bound,
    kv_capacity_floor,
    success_ceiling,
    zero_miss_floor,
)
from kvflow.bench.policies.figures import PolicyFigures, figures
from kvflow.bench.policies.fleet import (
    MODEL,
    engine_config,
    fleet_tenants,
    simulated_replicas,
)
from kvflow.bench.policies.task_runner import CountWindow, Outcome, TaskRunner
from kvflow.scheduler.config import REQUIRED_AXIS, SchedulerConfig
from kvflow.scheduler.fleet import Fleet
from kvflow.scheduler.placement import TIER_PRIORITY_SPAN
from kvflow.simulator.des import DiscreteEventFleet
from kvflow.simulator.policies import ALL_POLICIES, PlacementPolicy, PolicySetup
from kvflow.simulator.policies.base import (
    DEADLINE_PAUSE,
    DEFAULT_MECHANISMS,
    ENGINE_PRIORITY,
    FALLBACK,
    KV_RETENTION,
)
from kvflow.simulator.policies.kvflow_scheduler import LEVERS
from kvflow.simulator.policies.oracle import GREEDY_REFERENCE
from kvflow.simulator.workloads import WORKLOADS, Task, Workload, WorkloadSpec

DOWN_DETECTION_S = 2.0
"""A crashed replica is seen down this long after it crashed (two missed 1 s scrapes)."""
WARMUP_LIFETIMES = 2.0
"""Warm-up arrivals last this many estimated task lifetimes."""
COOLDOWN_LIFETIMES = 1.0
"""Arrivals go on this many lifetimes after the window (the counted tasks' last steps)."""


@dataclass(frozen=True)
class RunPlan:
    """How long arrivals last: warm-up, the counting window, cool-down (seconds)."""

    warmup_s: float
    window_s: float
    cooldown_s: float
    lifetime_s: float
    """The lifetime estimate the plan is built from."""

    @property
    def window(self) -> CountWindow:
        """The counting window."""
        return CountWindow(self.warmup_s, self.warmup_s + self.window_s)

    @property
    def arrivals_until_s(self) -> float:
        """When arrivals stop."""
        return self.warmup_s + self.window_s + self.cooldown_s


def run_plan(
    lifetime_s: float, *, task_rate: float, window_lifetimes: float, min_counted: int = 0
) -> RunPlan:
    """Warm-up of `WARMUP_LIFETIMES` lifetimes, a counting window, a cool-down.

    The window lasts `window_lifetimes` lifetimes, or longer if needed for `min_counted` tasks
    to arrive in it at `task_rate`.
    """
    window = max(window_lifetimes * lifetime_s, min_counted / task_rate)
    return RunPlan(
        warmup_s=WARMUP_LIFETIMES * lifetime_s,
        window_s=window,
        cooldown_s=COOLDOWN_LIFETIMES * lifetime_s,
        lifetime_s=lifetime_s,
    )


# ---------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class PolicyRun:
    """One finished run: its outcome, the harness (decisions, attempts) and the crash time."""

    outcome: Outcome
    runner: TaskRunner
    crash_at: float | None
    """When replica 0 crashed (the `faults` workload), else None."""


def kvflow_config(block_size: int, base: SchedulerConfig | None = None) -> SchedulerConfig:
    """The configuration of kvflow's scheduler for engines of `block_size`-token blocks.

    Its prefix index hashes prompts in `PrefixConfig.block_size` blocks; a deployment whose
    vLLM runs `--block-size 64` sets the same, as llm-d's precise profile does (the simulated
    policy hashes each prompt at the engines' block size).
    """
    config = base or SchedulerConfig()
    if config.prefix.block_size == block_size:
        return config
    prefix = config.prefix.model_copy(update={"block_size": block_size})
    return config.model_copy(update={"prefix": prefix})


def policy_factories() -> dict[str, Callable[[PolicySetup], PlacementPolicy]]:
    """Every policy by name: the compared ones and the greedy reference."""
    return dict(ALL_POLICIES)


def run_policy(
    name: str,
    *,
    spec: WorkloadSpec,
    fleet: Fleet,
    task_rate: float,
    seed: int,
    tasks: int | None = None,
    plan: RunPlan | None = None,
    mechanisms: frozenset[str] = DEFAULT_MECHANISMS,
    extra: dict[str, object] | None = None,
    workload: Workload | None = None,
    record_decisions: bool = False,
    kv_cache_scale: float = 1.0,
    retention_oracle: bool = False,
    kind_oracle: bool = False,
    deadline_pause: bool = False,
    deadline_hold: bool = False,
    even_arrivals: bool = False,
    host_tier: float = 0.0,
) -> PolicyRun:
    """Run one policy on one workload (faults included for `faults`).

    With a `plan`, tasks arrive until `plan.arrivals_until_s` and those in its window count;
    else the first `tasks` tasks arrive and all count. `workload` shares drawn tasks between
    runs of the same spec and seed.

    Two relaxations, for bounds and never for a comparison (`kvflow.bench.policies.
    relaxations`): `kv_cache_scale` gives every engine that multiple of its KV cache (a fleet
    of one pool); `retention_oracle` evicts by each conversation's true return
    (`oracle_retention`), on engines that evict by retention; with `kind_oracle` too, by the
    typical pause (median) of the tool its answer asks for instead of its own. Two more,
    `deadline_pause` and `deadline_hold`, give the engines those `EngineConfig` options;
    `even_arrivals` starts the same tasks evenly spaced (`Workload`), not as a Poisson stream.

    `host_tier` gives every replica host memory for KV blocks of that multiple of its GPU KV
    cache (`EngineConfig.host_tier`, vLLM's native offloading; 0: none), whatever the policy.
    A token copied back from host memory is counted among the call's cached tokens, as vLLM
    reports it (`usage.prompt_tokens_details.cached_tokens`), and billed at the pool's cached
    input price: that assumes the cached price covers the host memory and the copy, as it
    covers the GPU memory a GPU hit holds.
    """
    if not (math.isfinite(host_tier) and host_tier >= 0):
        raise ValueError(f"host_tier must be a multiple of the GPU KV cache ≥ 0, got {host_tier}")
    factories = policy_factories()
    extra = dict(extra or {})
    if name == "kvflow":
        given = extra.get("scheduler_config")
        if given is not None and not isinstance(given, SchedulerConfig):
            raise TypeError("scheduler_config must be a SchedulerConfig")
        extra["scheduler_config"] = kvflow_config(spec.block_size, given)
    if name not in factories:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(factories)}")
    if plan is None and tasks is None:
        raise ValueError("give a plan or a number of tasks")
    if kind_oracle and not (retention_oracle and spec.tools):
        raise ValueError("kind_oracle needs retention_oracle and a workload with tools")
    engine = engine_config(
        spec,
        priority=ENGINE_PRIORITY in mechanisms,
        retention=KV_RETENTION in mechanisms or retention_oracle,
    )
    deadline_pause = deadline_pause or DEADLINE_PAUSE in mechanisms
    if deadline_pause or deadline_hold:
        engine = engine.model_copy(
            update={
                "deadline_pause": deadline_pause,
                "deadline_hold": deadline_hold,
                # Lower tiers pause; the urgent call's own tier runs on (task-level order).
                "deadline_priority_span": TIER_PRIORITY_SPAN,
            }
        )
    if host_tier:
        engine = engine.model_copy(update={"host_tier": host_tier})
    slow = {1: 4.0} if spec.name == "faults" and sum(p.replicas for p in fleet.pools) > 2 else {}
    replicas = simulated_replicas(fleet, slow=slow, engine=engine)
    if kv_cache_scale != 1.0:
        if len(fleet.pools) != 1 or kv_cache_scale <= 0:
            raise ValueError("kv_cache_scale needs a positive scale and a fleet of one pool")
        blocks = next(iter(replicas[0].engines.values())).num_gpu_blocks
        engine = engine.model_copy(update={"num_gpu_blocks": round(blocks * kv_cache_scale)})
        replicas = simulated_replicas(fleet, slow=slow, engine=engine)
    block_size = replicas[0].config.block_size
    if workload is None:
        workload = Workload(
            spec, fleet_tenants(fleet), tasks=1, task_rate=task_rate, seed=seed,
            block_size=block_size, even_arrivals=even_arrivals,
        )  # fmt: skip
    elif even_arrivals != workload.even_arrivals:
        raise ValueError("even_arrivals must match the workload given")
    until = plan.arrivals_until_s if plan is not None else None
    workload = workload.at_rate(task_rate, tasks=None if plan else tasks, until_s=until)
    runner_box: list[TaskRunner] = []
    setup = PolicySetup(
        fleet=fleet,
        replica_names=[n for p in fleet.pools for n in p.replica_names()],
        block_size=block_size,
        clock=lambda: runner_box[0].sim.now,
        tokens_of=workload.tokens_of,
        cache_salts=workload.cache_salts,
        seed=seed,
        extra={
            "mechanisms": mechanisms,
            "priority_dispatch": ENGINE_PRIORITY in mechanisms,
            "allow_fallback": FALLBACK in mechanisms,
            **extra,
        },
    )
    policy = factories[name](setup)
    window = plan.window if plan is not None else None
    runner = TaskRunner(
        fleet,
        replicas,
        policy,
        max_tokens=spec.max_tokens,
        mechanisms=mechanisms,
        window=window,
        model=MODEL,
        typical_output_tokens=spec.output_median,
        record_decisions=record_decisions,
        retention_oracle=retention_oracle,
        kind_pauses={t.name: t.pause_median_s for t in spec.tools} if kind_oracle else None,
    )
    runner_box.append(runner)
    crash_at = (
        window.start + window.seconds / 3 if window is not None else (tasks or 0) / task_rate / 3
    )

    def faults(sim: DiscreteEventFleet) -> None:
        if spec.name != "faults" or len(sim.replicas) < 2:
            return

        def found_down() -> None:
            sim.mark_down(0)
            policy.on_replica_down(0)

        sim.schedule(crash_at, lambda: sim.crash(0))
        sim.schedule(crash_at + DOWN_DETECTION_S, found_down)

    outcome = runner.run(iter(workload), faults)
    return PolicyRun(outcome, runner, crash_at if spec.name == "faults" else None)


# ---------------------------------------------------------------------------- seeds


@dataclass(frozen=True)
class SeedJob:
    """One seed's share of a workload's runs (picklable: it may run in another process)."""

    workload: str
    fleet: Fleet
    seed: int
    loads: tuple[float, ...]
    task_rate_per_load: float
    """Tasks per second at load 1 (the capacity)."""
    lifetime_s: float
    window_lifetimes: float
    min_counted: int
    mechanisms: frozenset[str]
    policies: tuple[str, ...]
    extra: dict[str, dict[str, object]]
    ablate: bool = False
    bounds: bool = True
    """Also compute the bounds: both floors and the success ceiling (at the first load)."""
    relax_scales: tuple[float, ...] = ()
    """With the bounds, also run kvflow on engines with these multiples of their KV cache, to
    read its model time at the KV-capacity floor's hit rate (`SeedResult.model_s_at_floor`)."""
    host_tier: float = 0.0
    """Host memory for KV blocks per replica, as a multiple of its GPU KV cache (`run_policy`)."""


@dataclass
class SeedResult:
    """What one `SeedJob` measured."""

    seed: int
    runs: dict[float, dict[str, PolicyFigures]]
    ablations: dict[str, PolicyFigures]
    floor: ZeroMissFloor | None
    ceiling: SuccessCeiling | None
    capacity_floor: KvCapacityFloor | None = None
    batching: BatchingBound | None = None
    model_s_at_floor: float | None = None
    """kvflow's mean model time at the KV-capacity floor's hit rate, interpolated between its
    runs on larger caches (`SeedJob.relax_scales`); None when not run or not bracketed."""


def _plan(job: SeedJob, rate: float) -> RunPlan:
    return run_plan(
        job.lifetime_s,
        task_rate=rate,
        window_lifetimes=job.window_lifetimes,
        min_counted=job.min_counted,
    )


def run_seed(job: SeedJob, progress: Callable[[str], None] | None = None) -> SeedResult:
    """Run `job.policies` at every load of `job` on its seed (module docstring)."""
    spec = WORKLOADS[job.workload]
    fleet = job.fleet
    block_size = engine_config(spec).block_size
    workload = Workload(
        spec, fleet_tenants(fleet), tasks=1, task_rate=1.0, seed=job.seed, block_size=block_size
    )
    result = SeedResult(job.seed, {}, {}, None, None)
    for number, at in enumerate(job.loads):
        rate = at * job.task_rate_per_load
        plan = _plan(job, rate)
        window = plan.window

        def counted(task: Task, window: CountWindow = window) -> bool:
            return window.start <= task.arrival < window.end

        arrivals = workload.at_rate(rate, until_s=plan.arrivals_until_s)
        floor = zero_miss_floor(arrivals, fleet, block_size=block_size, counted=counted)
        if job.bounds and number == 0:
            result.floor = floor
            result.ceiling = success_ceiling(arrivals, fleet, spec, counted=counted)
            result.capacity_floor = kv_capacity_floor(
                arrivals, fleet, spec, task_rate=rate, counted=counted
            )
            result.batching = batching_bound(arrivals, fleet, spec, task_rate=rate, counted=counted)
        outcomes: dict[str, Outcome] = {}
        for policy in sorted(job.policies, key=lambda n: n != GREEDY_REFERENCE):
            if progress is not None:
                progress(f"{job.workload}, seed {job.seed}, {at:.0%} load: {policy}")
            run = run_policy(
                policy, spec=spec, fleet=fleet, task_rate=rate, seed=job.seed, plan=plan,
                mechanisms=job.mechanisms, extra=job.extra.get(policy), workload=workload,
                host_tier=job.host_tier,
            )  # fmt: skip
            outcomes[policy] = run.outcome
        reference = outcomes.get(GREEDY_REFERENCE)
        reference_hit = 0.0 if reference is None else figures(reference, 0.0).prefix_hit_rate

        def measured(
            outcome: Outcome, floor: ZeroMissFloor = floor, reference_hit: float = reference_hit
        ) -> PolicyFigures:
            return figures(
                outcome,
                reference_hit,
                floor_of_successes_usd=floor.of(outcome.succeeded),
                seed=job.seed,
            )

        result.runs[at] = {p: measured(o) for p, o in outcomes.items()}
        if number == 0 and result.capacity_floor is not None and "kvflow" in outcomes:
            result.model_s_at_floor = _model_s_at_floor(
                job, outcomes["kvflow"], result.capacity_floor, rate, plan, workload, progress
            )
        if job.ablate and number == 0:
            base = job.extra.get("kvflow", {})
            config = base.get("scheduler_config") or SchedulerConfig()
            if not isinstance(config, SchedulerConfig):
                raise TypeError("scheduler_config must be a SchedulerConfig")
            for axis in config.axes:
                if axis == REQUIRED_AXIS:
                    continue
                if progress is not None:
                    progress(f"{job.workload}, seed {job.seed}: kvflow without {axis}")
                # A copy, not a dump and validation: that would mark every field as set
                # by the caller, and `lever_config` refuses fields set against a lever.
                without = config.model_copy(update={"axes": [a for a in config.axes if a != axis]})
                run = run_policy(
                    "kvflow", spec=spec, fleet=fleet, task_rate=rate, seed=job.seed, plan=plan,
                    mechanisms=job.mechanisms, extra={**base, "scheduler_config": without},
                    workload=workload, host_tier=job.host_tier,
                )  # fmt: skip
                result.ablations[axis] = measured(run.outcome)
            for lever, default in LEVERS.items():
                # A lever on by default is switched off, one off by default on.
                name = f"{lever} {'off' if default else 'on'}"
                if progress is not None:
                    progress(f"{job.workload}, seed {job.seed}: kvflow with {name}")
                run = run_policy(
                    "kvflow", spec=spec, fleet=fleet, task_rate=rate, seed=job.seed, plan=plan,
                    mechanisms=job.mechanisms, extra={**base, lever: not default},
                    workload=workload, host_tier=job.host_tier,
                )  # fmt: skip
                result.ablations[name] = measured(run.outcome)
    return result


def _model_s_at_floor(
    job: SeedJob,
    kvflow: Outcome,
    floor: KvCapacityFloor,
    rate: float,
    plan: RunPlan,
    workload: Workload,
    progress: Callable[[str], None] | None,
) -> float | None:
    """The model time at the floor's hit rate: between kvflow's runs on larger KV caches.

    Model time has no closed-form bound where the cache binds: a miss slows every call
    decoding beside the recompute. Larger caches give least-recently-used engines higher hit
    rates; reading model time between them at the floor's hit rate estimates what a policy
    that reached the floor would take (`kvflow.bench.policies.relaxations`).
    """
    if not job.relax_scales:
        return None
    measured = figures(kvflow, 0.0)
    points = [(measured.prefix_hit_rate, measured.mean_model_s)]
    for scale in job.relax_scales:
        if progress is not None:
            progress(f"{job.workload}, seed {job.seed}: kvflow with {scale:g}× the KV cache")
        run = run_policy(
            "kvflow", spec=WORKLOADS[job.workload], fleet=job.fleet, task_rate=rate,
            seed=job.seed, plan=plan, mechanisms=job.mechanisms,
            extra=job.extra.get("kvflow"), workload=workload, kv_cache_scale=scale,
            host_tier=job.host_tier,
        )  # fmt: skip
        larger = figures(run.outcome, 0.0)
        points.append((larger.prefix_hit_rate, larger.mean_model_s))
    return at_hit_rate(points, floor.prefix_hit_rate)


def _silence() -> None:
    """In a worker process: the scheduler's logs are not news here."""
    logging.getLogger("kvflow").setLevel(logging.ERROR)
    logging.getLogger("scheduler").setLevel(logging.ERROR)


def run_seeds(
    jobs: Sequence[SeedJob], *, workers: int, progress: Callable[[str], None] | None = None
) -> list[SeedResult]:
    """Run `jobs`, in `workers` processes when more than one (seeds are independent)."""
    if workers <= 1 or len(jobs) <= 1:
        return [run_seed(job, progress) for job in jobs]
    context = multiprocessing.get_context("fork")
    done: dict[int, SeedResult] = {}
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=min(workers, len(jobs)), mp_context=context, initializer=_silence
    ) as pool:
        futures = {pool.submit(run_seed, job): i for i, job in enumerate(jobs)}
        for future in concurrent.futures.as_completed(futures):
            index = futures[future]
            done[index] = future.result()
            if progress is not None:
                job = jobs[index]
                loads = ", ".join(f"{at:.0%}" for at in job.loads)
                count = f"{len(done)}/{len(jobs)}"
                progress(f"{job.workload}: seed {job.seed} done at {loads} load ({count})")
    return [done[i] for i in range(len(jobs))]

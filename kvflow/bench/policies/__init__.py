"""`kvflow bench policies`: kvflow's placement against the routers platform teams run today.

Every policy (`kvflow.simulator.policies`) runs the same seeded workload
(`kvflow.simulator.workloads`) on the same discrete-event fleet through the same harness
(`kvflow.bench.policies.task_runner`): the same information (what a task declares and what was
observed, never its future), the same mechanisms around placement (engine priority by tier,
a router-side queue with admission, hints; fallback off), the same failure handling. Only
placement differs.

**Load** is a multiple of the fleet's measured capacity (`measure_capacity`): the highest
task rate at which the best placement keeps its goodput rising with the rate and its tier-1
SLO attainment at 99% or more, found by runs of the greedy reference at rising rates on
every seed.

**Runs** (`RunPlan`): arrivals for a warm-up of two task lifetimes, then a counting window,
then a lifetime more, so that the counted tasks live their whole lives under steady load;
only tasks arriving in the window count, and the run stops once they have all ended. A task
lifetime is estimated from the workload's calibration sample on an idle fleet (tool pauses
plus unloaded model time), times `LIFETIME_MARGIN`; each run reports the warm-up in its own
measured lifetimes.

**Bounds.** The zero-miss floor (`zero_miss_floor`) is the cost per successful task no
placement can go below; the KV-capacity floor (`kv_capacity_floor`) the same with the fleet's
KV cache as it is, for any policy that cannot see how long a tool call will run; the success
ceiling (`success_ceiling`) the share of tasks an idle fleet could finish within their
declared budgets; the batching bound (`batching_bound`) the least mean model time with
which the fleet serves the load, whatever the order and placement (checked against every
policy, seed by seed). Model time at the KV-capacity floor's hit rate (`RELAXED_SCALES`) is
an estimate, not a bound.

**Seeds.** Every cell (policy × load) runs on each seed (`kvflow.bench.policies.runs`,
in several processes with `workers`); `kvflow.bench.policies.figures` gives means and 95%
intervals; `goals` states kvflow's against the best anchor and the zero-miss floor.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from kvflow.bench.policies.bounds import (
    BatchingBound,
    KvCapacityFloor,
    SuccessCeiling,
    ZeroMissFloor,
    batching_bound,
    compute_bound_tasks_per_s,
    kv_capacity_floor,
    lifetime_estimate_s,
    success_ceiling,
    zero_miss_floor,
)
from kvflow.bench.policies.figures import (
    Interval,
    PolicyFigures,
    Summary,
    mean_ci,
    money_ci,
    summarise,
)
from kvflow.bench.policies.fleet import bench_fleet, simulated_replicas
from kvflow.bench.policies.runs import (
    DOWN_DETECTION_S,
    PolicyRun,
    RunPlan,
    SeedJob,
    SeedResult,
    policy_factories,
    run_plan,
    run_policy,
    run_seeds,
)
from kvflow.scheduler.fleet import Fleet
from kvflow.simulator.policies import POLICIES
from kvflow.simulator.policies.base import DEFAULT_MECHANISMS
from kvflow.simulator.policies.oracle import GREEDY_REFERENCE
from kvflow.simulator.workloads import WORKLOADS, WorkloadSpec

logger = logging.getLogger(__name__)

CAPACITY_STEP = 1.5
"""Rate ratio between capacity probes."""
CAPACITY_TIER1_SLO = 0.99
CAPACITY_PROBES = 8
PROBE_START = 0.1
"""The first probe's rate, as a share of the compute-only upper bound."""
ANCHORS = ("llm-d", "llm-d-precise", "sglang", "dynamo", "aibrix")
"""The routers the production systems run at their defaults; their `-tuned` variants also
count as anchors (`anchors`)."""


def anchors(names: Iterable[str]) -> list[str]:
    """The anchors among `names`: the production routers and their tuned variants."""
    return [n for n in names if n in ANCHORS or n.endswith("-tuned")]


def role(name: str) -> str:
    """kvflow, anchor, tuned-anchor, reference or baseline."""
    if name == "kvflow":
        return "kvflow"
    if name == GREEDY_REFERENCE:
        return "reference"
    if name.endswith("-tuned"):
        return "tuned-anchor"
    return "anchor" if name in ANCHORS else "baseline"


# ---------------------------------------------------------------------------- capacity


@dataclass(frozen=True)
class Probe:
    """One capacity probe: the rate and what the probe policy reached at it."""

    task_rate: float
    goodput_tasks_per_s: float
    """Success rate × the nominal rate (the arrivals' noise cancels out)."""
    tier1_slo: float | None
    tier1_ceiling: float
    """Tier-1 tasks an idle fleet finishes in time (`success_ceiling`)."""
    rising: bool
    """Tier-1 SLO attainment held at 99% of its ceiling, and goodput rose by at least half
    the rate's rise over the last good probe's."""


@dataclass(frozen=True)
class Capacity:
    """The measured capacity of a fleet for a workload, and the probes behind it."""

    tasks_per_s: float
    probes: list[Probe]
    policy: str
    seeds: list[int]


def measure_capacity(
    spec: WorkloadSpec,
    fleet: Fleet,
    *,
    seeds: Sequence[int],
    lifetime_s: float,
    window_lifetimes: float,
    min_counted: int = 0,
    mechanisms: frozenset[str] = DEFAULT_MECHANISMS,
    policy: str = GREEDY_REFERENCE,
    max_probes: int = CAPACITY_PROBES,
    workers: int = 1,
    progress: Callable[[str], None] | None = None,
    host_tier: float = 0.0,
) -> Capacity:
    """The highest task rate at which `policy` still turns more load into more goodput.

    Probes at rates rising by `CAPACITY_STEP` from `PROBE_START` × the compute bound (falling
    by it while the first fails), each a run on every seed of `seeds` (with the runs' plan):
    a probe is good when the seeds' mean tier-1 SLO attainment is at least 99% of its ceiling
    (what an idle fleet reaches on the same tasks) and their mean goodput rose by at least half
    as much as the rate over the last good probe. Between the last good and the first bad
    probe, one more at their geometric middle. Capacity = the last good rate.
    """

    def probe(rate: float, last: Probe | None) -> Probe:
        if progress is not None:
            progress(f"{spec.name}: capacity probe at {rate:.3g} tasks/s")
        jobs = [
            SeedJob(
                workload=spec.name,
                fleet=fleet,
                seed=seed,
                loads=(1.0,),
                task_rate_per_load=rate,
                lifetime_s=lifetime_s,
                window_lifetimes=window_lifetimes,
                min_counted=min_counted,
                mechanisms=mechanisms,
                policies=(policy,),
                extra={},
                host_tier=host_tier,
            )
            for seed in seeds
        ]
        results = run_seeds(jobs, workers=workers)
        runs = [r.runs[1.0][policy] for r in results]
        ceilings = [r.ceiling.by_tier.get("1", 1.0) for r in results if r.ceiling is not None]
        ceiling = sum(ceilings) / len(ceilings) if ceilings else 1.0
        tiers = [t for run in runs if (t := run.slo_attainment.get("1")) is not None]
        tier1 = sum(tiers) / len(tiers) if tiers else None
        goodput = rate * sum(run.success_rate for run in runs) / len(runs)
        return Probe(
            rate, goodput, tier1, ceiling, still_rising(rate, goodput, tier1, ceiling, last)
        )

    start = compute_bound_tasks_per_s(spec, fleet) * PROBE_START
    rate, probes = search_capacity(start, probe, max_probes)
    return Capacity(rate, probes, policy, list(seeds))


def still_rising(
    rate: float, goodput: float, tier1: float | None, ceiling: float, last: Probe | None
) -> bool:
    """Whether a probe is good (`measure_capacity`).

    Tier-1 SLO attainment ≥ 99% of its `ceiling`, and goodput up by at least half the rate's
    rise over the `last` good probe's (with no good probe yet: goodput ≥ 99% of the rate).
    """
    if tier1 is not None and tier1 < CAPACITY_TIER1_SLO * ceiling:
        return False
    if last is None:
        # The first good probe: almost every task offered succeeds.
        return goodput >= CAPACITY_TIER1_SLO * ceiling * rate
    return goodput >= last.goodput_tasks_per_s * (1 + (rate / last.task_rate - 1) / 2)


def search_capacity(
    start: float, probe: Callable[[float, Probe | None], Probe], max_probes: int
) -> tuple[float, list[Probe]]:
    """(capacity, the probes made) with `probe(rate, last good probe)` (`measure_capacity`)."""
    probes: list[Probe] = []
    rate = start
    good: Probe | None = None
    bad: Probe | None = None
    for _ in range(max_probes):
        result = probe(rate, good)
        probes.append(result)
        if result.rising:
            good = result
            if bad is not None:
                break
            rate *= CAPACITY_STEP
            continue
        bad = result
        if good is not None:
            break
        rate /= CAPACITY_STEP
    if good is not None and bad is not None and bad.task_rate > good.task_rate:
        result = probe(math.sqrt(good.task_rate * bad.task_rate), good)
        probes.append(result)
        if result.rising:
            good = result
    return (good.task_rate if good is not None else rate), probes


# ---------------------------------------------------------------------------- workloads


@dataclass
class Goal:
    """One goal of the benchmark and whether kvflow met it in this run."""

    text: str
    met: bool
    detail: str


@dataclass
class WorkloadResult:
    """Every policy's figures on one workload over seeds, the sweep, the bounds, the goals."""

    name: str
    description: str
    replicas: int
    seeds: list[int]
    load: float
    capacity: Capacity
    plan: RunPlan
    mechanisms: frozenset[str]
    summaries: dict[str, Summary]
    floors: list[ZeroMissFloor]
    ceilings: list[SuccessCeiling]
    capacity_floors: list[KvCapacityFloor] = field(default_factory=list)
    batching: list[BatchingBound] = field(default_factory=list)
    model_s_at_floor: dict[int, float] = field(default_factory=dict)
    """Seed → kvflow's mean model time at the KV-capacity floor's hit rate (`RELAXED_SCALES`),
    on the headline seeds and those run for this estimate alone (`RELAXED_SEEDS`): an
    estimate, not a bound (`RELAXED_SCALES`)."""
    bound_model_s: dict[str, dict[int, float]] = field(default_factory=dict)
    """Policy → seed → mean model time, on the seeds run for that estimate alone."""
    sweep: dict[float, dict[str, Summary]] = field(default_factory=dict)
    ablations: dict[str, Summary] = field(default_factory=dict)
    goals: list[Goal] = field(default_factory=list)
    sources: tuple[str, ...] = ()
    elapsed_s: float = 0.0

    @property
    def task_rate(self) -> float:
        """Tasks per second at the headline load."""
        return self.load * self.capacity.tasks_per_s

    def floor_cost(self) -> Decimal | None:
        """The zero-miss floor's cost per task, mean over seeds."""
        interval = money_ci([f.cost_per_task_usd for f in self.floors if f.cost_per_task_usd])
        return None if interval is None else interval.mean

    def capacity_floor_cost(self) -> Decimal | None:
        """The KV-capacity floor's cost per task, mean over seeds."""
        interval = money_ci(
            [f.cost_per_task_usd for f in self.capacity_floors if f.cost_per_task_usd]
        )
        return None if interval is None else interval.mean

    def capacity_floor_json(self) -> dict[str, Any] | None:
        """`workload.kv_capacity_floor`: the floor, its interval and what knowledge is worth."""
        floors = self.capacity_floors
        cost = money_ci([f.cost_per_task_usd for f in floors if f.cost_per_task_usd])
        if not floors or cost is None:
            return None

        def mean(pick: Callable[[KvCapacityFloor], float]) -> float:
            return round(sum(pick(f) for f in floors) / len(floors), 6)

        return {
            "cost_per_successful_task_usd": str(cost.mean),
            "ci95": cost.as_pair(),
            "prefix_hit_rate": mean(lambda f: f.prefix_hit_rate),
            "clairvoyant_hit_rate": mean(lambda f: f.clairvoyant_hit_rate),
            "one_keep_time_hit_rate": mean(lambda f: f.one_keep_time_hit_rate),
            "demand_over_cache": mean(lambda f: f.demand_over_cache),
            "recompute_s_per_task": mean(lambda f: f.recompute_s_per_task),
            "model_s_at_floor": (
                round(statistics.fmean(self.model_s_at_floor.values()), 6)
                if self.model_s_at_floor
                else None
            ),
        }

    def batching_json(self) -> dict[str, float] | None:
        """`workload.batching_bound`: the batching bound's figures, means over seeds."""
        bounds = self.batching
        if not bounds:
            return None

        def mean(pick: Callable[[BatchingBound], float]) -> float:
            return round(sum(pick(b) for b in bounds) / len(bounds), 6)

        def in_time(tier: str) -> float:
            return mean(lambda b: b.in_time_by_tier.get(tier, 1.0))

        return {
            "tpot_ms": mean(lambda b: b.tpot_s * 1000),
            "idle_tpot_ms": mean(lambda b: b.idle_tpot_s * 1000),
            "prefill_share": mean(lambda b: b.prefill_share),
            "kv_read_share": mean(lambda b: b.kv_read_share),
            "mean_model_s": mean(lambda b: b.mean_model_s),
            "p99_model_s": mean(lambda b: b.p99_model_s),
            **{
                f"in_time_tier_{tier}": in_time(tier)
                for tier in sorted({t for b in bounds for t in b.in_time_by_tier})
            },
        }

    def as_json(self) -> dict[str, Any]:
        """The figures scripts read (benchmarks/README.md describes every key)."""
        floor = money_ci([f.cost_per_task_usd for f in self.floors if f.cost_per_task_usd])
        floor_hit = mean_ci([f.prefix_hit_rate for f in self.floors])
        ceiling = mean_ci([c.overall for c in self.ceilings])
        tiers = sorted({t for c in self.ceilings for t in c.by_tier}, key=int)
        return {
            "workload": {
                "name": self.name,
                "description": self.description,
                "sources": list(self.sources),
                "replicas": self.replicas,
                "seeds": self.seeds,
                "capacity_tasks_per_s": round(self.capacity.tasks_per_s, 6),
                "capacity": {
                    "policy": self.capacity.policy,
                    "seeds": self.capacity.seeds,
                    "probes": [
                        {
                            "task_rate_per_s": round(p.task_rate, 6),
                            "goodput_tasks_per_s": round(p.goodput_tasks_per_s, 6),
                            "tier1_slo": p.tier1_slo,
                            "tier1_ceiling": p.tier1_ceiling,
                            "rising": p.rising,
                        }
                        for p in self.capacity.probes
                    ],
                },
                "load": self.load,
                "task_rate_per_s": round(self.task_rate, 6),
                "mechanisms": sorted(self.mechanisms),
                "warmup_s": round(self.plan.warmup_s, 1),
                "window_s": round(self.plan.window_s, 1),
                "cooldown_s": round(self.plan.cooldown_s, 1),
                "lifetime_estimate_s": round(self.plan.lifetime_s, 1),
                "zero_miss_floor": {
                    "cost_per_successful_task_usd": None if floor is None else str(floor.mean),
                    "ci95": None if floor is None else floor.as_pair(),
                    "prefix_hit_rate": None if floor_hit is None else round(floor_hit.mean, 6),
                },
                "kv_capacity_floor": self.capacity_floor_json(),
                "batching_bound": self.batching_json(),
                "success_ceiling": {
                    "overall": None if ceiling is None else round(ceiling.mean, 6),
                    "by_tier": {
                        t: round(
                            sum(c.by_tier.get(t, 1.0) for c in self.ceilings) / len(self.ceilings),
                            6,
                        )
                        for t in tiers
                    },
                    "idle_mean_model_s": None
                    if not self.ceilings
                    else round(sum(c.mean_model_s for c in self.ceilings) / len(self.ceilings), 3),
                    "idle_p99_model_s": None
                    if not self.ceilings
                    else round(sum(c.p99_model_s for c in self.ceilings) / len(self.ceilings), 3),
                },
                "elapsed_s": round(self.elapsed_s, 1),
            },
            "policies": {
                name: {"role": role(name), **summary.as_json()}
                for name, summary in self.summaries.items()
            },
            "sweep": {
                f"{load:.2f}": {
                    name: _sweep_cell(summary) for name, summary in sorted(cells.items())
                }
                for load, cells in sorted(self.sweep.items())
            },
            "ablations": {axis: s.as_json() for axis, s in self.ablations.items()},
            "goals": [{"goal": g.text, "met": g.met, "detail": g.detail} for g in self.goals],
        }


def _sweep_cell(summary: Summary) -> dict[str, Any]:
    full = summary.as_json()
    keys = (
        "cost_per_successful_task_usd",
        "success_rate",
        "slo_attainment",
        "goodput_tasks_per_s",
        "gpu_seconds_per_successful_task",
        "utilisation",
    )
    cell = {k: full[k] for k in keys}
    cell["ci95"] = {k: full["ci95"][k] for k in keys if k in full["ci95"]}
    if "kvflow_ratio" in full:
        ratios = full["kvflow_ratio"]
        cell["kvflow_ratio"] = {k: ratios[k] for k in keys if k in ratios}
    return cell


def default_sizes(quick: bool, spec: WorkloadSpec) -> tuple[int, float, int, tuple[float, ...]]:
    """(replicas, window in lifetimes, least counted tasks, sweep loads) of a quick or full run.

    A quick run of the KV-bound workload simulates fewer replicas (`quick_replicas`): its
    tasks live for tens of minutes, and two lifetimes of warm-up are a lot of them.
    """
    if quick:
        return spec.quick_replicas, 1.0, 100, (0.5, 1.0, 2.0)
    return 16, 3.0, 500, (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)


RELAXED_SCALES: dict[str, tuple[float, ...]] = {"long-agent": (1.15, 1.3, 1.5)}
"""Workloads whose KV cache binds model time: kvflow also runs on engines with these multiples
of their cache, to estimate model time at the KV-capacity floor's hit rate (`run_seed`): an
estimate, not a bound, since a policy can choose which conversations to miss by recompute
cost, or move recompute off the critical path."""
RELAXED_SEEDS = 10
"""Seeds behind that estimate: with fewer headline seeds, more run for it alone (kvflow and the
anchor best at model time), since five leave an interval too wide to rule a goal out."""


def run_workload(
    name: str,
    *,
    fleet: Fleet | None = None,
    replicas: int = 4,
    seeds: Sequence[int] = (0,),
    load: float | None = None,
    policies: Sequence[str] = tuple(POLICIES),
    sweep_loads: Sequence[float] = (),
    sweep_policies: Sequence[str] | None = None,
    window_lifetimes: float = 1.0,
    min_counted: int = 0,
    mechanisms: frozenset[str] = DEFAULT_MECHANISMS,
    capacity_tasks_per_s: float | None = None,
    capacity_probes: int = CAPACITY_PROBES,
    extra: dict[str, dict[str, object]] | None = None,
    progress: Callable[[str], None] | None = None,
    ablate: bool = False,
    workers: int = 1,
    bound_seeds: int = RELAXED_SEEDS,
    host_tier: float = 0.0,
) -> WorkloadResult:
    """Every policy and the greedy reference on workload `name`, on every seed; the sweep.

    `load` (default: the workload's) and `sweep_loads` are multiples of the capacity, measured
    on every seed unless `capacity_tasks_per_s` is given. `sweep_policies` run at the
    sweep's loads (default: kvflow and the anchor best at `load` on the workload's key
    figure). `extra` maps a policy name to its `PolicySetup.extra`. `ablate` also runs kvflow
    once per axis of its configuration with that axis switched off (`REQUIRED_AXIS`
    excepted), at `load`. `workers` processes share the seeds. Where the KV cache binds model
    time (`RELAXED_SCALES`), its estimate at the KV-capacity floor's hit rate takes `bound_seeds`
    seeds, the headline ones and, where fewer, the next ones run for it alone. `host_tier`
    gives every replica of every run host memory for KV blocks (`run_policy`).
    """
    started = time.perf_counter()
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    spec = WORKLOADS[name]
    load = spec.default_load if load is None else load
    if load <= 0:
        raise ValueError(f"offered load must be positive, got {load}")
    if not seeds:
        raise ValueError("give at least one seed")
    fleet = fleet or bench_fleet(name, replicas)
    lifetime = lifetime_estimate_s(spec, fleet)

    def plan_for(rate: float) -> RunPlan:
        return run_plan(
            lifetime, task_rate=rate, window_lifetimes=window_lifetimes, min_counted=min_counted
        )

    if capacity_tasks_per_s is None:
        capacity = measure_capacity(
            spec, fleet, seeds=seeds, lifetime_s=lifetime, window_lifetimes=window_lifetimes,
            min_counted=min_counted, mechanisms=mechanisms, max_probes=capacity_probes,
            host_tier=host_tier,
            workers=workers, progress=progress,
        )  # fmt: skip
    else:
        capacity = Capacity(capacity_tasks_per_s, [], "given", [])

    # Where the cache binds model time, kvflow's runs on larger caches estimate it (`run_seed`).
    scales = RELAXED_SCALES.get(name, ())

    def job(
        seed: int, loads: Sequence[float], names: Sequence[str], head: bool, *, more: bool = False
    ) -> SeedJob:
        return SeedJob(
            workload=name,
            fleet=fleet,
            seed=seed,
            loads=tuple(loads),
            task_rate_per_load=capacity.tasks_per_s,
            lifetime_s=lifetime,
            window_lifetimes=window_lifetimes,
            min_counted=min_counted,
            mechanisms=mechanisms,
            policies=tuple(names),
            extra=dict(extra or {}),
            ablate=ablate and head and not more,
            bounds=head,
            relax_scales=scales if head else (),
            host_tier=host_tier,
        )

    names = [*policies, GREEDY_REFERENCE]
    heads = run_seeds(
        [job(seed, [load], names, True) for seed in seeds], workers=workers, progress=progress
    )

    def summaries(cell: dict[str, list[PolicyFigures]]) -> dict[str, Summary]:
        kvflow = cell.get("kvflow")
        return {p: summarise(cell[p], kvflow) for p in names if p in cell}

    def gather(results: Sequence[SeedResult], at: float) -> dict[str, list[PolicyFigures]]:
        cell: dict[str, list[PolicyFigures]] = {}
        for seed_result in results:
            for policy, fig in seed_result.runs.get(at, {}).items():
                cell.setdefault(policy, []).append(fig)
        return cell

    headline = gather(heads, load)
    result = WorkloadResult(
        name=name,
        description=spec.description,
        replicas=sum(p.replicas for p in fleet.pools),
        seeds=list(seeds),
        load=load,
        capacity=capacity,
        plan=plan_for(load * capacity.tasks_per_s),
        mechanisms=mechanisms,
        summaries=summaries(headline),
        floors=[h.floor for h in heads if h.floor is not None],
        ceilings=[h.ceiling for h in heads if h.ceiling is not None],
        capacity_floors=[h.capacity_floor for h in heads if h.capacity_floor is not None],
        batching=[h.batching for h in heads if h.batching is not None],
        model_s_at_floor={
            h.seed: h.model_s_at_floor for h in heads if h.model_s_at_floor is not None
        },
        sources=spec.sources,
    )
    best = _best(result, "mean_model_s", low=True)
    if scales and "kvflow" in policies and best is not None and len(seeds) < bound_seeds:
        first = max(seeds) + 1
        more = run_seeds(
            [
                job(seed, [load], ["kvflow", best], True, more=True)
                for seed in range(first, first + bound_seeds - len(seeds))
            ],
            workers=workers,
            progress=progress,
        )
        for seed_result in more:
            if seed_result.model_s_at_floor is not None:
                result.model_s_at_floor[seed_result.seed] = seed_result.model_s_at_floor
            for policy, fig in seed_result.runs[load].items():
                result.bound_model_s.setdefault(policy, {})[seed_result.seed] = fig.mean_model_s
    kvflow_runs = headline.get("kvflow")
    ablated: dict[str, list[PolicyFigures]] = {}
    for head in heads:
        for axis, fig in head.ablations.items():
            ablated.setdefault(axis, []).append(fig)
    result.ablations = {axis: summarise(figs, kvflow_runs) for axis, figs in ablated.items()}
    swept = (
        list(sweep_policies)
        if sweep_policies is not None
        else default_sweep_policies(result, spec, policies)
    )
    others = [at for at in sweep_loads if not math.isclose(at, load)]
    if others and swept:
        sweeps = run_seeds(
            [job(seed, others, swept, False) for seed in seeds],
            workers=workers,
            progress=progress,
        )
        for at in others:
            result.sweep[at] = summaries(gather(sweeps, at))
        result.sweep[load] = {p: s for p, s in result.summaries.items() if p in swept}
    result.goals = goals(result)
    result.elapsed_s = time.perf_counter() - started
    return result


def default_sweep_policies(
    result: WorkloadResult, spec: WorkloadSpec, policies: Sequence[str]
) -> list[str]:
    """Kvflow and the anchor best at the headline load on the workload's key figure."""
    rivals = anchors(p for p in policies if p in result.summaries)
    chosen = ["kvflow"] if "kvflow" in policies else []
    figure = spec.key_figure
    means = {a: m for a in rivals if (m := result.summaries[a].mean(figure)) is not None}
    if means:
        sign = 1.0 if figure == "cost_per_successful_task_usd" else -1.0
        chosen.append(min(means, key=lambda a: sign * means[a]))
    return chosen


# ---------------------------------------------------------------------------- goals


def _ratio_text(summary: Summary, figure: str) -> str:
    """`0.93× [0.90, 0.96]`, and whether the interval holds 1 (no difference measured)."""
    interval = summary.ratios.get(figure)
    if interval is None:
        return "no ratio"
    pair = interval.as_pair()
    if pair is None:
        return f"{interval.mean:.3f}×"
    level = " (the interval holds 1: no difference measured)" if pair[0] <= 1 <= pair[1] else ""
    return f"{interval.mean:.3f}× [{pair[0]:.3f}, {pair[1]:.3f}]{level}"


def _best(result: WorkloadResult, figure: str, *, low: bool) -> str | None:
    """The anchor with the best mean of `figure` (lowest when `low`)."""
    means = {
        a: m
        for a in anchors(result.summaries)
        if (m := result.summaries[a].mean(figure)) is not None
    }
    if not means:
        return None
    return min(means, key=lambda a: means[a] if low else -means[a])


def _ratio_goal(
    result: WorkloadResult, figure: str, text: str, target: float, *, low: bool, bound: str = ""
) -> Goal | None:
    """The ratio of kvflow's `figure` to the best anchor's, seed by seed, against `target`."""
    best = _best(result, figure, low=low)
    if best is None:
        return None
    ratio = result.summaries[best].ratios.get(figure)
    met = ratio is not None and (ratio.mean <= target if low else ratio.mean >= target)
    return Goal(text, met, f"{_ratio_text(result.summaries[best], figure)} {best}{bound}")


def _ceiling_mean(result: WorkloadResult, pick: Callable[[SuccessCeiling], float]) -> float | None:
    values = [pick(c) for c in result.ceilings]
    return sum(values) / len(values) if values else None


def _floor_ratio(result: WorkloadResult, best: str) -> Interval | None:
    """The KV-capacity floor over `best`'s cost, seed by seed (seeds in the same order)."""
    ratios = [
        float(floor.cost_per_task_usd / run.cost_per_successful_task_usd)
        for floor, run in zip(result.capacity_floors, result.summaries[best].runs, strict=False)
        if floor.cost_per_task_usd and run.cost_per_successful_task_usd
    ]
    return mean_ci(ratios)


def _at_floor_ratio(result: WorkloadResult, best: str) -> Interval | None:
    """The model time at the KV-capacity floor's hit rate over `best`'s, seed by seed."""
    theirs = {run.seed: run.mean_model_s for run in result.summaries[best].runs}
    theirs.update(result.bound_model_s.get(best, {}))
    ratios = [
        at_floor / theirs[seed]
        for seed, at_floor in sorted(result.model_s_at_floor.items())
        if theirs.get(seed)
    ]
    return mean_ci(ratios)


def _cost_goal(result: WorkloadResult, target: float) -> Goal | None:
    best = _best(result, "cost_per_successful_task_usd", low=True)
    floor = result.floor_cost()
    capacity = result.capacity_floor_cost()
    bound = ""
    if best is not None and floor is not None:
        cost = result.summaries[best].mean("cost_per_successful_task_usd") or 0.0
        if cost:
            bound = (
                f"; bound: no placement goes below the zero-miss floor, {float(floor) / cost:.3f}×"
            )
        ratio = _floor_ratio(result, best)
        if cost and capacity is not None and capacity > floor and ratio is not None:
            pair = ratio.as_pair()
            spread = "" if pair is None else f" [{pair[0]:.3f}, {pair[1]:.3f}]"
            bound += (
                ", and no policy that cannot see how long a tool will run goes below the "
                f"KV-capacity floor, {ratio.mean:.3f}×{spread}"
            )
    return _ratio_goal(
        result,
        "cost_per_successful_task_usd",
        f"cost per successful task ≤ {target}× the best anchor's",
        target,
        low=True,
        bound=bound,
    )


def _model_time_goal(result: WorkloadResult, figure: str, target: float) -> Goal | None:
    best = _best(result, figure, low=True)
    idle = _ceiling_mean(
        result,
        (lambda c: c.mean_model_s) if figure == "mean_model_s" else (lambda c: c.p99_model_s),
    )
    recompute = 0.0
    if figure == "mean_model_s" and result.capacity_floors:
        floors = result.capacity_floors
        recompute = sum(f.recompute_s_per_task for f in floors) / len(floors)
    # Only the mean has a batching bound: a schedule may speed its slowest tasks (the p99)
    # at the others' cost, so the mean pace bounds no percentile.
    batched = (
        sum(b.mean_model_s for b in result.batching) / len(result.batching)
        if result.batching and figure == "mean_model_s"
        else 0.0
    )
    bound = ""
    if best is not None and idle:
        theirs = result.summaries[best].mean(figure) or 0.0
        if theirs and batched > idle + recompute:
            bound = (
                f"; bound: an idle fleet with every conversation cached takes {idle:.1f} s, "
                f"but at this load calls share their engines: serving it, no order or "
                f"placement gets the mean model time below {batched:.1f} s (each step reads "
                f"the weights once and every sequence's context, and the replicas' time "
                f"limits the steps): {batched / theirs:.2f}×"
            )
        elif theirs and recompute >= 0.05:
            bound = (
                f"; bound: an idle fleet with every conversation cached takes {idle:.1f} s, "
                f"and recomputing what the KV-capacity floor misses adds {recompute:.1f} s: "
                f"{(idle + recompute) / theirs:.2f}×; a miss also slows the calls beside it"
            )
            at_floor = _at_floor_ratio(result, best)
            if at_floor is not None:
                pair = at_floor.as_pair()
                spread = "" if pair is None else f" [{pair[0]:.3f}, {pair[1]:.3f}]"
                scales = RELAXED_SCALES.get(result.name, ())
                bound += (
                    f"; estimate, not a bound: at the KV-capacity floor's hit rate model time "
                    f"is about {at_floor.mean:.3f}×{spread} over {at_floor.n} seeds (kvflow on "
                    f"engines with {', '.join(f'{s:g}' for s in scales)}× the KV cache, read "
                    "at the floor's hit rate seed by seed; a policy can pick which "
                    "conversations to miss by recompute cost, or recompute off the critical "
                    "path)"
                )
            # Clairvoyant eviction, the other route to the floor: the relaxations.
            mechanisms = ",".join(sorted(result.mechanisms))
            bound += (
                "; engines evicting the conversation back last: `python -m "
                f"kvflow.bench.policies.relaxations --workload {result.name} --capacity "
                f"{result.capacity.tasks_per_s:.4g} --load {result.load:g} --replicas "
                f"{result.replicas} --anchor {best} --mechanisms {mechanisms} "
                f"--seeds {RELAXED_SEEDS}` "
                "(docs/benchmarks/bounds.md)"
            )
        elif theirs:
            bound = (
                f"; bound: an idle fleet with every conversation cached takes {idle:.1f} s, "
                f"{idle / theirs:.2f}×"
            )
    label = "mean" if figure == "mean_model_s" else "p99"
    return _ratio_goal(
        result, figure, f"{label} model time ≤ {target}× the best anchor's", target, low=True,
        bound=bound,
    )  # fmt: skip


def batching_checks(result: WorkloadResult) -> list[tuple[int, float, dict[str, float]]]:
    """Per seed: (seed, the batching bound, each policy's mean model time).

    Only policies that finish every counted task: another's mean covers its successes only.
    Empty where the bound is missing on a seed (a fleet of several GPUs, an overload).
    """
    if not result.batching or len(result.batching) != len(result.seeds):
        return []
    checks: list[tuple[int, float, dict[str, float]]] = []
    for seed, bound in zip(result.seeds, result.batching, strict=True):
        measured = {
            policy: run.mean_model_s
            for policy, summary in result.summaries.items()
            for run in summary.runs
            if run.seed == seed and run.success_rate == 1.0
        }
        checks.append((seed, bound.mean_model_s, measured))
    return checks


def _batching_check_goal(result: WorkloadResult) -> Goal | None:
    """Whether the batching bound is at or below every policy's mean model time, per seed.

    A policy below it means the bound's derivation no longer matches the engine: logged as
    an error as well as printed.
    """
    checks = batching_checks(result)
    if not checks:
        return None
    lines: list[str] = []
    holds = True
    for seed, bound, measured in checks:
        if not measured:
            lines.append(f"seed {seed}: {bound:.2f} s, no policy finished every task")
            continue
        least = min(measured, key=lambda p: measured[p])
        ok = all(seconds >= bound for seconds in measured.values())
        holds = holds and ok
        lines.append(
            f"seed {seed}: bound holds: {'yes' if ok else 'no'} ({bound:.2f} s; least "
            f"{measured[least]:.2f} s, {least})"
        )
    if not holds:
        logger.error(
            "%s: the batching bound is above a policy's mean model time: %s",
            result.name,
            "; ".join(lines),
        )
    return Goal("batching bound ≤ every policy's mean model time", holds, "; ".join(lines))


def _goodput_goal(result: WorkloadResult, target: float) -> Goal | None:
    best = _best(result, "goodput_tasks_per_s", low=False)
    ceiling = _ceiling_mean(result, lambda c: c.overall)
    bound = ""
    if best is not None and ceiling is not None:
        # Goodput is the counted tasks' successes over the window: no policy finishes more
        # than the idle fleet's share of the same tasks.
        success = result.summaries[best].mean("success_rate") or 0.0
        if success:
            bound = (
                f"; bound: at most {ceiling / success:.3f}× ({best} finishes {success:.1%} of "
                f"the tasks, an idle fleet {ceiling:.1%})"
            )
    return _ratio_goal(
        result, "goodput_tasks_per_s", f"goodput ≥ {target}× the best anchor's", target,
        low=False, bound=bound,
    )  # fmt: skip


def _tier1_goal(result: WorkloadResult, target: float) -> Goal | None:
    kvflow = result.summaries["kvflow"].slo.get("1")
    if kvflow is None:
        return None
    ceiling = _ceiling_mean(result, lambda c: c.by_tier.get("1", 1.0))
    bound = "" if ceiling is None else f"; bound: an idle fleet finishes {ceiling:.1%} of them"
    # What the anchors keep under the same load: where none reaches the goal either, the load
    # (a burst's prefills beside tier 1's steps), not kvflow's placement, is what misses it.
    kept = {a: i.mean for a in anchors(result.summaries) if (i := result.summaries[a].slo.get("1"))}
    if kept:
        best = max(kept, key=lambda a: kept[a])
        bound += f"; the best anchor keeps {kept[best]:.1%} ({best})"
    if result.batching:
        # At the least mean pace the load allows, do tier 1's steps fit? Where they do, the
        # load does not rule the goal out: what misses it is tier 1 batched above the mean.
        paced = sum(b.in_time_by_tier.get("1", 1.0) for b in result.batching)
        paced /= len(result.batching)
        tpot_ms = sum(b.tpot_s for b in result.batching) / len(result.batching) * 1000
        bound += (
            f"; every output token at the batching bound's {tpot_ms:.1f} ms, {paced:.1%} fit"
            + (", so the load alone does not rule the goal out" if paced >= target else "")
        )
    return Goal(
        f"tier-1 SLO attainment ≥ {target:.0%} at {result.load:.0%} of capacity",
        kvflow.mean >= target,
        f"{kvflow.mean:.1%} [{_pair_text(kvflow)}]{bound}",
    )


def _pair_text(interval: Interval) -> str:
    pair = interval.as_pair()
    return "one seed" if pair is None else f"{pair[0]:.1%}, {pair[1]:.1%}"


def _waste_goal(result: WorkloadResult) -> Goal | None:
    best = _best(result, "goodput_tasks_per_s", low=False)
    ours = result.summaries["kvflow"].mean("wasted_spend_share")
    if best is None or ours is None:
        return None
    theirs = result.summaries[best].mean("wasted_spend_share") or 0.0
    return Goal(
        "wasted-spend share ≤ half the best anchor's",
        ours <= theirs / 2,
        f"{ours:.2%} vs {theirs:.2%} ({best}, best at goodput); bound: 0, a policy that admits "
        "only tasks it finishes wastes nothing",
    )


def _floor_goal(result: WorkloadResult, target: float) -> Goal | None:
    floor = result.floor_cost()
    ours = result.summaries["kvflow"].mean("cost_per_successful_task_usd")
    if floor is None or not ours:
        return None
    ratio = ours / float(floor)
    detail = (
        f"{ratio:.3f}× the floor (the floor is the bound: every call finds cached all that an "
        "earlier call computed)"
    )
    capacity = result.capacity_floor_cost()
    if capacity is not None and capacity > floor:
        detail += (
            f"; with the fleet's KV cache no policy that cannot see how long a tool will run "
            f"goes below {float(capacity / floor):.3f}× it (the KV-capacity floor)"
        )
    best = _best(result, "cost_per_successful_task_usd", low=True)
    theirs = None if best is None else result.summaries[best].mean("cost_per_successful_task_usd")
    if best is not None and theirs:
        # Level with the best anchor, the rest of the gap is the engines' eviction order, which
        # no placement changes (benchmarks/README.md: task-end, larger caches, the oracle).
        detail += f"; the best anchor is at {theirs / float(floor):.3f}× ({best})"
    return Goal(
        f"cost per successful task within {target - 1:.0%} of the zero-miss floor",
        ratio <= target,
        detail,
    )


def _hotspot_goals(result: WorkloadResult) -> list[Goal]:
    kvflow = result.summaries["kvflow"]
    over = kvflow.mean("max_replica_load_over_mean") or 0.0
    found = [Goal("busiest replica ≤ 1.5× the mean", over <= 1.5, f"{over:.2f}× the mean")]
    floor_hit = mean_ci([f.prefix_hit_rate for f in result.floors])
    hit = kvflow.mean("prefix_hit_rate")
    if floor_hit is not None and hit is not None:
        found.append(
            Goal(
                "hit rate within 1 point of the zero-miss floor's",
                floor_hit.mean - hit <= 0.01,
                f"{hit:.1%} vs the floor's {floor_hit.mean:.1%}",
            )
        )
    return found


def _no_worse_goal(result: WorkloadResult) -> Goal | None:
    best = _best(result, "cost_per_successful_task_usd", low=True)
    if best is None:
        return None
    ratio = result.summaries[best].ratios.get("cost_per_successful_task_usd")
    pair = None if ratio is None else ratio.as_pair()
    met = ratio is not None and (ratio.mean <= 1.0 if pair is None else pair[0] <= 1.0)
    return Goal(
        "cost per successful task no worse than the best anchor's beyond the interval",
        met,
        f"{_ratio_text(result.summaries[best], 'cost_per_successful_task_usd')} {best}",
    )


LOADED_AGENT = 0.9
"""From this multiple of capacity on, the agent workload's goals are about model time."""


def goals(result: WorkloadResult) -> list[Goal]:
    """The goals of the workload, each against the best anchor at its figure, with a bound.

    The bound explains a miss: the zero-miss and KV-capacity floors, or the idle fleet.

    overload: goodput ≥ 1.3×, tier-1 SLO ≥ 99%, wasted share ≤ half; long-agent: cost
    ≤ 0.85×, mean model time ≤ 0.8×; agent near capacity (≥ 0.9×): mean model time ≤ 0.7×,
    p99 ≤ 0.8×; agent below: cost within 2% of the floor; hotspot: busiest replica ≤ 1.5× the
    mean, hit rate within 1 point of the floor's; heterogeneous and faults: cost no worse
    than the best anchor's beyond the interval. Wherever the batching bound is given, a last
    line checks it against every policy, seed by seed (`batching_checks`).
    """
    if "kvflow" not in result.summaries:
        return []
    found: list[Goal | None]
    name = result.name
    if name == "overload":
        found = [_goodput_goal(result, 1.3), _tier1_goal(result, 0.99), _waste_goal(result)]
    elif name == "long-agent":
        found = [_cost_goal(result, 0.85), _model_time_goal(result, "mean_model_s", 0.8)]
    elif name == "agent" and result.load >= LOADED_AGENT:
        found = [
            _model_time_goal(result, "mean_model_s", 0.7),
            _model_time_goal(result, "p99_model_s", 0.8),
            _tier1_goal(result, 0.99),
        ]
    elif name == "agent":
        found = [_floor_goal(result, 1.02), _cost_goal(result, 0.85)]
    elif name == "hotspot":
        found = list(_hotspot_goals(result))
    else:
        found = [_no_worse_goal(result)]
    found.append(_batching_check_goal(result))
    return [g for g in found if g is not None]


__all__ = [
    "ANCHORS",
    "DOWN_DETECTION_S",
    "BatchingBound",
    "Capacity",
    "Goal",
    "KvCapacityFloor",
    "PolicyRun",
    "Probe",
    "RunPlan",
    "WorkloadResult",
    "ZeroMissFloor",
    "batching_bound",
    "bench_fleet",
    "kv_capacity_floor",
    "measure_capacity",
    "policy_factories",
    "run_plan",
    "run_policy",
    "run_workload",
    "search_capacity",
    "simulated_replicas",
    "still_rising",
    "success_ceiling",
    "zero_miss_floor",
]

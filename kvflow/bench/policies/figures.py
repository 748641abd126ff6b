"""Figures of the policy benchmark: one run's, and their means and 95% intervals over seeds.

One run (`figures`):

- cost per successful task = all spend of the counted tasks (failed attempts and failed tasks
  included) / their successful tasks, an exact `Decimal`;
- GPU-seconds per successful task = engine busy time × GPUs per replica over the counting
  window / successful tasks (a replica decoding one sequence counts as busy);
- success rate and SLO attainment per tier = successful / all counted tasks (of the tier);
  a task degraded to a cheaper model is not a success (`degraded_rate`);
- goodput = successful counted tasks / the window's seconds;
- task time = arrival to end; model time = task time less the task's own tool pauses (what
  the task waited for the fleet: queues, prefill, decode, retries); mean and p99 over the
  successful counted tasks;
- TTFT over every finished attempt; prefix hit rate = cached / prompt tokens;
- wasted-spend share = spend of failed tasks / all spend; busiest replica's share of attempts
  and that share over the mean.

Over seeds (`summarise`): the mean of each figure, and a 95% confidence interval from
Student's t with n − 1 degrees of freedom (mean ± t · s / √n). Ratios to kvflow are taken
seed by seed (the same tasks on both sides) and then averaged, with their own interval.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from kvflow.bench.policies.task_runner import Outcome
from kvflow.scheduler.fleet import MICROS_PER_USD

HEADLINE = (
    "cost_per_successful_task_usd",
    "gpu_seconds_per_successful_task",
    "success_rate",
    "slo_attainment",
    "goodput_tasks_per_s",
    "mean_task_s",
    "p99_task_s",
    "mean_model_s",
    "p99_model_s",
    "prefix_hit_rate",
    "max_replica_load_over_mean",
    "wasted_spend_share",
)
"""The figures given as a mean and a 95% interval over seeds, and as ratios to kvflow."""
OTHER = (
    "degraded_rate",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "utilisation",
    "max_replica_load_share",
    "refusals",
    "failed_attempts",
    "mean_lifetime_s",
    "warmup_task_lifetimes",
    "kv_demand",
)
"""Figures given as a mean over seeds only."""

# Student's t, two-sided 95% (0.975 quantile), for 1 to 30 degrees of freedom.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom (df ≥ 1).

    A table to 30, then the Cornish–Fisher expansion around the normal's 1.95996 (within
    0.001 of the exact value beyond 30).
    """
    if df < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank `q` percentile (0 < q ≤ 1) of `values`; 0 when there are none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def cost_per_success(spend_micros: int, successes: int) -> Decimal | None:
    """Spend / successes in dollars, exact to the nano-dollar (rounded half even)."""
    if not successes:
        return None
    return (Decimal(spend_micros) / successes / MICROS_PER_USD).quantize(Decimal("1e-9"))


@dataclass
class PolicyFigures:
    """The figures of one policy in one run (see `figures`)."""

    policy: str
    tasks: int
    successes: int
    spend_micros: int
    wasted_micros: int
    cost_per_successful_task_usd: Decimal | None
    """Total spend / successful tasks, exact; None when no task succeeded."""
    success_rate: float
    slo_attainment: dict[str, float]
    """Tier → successful tasks of that tier / its tasks."""
    goodput_tasks_per_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    prefix_hit_rate: float
    reference_prefix_hit_rate: float
    wasted_spend_share: float
    utilisation: float
    max_replica_load_share: float
    max_replica_load_over_mean: float
    refusals: int
    failed_attempts: int
    mean_lifetime_s: float = 0.0
    """Mean time from a counted task's arrival to its end, failed tasks included."""
    warmup_task_lifetimes: float = 0.0
    """The warm-up lasted this many mean task lifetimes (the goal: at least 2)."""
    gpu_seconds_per_successful_task: float | None = None
    degraded_rate: float = 0.0
    mean_task_s: float = 0.0
    p99_task_s: float = 0.0
    mean_model_s: float = 0.0
    p99_model_s: float = 0.0
    floor_of_successes_usd: Decimal | None = None
    """The zero-miss floor of the very tasks this policy completed (no survivor bias)."""
    kv_demand: float = 0.0
    """Open conversations' tokens over the fleet's KV-cache tokens, mean over the window."""
    seed: int = 0

    def value(self, name: str) -> float | Decimal | dict[str, float] | None:
        """A figure by name (`HEADLINE`, `OTHER`)."""
        value = getattr(self, name)
        if isinstance(value, int | float | Decimal | dict) or value is None:
            return value
        raise TypeError(f"{name} is not a figure")

    def as_json(self) -> dict[str, Any]:
        """One run's figures; money as exact decimal strings."""
        return {
            "seed": self.seed,
            "cost_per_successful_task_usd": _money(self.cost_per_successful_task_usd),
            "gpu_seconds_per_successful_task": _round(self.gpu_seconds_per_successful_task),
            "success_rate": round(self.success_rate, 6),
            "degraded_rate": round(self.degraded_rate, 6),
            "slo_attainment": {k: round(v, 6) for k, v in self.slo_attainment.items()},
            "goodput_tasks_per_s": round(self.goodput_tasks_per_s, 6),
            "mean_task_s": round(self.mean_task_s, 3),
            "p99_task_s": round(self.p99_task_s, 3),
            "mean_model_s": round(self.mean_model_s, 3),
            "p99_model_s": round(self.p99_model_s, 3),
            "ttft_p50_s": round(self.ttft_p50_s, 6),
            "ttft_p90_s": round(self.ttft_p90_s, 6),
            "ttft_p99_s": round(self.ttft_p99_s, 6),
            "prefix_hit_rate": round(self.prefix_hit_rate, 6),
            "reference_prefix_hit_rate": round(self.reference_prefix_hit_rate, 6),
            "wasted_spend_share": round(self.wasted_spend_share, 6),
            "utilisation": round(self.utilisation, 6),
            "max_replica_load_share": round(self.max_replica_load_share, 6),
            "max_replica_load_over_mean": round(self.max_replica_load_over_mean, 6),
            "tasks": self.tasks,
            "successful_tasks": self.successes,
            "spend_micros": self.spend_micros,
            "wasted_spend_micros": self.wasted_micros,
            "refusals": self.refusals,
            "failed_attempts": self.failed_attempts,
            "mean_lifetime_s": round(self.mean_lifetime_s, 3),
            "warmup_task_lifetimes": round(self.warmup_task_lifetimes, 3),
            "floor_of_successes_usd": _money(self.floor_of_successes_usd),
            "kv_demand": round(self.kv_demand, 4),
        }


def _money(value: Decimal | None) -> str | None:
    return None if value is None else str(value)


def _round(value: float | None, places: int = 6) -> float | None:
    return None if value is None else round(value, places)


def figures(
    outcome: Outcome,
    reference_hit_rate: float,
    *,
    floor_of_successes_usd: Decimal | None = None,
    seed: int = 0,
) -> PolicyFigures:
    """The figures of one run (module docstring); `reference_hit_rate`: greedy-reference's."""
    attempts = outcome.attempts_by_replica
    total_attempts = sum(attempts)
    busiest = max(attempts) if attempts else 0
    span = outcome.span_s
    successes = outcome.successes
    return PolicyFigures(
        policy=outcome.policy,
        seed=seed,
        tasks=outcome.tasks,
        successes=successes,
        spend_micros=outcome.spend_micros,
        wasted_micros=outcome.wasted_micros,
        cost_per_successful_task_usd=cost_per_success(outcome.spend_micros, successes),
        gpu_seconds_per_successful_task=outcome.busy_gpu_s / successes if successes else None,
        success_rate=successes / outcome.tasks if outcome.tasks else 0.0,
        degraded_rate=outcome.degraded / outcome.tasks if outcome.tasks else 0.0,
        slo_attainment={
            str(tier): outcome.successes_by_tier.get(tier, 0) / count
            for tier, count in sorted(outcome.tasks_by_tier.items())
        },
        goodput_tasks_per_s=successes / span if span > 0 else 0.0,
        ttft_p50_s=percentile(outcome.ttfts, 0.50),
        ttft_p90_s=percentile(outcome.ttfts, 0.90),
        ttft_p99_s=percentile(outcome.ttfts, 0.99),
        prefix_hit_rate=(
            outcome.cached_tokens / outcome.prompt_tokens if outcome.prompt_tokens else 0.0
        ),
        reference_prefix_hit_rate=reference_hit_rate,
        wasted_spend_share=(
            outcome.wasted_micros / outcome.spend_micros if outcome.spend_micros else 0.0
        ),
        utilisation=outcome.busy_s / (outcome.replicas * span) if span > 0 else 0.0,
        max_replica_load_share=busiest / total_attempts if total_attempts else 0.0,
        max_replica_load_over_mean=(
            busiest * len(attempts) / total_attempts if total_attempts else 0.0
        ),
        refusals=outcome.refusals,
        failed_attempts=outcome.failed_attempts,
        mean_lifetime_s=outcome.mean_task_s,
        warmup_task_lifetimes=(
            outcome.warmup_s / outcome.mean_task_s if outcome.mean_task_s > 0 else 0.0
        ),
        mean_task_s=statistics.fmean(outcome.task_times) if outcome.task_times else 0.0,
        p99_task_s=percentile(outcome.task_times, 0.99),
        mean_model_s=statistics.fmean(outcome.model_times) if outcome.model_times else 0.0,
        p99_model_s=percentile(outcome.model_times, 0.99),
        floor_of_successes_usd=floor_of_successes_usd,
        kv_demand=outcome.kv_demand,
    )


# ---------------------------------------------------------------------------- over seeds


@dataclass(frozen=True)
class Interval:
    """A mean over seeds and its 95% interval (None with fewer than two values)."""

    mean: float
    low: float | None
    high: float | None
    n: int

    def as_pair(self) -> list[float] | None:
        """[low, high], or None without an interval."""
        if self.low is None or self.high is None:
            return None
        return [round(self.low, 6), round(self.high, 6)]


@dataclass(frozen=True)
class MoneyInterval:
    """A mean over seeds of an amount of money and its 95% interval, exact decimals."""

    mean: Decimal
    low: Decimal | None
    high: Decimal | None
    n: int

    def as_pair(self) -> list[str] | None:
        """[low, high] as decimal strings, or None without an interval."""
        if self.low is None or self.high is None:
            return None
        return [str(self.low), str(self.high)]


def mean_ci(values: Sequence[float]) -> Interval | None:
    """The mean of `values` and its Student-t 95% interval; None when empty."""
    n = len(values)
    if not n:
        return None
    mean = statistics.fmean(values)
    if n < 2:
        return Interval(mean, None, None, n)
    half = t975(n - 1) * statistics.stdev(values) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


_NANO = Decimal("1e-9")


def money_ci(values: Sequence[Decimal]) -> MoneyInterval | None:
    """`mean_ci` in exact decimals (to the nano-dollar)."""
    n = len(values)
    if not n:
        return None
    mean = sum(values, Decimal(0)) / n
    if n < 2:
        return MoneyInterval(mean.quantize(_NANO), None, None, n)
    variance = sum(((v - mean) ** 2 for v in values), Decimal(0)) / (n - 1)
    half = Decimal(str(t975(n - 1))) * variance.sqrt() / Decimal(n).sqrt()
    return MoneyInterval(
        mean.quantize(_NANO), (mean - half).quantize(_NANO), (mean + half).quantize(_NANO), n
    )


@dataclass
class Summary:
    """One policy's figures over seeds: means, intervals, and ratios to kvflow."""

    policy: str
    runs: list[PolicyFigures]
    cost: MoneyInterval | None = None
    intervals: dict[str, Interval | None] = field(default_factory=dict)
    slo: dict[str, Interval | None] = field(default_factory=dict)
    ratios: dict[str, Interval | None] = field(default_factory=dict)
    """Figure → kvflow's / this policy's, seed by seed (below 1: kvflow's is lower)."""
    slo_ratios: dict[str, Interval | None] = field(default_factory=dict)

    def mean(self, name: str) -> float | None:
        """The mean over seeds of a figure (cost as a float); None when undefined."""
        if name == "cost_per_successful_task_usd":
            return None if self.cost is None else float(self.cost.mean)
        interval = self.intervals.get(name)
        return None if interval is None else interval.mean

    def as_json(self) -> dict[str, Any]:
        """Means at the top, `ci95.<figure>` = [low, high], ratios to kvflow, and every run."""
        out: dict[str, Any] = {"seeds": len(self.runs)}
        ci: dict[str, Any] = {}
        out["cost_per_successful_task_usd"] = None if self.cost is None else str(self.cost.mean)
        ci["cost_per_successful_task_usd"] = None if self.cost is None else self.cost.as_pair()
        for name, interval in self.intervals.items():
            out[name] = None if interval is None else round(interval.mean, 6)
            if name in HEADLINE:
                ci[name] = None if interval is None else interval.as_pair()
        slo = self.slo.items()
        out["slo_attainment"] = {t: None if i is None else round(i.mean, 6) for t, i in slo}
        ci["slo_attainment"] = {t: None if i is None else i.as_pair() for t, i in slo}
        out["ci95"] = ci
        if self.ratios or self.slo_ratios:
            out["kvflow_ratio"] = {
                n: None if i is None else round(i.mean, 6) for n, i in self.ratios.items()
            }
            out["kvflow_ratio"]["slo_attainment"] = {
                t: None if i is None else round(i.mean, 6) for t, i in self.slo_ratios.items()
            }
            out["kvflow_ratio_ci95"] = {
                n: None if i is None else i.as_pair() for n, i in self.ratios.items()
            }
            out["kvflow_ratio_ci95"]["slo_attainment"] = {
                t: None if i is None else i.as_pair() for t, i in self.slo_ratios.items()
            }
        out["runs"] = [run.as_json() for run in self.runs]
        return out


def _number(value: object) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float | Decimal):
        return float(value)
    return None


def summarise(runs: Sequence[PolicyFigures], kvflow: Sequence[PolicyFigures] | None) -> Summary:
    """Means and 95% intervals over `runs` (one per seed), and ratios to `kvflow`'s runs.

    Ratios are paired by seed: `kvflow`'s figure over this policy's.
    """
    summary = Summary(policy=runs[0].policy if runs else "", runs=list(runs))
    costs = [r.cost_per_successful_task_usd for r in runs]
    summary.cost = money_ci([c for c in costs if c is not None])
    for name in (*HEADLINE, *OTHER):
        if name in ("cost_per_successful_task_usd", "slo_attainment"):
            continue
        values = [v for r in runs if (v := _number(r.value(name))) is not None]
        summary.intervals[name] = mean_ci(values)
    tiers = sorted({t for r in runs for t in r.slo_attainment}, key=int)
    for tier in tiers:
        attained = [r.slo_attainment[tier] for r in runs if tier in r.slo_attainment]
        summary.slo[tier] = mean_ci(attained)
    if kvflow is None:
        return summary
    ours = {r.seed: r for r in kvflow}
    for name in HEADLINE:
        if name == "slo_attainment":
            continue
        ratios: list[float] = []
        for run in runs:
            mine = ours.get(run.seed)
            if mine is None:
                continue
            top, bottom = _number(mine.value(name)), _number(run.value(name))
            if top is not None and bottom:
                ratios.append(top / bottom)
        summary.ratios[name] = mean_ci(ratios)
    for tier in tiers:
        ratios = []
        for run in runs:
            mine = ours.get(run.seed)
            if mine is None or tier not in mine.slo_attainment:
                continue
            bottom = run.slo_attainment.get(tier)
            if bottom:
                ratios.append(mine.slo_attainment[tier] / bottom)
        summary.slo_ratios[tier] = mean_ci(ratios)
    return summary

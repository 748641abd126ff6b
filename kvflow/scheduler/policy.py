"""The configured axes run as one policy: refresh a replica, filter and score it, bound it.

`Policy` knows the shape of the objective, not any one axis:

    J = cost_per_success(cost, at risk, p) × penalty × Π factors

where the axes fill in cost, the sunk cost at risk and P(success) while they filter
(`Axis.evaluate`), the replica's penalty is the product of their request-independent terms
(`Axis.refresh`) and the factors are their per-decision ones (`Axis.factor`), multiplied in
configuration order.
"""

from __future__ import annotations

import math

from kvflow.scheduler.axes import Axis
from kvflow.scheduler.decision import Decision, Estimate, Filter, cost_per_success
from kvflow.scheduler.fleet import ModelSpec
from kvflow.scheduler.placement import Observation
from kvflow.scheduler.state import ReplicaState


class Policy:
    """The axes `SchedulerConfig.axes` names, applied in that order to the fleet's replicas."""

    def __init__(self, axes: list[Axis], replicas: list[ReplicaState]) -> None:
        self.axes = axes
        self._replicas = replicas

    def refresh(self, state: ReplicaState) -> None:
        """Recompute the replica's request-independent terms and its static factor."""
        state.p_static = 1.0
        state.penalty = 1.0
        for axis in self.axes:
            axis.refresh(state)
        p = state.p_static
        state.static_factor = math.inf if p <= 0.0 else state.penalty / p

    def refresh_load(self, state: ReplicaState) -> None:
        """After a placement on the replica: its load-dependent terms."""
        for axis in self.axes:
            axis.refresh_load(state)

    def record(self, state: ReplicaState, model: ModelSpec, observation: Observation) -> None:
        """Fold a successful call into every axis's estimates."""
        for axis in self.axes:
            axis.record(state, model, observation)

    def observed(self, observation: Observation, now: float) -> None:
        """Any call that ended, to every axis."""
        for axis in self.axes:
            axis.observed(observation, now)

    def prepare(self, decision: Decision) -> None:
        """The axes' per-request constants."""
        for axis in self.axes:
            axis.prepare(decision)

    def prepare_model(self, decision: Decision) -> None:
        """The axes' per-request constants for the model being placed."""
        for axis in self.axes:
            axis.prepare_model(decision)

    def accepts(self, decision: Decision, load_fraction: float) -> bool:
        """Whether every axis lets the call onto the model's replicas at their load."""
        return all(axis.accepts(decision, load_fraction) for axis in self.axes)

    def evaluate(self, rid: int, decision: Decision) -> Estimate | Filter:
        """Run the filters on one replica and score it; the first filter that rejects it."""
        if rid in decision.excluded:
            return Filter.EXCLUDED
        state = self._replicas[rid]
        estimate = Estimate(rid, state.p_static)
        axes = self.axes
        for axis in axes:
            verdict = axis.evaluate(state, decision, estimate)
            if verdict is not None:
                return verdict
        objective = (
            cost_per_success(estimate.cost, estimate.at_risk, estimate.p_success) * state.penalty
        )
        for axis in axes:
            objective *= axis.factor(state, decision, estimate)
        estimate.objective = objective
        return estimate

    def floor(self, state: ReplicaState, decision: Decision, cost: float) -> float:
        """A lower bound on the objective `evaluate` would give the replica; inf if it cannot fit.

        `cost` is at most the call's cost there, and `decision.most_cached` at least its
        cached tokens: the quickest the call could finish (its queue, no cold load, that many
        tokens cached) bounds P(on time) from above, so the objective from below, and a replica
        that misses the step's budget even then cannot be placed at all. Cheaper than scoring,
        and it never rules out a replica `evaluate` would rank below the bound.
        """
        estimate = Estimate(state.rid, state.p_static)
        estimate.cached_tokens = decision.most_cached
        estimate.cost = cost
        for axis in self.axes:
            if axis.bound(state, decision, estimate) is not None:
                return math.inf
        return cost_per_success(cost, estimate.at_risk, estimate.p_success) * state.penalty

    def idle_duration_s(self, decision: Decision, chosen: Estimate) -> float:
        """The chosen call's duration had its replica nothing else to run (`Axis.idle`)."""
        state = self._replicas[chosen.rid]
        estimate = Estimate(chosen.rid, chosen.p_success)
        estimate.cached_tokens = chosen.cached_tokens
        estimate.cold_load_s = chosen.cold_load_s
        estimate.duration_s = chosen.duration_s - chosen.queue_wait_s
        for axis in self.axes:
            axis.idle(state, decision, estimate)
        # Never above the loaded estimate less its queue (a roofline slower than observed).
        return min(estimate.duration_s, chosen.duration_s - chosen.queue_wait_s)

    def finish(self, state: ReplicaState, decision: Decision, estimate: Estimate) -> None:
        """Complete the chosen replica's estimate for its placement."""
        for axis in self.axes:
            axis.finish(state, decision, estimate)

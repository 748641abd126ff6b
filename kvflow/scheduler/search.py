"""Which replicas a decision scores: best-first by a lower bound, and the rendezvous fallback.

A replica's request-independent factor (penalties / P(success), `ReplicaState.static_factor`)
is kept in per-pool lists sorted by factor, one set per model (`ModelRanking`), updated when
telemetry changes. Since J ≥ cost · factor (`ReplicaState.objective_bound` adds the sunk-cost
term) for every replica but the previous one, replicas are scored best-first by that bound
(the deepest prefix holders with their own depth, the rest pool by pool) until the bound
reaches the best J found or `search_width` replicas were examined. Before scoring one, its own
bound (`Policy.floor`) is checked, so replicas that cannot win are passed over unscored.

When no feasible replica holds any of the prompt's prefix, rendezvous hashing of the prefix
key over the replicas whose bound is within `rendezvous_tolerance` of the lowest, with bounded
load, picks the replica from shared telemetry only, so that every scheduler process sends a
new prefix to the same replica.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable
from dataclasses import dataclass, field

from kvflow.scheduler.axes import PoolPrices
from kvflow.scheduler.config import SchedulerConfig
from kvflow.scheduler.decision import Decision, Estimate, Filter
from kvflow.scheduler.fleet import ModelSpec
from kvflow.scheduler.policy import Policy
from kvflow.scheduler.prefix_index import replicas_in
from kvflow.scheduler.reliability import CircuitState
from kvflow.scheduler.rendezvous import (
    bounded_capacity,
    rendezvous_key,
    rendezvous_order,
    replica_seed,
)
from kvflow.scheduler.state import ReplicaState

Verdicts = dict[int, Estimate | Filter]
"""Replica id → its estimate, or the filter that turned it down."""


@dataclass(slots=True)
class ModelRanking:
    """The replicas that can serve one model, per pool, sorted by their static factor."""

    model: ModelSpec
    warm: list[list[tuple[float, int]]]
    cold: list[list[tuple[float, int]]]
    member: dict[
        int, tuple[list[tuple[float, int]], tuple[float, int], tuple[int, int, int] | None]
    ] = field(default_factory=dict)
    """Replica id → (its ranking list, its key there, its (load, slots, scraped) if warm)."""
    load: int = 0
    slots: int = 0
    shared_load: int = 0
    warm_count: int = 0


class Search:
    """Finds the replica with the lowest objective without scoring the whole fleet."""

    def __init__(
        self,
        policy: Policy,
        replicas: list[ReplicaState],
        prices: list[PoolPrices],
        models: list[ModelSpec],
        config: SchedulerConfig,
    ) -> None:
        self._policy = policy
        self._replicas = replicas
        self._prices = prices
        self._seeds = [replica_seed(r.name) for r in replicas]
        self._entry_tokens = config.prefix.block_size * config.prefix.index_stride
        # Configuration read on every decision, copied out of the pydantic models, whose
        # attribute reads go through a slow `__getattr__` hook (see `kvflow.scheduler.axes`).
        self._sunk_cost = config.weights.sunk_cost
        self._rendezvous_tolerance = 1.0 + config.prefix.rendezvous_tolerance
        self._rendezvous_prefix_blocks = config.prefix.rendezvous_prefix_blocks
        self._bounded_load_factor = config.prefix.bounded_load_factor
        self._affinity_load_factor = config.prefix.affinity_load_factor
        self._objective_load_factor = config.prefix.affinity_load_factor_with_objective
        self._affinity_min_load = config.prefix.affinity_min_load
        self._keeps_conversation = config.prefix.affinity_keeps_conversation
        self._search_width = config.prefix.search_width or max(16, len(replicas) // 16)
        self.rankings: dict[str, ModelRanking] = {
            m.name: ModelRanking(
                model=m,
                warm=[[] for _ in prices],
                cold=[[] for _ in prices],
            )
            for m in models
        }

    def rank(self, state: ReplicaState) -> None:
        """Put the replica at its static factor in every model's ranking (after a refresh)."""
        slots = state.pool.max_concurrency
        load = state.load
        shared = state.shared_load
        eligible = state.up and state.breaker.state is not CircuitState.OPEN
        rid = state.rid
        key = (state.static_factor, rid)
        for name, view in self.rankings.items():
            old = view.member.pop(rid, None)
            if old is not None:
                ranked, old_key, contribution = old
                del ranked[bisect_left(ranked, old_key)]
                if contribution is not None:
                    view.load -= contribution[0]
                    view.slots -= contribution[1]
                    view.shared_load -= contribution[2]
                    view.warm_count -= 1
            if not eligible:
                continue
            if name in state.warm_models:
                ranked = view.warm[state.pool_position]
                contribution = (load, slots, shared)
                view.load += load
                view.slots += slots
                view.shared_load += shared
                view.warm_count += 1
            elif name in state.loadable:
                ranked = view.cold[state.pool_position]
                contribution = None
            else:
                continue
            insort(ranked, key)
            view.member[rid] = (ranked, key, contribution)

    def rank_load(self, state: ReplicaState) -> None:
        """After a placement: the replica's load in the models' totals; its rank is unchanged.

        Its static factor depends on the shared (scraped) load, which a placement does not
        change once the replica has been scraped.
        """
        load = state.load
        rid = state.rid
        for view in self.rankings.values():
            member = view.member.get(rid)
            if member is None:
                continue
            ranked, key, contribution = member
            if contribution is None:
                continue
            old_load, old_slots, shared = contribution
            view.load += load - old_load
            view.member[rid] = (ranked, key, (load, old_slots, shared))

    def find(self, decision: Decision) -> tuple[Estimate, bool] | Verdicts:
        """The best replica and whether rendezvous chose it; the verdicts when none fits."""
        view = self.rankings[decision.model]
        policy = self._policy
        evaluated: Verdicts = {}
        best: list[Estimate] = []  # one element: the best so far
        cache_hit = False  # some feasible replica holds part of the prompt

        def consider(rid: int) -> Estimate | Filter:
            nonlocal cache_hit
            found = evaluated.get(rid)
            if found is None:
                found = policy.evaluate(rid, decision)
                evaluated[rid] = found
                if isinstance(found, Estimate):
                    if found.cached_tokens:
                        cache_hit = True
                    if not best or found.objective < best[0].objective:
                        best[:] = [found]
            return found

        if decision.previous >= 0:
            consider(decision.previous)
        for cold in (False, True):
            self._search(decision, view, cold, best, consider)
            if best:
                break
        if not best:
            return evaluated
        chosen = best[0]
        if not decision.block_hashes and not decision.workflow_id:
            return chosen, False
        if cache_hit:
            holder = self._replicas[chosen.rid]
            factor = (
                self._affinity_load_factor
                if decision.request.step_deadline_s_remaining is None
                else self._objective_load_factor
            )
            bound = self.affinity_capacity(view, holder.pool.max_concurrency, factor)
            if not chosen.cold_load_s and not self.may_win_on_cache(
                holder, bound, decision.previous
            ):
                chosen = self._within_bound(decision, view, best, evaluated, consider, factor)
            return chosen, False
        return self._rendezvous(decision, view, chosen, consider)

    def affinity_capacity(self, view: ModelRanking, slots: int, factor: float) -> int:
        """The most calls a prefix holder with `slots` slots may hold and still win on its cache.

        max(affinity_min_load, ⌈factor · (L + 1) · slots / S⌉), where the model's warm
        replicas hold L calls in S slots: its share of the load by its size, with head room
        (SGLang and AIBrix likewise leave the cache for the least loaded worker once load is
        imbalanced). `factor` is `affinity_load_factor`, or for a call whose step has an
        objective `affinity_load_factor_with_objective`.
        """
        bound = math.ceil(factor * (view.load + 1) * slots / max(1, view.slots))
        return bound if bound > self._affinity_min_load else self._affinity_min_load

    def may_win_on_cache(self, state: ReplicaState, bound: int, previous: int) -> bool:
        """Whether the replica may win a call on its cache past the affinity load bound.

        It may with at most `bound` calls, or as the workflow's previous replica while its
        engine would start the call at once: a free slot, no call waiting
        (`affinity_keeps_conversation`). Passing the conversation's replica over would
        recompute the whole conversation elsewhere, on every call, where the bound's purpose,
        spreading a shared prefix, copies that prefix once; the bound still places new tasks.
        """
        if state.load <= bound:
            return True
        return (
            self._keeps_conversation
            and state.rid == previous
            and state.waiting == 0
            and state.load < state.pool.max_concurrency
        )

    def _within_bound(
        self,
        ctx: Decision,
        view: ModelRanking,
        best: list[Estimate],
        evaluated: Verdicts,
        consider: Callable[[int], Estimate | Filter],
        factor: float,
    ) -> Estimate:
        """The lowest objective among warm replicas within their bound; else the best found.

        The candidates are the replicas already examined and, per pool, the first
        `search_width` of its ranking within the bound (`affinity_capacity` at `factor`; the
        ranking is by static factor, so least loaded first). Those not scored yet are scored
        lowest lower bound first, and only while the bound is below the best objective found
        among the candidates: the pick is the one scoring them all would make, at a fraction
        of the evaluations. The bound is cost · static factor at the most the replica can have
        cached (`objective_bound` less its sunk-cost term, which is checked before scoring).
        A pool's replicas holding none of the prompt all cost the same, so along its ranking
        their bounds only rise: they are merged pool by pool, as `_search` does, with the prefix
        holders, rather than sorted.
        """
        replicas = self._replicas
        prices = self._prices
        previous = ctx.previous
        prompt, output = ctx.prompt, ctx.output
        holders = 0  # every replica holding part of the prompt, one bit each
        for _, mask in ctx.levels:
            holders |= mask
        capacity: dict[int, int] = {}  # per pool
        # (lower bound, tie-break order, replica, cost, the pool's uncached candidates and the
        # index of this one among them, or None for a holder). Exact ties go to the earlier
        # pool, then the earlier in its ranking, as when the candidates were scored in order.
        heap: list[tuple[float, int, int, float, list[tuple[int, float]] | None, int]] = []
        seq = 0
        for position, ranked in enumerate(view.warm):
            if not ranked:
                continue
            capacity[position] = bound = self.affinity_capacity(
                view, replicas[ranked[0][1]].pool.max_concurrency, factor
            )
            uncached = prices[position].cost(prompt, 0, output)
            plain: list[tuple[int, float]] = []  # (replica, static factor), in ranking order
            taken = 0
            for static_factor, rid in ranked:
                if taken == self._search_width:
                    break
                if replicas[rid].load <= bound:
                    taken += 1
                    if rid in evaluated:
                        continue
                    if holders >> rid & 1:
                        cost = prices[position].cost(prompt, self._most_cached(ctx, rid), output)
                        heap.append((cost * static_factor, seq, rid, cost, None, 0))
                        seq += 1
                    else:
                        plain.append((rid, static_factor))
            if plain:
                rid, static_factor = plain[0]
                heap.append((uncached * static_factor, seq, rid, uncached, plain, 0))
                seq += len(plain)
        found: Estimate | None = None
        for rid, verdict in evaluated.items():
            state = replicas[rid]
            if (
                isinstance(verdict, Estimate)
                and not verdict.cold_load_s
                and self.may_win_on_cache(state, capacity.get(state.pool_position, 0), previous)
                and (found is None or verdict.objective < found.objective)
            ):
                found = verdict
        sunk = self._sunk_cost * ctx.spent
        heapq.heapify(heap)
        while heap:
            lower, order, rid, cost, run, at = heapq.heappop(heap)
            if found is not None and lower >= found.objective:
                break  # nor can any candidate after it: their bounds are higher still
            if run is not None and at + 1 < len(run):
                following, static_factor = run[at + 1]
                heapq.heappush(
                    heap, (cost * static_factor, order + 1, following, cost, run, at + 1)
                )
            if (
                found is not None
                and sunk
                and replicas[rid].objective_bound(cost, sunk) >= found.objective
            ):
                continue
            verdict = consider(rid)
            # Within its pool's bound by construction, so it may win on its cache.
            if (
                isinstance(verdict, Estimate)
                and not verdict.cold_load_s
                and (found is None or verdict.objective < found.objective)
            ):
                found = verdict
        return found if found is not None else best[0]

    def _most_cached(self, ctx: Decision, rid: int) -> int:
        """The most prompt tokens replica `rid` can serve from its cache (its prefix depth)."""
        for depth, mask in ctx.levels:
            if mask >> rid & 1:
                longest = ctx.prompt - 1 if ctx.prompt > 0 else 0
                cached = depth * self._entry_tokens
                return cached if cached < longest else longest
        return 0

    def _search(
        self,
        ctx: Decision,
        view: ModelRanking,
        cold: bool,
        best: list[Estimate],
        consider: Callable[[int], Estimate | Filter],
    ) -> None:
        """Score replicas best-first by a lower bound on their objective.

        A replica's objective is at least cost(its cached tokens) · its static factor. The
        deepest prefix holders enter with their own depth; every other replica of a pool
        enters, in static order, with the depth of the next-deepest holder. The search stops
        when the next bound reaches the best objective found, or after `search_width`
        replicas were examined (once one is feasible).
        """
        prompt, output = ctx.prompt, ctx.output
        block = self._entry_tokens
        prices = self._prices
        replicas = self._replicas
        limit = self._search_width
        # λ · spent, for each replica's `objective_bound`.
        sunk = self._sunk_cost * ctx.spent
        deadline = ctx.budget_s is not None
        longest = prompt - 1 if prompt > 0 else 0  # vLLM always computes the prompt's last token
        heap: list[tuple[float, int, int, list[tuple[float, int]] | None, float]] = []
        bulk_depth = 0
        if not cold:
            # The deepest `limit` holders (levels come deepest first), each with its own cost;
            # the next holder's depth bounds what any other replica has cached.
            taken = 0
            for depth, mask in ctx.levels:
                cached = min(depth * block, longest)
                level_costs: dict[int, float] = {}  # per pool, computed when first needed
                for rid in replicas_in(mask):
                    if taken == limit:
                        bulk_depth = depth
                        break
                    state = replicas[rid]
                    position = state.pool_position
                    cost = level_costs.get(position)
                    if cost is None:
                        cost = level_costs[position] = prices[position].cost(prompt, cached, output)
                    bound = state.objective_bound(cost, sunk)
                    heap.append((bound, rid, -1, None, cost))
                    taken += 1
                if bulk_depth:
                    break
        cached_bound = min(bulk_depth * block, longest)
        for position, pool_ranking in enumerate(view.cold if cold else view.warm):
            if pool_ranking:
                cost = prices[position].cost(prompt, cached_bound, output)
                factor, rid = pool_ranking[0]
                heap.append((cost * factor, rid, 0, pool_ranking, cost))
        heapq.heapify(heap)
        examined = 0
        while heap:
            bound, rid, at, ranked, cost = heapq.heappop(heap)
            if best and bound >= best[0].objective:
                break
            examined += 1
            if examined > limit and best:
                break
            if ranked is not None and at + 1 < len(ranked):
                factor, following = ranked[at + 1]
                heapq.heappush(heap, (cost * factor, following, at + 1, ranked, cost))
            # The heap's bound leaves out what is not ordered along a pool's ranking (the
            # sunk-cost term, the deadline); with them, this replica alone may be out of
            # reach, which costs a fraction of scoring it.
            state = replicas[rid]
            if best and state.objective_bound(cost, sunk) >= best[0].objective:
                continue
            if deadline:
                floor = self._policy.floor(state, ctx, cost)
                if floor == math.inf or (best and floor >= best[0].objective):
                    continue
            consider(rid)

    def _rendezvous(
        self,
        ctx: Decision,
        view: ModelRanking,
        chosen: Estimate,
        consider: Callable[[int], Estimate | Filter],
    ) -> tuple[Estimate, bool]:
        """The highest rendezvous weight among near-best replicas, under the load bound.

        The group and the bound come from shared state only (static factors and scraped
        loads), so processes fed the same telemetry form the same group: replicas whose lower
        bound cost · static factor is within `rendezvous_tolerance` of the lowest bound. The
        first in weight order that passes the filters, holds no more than the bounded-load
        capacity and whose objective is within the tolerance of the best found wins.
        """
        tolerance = self._rendezvous_tolerance
        lists = view.cold if chosen.cold_load_s else view.warm
        costs = [
            self._prices[position].cost(ctx.prompt, 0, ctx.output) for position in range(len(lists))
        ]
        lowest = math.inf
        for position, ranked in enumerate(lists):
            if ranked and costs[position] * ranked[0][0] < lowest:
                lowest = costs[position] * ranked[0][0]
        if not math.isfinite(lowest):
            return chosen, False
        group: list[int] = []
        for position, ranked in enumerate(lists):
            if not ranked:
                continue
            if costs[position] <= 0:
                group.extend([rid for _, rid in ranked])
                continue
            end = bisect_right(ranked, (lowest * tolerance / costs[position], math.inf))
            group.extend([rid for _, rid in ranked[:end]])
        key = rendezvous_key(ctx.block_hashes, ctx.workflow_id, self._rendezvous_prefix_blocks)
        seeds = self._seeds
        # The bound only starts above the affinity floor: below it, ⌈c · (L + 1) / n⌉ is 1 or
        # 2, and schedulers in different workflow workers, each counting its own calls, would
        # skip different replicas and split one prefix across several.
        capacity = max(
            bounded_capacity(view.shared_load, view.warm_count, self._bounded_load_factor),
            self._affinity_min_load,
        )
        replicas = self._replicas
        limit = chosen.objective * tolerance * tolerance
        for position in rendezvous_order(key, [seeds[rid] for rid in group]):
            rid = group[position]
            if replicas[rid].shared_load + 1 > capacity:
                continue
            candidate = consider(rid)
            if isinstance(candidate, Estimate) and candidate.objective <= limit:
                return candidate, True
        return chosen, False

"""llm-d's endpoint picker: weighted scorers and a max-score picker, approximate or precise.

Source: llm-d inference scheduler, `pkg/epp/config/loader/defaults.go` (default profile) and
`deploy/config/epp-precise-prefix-cache-config.yaml` (precise profile); the scorers'
formulas from `pkg/epp/scheduling/framework/plugins/scorer/`.

    score(pod) = Σ weight · scorer(pod),   the highest score wins (ties: random)

    queue     = (maxQ − q) / (maxQ − minQ)     q = waiting requests (scraped); 1 when all equal
    kv        = 1 − KV-cache usage             (scraped `vllm:kv_cache_usage_perc`)
    prefix    = matched blocks / prompt blocks

Default (`llm-d`): queue 2, kv-cache-utilization 2, prefix-cache 3; the prefix score from
an approximate per-server LRU index filled by its own decisions (16-token blocks, at most
256 blocks matched, `lruCapacityPerServer` 31,250 blocks).
Precise (`llm-d-precise`): precise-prefix-cache 2, kv-cache-utilization 1, queue 1; the
prefix score from the engines' KV events (here: the engines' caches, read directly).
"""

from __future__ import annotations

import random

from kvflow.simulator.des import FleetRequest, FleetView, candidates
from kvflow.simulator.policies.base import (
    ApproximatePrefixCache,
    PolicySetup,
    RequestRouter,
    prompt_blocks,
)

MAX_PREFIX_BLOCKS = 256
LRU_CAPACITY_PER_SERVER = 31_250


class LlmDPolicy(RequestRouter):
    """llm-d's default profile (approximate prefix index)."""

    name = "llm-d"
    queue_weight = 2.0
    kv_weight = 2.0
    prefix_weight = 3.0
    precise = False

    def __init__(self, setup: PolicySetup) -> None:
        self.block_size = setup.block_size
        self._rng = random.Random(setup.seed)
        self.index = ApproximatePrefixCache(LRU_CAPACITY_PER_SERVER, MAX_PREFIX_BLOCKS)

    def route(self, request: FleetRequest, fleet: FleetView, now: float) -> int | None:
        """The candidate with the highest weighted score."""
        serving = candidates(request, fleet)
        if not serving:
            return None
        blocks = prompt_blocks(request, self.block_size)
        prefix = self._prefix_scores(request, blocks, fleet, serving)
        metrics = fleet.metrics
        queues = [metrics[i].waiting for i in serving]
        low, high = min(queues), max(queues)
        best: list[int] = []
        best_score = -1.0
        for i, q in zip(serving, queues, strict=True):
            queue = 1.0 if high == low else (high - q) / (high - low)
            score = (
                self.queue_weight * queue
                + self.kv_weight * (1.0 - metrics[i].kv_cache_usage)
                + self.prefix_weight * prefix.get(i, 0.0)
            )
            if score > best_score + 1e-12:
                best, best_score = [i], score
            elif abs(score - best_score) <= 1e-12:
                best.append(i)
        chosen = best[0] if len(best) == 1 else self._rng.choice(best)
        if not self.precise:
            self.index.record(chosen, blocks)
        return chosen

    def _prefix_scores(
        self, request: FleetRequest, blocks: list[int], fleet: FleetView, serving: list[int]
    ) -> dict[int, float]:
        if not blocks:
            return {}
        total = min(len(blocks), MAX_PREFIX_BLOCKS)
        if self.precise:
            size = self.block_size
            return {
                i: fleet.cached_tokens(i, request.model, blocks) / size / len(blocks)
                for i in serving
            }
        return {i: depth / total for i, depth in self.index.match(blocks).items()}

    def on_replica_down(self, replica: int) -> None:
        """Its pod left the pool: forget its entries."""
        self.index.forget(replica)


class LlmDPrecisePolicy(LlmDPolicy):
    """llm-d's precise prefix-cache profile (KV events)."""

    name = "llm-d-precise"
    queue_weight = 1.0
    kv_weight = 1.0
    prefix_weight = 2.0
    precise = True

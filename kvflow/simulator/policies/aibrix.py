"""AIBrix's `prefix-cache` routing strategy.

Source: AIBrix, `pkg/plugins/gateway/algorithms/prefix_cache.go` (defaults:
`AIBRIX_PREFIX_CACHE_POD_RUNNING_REQUEST_IMBALANCE_ABS_COUNT` 8, standard-deviation factor 1):

    running(p) = running requests of pod p (scraped)
    if max running − min running > 8:   the least loaded pod (fewest running)
    else: pods by prefix match % descending, then running ascending; the first whose
          running ≤ mean + σ of all pods' running (none such, or no match: least loaded)

match % = matched blocks / prompt blocks on AIBrix's prefix indexer, filled by its own
routing decisions (an approximate per-pod LRU; 16-token blocks here).
"""

from __future__ import annotations

import statistics

from kvflow.simulator.des import FleetRequest, FleetView, candidates
from kvflow.simulator.policies.base import (
    ApproximatePrefixCache,
    PolicySetup,
    RequestRouter,
    prompt_blocks,
)

IMBALANCE_ABS_COUNT = 8
STANDARD_DEVIATION_FACTOR = 1.0
INDEX_CAPACITY_PER_POD = 1 << 20


class AibrixPrefixCachePolicy(RequestRouter):
    """AIBrix's prefix-cache strategy (module docstring)."""

    name = "aibrix"

    def __init__(self, setup: PolicySetup) -> None:
        self.block_size = setup.block_size
        self.index = ApproximatePrefixCache(INDEX_CAPACITY_PER_POD)

    def route(self, request: FleetRequest, fleet: FleetView, now: float) -> int | None:
        """Prefix match under a load bound, least loaded when imbalanced."""
        serving = candidates(request, fleet)
        if not serving:
            return None
        metrics = fleet.metrics
        running = {i: metrics[i].running for i in serving}
        least = min(serving, key=running.__getitem__)
        blocks = prompt_blocks(request, self.block_size)
        chosen = least
        if max(running.values()) - min(running.values()) <= IMBALANCE_ABS_COUNT and blocks:
            matched = self.index.match(blocks)
            values = list(running.values())
            bound = statistics.fmean(values) + STANDARD_DEVIATION_FACTOR * statistics.pstdev(values)
            ranked = sorted(
                (i for i in serving if matched.get(i, 0) > 0),
                key=lambda i: (-matched[i] / len(blocks), running[i]),
            )
            for i in ranked:
                if running[i] <= bound:
                    chosen = i
                    break
        self.index.record(chosen, blocks)
        return chosen

    def on_replica_down(self, replica: int) -> None:
        """The pod is gone: forget its entries."""
        self.index.forget(replica)

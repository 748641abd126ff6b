"""SGLang model gateway's `cache_aware` policy.

Source: sglang, `sgl-model-gateway/src/policies/cache_aware.rs` (defaults in its
`CacheAwareConfig`): `cache_threshold` 0.3, `balance_abs_threshold` 64,
`balance_rel_threshold` 1.5.

    load(w) = requests the gateway sent to worker w that have not ended (its own count)
    if max load − min load > 64 and max load > 1.5 · min load:   shortest queue (lowest load)
    else: match(w) = matched prefix / prompt length on an approximate radix tree per worker
          (the text the gateway routed there); best match if it is > 0.3, else least loaded

The radix tree here works on 16-token blocks instead of characters (the same share of the
prompt, at block granularity); the tree grows with every routed prompt and evicts least
recently used entries past its size (`max_tree_size`, 2²⁶ characters ≈ 2²² blocks).
"""

from __future__ import annotations

from kvflow.simulator.des import FleetRequest, FleetView, candidates
from kvflow.simulator.policies.base import (
    ApproximatePrefixCache,
    AttemptEnd,
    InflightCounter,
    PolicySetup,
    RequestRouter,
    prompt_blocks,
)

CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5
MAX_TREE_BLOCKS = 1 << 22


class SglangCacheAwarePolicy(RequestRouter):
    """SGLang's cache-aware routing (module docstring)."""

    name = "sglang"

    def __init__(self, setup: PolicySetup) -> None:
        self.block_size = setup.block_size
        self.tree = ApproximatePrefixCache(MAX_TREE_BLOCKS)
        self.load = InflightCounter()

    def route(self, request: FleetRequest, fleet: FleetView, now: float) -> int | None:
        """Shortest queue when imbalanced, else the best prefix match above the threshold."""
        serving = candidates(request, fleet)
        if not serving:
            return None
        load = self.load
        loads = [load[i] for i in serving]
        least = serving[loads.index(min(loads))]
        high, low = max(loads), min(loads)
        blocks = prompt_blocks(request, self.block_size)
        if high - low > BALANCE_ABS_THRESHOLD and high > BALANCE_REL_THRESHOLD * low:
            chosen = least
        else:
            matched = self.tree.match(blocks)
            best, depth = least, 0
            for i in serving:
                if matched.get(i, 0) > depth:
                    best, depth = i, matched[i]
            rate = depth * self.block_size / max(request.prompt_tokens, 1)
            chosen = best if rate > CACHE_THRESHOLD else least
        self.tree.record(chosen, blocks)
        load.sent(chosen)
        return chosen

    def on_attempt_end(self, end: AttemptEnd) -> None:
        """The request left the worker."""
        self.load.ended(end.replica)

    def on_replica_down(self, replica: int) -> None:
        """The worker was removed: its tree goes with it."""
        self.tree.forget(replica)

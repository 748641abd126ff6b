"""AIBrix's `prefix-cache` routing strategy, at its defaults and with KV-event sync.

Source: AIBrix (`vllm-project/aibrix`), `pkg/plugins/gateway/algorithms/prefix_cache.go`
(`routeOriginal`, `getTargetPodListOnLoadImbalance`, `getTargetPodFromMatchedPods`),
`least_request.go` (`getRequestCounts`, `selectTargetPodWithLeastRequestCount`), `util.go`
(`standardDeviation`, the sample deviation), the request counter in `pkg/cache/
cache_trace.go` (`addPodStats` / `donePodStats`) and the prefix table in `pkg/utils/
prefixcacheindexer/hash.go` with its store `pkg/utils/lrustore/lru_store.go`:

    running(p) = requests the gateway routed to pod p that have not ended (its own counter,
                 raised when it routes, lowered when the request is done; not vLLM's metric)
    ready      = every pod; if max running − min running > 8: only the pods at min running
    match(p)   = ⌊100 · (i + 1) / prompt blocks⌋ for the deepest block i that every pod of
                 `ready` still in the walk holds (pods drop out at their first missing block)
    matched pods, shuffled, then by match descending and running ascending (a stable sort):
    the first with running ≤ mean + 1 · σ of all pods' running (σ: sample deviation);
    none such, or no match: the least-running pod of all (ties at random)
    then the prompt's blocks are recorded for the chosen pod

The prefix table is one LRU for all pods: 200,000 entries of 4-character blocks (the
default `character` tokenizer), each entry dropped 20 minutes after it was last written.
At about 4 characters a token that is ≈ 200,000 tokens of distinct prompt prefix, held here
as `200,000 · 4 / 4 / block_size` blocks of the fleet's block size.

`aibrix-tuned` follows AIBrix's KV-event sync (`docs/source/features/kv-event-sync.rst`,
`AIBRIX_PREFIX_CACHE_KV_EVENT_SYNC_ENABLED=true`, route in `prefix_cache.go`'s
`kvSyncPrefixCacheRouter.Route`, table in `pkg/utils/syncprefixcacheindexer/sync_hash.go`):
the same decision, but a pod holds a block when its engine reported it stored (read here
from the engines' caches) or when the gateway routed a prompt with that block there and the
request has not ended (`AddPrefix` after each decision); a pod's match is the percentage
at the last block it holds while any ready pod holds each block before it.
"""

from __future__ import annotations

import random
import statistics
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence

from kvflow.simulator.des import FleetRequest, FleetView, candidates
from kvflow.simulator.policies.base import (
    AttemptEnd,
    PolicySetup,
    RequestRouter,
    prompt_blocks,
)

IMBALANCE_ABS_COUNT = 8
"""`AIBRIX_PREFIX_CACHE_POD_RUNNING_REQUEST_IMBALANCE_ABS_COUNT`."""
STANDARD_DEVIATION_FACTOR = 1
"""`AIBRIX_PREFIX_CACHE_STANDARD_DEVIATION_FACTOR`."""
PREFIX_CACHE_BLOCK_NUMBER = 200_000
"""`AIBRIX_PREFIX_CACHE_BLOCK_NUMBER`: entries of the prefix table, all pods together."""
PREFIX_CACHE_BLOCK_CHARS = 4
"""`AIBRIX_PREFIX_CACHE_BLOCK_SIZE`: characters a block of the `character` tokenizer."""
CHARACTERS_PER_TOKEN = 4
EVICTION_DURATION_S = 20 * 60.0
"""`AIBRIX_PREFIX_CACHE_EVICTION_DURATION_MINS`: an entry not written for this long goes."""


class PrefixHashTable:
    """AIBrix's prefix table: block hash → pods that were sent it, in one LRU with a TTL.

    `add` writes every block of a prompt for a pod (most recent first out of the LRU's
    reach); past `capacity_blocks` entries, or `ttl_s` after an entry was last written, the
    entry goes with all its pods (the store's `Put` and `evict`).
    """

    def __init__(self, capacity_blocks: int, ttl_s: float, clock: Callable[[], float]) -> None:
        self.capacity_blocks = capacity_blocks
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[int, tuple[float, set[int]]] = OrderedDict()

    def _expire(self) -> None:
        horizon = self.clock() - self.ttl_s
        while self._entries:
            written, _ = next(iter(self._entries.values()))
            if written >= horizon:
                return
            self._entries.popitem(last=False)

    def match(self, hashes: Sequence[int], ready: Collection[int]) -> dict[int, int]:
        """Pod → match percentage of `hashes`, among `ready` pods (`seqSearchPrefix`)."""
        self._expire()
        alive = set(ready)
        matched: dict[int, int] = {}
        for i, h in enumerate(hashes):
            entry = self._entries.get(h)
            if entry is None:
                break
            alive &= entry[1]
            if not alive:
                break
            percent = (i + 1) * 100 // len(hashes)
            for pod in alive:
                matched[pod] = percent
        return matched

    def add(self, hashes: Sequence[int], pod: int) -> None:
        """The gateway routed a prompt with `hashes` to `pod` (`AddPrefix`)."""
        now = self.clock()
        for h in hashes:
            entry = self._entries.pop(h, None)
            pods = entry[1] if entry is not None else set()
            pods.add(pod)
            self._entries[h] = (now, pods)
            if len(self._entries) > self.capacity_blocks:
                self._entries.popitem(last=False)


class AibrixPrefixCachePolicy(RequestRouter):
    """AIBrix's prefix-cache strategy at its defaults (module docstring)."""

    name = "aibrix"
    kv_event_sync = False

    def __init__(self, setup: PolicySetup) -> None:
        self.block_size = setup.block_size
        self._rng = random.Random(setup.seed)
        capacity = PREFIX_CACHE_BLOCK_NUMBER * PREFIX_CACHE_BLOCK_CHARS // CHARACTERS_PER_TOKEN
        self.table = PrefixHashTable(
            max(1, capacity // setup.block_size), EVICTION_DURATION_S, setup.clock
        )
        self.running: dict[int, int] = {}
        """Pod → requests routed there that have not ended (`realtime_num_requests_running`)."""
        self._routed: dict[str, tuple[int, list[int]]] = {}
        """Request id → (pod, prompt blocks) of the requests that have not ended."""
        self._pending: dict[int, dict[int, int]] = {}
        """Pod → block → live routed requests with that block (`AddPrefix` of the sync table)."""

    def route(self, request: FleetRequest, fleet: FleetView, now: float) -> int | None:
        """Prefix match among the (least loaded, when imbalanced) pods, under a load bound."""
        serving = candidates(request, fleet)
        if not serving:
            return None
        counts = {i: self.running.get(i, 0) for i in serving}
        low, high = min(counts.values()), max(counts.values())
        ready = list(serving)
        if high - low > IMBALANCE_ABS_COUNT:
            ready = [i for i in serving if counts[i] == low]
        blocks = prompt_blocks(request, self.block_size)
        matched = self._match(request, blocks, ready, fleet) if blocks else {}
        chosen = self._best_matched(matched, counts) if matched else None
        if chosen is None:
            least = [i for i in serving if counts[i] == low]
            chosen = self._rng.choice(least)
        self._record(request, chosen, blocks)
        return chosen

    def _match(
        self, request: FleetRequest, blocks: list[int], ready: list[int], fleet: FleetView
    ) -> dict[int, int]:
        return self.table.match(blocks, ready)

    def _best_matched(self, matched: dict[int, int], counts: dict[int, int]) -> int | None:
        values = [float(v) for v in counts.values()]
        mean = statistics.fmean(values)
        sigma = statistics.stdev(values) if len(values) > 1 else 0.0
        pods = list(matched)
        self._rng.shuffle(pods)
        pods.sort(key=lambda p: (-matched[p], counts[p]))
        for pod in pods:
            if counts[pod] <= mean + STANDARD_DEVIATION_FACTOR * sigma:
                return pod
        return None

    def _record(self, request: FleetRequest, pod: int, blocks: list[int]) -> None:
        if blocks and not self.kv_event_sync:
            self.table.add(blocks, pod)
        self.running[pod] = self.running.get(pod, 0) + 1
        self._routed[request.request_id] = (pod, blocks)
        if self.kv_event_sync:
            pending = self._pending.setdefault(pod, {})
            for h in blocks:
                pending[h] = pending.get(h, 0) + 1

    def on_attempt_end(self, end: AttemptEnd) -> None:
        """The request is done: the gateway lowers its pod's counter (`donePodStats`)."""
        routed = self._routed.pop(end.request.request_id, None)
        if routed is None:
            return
        pod, blocks = routed
        self.running[pod] = max(0, self.running.get(pod, 0) - 1)
        pending = self._pending.get(pod)
        if pending is None:
            return
        for h in blocks:
            left = pending.get(h, 0) - 1
            if left > 0:
                pending[h] = left
            else:
                pending.pop(h, None)


class AibrixKvSyncPolicy(AibrixPrefixCachePolicy):
    """AIBrix's prefix-cache strategy with KV-event sync (module docstring)."""

    name = "aibrix-tuned"
    kv_event_sync = True

    def _match(
        self, request: FleetRequest, blocks: list[int], ready: list[int], fleet: FleetView
    ) -> dict[int, int]:
        # The sync table's `MatchPrefix`: each block's ready holders get its percentage; the
        # walk ends at the first block no ready pod holds.
        size = self.block_size
        stored = {p: fleet.cached_tokens(p, request.model, blocks) // size for p in ready}
        matched: dict[int, int] = {}
        for i, h in enumerate(blocks):
            holders = [p for p in ready if i < stored[p] or h in self._pending.get(p, {})]
            if not holders:
                break
            percent = (i + 1) * 100 // len(blocks)
            for p in holders:
                matched[p] = percent
        return matched

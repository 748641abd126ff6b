"""llm-d's endpoint picker: weighted scorers and a max-score picker, approximate or precise.

Source: llm-d inference scheduler (`llm-d/llm-d-inference-scheduler`),
`pkg/epp/config/loader/defaults.go` (default profile), `deploy/config/
epp-precise-prefix-cache-config.yaml` (precise profile); the scorers' formulas from
`pkg/epp/framework/plugins/scheduling/scorer/` (`queuedepth`, `kvcacheutilization`,
`prefix`, `preciseprefixcache`, `loadaware`), the approximate index from
`pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/` (`plugin.go`,
`indexer.go`, `types.go`) and the picker from `.../picker/maxscore/`.

    score(pod) = Σ weight · scorer(pod),   the highest score wins (ties: random)

    queue     = (maxQ − q) / (maxQ − minQ)     q = waiting requests (scraped); 1 when all equal
    kv        = 1 − KV-cache usage             (scraped `vllm:kv_cache_usage_perc`)
    prefix    = matched blocks / prompt blocks
    load      = 0.5 · (1 − min(q, 128) / 128)  (load-aware scorer, threshold 128)

Default (`llm-d`): queue 2, kv-cache-utilization 2, prefix-cache 3. The prefix score comes
from the approximate index the picker fills with its own decisions: the prompt in blocks of
the engine's block size (`autoTune`: `vllm:cache_config_info`), at most 256 blocks; one LRU
per pod whose capacity is the pod's number of GPU KV blocks (`autoTune`), created when the
pod is first chosen; a pod's match counts every block of the prompt's walk it holds, the walk
ending at the first block no pod holds (`matchLongestPrefix`).
Precise (`llm-d-precise`): precise-prefix-cache 2, kv-cache-utilization 1, queue 1, on
64-token blocks (`tokenProcessorConfig.blockSize`); the prefix score is the leading 64-token
blocks of the prompt the engine reported stored (KV events; read here from the engines'
caches) over the prompt's 64-token blocks.

`llm-d-tuned` is the precise profile as the precise-prefix-cache guide deploys it
(`llm-d/llm-d`, `guides/precise-prefix-cache-aware/scheduler/
precise-prefix-cache-aware.values.yaml`: precise 2, kv-cache-utilization 1, queue 1,
64-token blocks) with the load-aware scorer beside it at weight 1 (as in
`deploy/config/epp-estimate-prefix-cache-config.yaml`) and speculative indexing on (the
precise scorer's README: each decision's blocks count as held by the chosen pod for
`speculativeTTL` 2 s, until the engine's events arrive).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

from kvflow.simulator.des import FleetRequest, FleetView, candidates
from kvflow.simulator.policies.base import PolicySetup, RequestRouter, prompt_blocks

MAX_PREFIX_BLOCKS = 256
DEFAULT_LRU_CAPACITY_PER_SERVER = 31_250
"""`lruCapacityPerServer`, used only when the pod does not report its GPU blocks."""
PRECISE_BLOCK_TOKENS = 64
LOAD_AWARE_THRESHOLD = 128
SPECULATIVE_TTL_S = 2.0


class ApproximatePrefixIndex:
    """llm-d's approximate prefix index: block hash → pods, with one LRU per pod.

    A pod's LRU is created at its first `add` with that pod's capacity; a hash evicted from
    a pod's LRU leaves that pod's entry in the map (`indexer.go`).
    """

    def __init__(self) -> None:
        self._pods_of: dict[int, set[int]] = {}
        self._lru: dict[int, OrderedDict[int, None]] = {}
        self._capacity: dict[int, int] = {}

    def longest_prefix(self, hashes: Sequence[int]) -> dict[int, int]:
        """Pod → blocks of the walk it holds; the walk ends where no pod holds a block."""
        counts: dict[int, int] = {}
        for h in hashes:
            pods = self._pods_of.get(h)
            if not pods:
                break
            for pod in pods:
                counts[pod] = counts.get(pod, 0) + 1
        return counts

    def add(self, hashes: Sequence[int], pod: int, capacity: int) -> None:
        """The picker chose `pod` for a prompt with `hashes`."""
        lru = self._lru.get(pod)
        if lru is None:
            lru = self._lru[pod] = OrderedDict()
            self._capacity[pod] = max(1, capacity)
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            self._pods_of.setdefault(h, set()).add(pod)
            if len(lru) > self._capacity[pod]:
                old, _ = lru.popitem(last=False)
                pods = self._pods_of.get(old)
                if pods is not None:
                    pods.discard(pod)
                    if not pods:
                        del self._pods_of[old]

    def remove_pod(self, pod: int) -> None:
        """The pod left the pool."""
        for h in self._lru.pop(pod, OrderedDict()):
            pods = self._pods_of.get(h)
            if pods is not None:
                pods.discard(pod)
                if not pods:
                    del self._pods_of[h]
        self._capacity.pop(pod, None)


class LlmDPolicy(RequestRouter):
    """llm-d's default profile (approximate prefix index)."""

    name = "llm-d"
    queue_weight = 2.0
    kv_weight = 2.0
    prefix_weight = 3.0
    load_aware_weight = 0.0
    precise = False
    speculative = False

    def __init__(self, setup: PolicySetup) -> None:
        self.block_size = setup.block_size
        self.clock = setup.clock
        self._rng = random.Random(setup.seed)
        self.index = ApproximatePrefixIndex()
        self._speculative: dict[int, dict[int, float]] = {}
        """Pod → 64-token block → when its speculative entry expires."""

    def route(self, request: FleetRequest, fleet: FleetView, now: float) -> int | None:
        """The candidate with the highest weighted score."""
        serving = candidates(request, fleet)
        if not serving:
            return None
        prefix = self.prefix_scores(request, fleet, serving, now)
        metrics = fleet.metrics
        queues = [metrics[i].waiting for i in serving]
        low, high = min(queues), max(queues)
        scored: list[tuple[float, int]] = []
        for i, q in zip(serving, queues, strict=True):
            queue = 1.0 if high == low else (high - q) / (high - low)
            load = 0.5 * (1.0 - min(q, LOAD_AWARE_THRESHOLD) / LOAD_AWARE_THRESHOLD)
            score = (
                self.queue_weight * queue
                + self.kv_weight * (1.0 - metrics[i].kv_cache_usage)
                + self.prefix_weight * prefix.get(i, 0.0)
                + self.load_aware_weight * load
            )
            scored.append((score, i))
        # `max-score-picker`: shuffle, then a stable sort by score (ties at random).
        self._rng.shuffle(scored)
        chosen = max(scored, key=lambda s: s[0])[1]
        self._record(request, fleet, chosen, now)
        return chosen

    def prefix_scores(
        self, request: FleetRequest, fleet: FleetView, serving: list[int], now: float
    ) -> dict[int, float]:
        """Pod → prefix score of `request` (approximate index, or the engines' caches)."""
        if self.precise:
            return self._precise_scores(request, fleet, serving, now)
        blocks = prompt_blocks(request, self.block_size)[:MAX_PREFIX_BLOCKS]
        if not blocks:
            return {}
        matched = self.index.longest_prefix(blocks)
        return {i: matched[i] / len(blocks) for i in serving if i in matched}

    def _precise_scores(
        self, request: FleetRequest, fleet: FleetView, serving: list[int], now: float
    ) -> dict[int, float]:
        size = self.block_size
        per_block = max(1, PRECISE_BLOCK_TOKENS // size)
        total = request.prompt_tokens // PRECISE_BLOCK_TOKENS
        if total == 0:
            return {}
        blocks = prompt_blocks(request, size)
        scores: dict[int, float] = {}
        for i in serving:
            held = fleet.cached_tokens(i, request.model, blocks) // PRECISE_BLOCK_TOKENS
            speculative = self._speculative.get(i)
            if speculative:
                while (
                    held < total and speculative.get(blocks[(held + 1) * per_block - 1], -1.0) > now
                ):
                    held += 1
            scores[i] = min(held, total) / total
        return scores

    def _record(self, request: FleetRequest, fleet: FleetView, pod: int, now: float) -> None:
        if not self.precise:
            blocks = prompt_blocks(request, self.block_size)[:MAX_PREFIX_BLOCKS]
            engine = fleet.replicas[pod].engines.get(request.model)
            capacity = engine.num_gpu_blocks if engine is not None else 0
            self.index.add(blocks, pod, capacity or DEFAULT_LRU_CAPACITY_PER_SERVER)
        elif self.speculative:
            per_block = max(1, PRECISE_BLOCK_TOKENS // self.block_size)
            blocks = prompt_blocks(request, self.block_size)
            entries = self._speculative.setdefault(pod, {})
            for h in blocks[per_block - 1 :: per_block]:
                entries[h] = now + SPECULATIVE_TTL_S
            if len(entries) > 4 * len(blocks) + 1024:
                for h in [h for h, until in entries.items() if until <= now]:
                    del entries[h]

    def on_replica_down(self, replica: int) -> None:
        """Its pod left the pool: forget its entries."""
        self.index.remove_pod(replica)
        self._speculative.pop(replica, None)


class LlmDPrecisePolicy(LlmDPolicy):
    """llm-d's precise prefix-cache profile (KV events)."""

    name = "llm-d-precise"
    queue_weight = 1.0
    kv_weight = 1.0
    prefix_weight = 2.0
    precise = True


class LlmDTunedPolicy(LlmDPrecisePolicy):
    """The precise profile with the load-aware scorer and speculative indexing."""

    name = "llm-d-tuned"
    load_aware_weight = 1.0
    speculative = True

"""Which replica holds which prompt prefix: block hash → replicas.

Keys are kvflow block hashes (`scheduler.blocks`), one per full block of `block_size` tokens,
each naming the whole prefix up to its block. Two sources fill the index:

- **approximate**: the scheduler's own placements. A replica that served a prompt is assumed
  to keep its blocks; each replica's entries are bounded by its KV cache size
  (`vllm:cache_config_info`) and evicted least recently used first, a prompt's last blocks
  before its first ones, as vLLM evicts (see `_Blocks`).
- **precise**: vLLM's KV-cache events (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`).
  Engines hash blocks with their own algorithm, so engine hashes are never used as keys: each
  `BlockStored` block is re-hashed from its token ids with `scheduler.blocks.hash_block`,
  chained from the kvflow hash of its parent (found through the engine hash → kvflow hashes
  map; no parent means `ROOT_HASH`). An engine block of `k · block_size` tokens becomes `k`
  kvflow blocks. Placements on a precise replica add *speculative* entries that count until a
  `BlockStored` confirms them or `speculative_ttl_s` passes.

Matching a request is O(blocks + holders of its deepest shared block), not O(replicas ×
blocks): the index maps each block to the set of replicas holding it, and a request is matched
from its deepest block backwards, assuming (as vLLM's tail-first eviction makes true) that a
replica holding a block holds the blocks before it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from heapq import heapify, heappop, heappush

from scheduler.blocks import ROOT_HASH, hash_block

logger = logging.getLogger(__name__)

EngineHash = int | bytes
"""An engine's own block hash: 64-bit int, or bytes for engines that hash with sha256."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """The engine cached full blocks: their engine hashes, parent and token ids."""

    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The engine evicted blocks."""

    block_hashes: tuple[EngineHash, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (e.g. a reset)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared

Holders = int | set[int]
"""The replicas holding a block: one replica id, or a set when several hold it.

Most blocks (a conversation's own tail) live on one replica; keeping those as a plain int
instead of a one-element set keeps millions of small containers away from the garbage
collector, whose full collections would otherwise stall decisions.
"""


def _count(holding: Holders | None) -> int:
    if holding is None:
        return 0
    return 1 if isinstance(holding, int) else len(holding)


_NO_PARENT = -1


class _Blocks:
    """One replica's blocks as a forest of prompt chains, evicted least recently used leaf first.

    Each block knows its parent and how many children it has. A request stamps only its
    deepest block; a block's recency is the newest stamp in its subtree, so eviction takes the
    leaf (a chain's tail) with the oldest stamp and hands that stamp up to its parent. This is
    exact LRU with tail-first eviction, at O(new blocks + log n) per request instead of one
    reordering per block. Blocks are kept in flat int → int dicts (no per-block objects).
    """

    __slots__ = ("capacity", "children", "leaves", "parent", "stamp", "tick")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.parent: dict[int, int] = {}
        self.children: dict[int, int] = {}
        self.stamp: dict[int, int] = {}
        self.leaves: list[tuple[int, int]] = []
        """Heap of (stamp, block) for blocks without children; stale entries are skipped."""
        self.tick = 0

    def __len__(self) -> int:
        return len(self.parent)

    def __contains__(self, h: int) -> bool:
        return h in self.parent

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.parent))

    def add_chain(self, parent: int, hashes: Sequence[int]) -> list[int]:
        """Add the chain `hashes` below `parent` (or at the root); the blocks that were new."""
        blocks_parent, children, stamp = self.parent, self.children, self.stamp
        new: list[int] = []
        previous = parent
        for h in hashes:
            if h not in blocks_parent:
                blocks_parent[h] = previous
                children[h] = 0
                stamp[h] = 0
                if previous in children:
                    children[previous] += 1
                new.append(h)
            previous = h
        return new

    def use(self, h: int) -> None:
        """A request ended at block `h`: it and its ancestors are the most recently used."""
        if h not in self.parent:
            return
        self.tick += 1
        self.stamp[h] = self.tick
        if self.children[h] == 0:
            heappush(self.leaves, (self.tick, h))
            if len(self.leaves) > 2 * len(self.parent) + 64:
                self._rebuild_leaves()

    def discard(self, h: int) -> bool:
        """Remove the block; whether it was there."""
        if h not in self.parent:
            return False
        self._remove(h)
        return True

    def pop_oldest(self) -> int:
        """Remove and return the least recently used leaf (the replica must hold blocks)."""
        stamp, children = self.stamp, self.children
        for attempt in range(2):
            leaves = self.leaves
            while leaves:
                tick, h = heappop(leaves)
                if stamp.get(h) == tick and children.get(h) == 0:
                    self._remove(h)
                    return h
            if attempt == 0:
                self._rebuild_leaves()
        # Only cycles left (impossible for hash chains): drop any block.
        h = next(iter(self.parent))
        self._remove(h)
        return h

    def _remove(self, h: int) -> None:
        parent = self.parent.pop(h)
        del self.children[h]
        tick = self.stamp.pop(h)
        children = self.children.get(parent)
        if children is not None:
            self.children[parent] = children - 1
            if tick > self.stamp[parent]:
                self.stamp[parent] = tick
            if children == 1:
                heappush(self.leaves, (self.stamp[parent], parent))

    def _rebuild_leaves(self) -> None:
        stamp = self.stamp
        self.leaves = [(stamp[h], h) for h, count in self.children.items() if count == 0]
        heapify(self.leaves)


class PrefixIndex:
    """Block hash → replicas holding it, per replica LRU, speculative entries, KV events.

    Replicas are small integer ids (0..n−1) assigned by the owner of the index.
    """

    def __init__(self, block_size: int, speculative_ttl_s: float, stride: int = 1) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if stride < 1:
            raise ValueError(f"stride must be at least 1, got {stride}")
        self.block_size = block_size
        self.stride = stride
        """Only every `stride`-th block of a prompt is an index entry."""
        self.entry_tokens = block_size * stride
        """Prompt tokens one index entry stands for: a depth of d entries is d · entry_tokens."""
        self.speculative_ttl_s = speculative_ttl_s
        self._holders: dict[int, Holders] = {}
        self._speculative: dict[int, dict[int, float]] = {}
        self._speculative_expiry: deque[tuple[float, int, int]] = deque()
        self._blocks: list[_Blocks] = []
        self._engine: list[dict[EngineHash, tuple[int, int, int, tuple[int, ...]]]] = []
        """Engine hash → (kvflow hash of the block, its position in the prompt, the last
        indexed entry at or before it, the entries it added)."""
        self._precise: set[int] = set()
        self.unmatched_events = 0
        """BlockStored events skipped because their parent block was never seen."""

    def add_replica(self, capacity_blocks: int) -> int:
        """Register a replica whose LRU holds `capacity_blocks` entries; returns its id."""
        self._blocks.append(_Blocks(capacity_blocks))
        self._engine.append({})
        return len(self._blocks) - 1

    def set_capacity(self, replica: int, capacity_blocks: int) -> None:
        """Resize a replica's LRU (in entries), evicting if it shrank."""
        self._blocks[replica].capacity = max(1, capacity_blocks)
        self._evict(replica)

    def is_precise(self, replica: int) -> bool:
        """Whether KV events feed this replica's entries."""
        return replica in self._precise

    def blocks_held(self, replica: int) -> int:
        """Confirmed (or, in approximate mode, assumed) entries of the replica."""
        return len(self._blocks[replica])

    def match(self, hashes: Sequence[int], now: float) -> dict[int, int]:
        """Replica id → number of leading index entries of `hashes` it holds, deepest first.

        `hashes` is a prompt's whole block-hash chain; its entries are every `stride`-th
        block. A depth of d entries means the replica holds the first d · entry_tokens prompt
        tokens. Replicas holding none are omitted; the dict lists replicas in order of
        decreasing depth.

        depth(r) = 1 + the index of the deepest entry of `hashes` that r holds. Because a
        replica holding a block holds its ancestors, the number of holders never grows along
        the chain; each depth level is found by binary search, so a match costs
        O(levels · log blocks) lookups.
        """
        self._expire(now)
        depths: dict[int, int] = {}
        if self.stride > 1:
            hashes = hashes[self.stride - 1 :: self.stride]
        if not hashes:
            return depths
        holders, speculative = self._holders, self._speculative

        def count(i: int) -> int:
            h = hashes[i]
            return _count(holders.get(h)) + len(speculative.get(h, ()))

        expected = count(0)
        high = len(hashes) - 1
        while len(depths) < expected and high >= 0:
            assigned = len(depths)
            # The deepest block in [0, high] with more holders than are assigned already.
            low = 0
            if count(high) > assigned:
                low = high
            else:
                while low < high:
                    mid = (low + high + 1) // 2
                    if count(mid) > assigned:
                        low = mid
                    else:
                        high = mid - 1
            h = hashes[low]
            confirmed = holders.get(h)
            if confirmed is not None:
                if isinstance(confirmed, int):
                    depths.setdefault(confirmed, low + 1)
                elif depths:
                    depths.update(dict.fromkeys(confirmed.difference(depths), low + 1))
                else:
                    depths = dict.fromkeys(confirmed, low + 1)
            guesses = speculative.get(h)
            if guesses:
                for replica in guesses:
                    if replica not in depths:
                        depths[replica] = low + 1
            if len(depths) == assigned:
                break  # holders not nested along the chain; what is assigned is a lower bound
            high = low - 1
        return depths

    def record_placement(
        self, replica: int, hashes: Sequence[int], now: float, held_depth: int = 0
    ) -> None:
        """A request with this block-hash chain was placed on the replica.

        Approximate replicas keep the entries (LRU); precise replicas hold them speculatively
        for `speculative_ttl_s` unless a KV event confirms them first. `held_depth` is how many
        leading entries `match` said the replica holds already.
        """
        if self.stride > 1:
            hashes = hashes[self.stride - 1 :: self.stride]
        if not hashes:
            return
        blocks = self._blocks[replica]
        if replica in self._precise:
            expiry = now + self.speculative_ttl_s
            speculative = self._speculative
            for h in hashes[held_depth:]:
                if h not in blocks:
                    guesses = speculative.get(h)
                    if guesses is None:
                        speculative[h] = {replica: expiry}
                    else:
                        guesses[replica] = expiry
                    self._speculative_expiry.append((expiry, h, replica))
            self._expire(now)
            return
        held = min(held_depth, len(hashes))
        new = blocks.add_chain(hashes[held - 1] if held else _NO_PARENT, hashes[held:])
        blocks.use(hashes[-1])
        holders = self._holders
        for h in new:
            holding = holders.get(h)
            if holding is None:
                holders[h] = replica
            elif isinstance(holding, int):
                if holding != replica:
                    holders[h] = {holding, replica}
            else:
                holding.add(replica)
        if len(blocks) > blocks.capacity:
            self._evict(replica)

    def apply(self, replica: int, events: Iterable[KvEvent]) -> None:
        """Apply an engine's KV events to the replica; from now on the replica is precise."""
        if replica not in self._precise:
            # Entries learned from placements are guesses; the engine's word replaces them.
            self._precise.add(replica)
            self.clear(replica)
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(replica, event)
            elif isinstance(event, BlockRemoved):
                self._removed(replica, event.block_hashes)
            else:
                self.clear(replica)

    def clear(self, replica: int) -> None:
        """Forget everything the replica holds (its cache was reset or it restarted)."""
        blocks = self._blocks[replica]
        for h in blocks:
            self._discard(h, replica)
        self._blocks[replica] = _Blocks(blocks.capacity)
        self._engine[replica] = {}
        for guesses in self._speculative.values():
            guesses.pop(replica, None)

    def _add(self, h: int, replica: int) -> None:
        holders = self._holders
        holding = holders.get(h)
        if holding is None:
            holders[h] = replica
        elif isinstance(holding, int):
            if holding != replica:
                holders[h] = {holding, replica}
        else:
            holding.add(replica)

    def _discard(self, h: int, replica: int) -> None:
        holders = self._holders
        holding = holders.get(h)
        if holding is None:
            return
        if isinstance(holding, int):
            if holding == replica:
                del holders[h]
            return
        holding.discard(replica)
        if len(holding) == 1:
            holders[h] = next(iter(holding))

    def _stored(self, replica: int, event: BlockStored) -> None:
        engine_map = self._engine[replica]
        size = event.block_size
        if size % self.block_size:
            logger.warning(
                "replica %d stores blocks of %d tokens, not a multiple of the index's %d; "
                "set the scheduler's prefix.block_size to a divisor of the engine block size",
                replica,
                size,
                self.block_size,
            )
            return
        if event.parent_block_hash is None:
            parent, position, anchor = ROOT_HASH, -1, _NO_PARENT
        else:
            known = engine_map.get(event.parent_block_hash)
            if known is None:
                self.unmatched_events += 1
                return
            parent, position, anchor, _ = known
        step = self.block_size
        stride = self.stride
        tokens = event.token_ids
        blocks = self._blocks[replica]
        speculative = self._speculative
        for j, engine_hash in enumerate(event.block_hashes):
            start = j * size
            block = tokens[start : start + size]
            if len(block) < size:
                break
            entries: list[int] = []
            for k in range(0, size, step):
                parent = hash_block(parent, block[k : k + step])
                position += 1
                if position % stride == stride - 1:
                    entries.append(parent)
                    guesses = speculative.get(parent)
                    if guesses is not None:
                        guesses.pop(replica, None)
            for h in blocks.add_chain(anchor, entries):
                self._add(h, replica)
            if entries:
                anchor = entries[-1]
            engine_map[engine_hash] = (parent, position, anchor, tuple(entries))
        if anchor != _NO_PARENT:
            blocks.use(anchor)
        self._evict(replica)

    def _removed(self, replica: int, engine_hashes: Iterable[EngineHash]) -> None:
        engine_map = self._engine[replica]
        blocks = self._blocks[replica]
        for engine_hash in engine_hashes:
            known = engine_map.pop(engine_hash, None)
            if known is None:
                continue
            for h in known[3]:
                if blocks.discard(h):
                    self._discard(h, replica)

    def _evict(self, replica: int) -> None:
        blocks = self._blocks[replica]
        excess = len(blocks) - blocks.capacity
        if excess <= 0:
            return
        holders = self._holders
        pop_oldest = blocks.pop_oldest
        for _ in range(excess):
            h = pop_oldest()
            # `_discard`, inlined: eviction runs once per block a placement pushes out.
            holding = holders.get(h)
            if holding is None:
                continue
            if isinstance(holding, int):
                if holding == replica:
                    del holders[h]
                continue
            holding.discard(replica)
            if len(holding) == 1:
                holders[h] = next(iter(holding))

    def _expire(self, now: float) -> None:
        queue = self._speculative_expiry
        while queue and queue[0][0] <= now:
            expiry, h, replica = queue.popleft()
            guesses = self._speculative.get(h)
            if guesses is not None and guesses.get(replica) == expiry:
                del guesses[replica]
                if not guesses:
                    del self._speculative[h]

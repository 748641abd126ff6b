"""Which replica holds which prompt prefix: block hash → replicas.

Keys are kvflow block hashes (`kvflow.scheduler.blocks`), one per full block of `block_size` tokens,
each naming the whole prefix up to its block. Two sources fill the index:

- **approximate**: the scheduler's own placements. A replica that served a prompt is assumed
  to keep its blocks; each replica's entries are bounded by its KV cache size
  (`vllm:cache_config_info`) and evicted least recently used first, a prompt's last blocks
  before its first ones, as vLLM evicts (see `_Blocks`).
- **precise**: vLLM's KV-cache events (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`).
  Engines hash blocks with their own algorithm, so engine hashes are never used as keys: each
  `BlockStored` block is re-hashed from its token ids with `kvflow.scheduler.blocks.hash_block`,
  chained from the kvflow hash of its parent (found through the engine hash → kvflow hashes
  map; no parent means `ROOT_HASH`, and the request's `cache_salt` enters the first block's
  hash, as `kvflow.scheduler.blocks` has it). An engine block of `k · block_size` tokens
  becomes `k` kvflow blocks. An engine that hashes as kvflow does (the simulator,
  `kvflow_hashes`) sends its hashes alone, and they are taken as they are: no token ids, no
  hashing. Placements on a precise replica add *speculative* entries that count until a
  `BlockStored` confirms them or `speculative_ttl_s` passes.

Matching a request is O(blocks + holders of its deepest shared block), not O(replicas ×
blocks): the index maps each block to the set of replicas holding it, and a request is matched
from its deepest block backwards, assuming (as vLLM's tail-first eviction makes true) that a
replica holding a block holds the blocks before it.
"""

from __future__ import annotations

import logging
from array import array
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from heapq import heapify, heappop, heappush

from kvflow.scheduler.blocks import ROOT_HASH, hash_block

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
    kvflow_hashes: bool = False
    """The engine's hashes are kvflow's own (`kvflow.scheduler.blocks`, blocks of the index's
    `block_size`), as the simulator's are: they are the index's keys, and `token_ids` may be
    empty. vLLM hashes with its own algorithm, so its events never set this."""
    cache_salt: str | None = None
    """The request's `cache_salt` when the event starts at the prompt's first block (no
    parent): re-hashing mixes it into that block as the engine did (vLLM's `extra_keys`)."""


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The engine evicted blocks."""

    block_hashes: tuple[EngineHash, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (e.g. a reset)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared

Holders = int
"""The replicas holding a block as a bit mask: bit r is set when replica r holds it.

A map of plain ints is invisible to the garbage collector (a map holding sets is walked by
every collection, and those pauses land on decisions), counting holders is one `bit_count`,
and adding or dropping a holder is one `|` or `&`.
"""


def replicas_in(mask: Holders) -> Iterator[int]:
    """The replica ids of a holder mask, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


_HASH_MASK = (1 << 64) - 1
_NO_PARENT = _HASH_MASK
"""The parent of a chain's first entry. A real block hash takes this value with probability
2⁻⁶⁴, and then only makes its block a chain start for eviction order."""


class _Blocks:
    """One replica's blocks as a forest of prompt chains, evicted least recently used leaf first.

    Each block knows its parent and how many children it has. A request stamps only its
    deepest block; a block's recency is the newest stamp in its subtree, so eviction takes the
    leaf (a chain's tail) with the oldest stamp and hands that stamp up to its parent. This is
    exact LRU with tail-first eviction, at O(new blocks + log n) per request instead of one
    reordering per block.

    Layout: one dict maps a block's hash to a slot, and three flat arrays hold each slot's
    parent, child count and stamp; freed slots are reused. Both choices keep pauses off the
    decision path: a dict whose keys churn is rebuilt in one go every few thousand inserts
    (one dict per replica instead of three makes those rare), and `array`s of machine ints,
    unlike lists, are invisible to the garbage collector, whose collections would otherwise
    walk every entry of every replica.
    """

    __slots__ = ("capacity", "children", "free", "leaves", "parent", "slots", "stamp", "tick")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.slots: dict[int, int] = {}
        """Block hash → its slot in the lists below."""
        self.parent = array("Q")
        """Slot → the parent block's hash (`_NO_PARENT` at a chain's start)."""
        self.children = array("q")
        self.stamp = array("q")
        self.free = array("q")
        """Slots of removed blocks, reused before the lists grow."""
        self.leaves: list[int] = []
        """Heap of `stamp << 64 | block` for blocks without children; stale entries are
        skipped. One int per entry, not a (stamp, block) tuple: ints are not tracked by the
        garbage collector, so a placement leaves nothing behind for it to collect."""
        self.tick = 0

    def __len__(self) -> int:
        return len(self.slots)

    def __contains__(self, h: int) -> bool:
        return h in self.slots

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.slots))

    def add_chain(self, parent: int, hashes: Sequence[int]) -> list[int]:
        """Add the chain `hashes` below `parent` (or at the root); the blocks that were new."""
        slots, parents, children, stamp, free = (
            self.slots,
            self.parent,
            self.children,
            self.stamp,
            self.free,
        )
        new: list[int] = []
        previous = parent
        previous_slot = slots.get(parent)
        for h in hashes:
            slot = slots.get(h)
            if slot is None:
                if free:
                    slot = free.pop()
                    parents[slot] = previous
                    children[slot] = 0
                    stamp[slot] = 0
                else:
                    slot = len(parents)
                    parents.append(previous)
                    children.append(0)
                    stamp.append(0)
                slots[h] = slot
                if previous_slot is not None:
                    children[previous_slot] += 1
                new.append(h)
            previous, previous_slot = h, slot
        return new

    def use(self, h: int) -> None:
        """A request ended at block `h`: it and its ancestors are the most recently used."""
        slot = self.slots.get(h)
        if slot is None:
            return
        self.tick += 1
        self.stamp[slot] = self.tick
        if self.children[slot] == 0:
            heappush(self.leaves, self.tick << 64 | h)
            # Stale heap entries are dropped by `compact`, off the decision path; this bound
            # only keeps a replica that is never trimmed from growing its heap without end.
            if len(self.leaves) > 8 * len(self.slots) + 1024:
                self._rebuild_leaves()

    def compact(self) -> None:
        """Drop stale leaf-heap entries once they outnumber the live ones."""
        if len(self.leaves) > 2 * len(self.slots) + 64:
            self._rebuild_leaves()

    def discard(self, h: int) -> bool:
        """Remove the block; whether it was there."""
        if h not in self.slots:
            return False
        self._remove(h)
        return True

    def pop_oldest(self) -> int:
        """Remove and return the least recently used leaf (the replica must hold blocks)."""
        slots, stamp, children = self.slots, self.stamp, self.children
        for attempt in range(2):
            leaves = self.leaves
            while leaves:
                entry = heappop(leaves)
                tick, h = entry >> 64, entry & _HASH_MASK
                slot = slots.get(h)
                if slot is not None and stamp[slot] == tick and children[slot] == 0:
                    self._remove(h)
                    return h
            if attempt == 0:
                self._rebuild_leaves()
        # Only cycles left (impossible for hash chains): drop any block.
        h = next(iter(slots))
        self._remove(h)
        return h

    def _remove(self, h: int) -> None:
        slot = self.slots.pop(h)
        self.free.append(slot)
        tick = self.stamp[slot]
        parent = self.parent[slot]
        parent_slot = self.slots.get(parent)
        if parent_slot is not None:
            children = self.children[parent_slot] - 1
            self.children[parent_slot] = children
            if tick > self.stamp[parent_slot]:
                self.stamp[parent_slot] = tick
            if children == 0:
                heappush(self.leaves, self.stamp[parent_slot] << 64 | parent)

    def _rebuild_leaves(self) -> None:
        stamp, children = self.stamp, self.children
        self.leaves = [
            stamp[slot] << 64 | h for h, slot in self.slots.items() if children[slot] == 0
        ]
        heapify(self.leaves)


class PrefixIndex:
    """Block hash → replicas holding it, per replica LRU, speculative entries, KV events.

    Replicas are small integer ids (0..n−1) assigned by the owner of the index.
    """

    def __init__(
        self,
        block_size: int,
        speculative_ttl_s: float,
        stride: int = 1,
        eviction_slack: float = 0.0,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if stride < 1:
            raise ValueError(f"stride must be at least 1, got {stride}")
        if eviction_slack < 0:
            raise ValueError(f"eviction_slack must be at least 0, got {eviction_slack}")
        self.block_size = block_size
        self.stride = stride
        """Only every `stride`-th block of a prompt is an index entry."""
        self.entry_tokens = block_size * stride
        """Prompt tokens one index entry stands for: a depth of d entries is d · entry_tokens."""
        self.speculative_ttl_s = speculative_ttl_s
        self.eviction_slack = eviction_slack
        """A placement may leave a replica up to this fraction over its capacity; `trim`
        (called off the decision path) evicts the excess. 0 evicts on every placement."""
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
        tokens. Replicas holding none are omitted. This is `match_levels` spelled out per
        replica.
        """
        return {
            replica: depth
            for depth, mask in self.match_levels(hashes, now)
            for replica in replicas_in(mask)
        }

    def match_levels(self, hashes: Sequence[int], now: float) -> list[tuple[int, Holders]]:
        """The replicas holding a prefix of `hashes`, as (depth, holder mask) levels.

        Levels come deepest first and each replica is in one level only: a replica in the
        level of depth d holds the first d index entries of `hashes` and not the next one.
        Most prompts have one to three levels however many replicas hold them (a shared
        system prompt on forty replicas is one level), so the scheduler looks a replica's
        depth up in the levels instead of building a map of every holder.

        depth(r) = 1 + the index of the deepest entry of `hashes` that r holds. Because a
        replica holding a block holds its ancestors, the holders never grow along the chain;
        each level is found by binary search, so a match costs O(levels · log blocks) lookups.
        """
        self._expire(now)
        levels: list[tuple[int, Holders]] = []
        if self.stride > 1:
            hashes = hashes[self.stride - 1 :: self.stride]
        if not hashes:
            return levels
        holders, speculative = self._holders, self._speculative
        confirmed = holders.get

        def held(i: int) -> Holders:
            h = hashes[i]
            mask = confirmed(h, 0)
            for replica in speculative.get(h, ()):
                mask |= 1 << replica
            return mask

        # Probes read the holder map directly unless speculative entries must be merged in
        # (precise mode): a function call per probe would be most of a match's cost.
        merge = bool(speculative)
        # Replicas holding the first entry whose depth is not known yet: a replica without
        # the first entry has no prefix to reuse, whatever deeper blocks it holds.
        remaining = held(0) if merge else confirmed(hashes[0], 0)
        high = len(hashes) - 1
        while remaining and high >= 0:
            # The deepest entry in [0, high] held by a replica not assigned yet.
            low = 0
            if (held(high) if merge else confirmed(hashes[high], 0)) & remaining:
                low = high
            else:
                while low < high:
                    mid = (low + high + 1) // 2
                    if (held(mid) if merge else confirmed(hashes[mid], 0)) & remaining:
                        low = mid
                    else:
                        high = mid - 1
            level = (held(low) if merge else confirmed(hashes[low], 0)) & remaining
            if not level:
                break  # holders not nested along the chain; what is assigned is a lower bound
            levels.append((low + 1, level))
            remaining &= ~level
            high = low - 1
        return levels

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
        bit = 1 << replica
        for h in new:
            holders[h] = holders.get(h, 0) | bit
        limit = int(blocks.capacity * (1.0 + self.eviction_slack))
        if len(blocks) > limit:
            # A replica placed on faster than it is trimmed: evict only what this placement
            # pushed past the limit, so one decision never pays for a whole trim.
            self._evict(replica, limit)

    def trim(self, replica: int) -> int:
        """Evict the replica's entries beyond its capacity; how many were evicted.

        With `eviction_slack`, placements only add entries and this does the evicting, so the
        owner calls it where latency does not matter (the scheduler: when the replica's
        telemetry arrives).
        """
        evicted = self._evict(replica)
        self._blocks[replica].compact()
        return evicted

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
        self._holders[h] = self._holders.get(h, 0) | (1 << replica)

    def _discard(self, h: int, replica: int) -> None:
        holders = self._holders
        holding = holders.get(h, 0) & ~(1 << replica)
        if holding:
            holders[h] = holding
        else:
            holders.pop(h, None)

    def _stored(self, replica: int, event: BlockStored) -> None:
        if event.kvflow_hashes and event.block_size == self.block_size:
            self._stored_keys(replica, event)
            return
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
        salt = None
        if event.parent_block_hash is None:
            parent, position, anchor = ROOT_HASH, -1, _NO_PARENT
            salt = event.cache_salt
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
                parent = hash_block(parent, block[k : k + step], salt)
                salt = None  # the prompt's first block only
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

    def _stored_keys(self, replica: int, event: BlockStored) -> None:
        """`_stored` for an engine whose hashes are the index's keys: no token ids to hash.

        The same entries as hashing the blocks' tokens would give; in a thrashing run, where
        every recomputed block is stored again, hashing them was most of the ingest's cost.
        """
        engine_map = self._engine[replica]
        if event.parent_block_hash is None:
            position, anchor = -1, _NO_PARENT
        else:
            known = engine_map.get(event.parent_block_hash)
            if known is None:
                self.unmatched_events += 1
                return
            _, position, anchor, _ = known
        stride = self.stride
        speculative = self._speculative
        first_anchor = anchor
        entries: list[int] = []
        for h in event.block_hashes:
            assert isinstance(h, int)  # kvflow hashes are 64-bit ints
            position += 1
            if position % stride == stride - 1:
                entries.append(h)
                if speculative:
                    guesses = speculative.get(h)
                    if guesses is not None:
                        guesses.pop(replica, None)
                anchor = h
                engine_map[h] = (h, position, h, (h,))
            else:
                engine_map[h] = (h, position, anchor, ())
        blocks = self._blocks[replica]
        holders = self._holders
        bit = 1 << replica
        for h in blocks.add_chain(first_anchor, entries):
            holders[h] = holders.get(h, 0) | bit
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

    def _evict(self, replica: int, limit: int | None = None) -> int:
        """Evict least recently used entries down to `limit` (the capacity by default)."""
        blocks = self._blocks[replica]
        excess = len(blocks) - (blocks.capacity if limit is None else limit)
        if excess <= 0:
            return 0
        holders = self._holders
        pop_oldest = blocks.pop_oldest
        keep = ~(1 << replica)
        for _ in range(excess):
            h = pop_oldest()
            # `_discard`, inlined: eviction runs once per block a placement pushes out.
            holding = holders.get(h, 0) & keep
            if holding:
                holders[h] = holding
            else:
                holders.pop(h, None)
        return excess

    def _expire(self, now: float) -> None:
        queue = self._speculative_expiry
        while queue and queue[0][0] <= now:
            expiry, h, replica = queue.popleft()
            guesses = self._speculative.get(h)
            if guesses is not None and guesses.get(replica) == expiry:
                del guesses[replica]
                if not guesses:
                    del self._speculative[h]

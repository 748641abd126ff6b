"""The paged KV cache: a pool of fixed-size blocks with prefix caching and LRU eviction.

Shaped like vLLM v1's `BlockPool` (`vllm/v1/core/block_pool.py`), rule for rule:

- Block 0 is the null block (a placeholder vLLM never hands out): of `num_blocks`, requests
  get `num_blocks − 1`, and usage is counted over those.
- Every block has a reference count. A full block is registered under its hash
  (`kvflow.scheduler.blocks`) when the step that fills it is scheduled, so a request admitted
  later, even in the same step, reuses it instead of computing it again.
- Several blocks may hold the same hash (two requests computed the same tokens, or a prompt's
  last full block, which is always recomputed): a lookup returns the first registered one
  still cached, and evicting one leaves the others findable.
- A request frees its blocks last block first. A freed block that has a hash goes to the tail
  of the free queue and stays reusable until the pool needs a block and evicts it from the
  head (least recently freed first, a `BlockRemoved` event); a freed block without a hash
  (a partial last block) goes to the head, to be reused first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import islice, takewhile
from typing import Any, cast

from kvflow.simulator.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored

NULL_BLOCK = 0
"""The placeholder block vLLM keeps out of the free queue."""


class BlockPool:
    """`num_blocks` KV blocks of `block_size` tokens; see the module docstring."""

    __slots__ = (
        "_block_hash",
        "_cached",
        "_copies",
        "_events",
        "_free",
        "_ref_cnt",
        "block_size",
        "enable_caching",
        "num_blocks",
        "releases",
    )

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        events: list[Any] | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (one is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._ref_cnt = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        # Insertion order is eviction order: the first key is the next block handed out.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._cached: dict[int, int] = {}
        """Hash → the block a lookup finds (the first registered one still cached)."""
        self._copies: dict[int, list[int]] = {}
        """Hash → further blocks registered under it, in registration order."""
        self._events = events
        self.releases = 0
        """Blocks that went back to the free queue so far."""

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: all but the null block."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks no running request holds (cached or not)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Hashes a lookup can find (held or free blocks)."""
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks held by requests, as `vllm:kv_cache_usage_perc` reports it."""
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    def longest_cached_prefix(self, block_hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Block ids of the longest run of `block_hashes` (from the first) that is cached."""
        if not self.enable_caching:
            return []
        # One pass in C (block ids are never 0, the null block's): a blocked request is
        # looked up again every step, and a Python loop over a long prompt cost most of a
        # thrashing run's time.
        found = takewhile(bool, map(self._cached.get, islice(block_hashes, max_blocks)))
        return cast(list[int], list(found))

    def is_cached(self, block_hash: int) -> bool:
        """Whether some block holds `block_hash` (a lookup would find it)."""
        return block_hash in self._cached

    def cached_prefix_blocks(self, block_hashes: Sequence[int]) -> int:
        """How many blocks from the first of `block_hashes` are cached (a read-only probe)."""
        if not self.enable_caching:
            return 0
        return sum(1 for _ in takewhile(self._cached.__contains__, block_hashes))

    def count_free(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` are in the free queue (would stop being free if touched)."""
        return list(map(self._ref_cnt.__getitem__, blocks)).count(0)

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached `blocks`, taking free ones out of the free queue."""
        ref_cnt = self._ref_cnt
        free = self._free
        for block in blocks:
            if ref_cnt[block] == 0:
                del free[block]
            ref_cnt[block] += 1

    def allocate(self, count: int) -> list[int] | None:
        """Take `count` blocks from the head of the free queue, evicting their hashes.

        Returns None, changing nothing, when fewer than `count` blocks are free.
        """
        free = self._free
        if count > len(free):
            return None
        ref_cnt = self._ref_cnt
        block_hash = self._block_hash
        evicted: list[int] | None = None
        blocks: list[int] = []
        for _ in range(count):
            block, _none = free.popitem(last=False)
            old = block_hash[block]
            if old is not None:
                block_hash[block] = None
                self._forget(old, block)
                if self._events is not None:
                    if evicted is None:
                        evicted = []
                    evicted.append(old)
            ref_cnt[block] = 1
            blocks.append(block)
        if evicted:
            assert self._events is not None
            # vLLM sends one event per evicted block; one event for the batch says the same.
            self._events.append(BlockRemoved(block_hashes=evicted, medium=MEDIUM_GPU))
        return blocks

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each of `blocks`, last block first (see the module docstring)."""
        ref_cnt = self._ref_cnt
        block_hash = self._block_hash
        free = self._free
        reuse_first: list[int] = []
        for block in reversed(blocks):
            ref_cnt[block] -= 1
            if ref_cnt[block] == 0:
                self.releases += 1
                if block_hash[block] is None:
                    reuse_first.append(block)
                else:
                    free[block] = None
        # vLLM puts blocks without a hash at the head, in the order they were freed.
        for block in reversed(reuse_first):
            free[block] = None
            free.move_to_end(block, last=False)

    def cache_blocks(
        self,
        blocks: Sequence[int],
        hashes: Sequence[int],
        parent: int | None,
        token_ids: list[int],
    ) -> None:
        """Register newly full `blocks` under `hashes` and report them as one `BlockStored`."""
        if not self.enable_caching:
            return
        cached = self._cached
        block_hash = self._block_hash
        for block, value in zip(blocks, hashes, strict=True):
            block_hash[block] = value
            first = cached.get(value)
            if first is None:
                cached[value] = block
            else:
                self._copies.setdefault(value, []).append(block)
        if self._events is not None:
            self._events.append(
                BlockStored(
                    block_hashes=list(hashes),
                    parent_block_hash=parent,
                    token_ids=token_ids,
                    block_size=self.block_size,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    lora_name=None,
                )
            )

    def reset(self) -> bool:
        """Forget every cached hash; only possible when no request holds a block."""
        if len(self._free) != self.num_blocks - 1:
            return False
        self._cached.clear()
        self._copies.clear()
        self._block_hash = [None] * self.num_blocks
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True

    def _forget(self, value: int, block: int) -> None:
        """`block` no longer holds hash `value`; another block holding it takes over lookups."""
        copies = self._copies.get(value)
        if self._cached.get(value) == block:
            if copies:
                self._cached[value] = copies.pop(0)
                if not copies:
                    del self._copies[value]
            else:
                del self._cached[value]
        elif copies is not None:
            copies.remove(block)
            if not copies:
                del self._copies[value]

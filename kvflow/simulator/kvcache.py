"""The paged KV cache: a pool of fixed-size blocks with prefix caching and LRU eviction.

Shaped like vLLM v1's `BlockPool`: every block has a reference count; a full block of a
request is registered under its hash (`kvflow.scheduler.blocks`), so a later request whose prompt
starts with the same tokens reuses it instead of computing it again. Blocks whose reference
count drops to zero go to the tail of a free queue but keep their hash: they stay reusable
until the pool needs a block and evicts the least recently freed one from the head (a
`BlockRemoved` event). A request frees its blocks last-first, so the tail of a prompt is
evicted before its shared head.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvflow.simulator.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored


class BlockPool:
    """`num_blocks` KV blocks of `block_size` tokens; see the module docstring."""

    __slots__ = (
        "_block_hash",
        "_cached",
        "_events",
        "_free",
        "_ref_cnt",
        "block_size",
        "enable_caching",
        "num_blocks",
    )

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        events: list[Any] | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._ref_cnt = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        # Insertion order is eviction order: the first key is the least recently freed block.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}
        self._events = events

    @property
    def num_free_blocks(self) -> int:
        """Blocks no running request holds (cached or not)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a hash (held or free)."""
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks held by requests, as `vllm:kv_cache_usage_perc` reports it."""
        return 1.0 - len(self._free) / self.num_blocks

    def longest_cached_prefix(self, block_hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Block ids of the longest run of `block_hashes` (from the first) that is cached."""
        if not self.enable_caching:
            return []
        cached = self._cached
        found: list[int] = []
        for block_hash in block_hashes[:max_blocks]:
            block = cached.get(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def cached_prefix_blocks(self, block_hashes: Sequence[int]) -> int:
        """How many blocks from the first of `block_hashes` are cached (a read-only probe)."""
        if not self.enable_caching:
            return 0
        cached = self._cached
        count = 0
        for block_hash in block_hashes:
            if block_hash not in cached:
                break
            count += 1
        return count

    def count_free(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` are in the free queue (would stop being free if touched)."""
        ref_cnt = self._ref_cnt
        return sum(1 for b in blocks if ref_cnt[b] == 0)

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
                if self._cached.get(old) == block:
                    del self._cached[old]
                    if self._events is not None:
                        if evicted is None:
                            evicted = []
                        evicted.append(old)
            ref_cnt[block] = 1
            blocks.append(block)
        if evicted:
            assert self._events is not None
            self._events.append(BlockRemoved(block_hashes=evicted, medium=MEDIUM_GPU))
        return blocks

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each of `blocks`, last block first (see the module docstring)."""
        ref_cnt = self._ref_cnt
        free = self._free
        for block in reversed(blocks):
            ref_cnt[block] -= 1
            if ref_cnt[block] == 0:
                free[block] = None

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
            # Two requests may compute the same block at once; the first one stays the lookup.
            cached.setdefault(value, block)
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
        if len(self._free) != self.num_blocks:
            return False
        self._cached.clear()
        self._block_hash = [None] * self.num_blocks
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True

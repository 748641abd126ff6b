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

`RetentionBlockPool` adds retention priorities on top, as TensorRT-LLM's block manager has
them (`EngineConfig.kv_retention`; vLLM has no such thing).
"""

from __future__ import annotations

from bisect import insort
from collections import OrderedDict, deque
from collections.abc import Sequence
from heapq import heappop, heappush
from itertools import filterfalse, islice, takewhile
from typing import Any, cast

from kvflow.simulator.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)

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
        # len(list(...)) stays in C; a generator under sum() cost twice as much (a router
        # probes every replica for every request).
        return len(list(takewhile(self._cached.__contains__, block_hashes)))

    def count_free(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` are in the free queue (would stop being free if touched)."""
        return list(map(self._ref_cnt.__getitem__, blocks)).count(0)

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached `blocks`, taking free ones out of the free queue."""
        ref_cnt = self._ref_cnt
        free = self._free
        for block in blocks:
            count = ref_cnt[block]
            if not count:
                del free[block]
            ref_cnt[block] = count + 1

    def allocate(self, count: int, now: float = 0.0) -> list[int] | None:
        """Take `count` blocks from the head of the free queue, evicting their hashes.

        Returns None, changing nothing, when fewer than `count` blocks are free. `now`, the
        simulated time, plays no part here (vLLM's order has no clock); a
        `RetentionBlockPool` needs it to let retentions lapse.
        """
        free = self._free
        if count > len(free):
            return None
        pop = free.popitem
        # Positional `last`: keyword parsing cost a tenth of the call.
        blocks = [pop(False)[0] for _ in range(count)]
        self._claim(blocks)
        return blocks

    def _claim(self, blocks: list[int]) -> None:
        """Hand out `blocks`, just taken from the free blocks: evict their hashes, one ref each."""
        ref_cnt = self._ref_cnt
        block_hash = self._block_hash
        cached = self._cached
        copies = self._copies
        evicted: list[int] | None = [] if self._events is not None else None
        for block in blocks:
            old = block_hash[block]
            if old is not None:
                block_hash[block] = None
                # `_forget` inlined for its common case (under memory pressure nearly every
                # block handed out evicts a hash, and the call cost more than the work).
                if old not in copies and cached.get(old) == block:
                    del cached[old]
                else:
                    self._forget(old, block)
                if evicted is not None:
                    evicted.append(old)
            ref_cnt[block] = 1
        if evicted:
            assert self._events is not None
            # vLLM sends one event per evicted block; one event for the batch says the same.
            self._events.append(BlockRemoved(block_hashes=evicted, medium=MEDIUM_GPU))

    def release(self, blocks: Sequence[int], now: float = 0.0) -> None:
        """Drop one reference on each of `blocks`, last block first (see the module docstring).

        `now` plays no part here, as in `allocate`.
        """
        ref_cnt = self._ref_cnt
        block_hash = self._block_hash
        free = self._free
        reuse_first: list[int] = []
        freed = 0
        for block in reversed(blocks):
            count = ref_cnt[block] - 1
            ref_cnt[block] = count
            if not count:
                freed += 1
                if block_hash[block] is None:
                    reuse_first.append(block)
                else:
                    free[block] = None
        self.releases += freed
        # vLLM puts blocks without a hash at the head, in the order they were freed.
        for block in reversed(reuse_first):
            free[block] = None
            free.move_to_end(block, last=False)

    def blocks_of(self, block_hashes: Sequence[int]) -> list[int]:
        """Every block that holds one of `block_hashes` now (held or free)."""
        found: list[int] = []
        for value in block_hashes:
            first = self._cached.get(value)
            if first is not None:
                found.append(first)
                found.extend(self._copies.get(value, ()))
        return found

    def evict_first(self, block_hashes: Sequence[int]) -> int:
        """Put the free blocks holding `block_hashes` at the head of the eviction order.

        For a conversation that will not come back (its task ended): the engine evicts its
        blocks before any other cached block, each block moved here before the ones moved
        earlier. Blocks a running request holds are left alone (they come back to the tail
        when it frees them), and the blocks stay findable until evicted. Returns how many
        blocks moved.
        """
        ref_cnt = self._ref_cnt
        free = self._free
        moved = 0
        for block in self.blocks_of(block_hashes):
            if ref_cnt[block] == 0:
                free.move_to_end(block, last=False)
                moved += 1
        return moved

    def cache_blocks(
        self,
        blocks: Sequence[int],
        hashes: Sequence[int],
        parent: int | None,
        token_ids: list[int],
        cache_salt: str | None = None,
    ) -> None:
        """Register newly full `blocks` under `hashes` and report them as one `BlockStored`.

        `cache_salt` is the request's when `blocks` start at its first block (`parent` None):
        the event lists it among that block's extra keys, as vLLM does.
        """
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
                    extra_keys=(
                        [[cache_salt], *([None] * (len(hashes) - 1))]
                        if cache_salt and parent is None and hashes
                        else None
                    ),
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


DEFAULT_RETENTION_PRIORITY = 35
"""TensorRT-LLM's default retention priority, on its scale of 0 (evicted first) to 100."""
MIN_RETENTION_PRIORITY = 0
MAX_RETENTION_PRIORITY = 100

_UNHASHED = -1
"""Level of the queue of free blocks without a hash: below every priority, evicted first."""
_AGED = -2
"""Level of a free block whose retention lapsed and that waits in the aged heap."""


class RetentionBlockPool(BlockPool):
    """A `BlockPool` that evicts free blocks by retention priority, as TensorRT-LLM does.

    TensorRT-LLM's `KvCacheRetentionConfig` (`tensorrt_llm.llmapi`; "How to Change Block
    Priorities" and the `KvCacheRetentionConfig` reference in its documentation, and NVIDIA's
    "Introducing New KV Cache Reuse Optimizations in NVIDIA TensorRT-LLM") gives the
    blocks of a request a retention priority from 0 to 100 (100 kept longest; the default is
    35), per token range of the prompt (`TokenRangeRetentionConfig(token_start, token_end,
    priority, duration_ms)`) and for the blocks of generated tokens
    (`decode_retention_priority`, `decode_duration_ms`). A duration makes the priority lapse:
    afterwards the block counts as the default priority. When the block manager needs a block,
    it evicts a free reusable block of the lowest priority, the least recently used one within
    that priority.

    Here a request gives one priority and one duration (in seconds, not TensorRT-LLM's
    milliseconds) for all its blocks (`release`), and they take effect when it frees them; the
    duration runs from that release. The rules:

    - Free blocks without a hash (never used, or a partial last block) still go first, in
      vLLM's order (`BlockPool`); they hold nothing worth keeping.
    - Then the lowest effective priority, least recently freed first within a priority.
    - A block whose retention lapsed counts as priority 35 from then on, ordered among the
      priority-35 blocks by when it was freed: where it would be had it been freed at the
      default priority. Not at the tail: that would make a block whose retention ran out long
      ago look freshly used, still protected after its window. Lapses are applied lazily, when
      a block is next allocated (`now`), which is the only moment the order matters.
    - A block several requests held takes the priority of the release that frees it (the
      last holder's); freed again after a cache hit, it takes that release's.

    With every release at the default priority the order is exactly `BlockPool`'s. A retained
    free block is free: `num_free_blocks` counts it and `usage()` does not, as vLLM's
    `kv_cache_usage_perc` does not count cached free blocks.

    Structure: one queue (insertion order = eviction order) per priority in use; a heap of
    (expires_at, first release number, blocks), one entry per release with a finite
    retention (its blocks are numbered consecutively); and a heap of (release number, block)
    of lapsed blocks, merged with the priority-35 queue by release number. Heap entries are
    dropped lazily: a block taken or freed again since (another release number) is skipped.
    """

    __slots__ = (
        "_aged",
        "_clock",
        "_expiring",
        "_level",
        "_levels",
        "_num_free",
        "_queues",
        "_seq",
    )

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        events: list[Any] | None = None,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_caching, events)
        # The base class's free queue holds the blocks without a hash here.
        self._queues: dict[int, OrderedDict[int, None]] = {
            _UNHASHED: self._free,
            DEFAULT_RETENTION_PRIORITY: OrderedDict(),
        }
        self._levels: list[int] = [DEFAULT_RETENTION_PRIORITY]
        """Priorities with a queue, ascending (the unhashed queue is looked at first)."""
        self._level: list[int] = [_UNHASHED] * num_blocks
        """Per block while free: the priority of its queue, `_UNHASHED` or `_AGED`."""
        self._seq: list[int] = [0] * num_blocks
        """Per block: the number of its latest release (a free block's age)."""
        self._clock = 0
        self._expiring: list[tuple[float, int, list[int]]] = []
        """(expires_at, release number of the first, blocks) per release with a retention."""
        self._aged: list[tuple[int, int]] = []
        self._num_free = num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks no running request holds (cached, retained or not)."""
        return self._num_free

    def usage(self) -> float:
        """Fraction of blocks held by requests; retained free blocks are not in use."""
        return 1.0 - self._num_free / (self.num_blocks - 1)

    def next_expiry(self, now: float) -> float | None:
        """When the next retention lapses after `now`; None if none is pending.

        Lapses up to `now` are applied first. The time may be that of a retention whose blocks
        were all taken since: early, never late.
        """
        heap = self._expiring
        if heap and heap[0][0] <= now:
            self._expire(now)
        return heap[0][0] if heap else None

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached `blocks`, taking free ones out of the free structure."""
        ref_cnt = self._ref_cnt
        level = self._level
        queues = self._queues
        for block in blocks:
            if ref_cnt[block] == 0:
                where = level[block]
                # A lapsed block's heap entry goes stale on its own (the block is not free).
                if where != _AGED:
                    del queues[where][block]
                self._num_free -= 1
            ref_cnt[block] += 1

    def allocate(self, count: int, now: float = 0.0) -> list[int] | None:
        """Take `count` free blocks in eviction order at time `now` (class docstring).

        Returns None, changing nothing, when fewer than `count` blocks are free.
        """
        if count > self._num_free:
            return None
        if self._expiring and self._expiring[0][0] <= now:
            self._expire(now)
        blocks = self._take(count)
        self._claim(blocks)
        self._num_free -= count
        return blocks

    def release(
        self,
        blocks: Sequence[int],
        now: float = 0.0,
        priority: int | None = None,
        retention_s: float | None = None,
    ) -> None:
        """Drop one reference on each of `blocks`, last block first.

        A block no request holds any more becomes free: without a hash at the head of the
        eviction order (as `BlockPool`), with one under `priority` (None: the default, 35)
        until `now + retention_s` (None: until evicted), then under the default priority.
        """
        if priority is None:
            priority = DEFAULT_RETENTION_PRIORITY
        elif not MIN_RETENTION_PRIORITY <= priority <= MAX_RETENTION_PRIORITY:
            raise ValueError(f"retention priority must be within 0..100, got {priority}")
        expires_at = (
            None
            if retention_s is None or priority == DEFAULT_RETENTION_PRIORITY
            else now + retention_s
        )
        queue = self._queues.get(priority)
        if queue is None:
            queue = self._queues[priority] = OrderedDict()
            insort(self._levels, priority)
        ref_cnt = self._ref_cnt
        block_hash = self._block_hash
        level = self._level
        seq = self._seq
        clock = first = self._clock + 1
        freed = 0
        retained: list[int] = []
        reuse_first: list[int] = []
        for block in reversed(blocks):
            ref_cnt[block] -= 1
            if ref_cnt[block] == 0:
                freed += 1
                if block_hash[block] is None:
                    reuse_first.append(block)
                    continue
                seq[block] = clock
                clock += 1
                level[block] = priority
                queue[block] = None
                retained.append(block)
        self._clock = clock - 1
        if expires_at is not None and retained:
            # One entry for the release, not one per block: its blocks have consecutive
            # release numbers from `first`.
            heappush(self._expiring, (expires_at, first, retained))
        self.releases += freed
        self._num_free += freed
        free = self._free
        for block in reversed(reuse_first):
            level[block] = _UNHASHED
            free[block] = None
            free.move_to_end(block, last=False)

    def evict_first(self, block_hashes: Sequence[int]) -> int:
        """As `BlockPool.evict_first`: the free blocks go to the lowest priority (0), first.

        Whatever retention they were released under no longer holds: a new release number
        makes their pending lapse (or their place among the lapsed blocks) stale.
        """
        ref_cnt = self._ref_cnt
        level = self._level
        queues = self._queues
        seq = self._seq
        queue = queues.get(MIN_RETENTION_PRIORITY)
        if queue is None:
            queue = queues[MIN_RETENTION_PRIORITY] = OrderedDict()
            insort(self._levels, MIN_RETENTION_PRIORITY)
        moved = 0
        for block in self.blocks_of(block_hashes):
            if ref_cnt[block] != 0:
                continue
            where = level[block]
            if where != _AGED:
                del queues[where][block]
            self._clock += 1
            seq[block] = self._clock
            level[block] = MIN_RETENTION_PRIORITY
            queue[block] = None
            queue.move_to_end(block, last=False)
            moved += 1
        return moved

    def reset(self) -> bool:
        """Forget every cached hash; only possible when no request holds a block.

        The free blocks keep their eviction order, all of them now without a hash.
        """
        if self._num_free != self.num_blocks - 1:
            return False
        self._free.update(OrderedDict.fromkeys(self._take(self._num_free)))
        self._level = [_UNHASHED] * self.num_blocks
        self._expiring.clear()
        self._aged.clear()
        return super().reset()

    def _expire(self, now: float) -> None:
        """Move free blocks whose retention lapsed by `now` to the aged heap (default level)."""
        heap = self._expiring
        ref_cnt = self._ref_cnt
        seq = self._seq
        level = self._level
        queues = self._queues
        aged = self._aged
        while heap and heap[0][0] <= now:
            _, number, blocks = heappop(heap)
            for block in blocks:
                # Skipped if taken, or freed again since: another release's rules apply.
                if ref_cnt[block] == 0 and seq[block] == number:
                    del queues[level[block]][block]
                    level[block] = _AGED
                    heappush(aged, (number, block))
                number += 1

    def _take(self, count: int) -> list[int]:
        """Take the next `count` free blocks to evict out of the free structure, in order.

        Whole runs come from one queue at a time: a Python call per block cost a third of a
        run under memory pressure.
        """
        taken: list[int] = []
        append = taken.append
        need = count
        queues = self._queues
        for priority in (_UNHASHED, *self._levels):
            queue = queues[priority]
            if priority == DEFAULT_RETENTION_PRIORITY and self._aged:
                need = self._take_default(queue, need, taken)
            else:
                pop = queue.popitem
                for _ in range(min(need, len(queue))):
                    append(pop(last=False)[0])
                need = count - len(taken)
            if not need:
                return taken
        raise AssertionError("fewer free blocks than the count said")

    def _take_default(self, queue: OrderedDict[int, None], need: int, taken: list[int]) -> int:
        """Take up to `need` default-priority blocks: `queue` merged with the lapsed blocks.

        Both are in release order; the older head goes first. Returns how many are still
        needed.
        """
        aged = self._aged
        ref_cnt = self._ref_cnt
        seq = self._seq
        level = self._level
        while need:
            while aged:
                number, block = aged[0]
                if ref_cnt[block] == 0 and level[block] == _AGED and seq[block] == number:
                    break
                heappop(aged)  # stale: taken or freed again since it lapsed
            if aged and (not queue or aged[0][0] < seq[next(iter(queue))]):
                block = heappop(aged)[1]
            elif queue:
                block = queue.popitem(last=False)[0]
            else:
                break
            taken.append(block)
            need -= 1
        return need


GIVEN_OUT_PER_BLOCK = 2
"""Shared hashes a simulated server's `TaskBlocks` remembers per block of its engine's cache,
as `kvflow_vllm.scheduler.GIVEN_OUT_PER_BLOCK`."""


class TaskBlocks:
    """Which block hashes only one task has asked for: what its end may evict first.

    The engine's side of a task's end (`kvflow_vllm.scheduler.TaskEndScheduler` in vLLM; the
    benchmark's `task-end` mechanism): every call notes its blocks under its task, and when
    the task ends, `end` returns the hashes no other task asked for. A block another task
    asked for first (a system prompt) is shared, and so is one a task asks for after its
    first user ended (it was given out already), so a hash is given out at most once.

    Memory is bounded as in vLLM's: at most `max_tasks` tasks are tracked (the least recently
    noted forgotten first; its blocks are then given out, to no one), and at most `max_shared`
    shared hashes are remembered, oldest first forgotten (None: no bound, as the benchmark's
    runs are finite; a simulated server bounds it by its cache, as vLLM's scheduler does).
    """

    __slots__ = ("_blocks", "_owner", "_shared", "max_shared", "max_tasks")

    def __init__(self, *, max_shared: int | None = None, max_tasks: int = 100_000) -> None:
        self.max_shared = max_shared
        self.max_tasks = max_tasks
        self._owner: dict[int, object] = {}
        """Block hash → the one open task that asked for it, while no other did."""
        self._shared: OrderedDict[int, None] = OrderedDict()
        """Hashes more than one task asked for, or an ended task did: least recently seen first."""
        self._blocks: OrderedDict[object, set[int]] = OrderedDict()
        """Open task → every hash its calls asked for; least recently noted first."""

    def note(self, task: object, block_hashes: Sequence[int]) -> None:
        """The task's call asks for `block_hashes` (its whole prompt, a conversation grows)."""
        seen = self._blocks.pop(task, None)
        if seen is None:
            seen = set()
        self._blocks[task] = seen  # now the most recently noted
        fresh = set(block_hashes) - seen
        owner, shared = self._owner, self._shared
        for value in fresh:
            if value in shared:
                shared.move_to_end(value)
                continue
            first = owner.setdefault(value, task)
            if first != task:
                del owner[value]
                shared[value] = None
        seen |= fresh
        self._trim()

    def end(self, task: object) -> list[int]:
        """The task ended: the hashes only it asked for (none the second time)."""
        blocks = self._blocks.pop(task, None)
        if not blocks:
            return []
        own = self._give_out(task, blocks)
        self._trim()
        return own

    def _give_out(self, task: object, blocks: set[int]) -> list[int]:
        """Forget the task: its own hashes (returned) and all it asked for become shared."""
        owner, shared = self._owner, self._shared
        own = [value for value in blocks if owner.get(value) == task]
        for value in own:
            del owner[value]
        for value in blocks:
            if value not in owner:  # a later task's own (its first asker forgotten) stays
                shared[value] = None
                shared.move_to_end(value)
        return own

    def _trim(self) -> None:
        while len(self._blocks) > self.max_tasks:
            task, blocks = self._blocks.popitem(last=False)
            self._give_out(task, blocks)
        if self.max_shared is not None:
            while len(self._shared) > self.max_shared:
                self._shared.popitem(last=False)


DEFAULT_STORE_TRACKER_SIZE = 64_000
"""Hashes the store gate counts at most (vLLM's `max_tracker_size` default)."""


class HostTier:
    """A replica's host-memory copy of full KV blocks: vLLM's native CPU offloading.

    The rules of vLLM's offloading connector with its CPU spec (`vllm/v1/kv_offload/`:
    `LRUOffloadingManager`, `FilterReusedOffloadingManager`, `CPUOffloadingSpec`; the
    scheduler side of `OffloadingConnector`), re-implemented at the GPU block size (vLLM's
    default offloaded block size):

    - Write-through: a block is offered for storing once it is full (`prepare_store`). Blocks
      already in host memory are skipped; room is made by evicting the least recently used
      blocks that no transfer uses (a `BlockRemoved` event, medium "CPU"). When not enough
      can be evicted, nothing of the offer is stored (`None`) and it is offered again later.
      A stored block is found by `lookup` only once its transfer ends (`complete_stores`,
      a `BlockStored` event, medium "CPU", without token ids or parent, as vLLM sends them).
    - `store_threshold` (vLLM's `store_threshold`; under 2: off, vLLM's default): only
      blocks `lookup` was asked for that many times are stored, counted in an LRU table of
      `DEFAULT_STORE_TRACKER_SIZE` hashes.
    - Recency: `touch` makes a request's blocks the most recently used, its first block
      last (so a prefix's tail is evicted before its head); a lookup and a store touch.
    - Loads: `lookup` counts the ready blocks from the first asked for; `begin_load` pins
      them (a block being loaded or stored is never evicted) until `end_load`.
    - One link per replica carries loads and stores in both directions, one transfer at a
      time in the order issued, at `bytes_per_second` (`perf.HOST_LINK_GBPS`): a transfer
      of `n` blocks takes `n · bytes_per_block / bytes_per_second` once the link is free.
      vLLM copies on separate CUDA streams; one shared rate is the conservative reading of
      a full-duplex PCIe link.
    """

    __slots__ = (
        "_blocks",
        "_counts",
        "_events",
        "_link_free_at",
        "_ready",
        "_stores",
        "block_size",
        "bytes_per_block",
        "bytes_per_second",
        "loaded_blocks",
        "num_blocks",
        "store_threshold",
        "stored_blocks",
    )

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        bytes_per_block: int,
        bytes_per_second: float,
        *,
        store_threshold: int = 0,
        events: list[Any] | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"a host tier needs at least one block, got {num_blocks}")
        if bytes_per_second <= 0:
            raise ValueError(f"the host link needs a positive bandwidth, got {bytes_per_second}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.bytes_per_second = bytes_per_second
        self.store_threshold = store_threshold
        self._blocks: OrderedDict[int, int] = OrderedDict()
        """Hash → transfers using it: -1 while being stored, 0 ready, n > 0 being loaded n
        times. Insertion order is recency: the first key is evicted first."""
        self._ready: set[int] = set()
        """Hashes whose store ended (what `lookup` finds)."""
        self._counts: OrderedDict[int, int] = OrderedDict()
        """Hash → lookups that asked for it (only with a store threshold)."""
        self._stores: deque[tuple[float, list[int]]] = deque()
        """(end time, hashes) of stores in flight, in the order they end."""
        self._link_free_at = 0.0
        self._events = events
        self.stored_blocks = 0
        """Blocks written to host memory so far."""
        self.loaded_blocks = 0
        """Blocks read back to the GPU so far."""

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def is_ready(self, block_hash: int) -> bool:
        """Whether `block_hash` is in host memory and its store has ended."""
        return block_hash in self._ready

    def transfer_seconds(self, num_blocks: int) -> float:
        """Seconds the link takes for `num_blocks` blocks once it is free."""
        return num_blocks * self.bytes_per_block / self.bytes_per_second

    def _transfer(self, num_blocks: int, now: float) -> float:
        """Queue a transfer on the link; when it ends."""
        start = now if now > self._link_free_at else self._link_free_at
        end = start + self.transfer_seconds(num_blocks)
        self._link_free_at = end
        return end

    @property
    def busy_until(self) -> float:
        """When the link has carried every transfer issued so far."""
        return self._link_free_at

    def next_store_end(self) -> float | None:
        """When the earliest store in flight ends; None if none is."""
        return self._stores[0][0] if self._stores else None

    def complete_stores(self, now: float) -> None:
        """Stores ended by `now` make their blocks findable (`BlockStored`, medium CPU)."""
        stores = self._stores
        blocks = self._blocks
        while stores and stores[0][0] <= now:
            _, hashes = stores.popleft()
            done = []
            for value in hashes:
                if blocks.get(value) == -1:
                    blocks[value] = 0
                    done.append(value)
            self._ready.update(done)
            if done and self._events is not None:
                self._events.append(
                    BlockStored(
                        block_hashes=done,
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=self.block_size,
                        lora_id=None,
                        medium=MEDIUM_CPU,
                        lora_name=None,
                    )
                )

    def touch(self, block_hashes: Sequence[int]) -> None:
        """Make the blocks of `block_hashes` held here the most recently used, first last."""
        blocks = self._blocks
        # All in C: a request touches its whole prefix at every lookup and store, and a
        # Python loop over 1,000-block conversations was most of a host-tier run's time.
        deque(map(blocks.move_to_end, filter(blocks.__contains__, reversed(block_hashes))), 0)

    def lookup(self, block_hashes: Sequence[int]) -> int:
        """How many of `block_hashes`, from the first, are ready in host memory."""
        if self.store_threshold >= 2:
            counts = self._counts
            for value in block_hashes:
                if value in counts:
                    counts.move_to_end(value)
                    counts[value] += 1
                else:
                    if len(counts) >= DEFAULT_STORE_TRACKER_SIZE:
                        counts.popitem(last=False)
                    counts[value] = 1
        return len(list(takewhile(self._ready.__contains__, block_hashes)))

    def prepare_store(self, block_hashes: Sequence[int]) -> list[int] | None:
        """Make room for the blocks of `block_hashes` not held yet; the hashes to store.

        None, changing nothing, when too few blocks can be evicted (see the class docstring).
        """
        blocks = self._blocks
        if self.store_threshold >= 2:
            counts = self._counts
            threshold = self.store_threshold
            block_hashes = [v for v in block_hashes if counts.get(v, 0) >= threshold]
        fresh = list(filterfalse(blocks.__contains__, block_hashes))
        excess = len(blocks) + len(fresh) - self.num_blocks
        evict: list[int] = []
        if excess > 0:
            for value, users in blocks.items():
                if users == 0:
                    evict.append(value)
                    if len(evict) == excess:
                        break
            else:
                return None
            for value in evict:
                del blocks[value]
            self._ready.difference_update(evict)
            if self._events is not None:
                self._events.append(BlockRemoved(block_hashes=evict, medium=MEDIUM_CPU))
        for value in fresh:
            blocks[value] = -1
        return fresh

    def store(self, block_hashes: list[int], now: float) -> float:
        """Copy the prepared `block_hashes` from the GPU, starting no earlier than `now`.

        Returns when the copy ends (the blocks are findable from then on).
        """
        end = self._transfer(len(block_hashes), now)
        self._stores.append((end, block_hashes))
        self.stored_blocks += len(block_hashes)
        return end

    def begin_load(self, block_hashes: Sequence[int], now: float) -> float:
        """Pin the ready `block_hashes` and copy them to the GPU; when the copy ends."""
        blocks = self._blocks
        for value in block_hashes:
            blocks[value] += 1
        self.loaded_blocks += len(block_hashes)
        return self._transfer(len(block_hashes), now)

    def end_load(self, block_hashes: Sequence[int]) -> None:
        """The load of `block_hashes` ended: unpin them."""
        blocks = self._blocks
        for value in block_hashes:
            if value in blocks:
                blocks[value] -= 1

"""The prefix index: approximate LRU, speculative entries, and vLLM KV events re-hashed."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from kvflow.scheduler.blocks import block_hashes
from kvflow.scheduler.prefix_index import AllBlocksCleared, BlockRemoved, BlockStored, PrefixIndex


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32_000) for _ in range(count)]


def index_with(replicas: int, capacity: int = 10_000, ttl: float = 10.0) -> PrefixIndex:
    index = PrefixIndex(block_size=16, speculative_ttl_s=ttl)
    for _ in range(replicas):
        index.add_replica(capacity)
    return index


def test_a_placed_prompt_matches_in_full_on_its_replica_only() -> None:
    index = index_with(3)
    chain = block_hashes(tokens(1, 800), 16)
    index.record_placement(1, chain, now=0.0)
    assert index.match(chain, now=0.0) == {1: 50}
    assert index.match(chain[:20], now=0.0) == {1: 20}
    longer = block_hashes(tokens(1, 800) + tokens(2, 160), 16)
    assert index.match(longer, now=0.0) == {1: 50}
    assert index.match(block_hashes(tokens(3, 800), 16), now=0.0) == {}


@given(
    shared=st.integers(1, 40),
    tails=st.lists(st.integers(0, 40), min_size=1, max_size=6),
)
def test_match_reports_each_replicas_deepest_shared_block(shared: int, tails: list[int]) -> None:
    index = index_with(len(tails))
    system = tokens(0, shared * 16)
    for replica, tail in enumerate(tails):
        index.record_placement(
            replica, block_hashes(system + tokens(replica + 1, tail * 16), 16), now=0.0
        )
    query = block_hashes(system + tokens(1, tails[0] * 16), 16)
    depths = index.match(query, now=0.0)
    assert depths[0] == shared + tails[0]
    for replica in range(1, len(tails)):
        assert depths[replica] == shared
    assert list(depths.values()) == sorted(depths.values(), reverse=True)


def test_a_full_replica_evicts_a_prompts_tail_before_its_start() -> None:
    index = index_with(1, capacity=30)
    first = block_hashes(tokens(1, 20 * 16), 16)
    second = block_hashes(tokens(2, 20 * 16), 16)
    index.record_placement(0, first, now=0.0)
    index.record_placement(0, second, now=1.0)
    assert index.blocks_held(0) == 30
    assert index.match(second, now=1.0) == {0: 20}
    # The older prompt lost its last 10 blocks and kept its first 10: a shorter prefix hit.
    assert index.match(first, now=1.0) == {0: 10}


def test_touching_a_prompt_again_protects_it_from_eviction() -> None:
    index = index_with(1, capacity=40)
    first = block_hashes(tokens(1, 20 * 16), 16)
    second = block_hashes(tokens(2, 20 * 16), 16)
    index.record_placement(0, first, now=0.0)
    index.record_placement(0, second, now=1.0)
    index.record_placement(0, first, now=2.0)  # used again: most recent
    index.record_placement(0, block_hashes(tokens(3, 10 * 16), 16), now=3.0)
    assert index.match(first, now=3.0) == {0: 20}
    assert index.match(second, now=3.0) == {0: 10}


def test_with_slack_placements_only_add_and_trim_evicts_the_oldest_tails() -> None:
    index = PrefixIndex(block_size=16, speculative_ttl_s=10.0, eviction_slack=0.5)
    index.add_replica(30)
    first = block_hashes(tokens(1, 20 * 16), 16)
    second = block_hashes(tokens(2, 20 * 16), 16)
    index.record_placement(0, first, now=0.0)
    index.record_placement(0, second, now=1.0)
    # 40 entries fit under 30 · 1.5: nothing was evicted on the decision path...
    assert index.blocks_held(0) == 40
    assert index.match(first, now=1.0) == {0: 20}
    # ...and trimming evicts exactly as a placement without slack would have.
    assert index.trim(0) == 10
    assert index.blocks_held(0) == 30
    assert index.match(second, now=1.0) == {0: 20}
    assert index.match(first, now=1.0) == {0: 10}


def test_a_placement_past_the_slack_evicts_only_down_to_the_slack() -> None:
    index = PrefixIndex(block_size=16, speculative_ttl_s=10.0, eviction_slack=0.5)
    index.add_replica(20)
    for seed in range(4):
        index.record_placement(0, block_hashes(tokens(seed, 10 * 16), 16), now=float(seed))
    assert index.blocks_held(0) == 30  # 40 recorded, evicted down to 20 · 1.5
    assert index.match(block_hashes(tokens(3, 10 * 16), 16), now=4.0) == {0: 10}
    assert index.match(block_hashes(tokens(0, 10 * 16), 16), now=4.0) == {}


def test_levels_list_each_holder_once_deepest_first_for_hundreds_of_replicas() -> None:
    index = index_with(300)
    system = tokens(0, 8 * 16)
    for replica in range(300):
        tail = replica % 3  # 100 replicas each at 8, 9 and 10 blocks
        index.record_placement(
            replica, block_hashes(system + tokens(1, 2 * 16)[: tail * 16], 16), now=0.0
        )
    query = block_hashes(system + tokens(1, 2 * 16), 16)
    levels = index.match_levels(query, now=0.0)
    assert [depth for depth, _ in levels] == [10, 9, 8]
    assert [mask.bit_count() for _, mask in levels] == [100, 100, 100]
    depths = index.match(query, now=0.0)
    assert len(depths) == 300
    assert all(depths[replica] == 8 + replica % 3 for replica in range(300))


def test_a_replica_without_the_first_block_has_no_prefix_to_offer() -> None:
    index = index_with(2)
    chain = block_hashes(tokens(1, 10 * 16), 16)
    index.record_placement(0, chain, now=0.0)
    index.record_placement(1, chain[5:], now=0.0)  # deeper blocks, but not the start
    assert index.match(chain, now=0.0) == {0: 10}


def stored(
    chain_tokens: list[int],
    engine_hashes: list[int | bytes],
    parent: int | bytes | None,
    size: int = 128,
) -> BlockStored:
    return BlockStored(
        block_hashes=tuple(engine_hashes),
        parent_block_hash=parent,
        token_ids=tuple(chain_tokens),
        block_size=size,
    )


def test_engine_blocks_are_rehashed_into_kvflow_blocks_whatever_the_engine_hash() -> None:
    index = index_with(2)
    prompt = tokens(5, 512)
    # Two batches: blocks 0-1, then blocks 2-3 chained to block 1 by its engine hash. The
    # engine's hashes (here opaque bytes) are never index keys.
    index.apply(0, [stored(prompt[:256], [b"e0", b"e1"], None)])
    index.apply(0, [stored(prompt[256:], [b"e2", b"e3"], b"e1")])
    ours = block_hashes(prompt, 16)
    assert index.match(ours, now=0.0) == {0: 32}
    assert index.is_precise(0) and not index.is_precise(1)
    index.apply(0, [BlockRemoved(block_hashes=(b"e3",))])
    assert index.match(ours, now=0.0) == {0: 24}
    index.apply(0, [AllBlocksCleared()])
    assert index.match(ours, now=0.0) == {}


def test_an_event_whose_parent_was_never_seen_is_skipped_and_counted() -> None:
    index = index_with(1)
    prompt = tokens(6, 256)
    index.apply(0, [stored(prompt[128:], [22], 21)])
    assert index.unmatched_events == 1
    assert index.blocks_held(0) == 0


def test_engine_block_size_must_be_a_multiple_of_the_index_block_size() -> None:
    index = index_with(1)
    index.apply(0, [stored(tokens(7, 24), [1], None, size=24)])
    assert index.blocks_held(0) == 0


def test_speculative_entries_count_until_the_ttl_unless_an_event_confirms_them() -> None:
    index = index_with(2, ttl=10.0)
    index.apply(0, [])  # replica 0 is fed by KV events from now on
    index.apply(1, [])
    a = tokens(8, 256)
    b = tokens(9, 256)
    index.record_placement(0, block_hashes(a, 16), now=100.0)
    index.record_placement(1, block_hashes(b, 16), now=100.0)
    assert index.match(block_hashes(a, 16), now=105.0) == {0: 16}
    # Replica 1's engine confirms what it cached; replica 0's never does.
    index.apply(1, [stored(b, [1, 2], None)])
    assert index.match(block_hashes(a, 16), now=110.0) == {}
    assert index.match(block_hashes(b, 16), now=110.0) == {1: 16}


def test_first_events_replace_what_was_guessed_from_placements() -> None:
    index = index_with(1)
    guessed = block_hashes(tokens(10, 320), 16)
    index.record_placement(0, guessed, now=0.0)
    assert index.match(guessed, now=0.0) == {0: 20}
    index.apply(0, [stored(tokens(11, 128), [7], None)])
    assert index.match(guessed, now=0.0) == {}


def test_clearing_a_replica_forgets_only_that_replica() -> None:
    index = index_with(2)
    chain = block_hashes(tokens(12, 320), 16)
    index.record_placement(0, chain, now=0.0)
    index.record_placement(1, chain, now=0.0)
    index.clear(0)
    assert index.match(chain, now=0.0) == {1: 20}

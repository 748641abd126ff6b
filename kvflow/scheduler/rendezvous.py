"""Rendezvous (highest-random-weight) hashing with bounded load.

When no replica holds a request's prefix, every scheduler process must still send the same
prefix to the same replica, without talking to each other. Each replica gets a weight
`w = mix(key XOR seed(replica))` for the request's prefix key; the replica with the highest
weight wins, skipping replicas whose load is above the bound

    capacity = ⌈factor · (total load + 1) / replicas⌉

(consistent hashing with bounded loads, Mirrokni et al.), so a popular prefix spills over to
its second choice instead of piling onto one replica. Seeds come from blake2b of the replica
name and the mix is SplitMix64's finalizer: stable across processes, machines and Python
versions (unlike `hash()`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

from kvflow.scheduler.blocks import hash_block

_MASK = (1 << 64) - 1


def replica_seed(name: str) -> int:
    """A replica's 64-bit rendezvous seed, from its name."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def rendezvous_key(block_hashes: Sequence[int], workflow_id: str, prefix_blocks: int) -> int:
    """The key a request is rendezvoused on.

    The hash of its first `prefix_blocks` blocks (a block hash names its whole prefix), so
    requests that share that much prompt meet on one replica; the workflow id when the prompt
    has no full block.
    """
    if block_hashes:
        return block_hashes[min(prefix_blocks, len(block_hashes)) - 1]
    return hash_block(0, list(workflow_id.encode()))


def rendezvous_weights(key: int, seeds: Sequence[int]) -> list[int]:
    """The weight of every seed for `key`: the SplitMix64 finalizer of key XOR seed.

    One loop for a whole group of replicas keeps per-replica function calls off the decision
    path.
    """
    weights: list[int] = []
    for seed in seeds:
        x = (key ^ seed) & _MASK
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
        weights.append(x ^ (x >> 31))
    return weights


def bounded_capacity(total_load: int, replicas: int, factor: float) -> int:
    """The most calls a rendezvous pick may already hold, plus one: ⌈c · (L + 1) / n⌉."""
    return max(1, math.ceil(factor * (total_load + 1) / max(1, replicas)))


def rendezvous_order(key: int, seeds: Sequence[int]) -> list[int]:
    """Positions of `seeds` from the highest weight for `key` to the lowest."""
    weights = rendezvous_weights(key, seeds)
    return sorted(range(len(seeds)), key=weights.__getitem__, reverse=True)

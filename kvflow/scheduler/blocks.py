"""Block hashes: the keys of the prefix cache, shared by the simulator and the prefix index.

As in vLLM's v1 KV cache (`kv_cache_utils.py`), a prompt is cut into full blocks of
`block_size` tokens and each block's hash covers its parent's hash and its own token ids, so
one hash names a whole prefix. Only full blocks are hashed: a partial last block is never
cached. The hash is 64 bits (blake2b), the width vLLM's KV events use.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = 0
"""The parent hash of a prompt's first block."""


def hash_block(parent: int, token_ids: Sequence[int]) -> int:
    """Hash of one block: blake2b-64 over the parent hash and the block's token ids."""
    digest = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    digest.update(array("q", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, root: int = ROOT_HASH) -> list[int]:
    """The hash chain of every full block of `token_ids`, first block first."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    hashes: list[int] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes

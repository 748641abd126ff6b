"""Block hashes: the keys of the prefix cache, shared by the simulator and the prefix index.

As in vLLM's v1 KV cache (`kv_cache_utils.py`), a prompt is cut into full blocks of
`block_size` tokens and each block's hash covers its parent's hash and its own token ids, so
one hash names a whole prefix. Only full blocks are hashed: a partial last block is never
cached. The hash is 64 bits (blake2b), the width vLLM's KV events use.

**Cache salt.** vLLM takes a `cache_salt` string per request and, like its LoRA name or
multimodal hashes, hashes it as an extra key of the request's *first* block only (the block
that starts at token 0). Every later block chains from that first hash, so two requests with
the same tokens and different salts share no block, while a request's own later turns (same
salt) find all of its blocks. kvflow follows the same rule: `hash_block(..., cache_salt=...)`
for the first block, plain `hash_block` after it. A request without a salt hashes exactly as
before salts existed.

By default every tenant's calls carry their own salt (`tenant_cache_salt`), so one tenant's
cached prompt is neither a discount nor a timing side channel for another. A fleet names the
prompts its tenants share on purpose (`[cache] shared_prefixes` in `fleet.toml`): a call that
starts with one is sent without a salt (`call_cache_salt`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Collection, Sequence

ROOT_HASH = 0
"""The parent hash of a prompt's first block."""

_SALT_KEY = b"\x00cache_salt\x00"
"""Separates a first block's token ids from its salt in the hashed bytes."""


def hash_block(parent: int, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
    """Hash of one block: blake2b-64 over the parent hash, the token ids and the salt if any.

    Give `cache_salt` for a request's first block only (vLLM's rule, see the module docstring).
    """
    digest = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    digest.update(array("q", token_ids).tobytes())
    if cache_salt:
        digest.update(_SALT_KEY + cache_salt.encode("utf-8"))
    return int.from_bytes(digest.digest(), "little")


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    root: int = ROOT_HASH,
    cache_salt: str | None = None,
) -> list[int]:
    """The hash chain of every full block of `token_ids`, first block first.

    `cache_salt` enters the first block's hash only, as in vLLM; `root` is the parent of the
    first block (the chain of a prompt starts at `ROOT_HASH`).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    hashes: list[int] = []
    parent = root
    salt = cache_salt
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], salt)
        salt = None
        hashes.append(parent)
    return hashes


SALT_PREFIX = "kvflow-tenant-"
"""How a kvflow tenant salt starts (what follows is 64 hex digits)."""


def tenant_cache_salt(namespace: str, tenant: str) -> str:
    """The `cache_salt` of a tenant's calls: a sha256 of the Temporal namespace and tenant.

    Not the tenant's name: the salt travels to the engine and its logs. It is at most 128
    characters of `[a-z0-9-]`, which vLLM accepts. The same tenant in two namespaces gets
    two salts: namespaces are separate customers on a shared Temporal Cloud account.
    """
    digest = hashlib.sha256(b"kvflow cache salt\x00")
    digest.update(namespace.encode("utf-8") + b"\x00" + tenant.encode("utf-8"))
    return SALT_PREFIX + digest.hexdigest()


def prefix_content_hash(text: str) -> str:
    """How `[cache] shared_prefixes` names a prompt: `sha256:` and the hex of its UTF-8 text.

    The same as `printf %s "$PROMPT" | sha256sum`.
    """
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def call_cache_salt(
    namespace: str, tenant: str, first_text: str | None, shared_prefixes: Collection[str]
) -> str | None:
    """The `cache_salt` a call is sent with: None when it starts with a shared prompt.

    `first_text` is the text of the call's first chat message (its system prompt, usually),
    None for a completion call; `shared_prefixes` are `prefix_content_hash` values. vLLM salts a
    whole request, so an unsalted call shares its later blocks too: name only prompts whose
    continuations may be shared (a fleet-wide system prompt followed by per-task content is).
    """
    if (
        first_text is not None
        and shared_prefixes
        and prefix_content_hash(first_text) in shared_prefixes
    ):
        return None
    return tenant_cache_salt(namespace, tenant)

"""Content-addressed references, so conversations live outside Temporal's history.

Temporal caps a payload at 2 MB and a history at 50 MB, and agent prompts grow every step.
Message contents above `INLINE_LIMIT_BYTES` are kept in a context store (see
`kvflow.activities.context_store`) under the SHA-256 of their bytes; workflows and activity inputs
carry a `ContextRef` of about a hundred bytes instead. The same digests are the prefix keys
the scheduler matches on, so two steps that share a long context share its keys.
"""

from __future__ import annotations

import hashlib

from pydantic import BaseModel, Field

INLINE_LIMIT_BYTES = 2048
"""Contents larger than this travel as a `ContextRef`."""


class ContextRef(BaseModel):
    """A pointer to content in the context store."""

    digest: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the UTF-8 bytes")
    size: int = Field(ge=0, description="bytes")
    preview: str = Field(default="", max_length=120, description="the first characters, for UIs")


def digest_of(text: str) -> str:
    """The SHA-256 hex digest of `text` as UTF-8: the key it is stored under."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def ref_for(text: str) -> ContextRef:
    """The reference `text` is stored under (computing it does not store anything)."""
    data = text.encode("utf-8")
    return ContextRef(digest=hashlib.sha256(data).hexdigest(), size=len(data), preview=text[:80])


def needs_store(text: str) -> bool:
    """Whether `text` is too large to travel inline."""
    return len(text.encode("utf-8")) > INLINE_LIMIT_BYTES

"""What every shared context store does the same way: keys, refusals, checks and prune's rule.

A backend files each content under a *space* (`tenants/<tenant>`, `shared`,
`payloads/<scope>`, `payloads`; `text_space` and `payload_space`) and its digest, with the
time it was last used, and implements three primitives: store (or renew), load (and renew when
the recorded use is stale), delete what was last used before a time. Everything else (which
space a caller may open, forged keys, corrupt content, the messages) is here, so the stores
cannot drift apart from each other or from the directory store.

Renewing on a read is a write (an UPDATE, an S3 copy), so a read renews content only when its
recorded use is older than `renew_after` (an hour by default): a recorded use is then at most
that much older than the real last use, and `prune` waits that much longer before it deletes,
so that nothing used within `older_than` is ever deleted.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from abc import ABC, abstractmethod
from datetime import timedelta
from types import TracebackType
from typing import Self

from kvflow.activities.context_store import (
    Clock,
    ContextNotFound,
    checked_digest,
    payload_space,
    text_space,
)
from kvflow.activities.wire import ContextRef, digest_of, ref_for

RENEW_AFTER = timedelta(hours=1)
"""How stale a recorded use must be before a read records a new one (a write)."""


class SharedContextStore(ABC):
    """A context store on a server many machines reach; the backends implement the primitives.

    Thread-safe: the async methods run the synchronous ones in threads, several at once.
    """

    def __init__(self, *, clock: Clock = time.time, renew_after: timedelta = RENEW_AFTER) -> None:
        self._clock = clock
        self.renew_after = renew_after
        """A read records a use only when the last recorded one is older than this."""

    @property
    @abstractmethod
    def location(self) -> str:
        """Where the store is, for messages: a URL without its password."""

    @property
    def root(self) -> str:
        """`location`, under the name the directory store's folder has.

        Code written for `DirectoryContextStore` names `store.root` in its messages; this
        keeps those messages (and the handlers that build them) working with any store.
        """
        return self.location

    @abstractmethod
    def _store(self, space: str, digest: str, data: bytes, now: float) -> None:
        """Store `data` under (`space`, `digest`) used at `now`, or renew it if already there."""

    @abstractmethod
    def _load(self, space: str, digest: str, now: float) -> bytes | None:
        """The bytes under (`space`, `digest`), None if absent; renew a stale recorded use."""

    @abstractmethod
    def _delete_unused_since(self, cutoff: float) -> int:
        """Delete every content whose recorded use is before `cutoff`; return how many."""

    @abstractmethod
    def close(self) -> None:
        """Release the store's connections; the store is not used after."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _stale(self, used_at: float, now: float) -> bool:
        """Whether a use recorded at `used_at` is old enough that a read should renew it."""
        return used_at < now - self.renew_after.total_seconds()

    def put(self, text: str, tenant: str | None = None) -> ContextRef:
        """Store `text` for `tenant` (None: shared), idempotently; return its reference."""
        ref = ref_for(text).model_copy(update={"tenant": tenant})
        self._store(text_space(tenant), ref.digest, text.encode("utf-8"), self._clock())
        return ref

    def put_bytes(self, data: bytes, scope: str | None = None) -> str:
        """Store a payload under `scope` (32 hex characters), idempotently; return its SHA-256.

        Only `get_bytes(digest, scope)` reads it back; `get`, which reads text, never does.
        """
        digest = hashlib.sha256(data).hexdigest()
        self._store(payload_space(scope), digest, data, self._clock())
        return digest

    def get_bytes(self, digest: str, scope: str | None = None) -> bytes:
        """The payload stored under `digest` for `scope`; `ContextNotFound` if not there.

        Content whose SHA-256 is not `digest` is refused: `ContextNotFound`, "is corrupt".
        """
        space = payload_space(scope)
        data = self._load(space, checked_digest(digest), self._clock())
        if data is None:
            raise ContextNotFound(f"content {digest[:12]}… is not in {self.location}")
        if hashlib.sha256(data).hexdigest() != digest:
            raise ContextNotFound(f"content {digest[:12]}… in {self.location} is corrupt")
        return data

    def get(self, ref: ContextRef, tenant: str | None = None) -> str:
        """The content `ref` points at; `ContextNotFound` if the store lacks it.

        With `tenant`, a reference to content stored for another tenant is refused as if it
        did not exist, and one without a tenant opens shared text only: a digest alone opens
        neither a tenant's text nor a claim-checked payload.
        """
        if tenant is not None and ref.tenant is not None and ref.tenant != tenant:
            raise ContextNotFound(
                f"context {ref.digest[:12]}… belongs to another tenant than {tenant!r}"
            )
        data = self._load(text_space(ref.tenant), checked_digest(ref.digest), self._clock())
        if data is None:
            raise ContextNotFound(
                f"context {ref.digest[:12]}… ({ref.size} bytes) is not in {self.location}; "
                "every worker must use the same context store"
            )
        text = data.decode("utf-8", "replace")
        if digest_of(text) != ref.digest:
            raise ContextNotFound(f"context {ref.digest[:12]}… in {self.location} is corrupt")
        return text

    def prune(self, older_than: timedelta, *, now: float | None = None) -> int:
        """Delete contents not stored or read for `older_than`; return how many.

        What a read renewed is recorded up to `renew_after` late, so prune waits that much
        longer: content used within `older_than` is never deleted. A task that references
        pruned content fails with `ContextNotFound`; choose `older_than` longer than the
        longest task (and any replay of its history) lasts.
        """
        now = self._clock() if now is None else now
        cutoff = now - older_than.total_seconds() - self.renew_after.total_seconds()
        return self._delete_unused_since(cutoff)

    async def aput(self, text: str, tenant: str | None = None) -> ContextRef:
        """`put` in a thread, for async activities."""
        return await asyncio.to_thread(self.put, text, tenant)

    async def aget(self, ref: ContextRef, tenant: str | None = None) -> str:
        """`get` in a thread, for async activities."""
        return await asyncio.to_thread(self.get, ref, tenant)

"""The context store: content-addressed blobs that conversations reference from history.

`DirectoryContextStore` keeps each content in a file named by its SHA-256 under a directory
(`.kvflow/context/` in the embedded stack), written atomically so that concurrent writers of
the same content never expose a partial file. Every process that resolves references (the
workflow worker, every GPU worker) must see the same directory; on several machines use a
shared volume.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

from kvflow.activities.wire import ContextRef, digest_of, ref_for

DEFAULT_CONTEXT_DIR = Path(".kvflow/context")


class ContextNotFound(KeyError):
    """A reference names content the store does not hold."""


class DirectoryContextStore:
    """Blobs in files under `root`, two-level fan-out by digest."""

    def __init__(self, root: Path = DEFAULT_CONTEXT_DIR) -> None:
        self.root = root

    def _path(self, digest: str) -> Path:
        return self.root / digest[:2] / digest

    def put(self, text: str) -> ContextRef:
        """Store `text` (idempotent) and return its reference."""
        ref = ref_for(text)
        path = self._path(ref.digest)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("wb", dir=path.parent, delete=False) as tmp:
                tmp.write(text.encode("utf-8"))
            os.replace(tmp.name, path)
        return ref

    def get(self, ref: ContextRef) -> str:
        """The content `ref` points at; `ContextNotFound` if the store lacks it."""
        try:
            text = self._path(ref.digest).read_bytes().decode("utf-8")
        except FileNotFoundError:
            raise ContextNotFound(
                f"context {ref.digest[:12]}… ({ref.size} bytes) is not in {self.root}; every "
                "worker must use the same context store directory"
            ) from None
        if digest_of(text) != ref.digest:
            raise ContextNotFound(f"context {ref.digest[:12]}… in {self.root} is corrupt")
        return text

    async def aput(self, text: str) -> ContextRef:
        """`put` in a thread, for async activities."""
        return await asyncio.to_thread(self.put, text)

    async def aget(self, ref: ContextRef) -> str:
        """`get` in a thread, for async activities."""
        return await asyncio.to_thread(self.get, ref)

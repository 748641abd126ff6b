"""A claim-check payload codec: large payloads travel through Temporal as references.

Temporal records every workflow input and result, activity input and result, local-activity
marker, query result, heartbeat and failure detail as a payload, in history or on the wire.
`ClaimCheckCodec` replaces each payload whose serialized size exceeds a threshold (by default
`INLINE_LIMIT_BYTES`) with a small one (`encoding: kvflow/claim-check`, data: the SHA-256 of the
original payload's serialized bytes) after storing those bytes in the context store; decoding
fetches and restores the original. Workflow code never sees the references: the codec runs in
the worker and the client, outside the sandbox.

The codec has no task context, so what it stores lives in the store's shared area (no tenant):
the reference in history is the only way to name it. Every process that decodes (clients,
workflow workers, GPU workers, replayers) must use the same context store.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Sequence

from temporalio.api.common.v1 import Payload
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DataConverter, PayloadCodec

from kvflow.activities.context_store import ContextNotFound, DirectoryContextStore
from kvflow.activities.wire import INLINE_LIMIT_BYTES

CLAIM_CHECK_ENCODING = b"kvflow/claim-check"
"""The `encoding` metadata of a payload that stands for one in the context store."""
_DIGEST = re.compile(rb"[0-9a-f]{64}")


class ClaimCheckMissing(RuntimeError):
    """A claim-checked payload's content is not in (or is corrupt in) the context store."""


class ClaimCheckCodec(PayloadCodec):
    """Offloads payloads larger than `threshold_bytes` (serialized) to `store`."""

    def __init__(
        self, store: DirectoryContextStore, threshold_bytes: int = INLINE_LIMIT_BYTES
    ) -> None:
        if threshold_bytes < 0:
            raise ValueError(f"threshold_bytes must be >= 0, not {threshold_bytes}")
        self.store = store
        self.threshold_bytes = threshold_bytes

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        """Each payload, or a reference to it when it is larger than the threshold."""
        return [await self._encode_one(p) for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        """Each payload, with the references restored from the store."""
        return [await self._decode_one(p) for p in payloads]

    async def _encode_one(self, payload: Payload) -> Payload:
        if is_claim_check(payload) or payload.ByteSize() <= self.threshold_bytes:
            return payload
        digest = await asyncio.to_thread(self.store.put_bytes, payload.SerializeToString())
        return Payload(metadata={"encoding": CLAIM_CHECK_ENCODING}, data=digest.encode("ascii"))

    async def _decode_one(self, payload: Payload) -> Payload:
        if not is_claim_check(payload):
            return payload
        if not _DIGEST.fullmatch(payload.data):
            raise ClaimCheckMissing(f"a claim-checked payload names no digest: {payload.data!r}")
        digest = payload.data.decode("ascii")
        try:
            data = await asyncio.to_thread(self.store.get_bytes, digest)
        except ContextNotFound as missing:
            # e.g. "claim-checked payload: content 0a1b2c… is not in .kvflow/context; ..."
            raise ClaimCheckMissing(
                f"claim-checked payload: {missing.args[0]}; every process must use the same "
                "context store (the same context directory)"
            ) from None
        return Payload.FromString(data)


def is_claim_check(payload: Payload) -> bool:
    """Whether `payload` is a reference that `ClaimCheckCodec` made."""
    return payload.metadata.get("encoding") == CLAIM_CHECK_ENCODING


def claim_check_converter(
    store: DirectoryContextStore, threshold_bytes: int | None = INLINE_LIMIT_BYTES
) -> DataConverter:
    """The pydantic data converter with a `ClaimCheckCodec` on `store` (None: without one)."""
    if threshold_bytes is None:
        return pydantic_data_converter
    return dataclasses.replace(
        pydantic_data_converter, payload_codec=ClaimCheckCodec(store, threshold_bytes)
    )

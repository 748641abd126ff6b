"""A claim-check payload codec: large payloads travel through Temporal as references.

Temporal records every workflow input and result, activity input and result, local-activity
marker, query result, heartbeat and failure detail as a payload, in history or on the wire.
`ClaimCheckCodec` replaces each payload whose serialized size exceeds a threshold (by default
`INLINE_LIMIT_BYTES`) with a small one (`encoding: kvflow/claim-check`, data: the SHA-256 of the
original payload's serialized bytes) after storing those bytes in the context store; decoding
fetches and restores the original. Workflow code never sees the references: the codec runs in
the worker and the client, outside the sandbox.

Each payload is stored under the scope of the workflow it belongs to: Temporal hands the codec
the payload's workflow id (its serialization context) wherever it encodes or decodes one for a
workflow, in clients, workflow workers, GPU workers and replayers alike. The reference names
its scope (`kvflow-scope` metadata), and a codec that knows its workflow opens references of
that workflow only: a digest copied from one task's history into another's (or read through
`Agent.read`, which reads text, never payloads) opens nothing. A codec without a workflow (a
tool decoding a fetched history) follows the scope the reference names. Every process that
decodes must use the same context store.

Payloads encoded outside any workflow, and those of earlier versions, carry no scope: any
workflow's codec resolves them, from the payloads of no workflow. Workflows started by a
schedule are encoded under the schedule's workflow-id prefix, not their own id, so they do
not open their large inputs; give them inputs under the threshold.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import re
from collections.abc import Callable, Sequence
from typing import Self

from temporalio.api.common.v1 import Payload
from temporalio.contrib.pydantic import PydanticPayloadConverter, pydantic_data_converter
from temporalio.converter import (
    ActivitySerializationContext,
    DataConverter,
    DefaultPayloadConverter,
    PayloadCodec,
    SerializationContext,
    WithSerializationContext,
    WorkflowSerializationContext,
)

from kvflow.activities.context_store import ContextNotFound, ContextStore
from kvflow.activities.wire import INLINE_LIMIT_BYTES

CLAIM_CHECK_ENCODING = b"kvflow/claim-check"
"""The `encoding` metadata of a payload that stands for one in the context store."""
SCOPE_METADATA = "kvflow-scope"
"""The metadata key of a reference that names the scope (the workflow) its payload belongs to."""
_DIGEST = re.compile(rb"[0-9a-f]{64}")


class ClaimCheckMissing(RuntimeError):
    """A claim-checked payload's content is not in (or is corrupt in) the context store."""


class ClaimCheckRefused(ClaimCheckMissing):
    """A claim-checked payload belongs to another workflow than the one decoding it."""


def workflow_scope(context: SerializationContext | None) -> str | None:
    """The scope of the workflow `context` names: 32 hex characters; None outside a workflow.

    A digest of the workflow id, so that the store's folder names do not hold it. Not of the
    namespace: a replayer decodes under a namespace of its own (`ReplayNamespace`).
    """
    if not isinstance(context, WorkflowSerializationContext | ActivitySerializationContext):
        return None
    if not context.workflow_id:
        return None  # an activity started by a client, outside any workflow
    return hashlib.sha256(context.workflow_id.encode("utf-8")).hexdigest()[:32]


class ClaimCheckCodec(PayloadCodec, WithSerializationContext):
    """Offloads payloads larger than `threshold_bytes` (serialized) to `store`.

    Temporal hands each payload's workflow to `with_context`; the codec it returns stores under,
    and opens only, that workflow's scope. `scope` None: a codec outside any workflow.
    """

    def __init__(
        self,
        store: ContextStore,
        threshold_bytes: int = INLINE_LIMIT_BYTES,
        *,
        scope: str | None = None,
    ) -> None:
        if threshold_bytes < 0:
            raise ValueError(f"threshold_bytes must be >= 0, not {threshold_bytes}")
        self.store = store
        self.threshold_bytes = threshold_bytes
        self.scope = scope

    def with_context(self, context: SerializationContext) -> Self:
        """The codec for the payloads of the workflow `context` names."""
        scope = workflow_scope(context)
        if scope == self.scope:
            return self
        return type(self)(self.store, self.threshold_bytes, scope=scope)

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        """Each payload, or a reference to it when it is larger than the threshold."""
        return [await self._encode_one(p) for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        """Each payload, with the references restored from the store."""
        return [await self._decode_one(p) for p in payloads]

    async def _encode_one(self, payload: Payload) -> Payload:
        if is_claim_check(payload) or payload.ByteSize() <= self.threshold_bytes:
            return payload
        data = payload.SerializeToString()
        digest = await asyncio.to_thread(self.store.put_bytes, data, self.scope)
        metadata = {"encoding": CLAIM_CHECK_ENCODING}
        if self.scope is not None:
            metadata[SCOPE_METADATA] = self.scope.encode("ascii")
        return Payload(metadata=metadata, data=digest.encode("ascii"))

    async def _decode_one(self, payload: Payload) -> Payload:
        if not is_claim_check(payload):
            return payload
        if not _DIGEST.fullmatch(payload.data):
            raise ClaimCheckMissing(f"a claim-checked payload names no digest: {payload.data!r}")
        digest = payload.data.decode("ascii")
        named = payload.metadata.get(SCOPE_METADATA)
        scope = None if named is None else named.decode("ascii", "replace")
        if self.scope is not None and scope is not None and scope != self.scope:
            raise ClaimCheckRefused(
                f"claim-checked payload {digest[:12]}… belongs to another workflow than the "
                "one decoding it; a reference copied from another task's history opens nothing"
            )
        try:
            data = await asyncio.to_thread(self.store.get_bytes, digest, scope)
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
    store: ContextStore, threshold_bytes: int | None = INLINE_LIMIT_BYTES
) -> DataConverter:
    """The pydantic data converter with a `ClaimCheckCodec` on `store` (None: without one)."""
    return with_claim_check(store, threshold_bytes)(None)


class ChainedCodec(PayloadCodec, WithSerializationContext):
    """Codecs in turn: encoding runs them in order, decoding in reverse.

    Holds a user's own codec (encryption, compression) and kvflow's claim check after it, so
    that what the context store keeps is what the user's codec made of the payload.
    """

    def __init__(self, codecs: Sequence[PayloadCodec]) -> None:
        self.codecs = tuple(codecs)

    def with_context(self, context: SerializationContext) -> Self:
        """Each codec that takes a serialization context, given it."""
        return type(self)(
            [c.with_context(context) if isinstance(c, WithSerializationContext) else c
             for c in self.codecs]
        )  # fmt: skip

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        """Every codec's encoding, first to last."""
        encoded = list(payloads)
        for codec in self.codecs:
            encoded = await codec.encode(encoded)
        return encoded

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        """Every codec's decoding, last to first."""
        decoded = list(payloads)
        for codec in reversed(self.codecs):
            decoded = await codec.decode(decoded)
        return decoded


def claim_check_of(converter: DataConverter) -> ClaimCheckCodec | None:
    """The `ClaimCheckCodec` that `converter` encodes with, alone or after a user's codec."""
    codec = converter.payload_codec
    if isinstance(codec, ClaimCheckCodec):
        return codec
    if isinstance(codec, ChainedCodec):
        return next((c for c in codec.codecs if isinstance(c, ClaimCheckCodec)), None)
    return None


def with_claim_check(
    store: ContextStore, threshold_bytes: int | None = INLINE_LIMIT_BYTES
) -> Callable[[DataConverter | None], DataConverter]:
    """What `KvflowPlugin` makes of the data converter a client was given.

    kvflow's models need pydantic's payload converter: the SDK's default one is replaced by
    it; one of the user's own choosing (pydantic's, Pydantic AI's, the Agents SDK's) is kept,
    and must read pydantic models. The rest of the converter is kept, and a codec of the
    user's own stays first: the claim check runs after it on encoding (it stores what that
    codec made, encrypted if it encrypts) and before it on decoding. A converter that
    claim-checks already is kept as it is. `threshold_bytes` None: no claim check.
    """

    def configure(existing: DataConverter | None) -> DataConverter:
        base = existing if existing is not None else pydantic_data_converter
        if claim_check_of(base) is not None:
            return base
        converter_class = base.payload_converter_class
        if converter_class is DefaultPayloadConverter:
            converter_class = PydanticPayloadConverter
        codec = base.payload_codec
        if threshold_bytes is not None:
            claim_check = ClaimCheckCodec(store, threshold_bytes)
            codec = claim_check if codec is None else ChainedCodec([codec, claim_check])
        return dataclasses.replace(
            base, payload_converter_class=converter_class, payload_codec=codec
        )

    return configure

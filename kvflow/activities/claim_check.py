"""A claim-check payload codec: large payloads travel through Temporal as references.

Temporal records every workflow input and result, activity input and result, local-activity
marker, query result, heartbeat and failure detail as a payload, in history or on the wire.
`ClaimCheckCodec` replaces each payload whose serialized size exceeds a threshold (by default
`INLINE_LIMIT_BYTES`) with a small one (`encoding: kvflow/claim-check`, data: the SHA-256 of the
original payload's serialized bytes) after storing those bytes in the context store; decoding
fetches and restores the original. Workflow code never sees the references: the codec runs in
the worker and the client, outside the sandbox.

**The scope.** Each payload is stored under the scope of the workflow it belongs to: Temporal
hands the codec the payload's namespace and workflow id (its serialization context) wherever it
encodes or decodes one for a workflow, in clients, workflow workers, GPU workers and replayers
alike; it never hands it the run id (a client encodes a workflow's input before the run
exists). The scope is the first 32 hex characters of SHA-256 over the namespace and the
workflow id (`workflow_scope`), and the reference names it together with the namespace and the
workflow id it was made of (`kvflow-scope`, `kvflow-namespace`, `kvflow-workflow` metadata), so
that anyone can check that a scope is that workflow's without a lookup (`reference_scope`):

- a codec that knows its workflow opens references of that workflow only (its namespace, its
  id: a digest copied from one task's history into another's, or into a workflow of the same
  id in another namespace, opens nothing), except under the Replayer's namespace
  (`REPLAY_NAMESPACE`), where a fetched history is decoded under a namespace of its own and
  only the workflow id is checked;
- a codec without a workflow (a tool decoding a fetched history) follows the scope the
  reference names, once it checks out;
- the codec server (`kvflow.workers.codec_server`), whose callers write the metadata they send,
  refuses a reference whose scope is not the digest of the namespace and the workflow id it
  names, so forged metadata leads to no other workflow's folder, and it grants a payload to
  the tenant of that workflow id in that namespace, asked of Temporal.

Why that is safe: the folder a reader opens is the digest of what the reference names, so a
reference that names another namespace or workflow than the one whose payload it carries
leads to a folder where that payload is not; and the owner is what Temporal records for that
workflow id in that namespace, never what the caller says.

Runs are not told apart: a workflow id reused, by the same tenant or another, shares its scope
with its earlier runs. The codec server therefore grants a scope only when every run of the id
belongs to one tenant, and denies it otherwise.

Every process that decodes must use the same context store, and workers must run this version
before clients do: an earlier version's worker refuses a reference whose scope covers the
namespace, as belonging to another workflow. Earlier versions' references stay readable as
they were: those scoped by the workflow id alone (`legacy_workflow_scope`; they name no
namespace, so the codec server looks their workflow up in the request's namespace, and where
one store serves several namespaces they are no safer than before), and unscoped payloads
(encoded outside any workflow, or before scopes), which any workflow's codec resolves, from
the payloads of no workflow, and the codec server opens for callers of every tenant only.

Workflows started by a schedule are encoded under the schedule's workflow-id prefix, not their
own id, so they do not open their large inputs; give them inputs under the threshold.
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
NAMESPACE_METADATA = "kvflow-namespace"
"""The metadata key of a reference that names the namespace its scope was made of."""
WORKFLOW_METADATA = "kvflow-workflow"
"""The metadata key of a reference that names the workflow id its scope was made of."""
REPLAY_NAMESPACE = "ReplayNamespace"
"""The namespace `temporalio.worker.Replayer` decodes under unless told another."""
_DIGEST = re.compile(rb"[0-9a-f]{64}")


class ClaimCheckMissing(RuntimeError):
    """A claim-checked payload's content is not in (or is corrupt in) the context store."""


class ClaimCheckRefused(ClaimCheckMissing):
    """A claim-checked payload belongs to another workflow than the one decoding it."""


def workflow_scope(context: SerializationContext | None) -> str | None:
    """The scope of the workflow `context` names: 32 hex characters; None outside a workflow.

    A digest of the namespace and the workflow id (`scope_of`), so that the store's folder
    names hold neither, and so that a workflow id used in two namespaces has two scopes.
    """
    if not isinstance(context, WorkflowSerializationContext | ActivitySerializationContext):
        return None
    if not context.workflow_id:
        return None  # an activity started by a client, outside any workflow
    return scope_of(context.namespace, context.workflow_id)


def scope_of(namespace: str, workflow_id: str) -> str:
    """The scope of the payloads of `workflow_id` in `namespace`: 32 hex characters."""
    # Both parts length-prefixed: no two (namespace, id) pairs hash the same bytes.
    named = f"kvflow-scope-2\n{len(namespace)}:{namespace}{len(workflow_id)}:{workflow_id}"
    return hashlib.sha256(named.encode("utf-8")).hexdigest()[:32]


def legacy_workflow_scope(workflow_id: str) -> str:
    """The scope earlier versions gave a workflow's payloads: a digest of its id alone."""
    return hashlib.sha256(workflow_id.encode("utf-8")).hexdigest()[:32]


@dataclasses.dataclass(frozen=True)
class ReferenceScope:
    """What a claim-check reference says of the workflow it belongs to (`reference_scope`).

    `scope` None: a payload of no workflow. `namespace` and `workflow_id` None: a reference of
    an earlier version, whose scope is the workflow id's digest alone (or that names none).
    """

    scope: str | None
    namespace: str | None = None
    workflow_id: str | None = None

    @property
    def legacy(self) -> bool:
        """Whether the reference names a scope but not what it was made of (earlier versions)."""
        return self.scope is not None and self.workflow_id is None


class ClaimCheckForged(ClaimCheckMissing):
    """A reference whose scope is not the digest of the namespace and workflow id it names."""


def reference_scope(payload: Payload) -> ReferenceScope:
    """The scope a claim-check reference names, checked; `ClaimCheckForged` when it lies.

    A reference that names a namespace and a workflow id must name their scope: its metadata
    can be written by anyone who sends it (a codec server's caller), its folder cannot.
    """

    def text(key: str) -> str | None:
        value = payload.metadata.get(key)
        return None if value is None else value.decode("utf-8", "replace")

    scope, namespace, workflow_id = (
        text(SCOPE_METADATA), text(NAMESPACE_METADATA), text(WORKFLOW_METADATA)
    )  # fmt: skip
    if namespace is None and workflow_id is None:
        return ReferenceScope(scope)
    if scope is None or namespace is None or workflow_id is None:
        raise ClaimCheckForged(
            "a claim-checked payload names part of its workflow only (scope, namespace and "
            "workflow id go together)"
        )
    if scope_of(namespace, workflow_id) != scope:
        raise ClaimCheckForged(
            f"a claim-checked payload's scope {scope[:12]}… is not that of the workflow it names"
        )
    return ReferenceScope(scope, namespace, workflow_id)


class ClaimCheckCodec(PayloadCodec, WithSerializationContext):
    """Offloads payloads larger than `threshold_bytes` (serialized) to `store`.

    Temporal hands each payload's workflow to `with_context`; the codec it returns stores under,
    and opens only, that workflow's scope (`namespace`, `workflow_id`; None: a codec outside
    any workflow, which follows the scope each reference names).
    """

    def __init__(
        self,
        store: ContextStore,
        threshold_bytes: int = INLINE_LIMIT_BYTES,
        *,
        namespace: str | None = None,
        workflow_id: str | None = None,
    ) -> None:
        if threshold_bytes < 0:
            raise ValueError(f"threshold_bytes must be >= 0, not {threshold_bytes}")
        self.store = store
        self.threshold_bytes = threshold_bytes
        self.namespace = namespace
        self.workflow_id = workflow_id
        self.scope = None if workflow_id is None else scope_of(namespace or "", workflow_id)
        """Where this codec stores payloads; None: a codec outside any workflow."""

    def with_context(self, context: SerializationContext) -> Self:
        """The codec for the payloads of the workflow `context` names."""
        namespace, workflow_id = None, None
        if workflow_scope(context) is not None:
            assert isinstance(context, WorkflowSerializationContext | ActivitySerializationContext)
            namespace, workflow_id = context.namespace, context.workflow_id
        if (namespace, workflow_id) == (self.namespace, self.workflow_id):
            return self
        return type(self)(
            self.store, self.threshold_bytes, namespace=namespace, workflow_id=workflow_id
        )

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
        if self.scope is not None and self.workflow_id is not None:
            metadata[SCOPE_METADATA] = self.scope.encode("ascii")
            metadata[NAMESPACE_METADATA] = (self.namespace or "").encode("utf-8")
            metadata[WORKFLOW_METADATA] = self.workflow_id.encode("utf-8")
        return Payload(metadata=metadata, data=digest.encode("ascii"))

    def _refuses(self, named: ReferenceScope) -> bool:
        """Whether a reference naming `named` belongs to another workflow than this codec's."""
        if self.workflow_id is None or named.scope is None:
            return False  # a codec outside any workflow, or a payload of none
        if named.workflow_id is None:  # an earlier version's: the workflow id's digest alone
            return named.scope != legacy_workflow_scope(self.workflow_id)
        if named.workflow_id != self.workflow_id:
            return True
        # The Replayer decodes a fetched history under a namespace of its own.
        return named.namespace != self.namespace and self.namespace != REPLAY_NAMESPACE

    async def _decode_one(self, payload: Payload) -> Payload:
        if not is_claim_check(payload):
            return payload
        if not _DIGEST.fullmatch(payload.data):
            raise ClaimCheckMissing(f"a claim-checked payload names no digest: {payload.data!r}")
        digest = payload.data.decode("ascii")
        named = reference_scope(payload)
        if self._refuses(named):
            raise ClaimCheckRefused(
                f"claim-checked payload {digest[:12]}… belongs to another workflow than the "
                "one decoding it; a reference copied from another task's history opens nothing"
            )
        try:
            data = await asyncio.to_thread(self.store.get_bytes, digest, named.scope)
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

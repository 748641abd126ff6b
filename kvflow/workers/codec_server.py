"""A Temporal remote codec server that opens claim-checked payloads for the Web UI and CLI.

The claim-check codec (`kvflow.activities.claim_check`) leaves a small reference in history
for every payload over 2 KB. The Temporal Web UI and `temporal workflow show
--codec-endpoint URL` send such payloads to `POST {URL}/decode` (and `/encode`) as JSON,
`{"payloads": [...]}` in the protobuf JSON form (metadata values and data base64), with the
namespace in `X-Namespace` and the caller's `Authorization` header; this server answers with
the payloads restored from the context store. Only the last path segment picks the route, so
`/{namespace}/decode` works as well.

Two kinds of reference are opened (`PayloadOpener`): claim-checked payloads, restored whole,
and the context references (`ContextRef`) in which the agent keeps long prompts, answers and
tool results, which get a `"text"` key with their content beside their own fields.

Who may read what (`CodecAccess`):

- No tokens: every caller reads everything. The server then listens on loopback only, for
  the one person whose machine runs it (`kvflow server`, `kvflow demo`).
- A tokens file: `Authorization: Bearer <token>` names the caller and the tenants it may read
  (`*`: all). A missing or unknown token gets 401. A claim-checked payload of a tenant the
  caller may not read comes back as a short placeholder, never as its text.

A reference names its workflow (namespace, workflow id, and the scope, their digest: see
`kvflow.activities.claim_check`), not its tenant, and the codec that writes it knows no tenant.
The caller writes the reference it sends, so its claims are checked, not believed: a scope
that is not the digest of the namespace and workflow id named beside it, or a namespace other
than the request's (`X-Namespace`), opens for no one but callers of every tenant. The tenant
is then asked of Temporal (`WorkflowTenants`): the `KvflowTenant` search attribute of every
run of that workflow id in that namespace, and of its latest run as the server itself holds it
(visibility lags). Temporal lets a closed workflow id be used again, by any client of the
namespace, and the runs of an id share its scope: one tenant for all of them grants the
payload to that tenant, and anything else (two tenants, a run with no tenant yet, a latest
run that visibility does not list yet) is ambiguous, and denied. References of earlier
versions name a scope made of the workflow id alone: their workflow id is found by listing the
request's namespace, then the same rule applies. A reference without a scope (payloads encoded
outside any workflow, and those of versions before scopes) has no known tenant: only callers
who may read every tenant open it. Callers of every tenant cost no lookup at all.

A context reference names its tenant itself; one with no tenant is shared text, which any
caller reads.

A deployment whose clients have a codec of their own (`Client.connect(data_converter=...)`,
kept by `KvflowPlugin` before the claim check) gives it to the server too (`--codec
MODULE:NAME`, `PayloadOpener(codec=...)`): the server decodes with it after opening a claim
check, so the UI shows text rather than that codec's bytes.

Every decode that opens or refuses tenant data is logged: caller, namespace, scopes, how many
payloads; never their content.

What a request may be: `application/json` only (415 otherwise, so that a web page's form or
`text/plain` POST, which browsers send across origins without asking, is refused), at most
`max_body_bytes` (413 from its `Content-Length`, or as soon as a chunked body passes it), and
with no tokens a `Host` that is this machine's loopback (403 otherwise: a page whose domain
resolves to 127.0.0.1 does not reach it). What one caller stores through `/encode` is bounded
(`EncodeQuota`, 429 above it).
"""

from __future__ import annotations

import asyncio
import hmac
import importlib
import ipaddress
import json
import logging
import re
import threading
import time
import tomllib
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar
from urllib.parse import urlsplit

import uvicorn
from google.protobuf import json_format
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from temporalio.api.common.v1 import Payload, Payloads
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import Client
from temporalio.converter import PayloadCodec
from temporalio.service import RPCError, RPCStatusCode

from kvflow.activities.claim_check import (
    ClaimCheckCodec,
    ClaimCheckForged,
    ClaimCheckMissing,
    ReferenceScope,
    is_claim_check,
    legacy_workflow_scope,
    reference_scope,
)
from kvflow.activities.context_store import (
    ContextNotFound,
    ContextStore,
    DirectoryContextStore,
)
from kvflow.activities.wire import INLINE_LIMIT_BYTES, ContextRef
from kvflow.workflows.search_attributes import TENANT

log = logging.getLogger(__name__)

DEFAULT_CODEC_PORT = 8888
DEFAULT_UI_ORIGINS = ("http://localhost:8233", "http://127.0.0.1:8233")
"""The origins of the Web UI of `kvflow server` (and of `temporal server start-dev`)."""
ALL_TENANTS = "*"
MAX_BODY_BYTES = 64 * 1024 * 1024
"""The largest request accepted: a whole history's payloads, with room (413 above)."""
ENCODE_QUOTA_BYTES = 64 * 1024 * 1024
"""What one caller may send to `/encode` per `ENCODE_QUOTA_WINDOW_S` by default (429 above)."""
ENCODE_QUOTA_WINDOW_S = 60.0
NOT_YOURS = "[kvflow] claim-checked payload of a tenant this token may not read"
NOT_STORED = "[kvflow] claim-checked payload not in the codec server's context store"


class CodecConfigError(ValueError):
    """The codec server's configuration (its tokens file, its host) is unusable."""


@dataclass(frozen=True)
class Caller:
    """Who sent a request: a name for the log, and the tenants it may read."""

    name: str
    tenants: frozenset[str]

    @property
    def reads_all(self) -> bool:
        """Whether this caller may read every tenant's content (`*`)."""
        return ALL_TENANTS in self.tenants

    def may_read(self, tenant: str | None) -> bool:
        """Whether this caller may read a payload of `tenant` (None: tenant unknown)."""
        return self.reads_all or (tenant is not None and tenant in self.tenants)


@dataclass(frozen=True)
class CodecAccess:
    """Bearer tokens and what each may read; no tokens: everyone reads everything."""

    tokens: Mapping[str, Caller] = field(default_factory=dict)

    @property
    def open(self) -> bool:
        """Whether any caller, with or without a token, reads everything."""
        return not self.tokens

    def caller(self, authorization: str | None) -> Caller | None:
        """The caller an `Authorization` header names; None when it names no known token."""
        if self.open:
            return Caller("anyone (no tokens configured)", frozenset({ALL_TENANTS}))
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        token = token.strip()
        found = None
        for known, caller in self.tokens.items():
            # Every token compared in constant time, so timing tells nothing of which is close.
            if hmac.compare_digest(known.encode(), token.encode()):
                found = caller
        return found


def load_tokens(path: Path) -> CodecAccess:
    """The tokens of a TOML file; `CodecConfigError` naming the problem when it is unusable.

    One table per caller; the table's name is what the log shows, never the token::

        [tokens.acme-support]
        token = "a long random string"   # at least 16 characters
        tenants = ["acme"]               # or ["*"]: every tenant
    """
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CodecConfigError(f"tokens file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise CodecConfigError(f"tokens file {path} is not valid TOML: {exc}") from None
    entries = data.get("tokens")
    if not isinstance(entries, dict) or not entries:
        raise CodecConfigError(
            f'tokens file {path} has no [tokens.NAME] tables; each needs token = "..." '
            'and tenants = ["..."] (or ["*"])'
        )
    tokens: dict[str, Caller] = {}
    for name, entry in entries.items():
        where = f"tokens file {path}, [tokens.{name}]"
        if not isinstance(entry, dict):
            raise CodecConfigError(f"{where} must be a table with token and tenants")
        token, tenants = entry.get("token"), entry.get("tenants")
        if not isinstance(token, str) or len(token.strip()) < 16 or token != token.strip():
            raise CodecConfigError(
                f"{where}: token must be a string of at least 16 characters, no spaces around"
            )
        if (
            not isinstance(tenants, list)
            or not tenants
            or not all(isinstance(t, str) and t for t in tenants)
        ):
            raise CodecConfigError(f'{where}: tenants must be a list of tenant names, or ["*"]')
        if token in tokens:
            raise CodecConfigError(f"{where}: the same token as [tokens.{tokens[token].name}]")
        tokens[token] = Caller(name=name, tenants=frozenset(tenants))
    return CodecAccess(tokens)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or `localhost`) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, access: CodecAccess) -> None:
    """Refuse a server that would give everything to anyone on the network."""
    if access.open and not is_loopback(host):
        raise CodecConfigError(
            f"--host {host} is reachable from other machines, and with no --tokens anyone "
            "there could read every tenant's payloads; give --tokens FILE, or use 127.0.0.1"
        )


class TenantOf(Protocol):
    """Who owns a workflow's payloads: one tenant, or None when unknown or ambiguous."""

    async def of_workflow(self, namespace: str, workflow_id: str) -> str | None:
        """The one tenant of every run of `workflow_id` in `namespace`; None otherwise."""
        ...

    async def of_legacy_scope(self, namespace: str, scope: str) -> str | None:
        """The same, for an earlier version's scope (a digest of the workflow id alone)."""
        ...


class _NoTenants:
    """No lookup: every tenant unknown, so only callers of every tenant open payloads."""

    async def of_workflow(self, namespace: str, workflow_id: str) -> str | None:
        return None

    async def of_legacy_scope(self, namespace: str, scope: str) -> str | None:
        return None


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _ExpiringCache(Generic[K, V]):
    """At most `max_entries` values, each forgotten `ttl_s` after it was put (oldest first)."""

    def __init__(self, max_entries: int, clock: Callable[[], float]) -> None:
        self._entries: OrderedDict[K, tuple[float, V]] = OrderedDict()
        self._max = max_entries
        self._clock = clock

    def get(self, key: K) -> tuple[bool, V | None]:
        """(found, value): found False when absent or expired."""
        entry = self._entries.get(key)
        if entry is None:
            return False, None
        if entry[0] <= self._clock():
            del self._entries[key]
            return False, None
        self._entries.move_to_end(key)
        return True, entry[1]

    def put(self, key: K, value: V, ttl_s: float) -> None:
        """Keep `value` for `ttl_s`, dropping the least recently used entry when full."""
        self._entries[key] = (self._clock() + ttl_s, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


# A workflow id goes into a visibility query as a quoted literal; others are not looked up.
_QUERYABLE_ID = re.compile(r"[^'\\\x00-\x1f]{1,1000}")


class WorkflowTenants:
    """The tenant of a workflow's payloads, from the `KvflowTenant` of its runs in Temporal.

    `of_workflow(namespace, id)` lists every run of the id (visibility) and describes its
    latest run (the server's own record, which visibility lags): one tenant for all of them,
    the latest listed, is the answer; anything else is None (denied). Answers are kept for
    `refresh_interval_s`, at most `max_workflows` of them, so a reuse of the id is seen within
    that time.

    `of_legacy_scope` serves references of earlier versions, whose scope is a digest of the
    workflow id alone: the namespace's kvflow workflows are listed (`KvflowTenant IS NOT
    NULL`), at most once per `refresh_interval_s` per namespace and after the first listing
    only workflows started in the last `overlap`, to find the id; then as `of_workflow`.

    A namespace is looked up only if Temporal has it (asked once, kept for
    `namespace_ttl_s`; at most `max_namespaces` kept); asking about namespaces not kept costs
    a call each, at most `unknown_namespace_calls_per_minute` of them (beyond: denied without
    a call), so that a caller naming made-up namespaces costs neither calls nor memory.
    """

    def __init__(
        self,
        connect: Callable[[], Awaitable[Client]],
        *,
        refresh_interval_s: float = 1.0,
        overlap: timedelta = timedelta(minutes=10),
        max_workflows: int = 10_000,
        max_runs: int = 1_000,
        max_namespaces: int = 64,
        namespace_ttl_s: float = 300.0,
        unknown_namespace_calls_per_minute: int = 30,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._connect = connect
        self._client: Client | None = None
        self._refresh_interval_s = refresh_interval_s
        self._overlap = overlap
        self._max_runs = max_runs
        self._namespace_ttl_s = namespace_ttl_s
        self._clock = clock
        self._owners: _ExpiringCache[tuple[str, str], str | None] = _ExpiringCache(
            max_workflows, clock
        )
        self._namespaces: _ExpiringCache[str, bool] = _ExpiringCache(max_namespaces, clock)
        self._unknown_calls: deque[float] = deque()
        self._unknown_calls_per_minute = unknown_namespace_calls_per_minute
        # Earlier versions' scopes: per namespace kept, the workflow id of each scope listed.
        self._legacy: _ExpiringCache[str, dict[str, str]] = _ExpiringCache(max_namespaces, clock)
        self._listed_at: dict[str, tuple[float, datetime]] = {}
        self._lock = asyncio.Lock()

    async def _namespace_client(self, namespace: str) -> Client | None:
        """A client of `namespace` if Temporal has it (within the call budget); else None."""
        if self._client is None:
            async with self._lock:
                if self._client is None:
                    self._client = await self._connect()
        client = Client(self._client.service_client, namespace=namespace)
        found, exists = self._namespaces.get(namespace)
        if not found:
            now = self._clock()
            while self._unknown_calls and self._unknown_calls[0] <= now - 60.0:
                self._unknown_calls.popleft()
            if len(self._unknown_calls) >= self._unknown_calls_per_minute:
                log.warning(
                    "codec: namespace %r not looked up: over %d lookups of new namespaces in a "
                    "minute",
                    namespace[:80],
                    self._unknown_calls_per_minute,
                )
                return None
            self._unknown_calls.append(now)
            exists = await self._call(
                client.workflow_service.describe_namespace(
                    DescribeNamespaceRequest(namespace=namespace)
                )
            )
            exists = exists is not None
            self._namespaces.put(namespace, exists, self._namespace_ttl_s)
        return client if exists else None

    async def _call(self, call: Awaitable[Any]) -> Any:
        """`call`'s answer; None when Temporal says not found or fails (logged)."""
        try:
            return await call
        except RPCError as exc:
            if exc.status not in {RPCStatusCode.NOT_FOUND, RPCStatusCode.INVALID_ARGUMENT}:
                log.warning("codec: Temporal lookup failed: %s", exc)
            return None

    async def of_workflow(self, namespace: str, workflow_id: str) -> str | None:
        """The one tenant of every run of `workflow_id` in `namespace`; None otherwise."""
        found, tenant = self._owners.get((namespace, workflow_id))
        if found:
            return tenant
        client = await self._namespace_client(namespace)
        if client is None or not _QUERYABLE_ID.fullmatch(workflow_id):
            return None
        tenant = await self._owner(client, workflow_id)
        self._owners.put((namespace, workflow_id), tenant, self._refresh_interval_s)
        return tenant

    async def _owner(self, client: Client, workflow_id: str) -> str | None:
        latest = await self._call(client.get_workflow_handle(workflow_id).describe())
        if latest is None:
            return None
        tenants: set[str | None] = {latest.typed_search_attributes.get(TENANT)}
        runs: set[str] = set()

        async def list_runs() -> bool:
            async for run in client.list_workflows(
                f"WorkflowId = '{workflow_id}'", limit=self._max_runs + 1
            ):
                runs.add(run.run_id)
                tenants.add(run.typed_search_attributes.get(TENANT))
            return True

        if await self._call(list_runs()) is None:
            return None
        if len(runs) > self._max_runs or latest.run_id not in runs:
            return None  # too many runs to tell, or visibility has not caught up
        if len(tenants) != 1 or None in tenants:
            return None  # runs of several tenants, or one whose tenant is not set yet
        [tenant] = tenants
        return tenant

    async def of_legacy_scope(self, namespace: str, scope: str) -> str | None:
        """The tenant of the workflow whose id an earlier version's `scope` digests; or None."""
        found, known = self._legacy.get(namespace)
        workflow_id = known.get(scope) if known else None
        if workflow_id is None:
            client = await self._namespace_client(namespace)
            if client is None:
                return None
            async with self._lock:
                listed = self._listed_at.get(namespace) if found else None
                if listed is None or self._clock() - listed[0] >= self._refresh_interval_s:
                    await self._list(client, namespace, None if listed is None else listed[1])
            found, known = self._legacy.get(namespace)
            workflow_id = known.get(scope) if known else None
        if workflow_id is None:
            return None
        return await self.of_workflow(namespace, workflow_id)

    async def _list(self, client: Client, namespace: str, since: datetime | None) -> None:
        started = datetime.now(UTC)
        query = f"{TENANT.name} IS NOT NULL"
        if since is not None:
            query += f" AND StartTime >= '{(since - self._overlap).isoformat()}'"
        _, kept = self._legacy.get(namespace)
        scopes: dict[str, str] = dict(kept or {})

        async def list_ids() -> bool:
            async for execution in client.list_workflows(query):
                scopes[legacy_workflow_scope(execution.id)] = execution.id
            return True

        if await self._call(list_ids()) is None:
            return
        self._legacy.put(namespace, scopes, self._namespace_ttl_s)
        self._listed_at[namespace] = (self._clock(), started)
        for stale in [ns for ns in self._listed_at if not self._legacy.get(ns)[0]]:
            del self._listed_at[stale]  # forgotten with its namespace's scopes


def _text_payload(text: str) -> Payload:
    """A payload that the UI shows as `text`: JSON, as Temporal's default converter writes."""
    return Payload(metadata={"encoding": b"json/plain"}, data=json.dumps(text).encode())


@dataclass
class _DecodeTally:
    """What one decode request opened and refused, for the log (never the content)."""

    opened: dict[str, int] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)
    missing: int = 0

    def count(self, into: dict[str, int], label: str) -> None:
        into[label] = into.get(label, 0) + 1


class PayloadOpener:
    """Decodes and encodes payload lists for one caller at a time, by what it may read.

    Two kinds of reference stand for content in history, and both are opened:

    - a claim-checked payload (a whole payload over 2 KB) is restored, or replaced by a
      `NOT_YOURS` placeholder payload;
    - a context reference inside a JSON payload (`{"digest", "size", "preview", "tenant"}`:
      a prompt, an answer or a tool result the agent stored) gets a `"text"` key beside its
      fields with the content, or the placeholder. The reference keeps its fields, so what
      the UI shows still parses as the `ContextRef` the workflow saw.

    `codec`: the deployment's own codec (encryption, compression), which its clients run
    before the claim check (`with_claim_check`). It decodes what a claim check restored,
    once the caller may read that tenant; and payloads in history as it left them, for
    callers of every tenant only (such a payload names no workflow, so no tenant: a caller
    of some tenants gets the placeholder where that codec would have opened anything).
    """

    def __init__(
        self,
        store: ContextStore,
        *,
        tenant_of: TenantOf | None = None,
        threshold_bytes: int = INLINE_LIMIT_BYTES,
        codec: PayloadCodec | None = None,
    ) -> None:
        # No scope: it follows the scope each reference names (access is checked here first).
        self._codec = ClaimCheckCodec(store, threshold_bytes)
        self._own = codec
        self._store = store
        self._tenant_of: TenantOf = tenant_of if tenant_of is not None else _NoTenants()

    async def decode(
        self, payloads: Sequence[Payload], caller: Caller, namespace: str
    ) -> list[Payload]:
        """`payloads` with every reference `caller` may read opened, the rest placeholders."""
        tally = _DecodeTally()
        decoded = [await self._decode_one(p, caller, namespace, tally) for p in payloads]
        if tally.opened or tally.refused or tally.missing:
            log.info(
                "codec decode by %s in namespace %r: %d payloads; opened %s; refused %s; "
                "%d not in the store",
                caller.name,
                namespace,
                len(payloads),
                tally.opened or "none",
                tally.refused or "none",
                tally.missing,
            )
        return decoded

    async def _decode_one(
        self, payload: Payload, caller: Caller, namespace: str, tally: _DecodeTally
    ) -> Payload:
        if is_claim_check(payload):
            try:
                named: ReferenceScope | None = reference_scope(payload)
            except ClaimCheckForged as exc:
                log.warning("codec decode by %s: %s", caller.name, exc)
                named = None
            scope = named.scope if named is not None else None
            label = f"workflow {scope[:12]}" if scope else "unscoped payload"
            tenant = await self._tenant_of_reference(named, namespace, caller)
            if named is None or not caller.may_read(tenant):
                tally.count(tally.refused, label)
                return _text_payload(NOT_YOURS)
            try:
                [payload] = await self._codec.decode([payload])
            except ClaimCheckMissing as exc:
                log.warning("codec decode: %s", exc)
                tally.missing += 1
                return _text_payload(NOT_STORED)
            tally.count(tally.opened, label)
            if self._own is not None:
                [payload] = await self._own.decode([payload])
        elif self._own is not None:
            [opened] = await self._own.decode([payload])
            if opened != payload:
                if not caller.may_read(None):
                    tally.count(tally.refused, "payload of the deployment's codec")
                    return _text_payload(NOT_YOURS)
                tally.count(tally.opened, "payload of the deployment's codec")
                payload = opened
        return await self._with_context_texts(payload, caller, tally)

    async def _tenant_of_reference(
        self, named: ReferenceScope | None, namespace: str, caller: Caller
    ) -> str | None:
        """The tenant a reference's payload belongs to, as far as Temporal can tell; else None.

        Not looked up for a caller of every tenant, who reads it whoever owns it. A reference
        of another namespace than the request's is nobody's here: the caller chose the header.
        """
        if named is None or named.scope is None or caller.reads_all:
            return None
        if named.legacy:
            return await self._tenant_of.of_legacy_scope(namespace, named.scope)
        if named.namespace != namespace or named.workflow_id is None:
            return None
        return await self._tenant_of.of_workflow(namespace, named.workflow_id)

    async def _with_context_texts(
        self, payload: Payload, caller: Caller, tally: _DecodeTally
    ) -> Payload:
        """`payload`, each context reference in its JSON given the text it stands for."""
        if payload.metadata.get("encoding") != b"json/plain" or b'"digest"' not in payload.data:
            return payload
        try:
            value = json.loads(payload.data)
        except ValueError:
            return payload
        refs: list[dict[str, Any]] = []
        _collect_context_refs(value, refs)
        if not refs:
            return payload
        for ref in refs:
            # "text" first, so the UI's one-line summary of the event shows it, not a digest.
            fields = dict(ref)
            ref.clear()
            ref["text"] = ""
            ref.update(fields)
            tenant = ref.get("tenant")
            label = f"tenant {tenant}" if tenant else "shared"
            # Shared text was stored for no tenant on purpose: any caller may read it.
            if tenant is not None and not caller.may_read(tenant):
                tally.count(tally.refused, label)
                ref["text"] = NOT_YOURS
                continue
            try:
                context = ContextRef.model_validate(ref)
                # A caller of some tenants reads shared text from `shared/` only, never from
                # the earlier versions' folder, which mixes every tenant's content.
                reader = None if caller.reads_all else (tenant or min(caller.tenants))
                ref["text"] = await self._store.aget(context, reader)
            except (ValueError, ContextNotFound) as exc:
                log.warning("codec decode: %s", exc)
                tally.missing += 1
                ref["text"] = NOT_STORED
                continue
            tally.count(tally.opened, label)
        return Payload(
            metadata=payload.metadata, data=json.dumps(value, ensure_ascii=False).encode()
        )

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        """`payloads` as workers encode them outside a workflow (large ones: references)."""
        if self._own is not None:
            payloads = await self._own.encode(payloads)
        return await self._codec.encode(payloads)


def load_codec(spec: str) -> PayloadCodec:
    """The `PayloadCodec` that `MODULE:NAME` names: an instance, or a callable making one.

    `CodecConfigError` naming what is wrong when the module, the name or the object is not
    usable.
    """
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise CodecConfigError(
            f"--codec takes MODULE:NAME (such as mycompany.codecs:EncryptionCodec), not {spec!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CodecConfigError(
            f"--codec {spec}: cannot import {module_name!r} ({exc}); install it where kvflow "
            "runs, or run from the folder that holds it"
        ) from None
    found = getattr(module, name, None)
    if found is None:
        raise CodecConfigError(f"--codec {spec}: {module_name} has no {name!r}")
    codec = found
    if callable(found) and not isinstance(found, PayloadCodec):
        try:
            codec = found()
        except Exception as exc:  # the user's own code: its error, named, not a traceback
            raise CodecConfigError(f"--codec {spec}: {name}() failed: {exc}") from None
    if not isinstance(codec, PayloadCodec):
        raise CodecConfigError(
            f"--codec {spec}: {name} is a {type(codec).__name__}, not a "
            "temporalio.converter.PayloadCodec (or a callable that returns one)"
        )
    return codec


_CONTEXT_REF_KEYS = frozenset(ContextRef.model_fields)


def _collect_context_refs(value: Any, into: list[dict[str, Any]]) -> None:
    """Every JSON object in `value` that is a `ContextRef` (its fields, and a digest)."""
    if isinstance(value, dict):
        if (
            "digest" in value
            and "size" in value
            and value.keys() <= _CONTEXT_REF_KEYS
            and isinstance(value["digest"], str)
        ):
            into.append(value)
            return
        for item in value.values():
            _collect_context_refs(item, into)
    elif isinstance(value, list):
        for item in value:
            _collect_context_refs(item, into)


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> Response:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


class EncodeQuota:
    """How many bytes of payloads each caller may send to `/encode` per window (429 above).

    `/encode` stores what it is sent (the UI's edits, a tool's inputs) in the context store,
    so one caller, or with no tokens anyone, could fill it: each caller (by its name) gets
    `max_bytes` per `window_s`, a sliding window. `max_bytes` 0: `/encode` stores nothing.
    """

    def __init__(
        self,
        max_bytes: int = ENCODE_QUOTA_BYTES,
        window_s: float = ENCODE_QUOTA_WINDOW_S,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_bytes < 0 or window_s <= 0:
            raise ValueError(
                f"an encode quota needs max_bytes >= 0 and window_s > 0, not {max_bytes} "
                f"and {window_s}"
            )
        self.max_bytes = max_bytes
        self.window_s = window_s
        self._clock = clock
        self._sent: dict[str, deque[tuple[float, int]]] = {}

    def charge(self, caller: str, size: int) -> float | None:
        """Count `size` bytes to `caller`: None if within its quota, else seconds to wait."""
        now = self._clock()
        sent = self._sent.setdefault(caller, deque())
        while sent and sent[0][0] <= now - self.window_s:
            sent.popleft()
        used = sum(n for _, n in sent)
        if used + size > self.max_bytes:
            if size > self.max_bytes or not sent:
                return self.window_s  # never fits: the window is the honest answer
            return sent[0][0] + self.window_s - now  # when the oldest bytes leave the window
        if size:
            sent.append((now, size))
        return None


def _is_json(content_type: str | None) -> bool:
    """Whether a `Content-Type` header says JSON (`application/json`, any parameters)."""
    return (content_type or "").split(";", 1)[0].strip().lower() == "application/json"


def _host_is_loopback(host_header: str | None) -> bool:
    """Whether a `Host` header names this machine's loopback (`127.0.0.1:8888`, `[::1]`...)."""
    if not host_header:
        return False
    try:
        hostname = urlsplit(f"//{host_header}").hostname
    except ValueError:
        return False
    return hostname is not None and is_loopback(hostname)


async def _read_body(request: Request, limit: int) -> bytes | None:
    """The request's body, or None as soon as it passes `limit` bytes (declared or sent)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.strip().isdigit() or int(declared) > limit):
        return None
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                return None  # stop reading: the rest is never awaited
    except ClientDisconnect:
        return b""  # gone before the end: what is answered reaches no one
    return bytes(body)


def codec_app(
    opener: PayloadOpener,
    access: CodecAccess,
    *,
    ui_origins: Sequence[str] = DEFAULT_UI_ORIGINS,
    default_namespace: str = "default",
    max_body_bytes: int | None = None,
    encode_quota: EncodeQuota | None = None,
) -> Starlette:
    """The ASGI app: `POST .../decode` and `POST .../encode`, CORS for `ui_origins`.

    `max_body_bytes`: the largest request (default `MAX_BODY_BYTES`); `encode_quota`: what
    each caller may store through `/encode` (default `EncodeQuota()`).
    """
    quota = encode_quota if encode_quota is not None else EncodeQuota()
    body_limit = MAX_BODY_BYTES if max_body_bytes is None else max_body_bytes

    async def endpoint(request: Request) -> Response:
        route = request.url.path.rstrip("/").rsplit("/", 1)[-1]
        if route not in {"decode", "encode"}:
            return _error(404, "no such route; POST .../decode or .../encode")
        if access.open and not _host_is_loopback(request.headers.get("host")):
            # With no tokens it serves loopback only; another name is a rebound domain.
            return _error(
                403,
                f"Host {request.headers.get('host', '')[:100]!r} is not this machine's "
                "loopback; without --tokens the codec server answers http://127.0.0.1:PORT "
                "or http://localhost:PORT only",
            )
        caller = access.caller(request.headers.get("authorization"))
        if caller is None:
            return _error(
                401,
                "a valid `Authorization: Bearer <token>` header is required",
                {"WWW-Authenticate": 'Bearer realm="kvflow codec"'},
            )
        if not _is_json(request.headers.get("content-type")):
            return _error(
                415,
                "the body must be JSON, sent with `Content-Type: application/json`, not "
                f"{request.headers.get('content-type', 'no Content-Type')[:100]!r}",
            )
        body = await _read_body(request, body_limit)
        if body is None:
            return _error(413, f"request body over {body_limit} bytes")
        try:
            parsed = json.loads(body)
            if not isinstance(parsed, dict) or not isinstance(parsed.get("payloads"), list):
                raise ValueError('the body must be {"payloads": [...]}')
            payloads = json_format.ParseDict(parsed, Payloads(), ignore_unknown_fields=True)
        except (ValueError, json_format.ParseError) as exc:
            return _error(400, f"not a Payloads JSON body: {exc}")
        namespace = request.headers.get("x-namespace") or default_namespace
        if route == "decode":
            result = await opener.decode(payloads.payloads, caller, namespace)
        else:
            size = sum(p.ByteSize() for p in payloads.payloads)
            wait_s = quota.charge(caller.name, size)
            if wait_s is not None:
                return _error(
                    429,
                    f"{caller.name} may send {quota.max_bytes} bytes of payloads to /encode "
                    f"per {quota.window_s:g} s and this request has {size}; retry in "
                    f"{wait_s:.0f} s (kvflow codec serve --encode-quota-mib sets the limit)",
                    {"Retry-After": str(max(1, round(wait_s)))},
                )
            result = await opener.encode(payloads.payloads)
        content: dict[str, Any] = json_format.MessageToDict(Payloads(payloads=result))
        content.setdefault("payloads", [])
        return JSONResponse(content)

    return Starlette(
        routes=[Route("/{path:path}", endpoint, methods=["POST"])],
        middleware=[
            Middleware(
                CORSMiddleware,
                allow_origins=list(ui_origins),
                allow_methods=["POST"],
                allow_headers=["Authorization", "Content-Type", "X-Namespace"],
                allow_credentials=True,
            )
        ],
    )


def ui_origins_for(ui_url: str) -> tuple[str, ...]:
    """The origins a browser may show the UI at `ui_url` from (127.0.0.1 and localhost)."""
    origins = [ui_url.rstrip("/")]
    for a, b in (("127.0.0.1", "localhost"), ("localhost", "127.0.0.1")):
        if f"//{a}:" in ui_url:
            origins.append(origins[0].replace(f"//{a}:", f"//{b}:"))
    return tuple(origins)


class CodecServerThread:
    """The codec app served by uvicorn on a thread of this process, for the embedded stack.

    `start()` returns once it listens (port 0: any free port, see `url`); `stop()` ends it.
    """

    def __init__(self, app: Starlette, *, host: str = "127.0.0.1", port: int = 0) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="kvflow-codec", daemon=True)
        self.host = host

    @property
    def port(self) -> int:
        """The port it listens on, once started."""
        [server] = self._server.servers
        port: int = server.sockets[0].getsockname()[1]
        return port

    @property
    def url(self) -> str:
        """The endpoint to give the UI (`--ui-codec-endpoint`) and `--codec-endpoint`."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        """Serve on the thread; raise `OSError` if it does not listen within `timeout_s`."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"the codec server did not start on {self.host}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop serving and wait for the thread."""
        self._server.should_exit = True
        self._thread.join(timeout=5)


def local_codec_server(context_dir: Path, ui_port: int, port: int = 0) -> CodecServerThread:
    """The embedded stack's codec server, started: loopback, no tokens, for its UI's origin.

    `port` 0: any free port (its `url` says which), so that it never collides.
    """
    opener = PayloadOpener(DirectoryContextStore(context_dir))
    app = codec_app(opener, CodecAccess(), ui_origins=ui_origins_for(f"http://127.0.0.1:{ui_port}"))
    server = CodecServerThread(app, port=port)
    server.start()
    return server

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

A reference names its workflow's scope (a digest of the workflow id), not its tenant, and the
codec that writes it knows no tenant. The tenant of a scope is the `KvflowTenant` search
attribute of the workflow whose id has that digest (`WorkflowTenants` lists the namespace's
kvflow workflows and caches their scopes). A reference without a scope (payloads encoded
outside any workflow, and those of versions before scopes) has no known tenant: only callers
who may read every tenant open it.

A context reference names its tenant itself; one with no tenant is shared text, which any
caller reads.

A deployment whose clients have a codec of their own (`Client.connect(data_converter=...)`,
kept by `KvflowPlugin` before the claim check) gives it to the server too (`--codec
MODULE:NAME`, `PayloadOpener(codec=...)`): the server decodes with it after opening a claim
check, so the UI shows text rather than that codec's bytes.

Every decode that opens or refuses tenant data is logged: caller, namespace, scopes, how many
payloads; never their content.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib
import ipaddress
import json
import logging
import threading
import time
import tomllib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import uvicorn
from google.protobuf import json_format
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from temporalio.api.common.v1 import Payload, Payloads
from temporalio.client import Client
from temporalio.converter import PayloadCodec, WorkflowSerializationContext

from kvflow.activities.claim_check import (
    SCOPE_METADATA,
    ClaimCheckCodec,
    ClaimCheckMissing,
    is_claim_check,
    workflow_scope,
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


TenantOf = Callable[[str, str], Awaitable[str | None]]
"""`(namespace, scope) -> tenant`: the tenant of a claim-check scope, None when unknown."""


class WorkflowTenants:
    """The tenant of each claim-check scope, from the `KvflowTenant` of the namespace's workflows.

    A scope is a digest of a workflow id, so it cannot be looked up: the namespace's kvflow
    workflows are listed (`KvflowTenant IS NOT NULL`) and their scopes cached. A scope not in
    the cache lists again, at most once per `refresh_interval_s` per namespace, and after the
    first listing only workflows started in the last `overlap` (visibility lags a little).
    """

    def __init__(
        self,
        connect: Callable[[], Awaitable[Client]],
        *,
        refresh_interval_s: float = 1.0,
        overlap: timedelta = timedelta(minutes=10),
    ) -> None:
        self._connect = connect
        self._client: Client | None = None
        self._refresh_interval_s = refresh_interval_s
        self._overlap = overlap
        self._tenants: dict[str, dict[str, str]] = {}
        self._listed_at: dict[str, tuple[float, datetime]] = {}
        self._lock = asyncio.Lock()

    async def __call__(self, namespace: str, scope: str) -> str | None:
        """The tenant of `scope` in `namespace`; None when no kvflow workflow has it."""
        known = self._tenants.get(namespace, {})
        if scope in known:
            return known[scope]
        async with self._lock:
            listed = self._listed_at.get(namespace)
            if listed is None or time.monotonic() - listed[0] >= self._refresh_interval_s:
                await self._list(namespace, since=None if listed is None else listed[1])
        return self._tenants.get(namespace, {}).get(scope)

    async def _list(self, namespace: str, since: datetime | None) -> None:
        if self._client is None:
            self._client = await self._connect()
        client = Client(self._client.service_client, namespace=namespace)
        started = datetime.now(UTC)
        query = f"{TENANT.name} IS NOT NULL"
        if since is not None:
            query += f" AND StartTime >= '{(since - self._overlap).isoformat()}'"
        found = self._tenants.setdefault(namespace, {})
        async for execution in client.list_workflows(query):
            tenant = execution.typed_search_attributes.get(TENANT)
            context = WorkflowSerializationContext(namespace=namespace, workflow_id=execution.id)
            scope = workflow_scope(context)
            if tenant is not None and scope is not None:
                found[scope] = tenant
        self._listed_at[namespace] = (time.monotonic(), started)


async def _no_tenant(namespace: str, scope: str) -> None:
    return None


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
        tenant_of: TenantOf = _no_tenant,
        threshold_bytes: int = INLINE_LIMIT_BYTES,
        codec: PayloadCodec | None = None,
    ) -> None:
        # No scope: it follows the scope each reference names (access is checked here first).
        self._codec = ClaimCheckCodec(store, threshold_bytes)
        self._own = codec
        self._store = store
        self._tenant_of = tenant_of

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
            named = payload.metadata.get(SCOPE_METADATA)
            scope = None if named is None else named.decode("ascii", "replace")
            label = f"workflow {scope[:12]}" if scope else "unscoped payload"
            tenant = None if scope is None else await self._tenant_of(namespace, scope)
            if not caller.may_read(tenant):
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


def codec_app(
    opener: PayloadOpener,
    access: CodecAccess,
    *,
    ui_origins: Sequence[str] = DEFAULT_UI_ORIGINS,
    default_namespace: str = "default",
) -> Starlette:
    """The ASGI app: `POST .../decode` and `POST .../encode`, CORS for `ui_origins`."""

    async def endpoint(request: Request) -> Response:
        route = request.url.path.rstrip("/").rsplit("/", 1)[-1]
        if route not in {"decode", "encode"}:
            return _error(404, "no such route; POST .../decode or .../encode")
        caller = access.caller(request.headers.get("authorization"))
        if caller is None:
            return _error(
                401,
                "a valid `Authorization: Bearer <token>` header is required",
                {"WWW-Authenticate": 'Bearer realm="kvflow codec"'},
            )
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            return _error(413, f"request body over {MAX_BODY_BYTES} bytes")
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

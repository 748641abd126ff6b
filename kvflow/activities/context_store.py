"""The context store: content-addressed blobs that conversations reference from history.

`DirectoryContextStore` keeps each content in a file named by its SHA-256 under a directory
(`.kvflow/context/` in the embedded stack), written atomically so that concurrent writers of
the same content never expose a partial file. Every process that resolves references (the
workflow worker, every GPU worker, the codec server) must see the same store: on several
machines a shared volume, or one of the stores many machines reach over the network
(`kvflow.activities.context_stores`): a PostgreSQL table or an S3-compatible bucket.

Content is scoped, so that a digest seen in one task's history opens nothing in another's:

    tenants/<tenant>/ab/<digest>    text stored for a tenant: `put(text, tenant="acme")`
    shared/ab/<digest>              text stored for no tenant, on purpose: `put(text)`
    payloads/<scope>/ab/<digest>    claim-checked payloads of one workflow: `put_bytes`
    payloads/ab/<digest>            claim-checked payloads encoded outside any workflow
    ab/<digest>                     earlier versions: shared text and payloads, mixed

A reference names its tenant and resolves only for that tenant (`get(ref, tenant="acme")`); a
reference without one resolves from `shared/` only, never from the payloads nor from the
earlier versions' folder (whose files include claim-checked payloads of every tenant). A
caller that states no tenant (operators' tools, the store's own tests) may read any text, the
earlier versions' folder included. Payloads (`put_bytes`/`get_bytes`, for
`kvflow.activities.claim_check`) are never text: `get` cannot open them, and one workflow's
open only under its scope. The shared stores file content under the same names (a key or a
row per file) and refuse the same way; they have no earlier versions' folder.

Nothing expires by itself: `prune(older_than)` (`kvflow context prune`) deletes contents not
stored or read since; storing or reading content again renews it, so contents that running
tasks still use survive a prune that is longer than a task's lifetime.

`open_context_store` opens the store a spec names, so that every command and constructor that
took a directory takes a URL as well:

    .kvflow/context, /mnt/kvflow/context            a directory (the default)
    postgresql://user@host:5432/db?schema=NAME      a table (`kvflow_context`, or `&table=`)
    s3://bucket/prefix?endpoint_url=http://host:9000   a bucket (credentials as boto3 finds them)
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Protocol

from kvflow.activities.wire import ContextRef, digest_of, ref_for
from kvflow.scheduler.redact import redact_url

DEFAULT_CONTEXT_DIR = Path(".kvflow/context")
TENANTS_DIR = "tenants"
"""The folder under the store's root that holds one folder per tenant."""
SHARED_DIR = "shared"
"""The folder under the store's root of text stored for no tenant."""
PAYLOADS_DIR = "payloads"
"""The folder under the store's root of claim-checked payloads, one folder per scope."""
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_SCOPE = re.compile(r"[0-9a-f]{32}")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_FAN_OUT = re.compile(r"[0-9a-f]{2}")
_TENANT_FOLDER = re.compile(r"[A-Za-z0-9_.-]{1,64}|sha256-[0-9a-f]{32}")
_TEMP_FILE = re.compile(r"tmp[a-z0-9_]{8}")
"""A temporary file of an interrupted write (`tempfile`'s names), beside the digests."""
_OWN_FILE = re.compile(rf"{_DIGEST.pattern}|{_TEMP_FILE.pattern}")

Clock = Callable[[], float]
"""Seconds since the epoch: when a store records a use. The wall clock unless a test injects one."""


class ContextNotFound(KeyError):
    """A reference names content the store does not hold."""


class ContextKeyInvalid(ContextNotFound):
    """A key is not a SHA-256 hex digest, so it names no content (and no path) in the store.

    A `ContextNotFound`, so that callers which treat a missing content as permanent (the
    control-plane activities) refuse a forged key the same way.
    """


class ContextStoreUnavailable(OSError):
    """A store many machines share cannot be reached, or refused an operation.

    An `OSError`, as a full or unmounted disk is for the directory store: callers that treat
    the store's failure as the worker's fault (retryable) treat both the same. The message
    names what is wrong and how to fix it, and never a password.
    """


class ContextStoreUrlError(ValueError):
    """A context store spec names no store kvflow can open (unknown scheme, bad parameter)."""


class ContextStore(Protocol):
    """What every context store does: the directory store and the stores machines share.

    Callers that only store and read take this protocol, so that a deployment chooses its
    store by URL (`open_context_store`) without them knowing which.
    """

    @property
    def location(self) -> str:
        """Where the store is, for messages: a folder or a URL, never with a password."""
        ...

    def put(self, text: str, tenant: str | None = None) -> ContextRef:
        """Store `text` for `tenant` (None: shared), idempotently; return its reference."""
        ...

    def get(self, ref: ContextRef, tenant: str | None = None) -> str:
        """The content `ref` points at, for `tenant`; `ContextNotFound` if not there."""
        ...

    def put_bytes(self, data: bytes, scope: str | None = None) -> str:
        """Store a claim-checked payload under `scope`; return its SHA-256."""
        ...

    def get_bytes(self, digest: str, scope: str | None = None) -> bytes:
        """The payload stored under `digest` for `scope`; `ContextNotFound` if not there."""
        ...

    def prune(self, older_than: timedelta, *, now: float | None = None) -> int:
        """Delete contents not stored or read for `older_than`; return how many."""
        ...

    async def aput(self, text: str, tenant: str | None = None) -> ContextRef:
        """`put`, for async activities."""
        ...

    async def aget(self, ref: ContextRef, tenant: str | None = None) -> str:
        """`get`, for async activities."""
        ...

    def close(self) -> None:
        """Release the store's connections; it is not used after."""
        ...


def tenant_folder(tenant: str) -> str:
    """The folder name of a tenant: the name itself when it is a plain file name, else a digest."""
    if _PLAIN_NAME.fullmatch(tenant) and tenant not in {".", ".."}:
        return tenant
    return "sha256-" + hashlib.sha256(tenant.encode("utf-8")).hexdigest()[:32]


def checked_digest(digest: str) -> str:
    """`digest` if it is a SHA-256 hex digest; else `ContextKeyInvalid`.

    The digest becomes a file name or a key: only a content hash may, so that a forged
    reference (`../`, an absolute path; `ContextRef.model_construct` skips validation) cannot
    read or touch anything outside the store.
    """
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise ContextKeyInvalid(
            f"context key {digest!r:.80} is not a SHA-256 digest (64 lower-case hex "
            "characters); the store refuses it"
        )
    return digest


def text_space(tenant: str | None) -> str:
    """Where text stored for `tenant` (None: shared) is filed: `tenants/<folder>` or `shared`."""
    if tenant is None:
        return SHARED_DIR
    return f"{TENANTS_DIR}/{tenant_folder(tenant)}"


def payload_space(scope: str | None) -> str:
    """Where payloads of `scope` (None: of no workflow) are filed; `ContextKeyInvalid` if bad."""
    if scope is None:
        return PAYLOADS_DIR
    if not isinstance(scope, str) or not _SCOPE.fullmatch(scope):
        raise ContextKeyInvalid(
            f"payload scope {scope!r:.80} is not 32 lower-case hex characters; the store refuses it"
        )
    return f"{PAYLOADS_DIR}/{scope}"


def _subfolders(folder: Path, name: re.Pattern[str], *, files: bool = False) -> list[Path]:
    """The folders (`files`: the files) in `folder` whose names `name` matches; none if absent."""
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [
        folder / entry.name
        for entry in entries
        if name.fullmatch(entry.name)
        and (entry.is_file(follow_symlinks=False) if files else entry.is_dir(follow_symlinks=False))
    ]


class DirectoryContextStore:
    """Blobs in files under `root`, two-level fan-out by digest, one folder per tenant.

    `clock` stamps every store and read on the file (its modification time), which `prune`
    compares with.
    """

    def __init__(self, root: Path = DEFAULT_CONTEXT_DIR, *, clock: Clock = time.time) -> None:
        self.root = root
        self._clock = clock

    @property
    def location(self) -> str:
        """The store's folder."""
        return str(self.root)

    def close(self) -> None:
        """Nothing to release: every call opens its own files."""

    @staticmethod
    def _file(base: Path, digest: str) -> Path:
        return base / checked_digest(digest)[:2] / digest

    def _path(self, digest: str, tenant: str | None) -> Path:
        """Where text stored for `tenant` (None: shared) lives."""
        return self._file(self.root / text_space(tenant), digest)

    def _payload_path(self, digest: str, scope: str | None) -> Path:
        """Where a claim-checked payload of `scope` (None: of no workflow) lives."""
        return self._file(self.root / payload_space(scope), digest)

    def put(self, text: str, tenant: str | None = None) -> ContextRef:
        """Store `text` for `tenant` (None: shared), idempotently; return its reference."""
        ref = ref_for(text).model_copy(update={"tenant": tenant})
        self._write(self._path(ref.digest, tenant), text.encode("utf-8"), self._clock())
        return ref

    def put_bytes(self, data: bytes, scope: str | None = None) -> str:
        """Store a payload under `scope` (32 hex characters), idempotently; return its SHA-256.

        For a payload codec (`kvflow.activities.claim_check`): the scope names the workflow the
        payload belongs to, and only `get_bytes(digest, scope)` reads it back. None: a payload
        of no workflow. `get`, which reads text, never opens a payload.
        """
        digest = hashlib.sha256(data).hexdigest()
        self._write(self._payload_path(digest, scope), data, self._clock())
        return digest

    def get_bytes(self, digest: str, scope: str | None = None) -> bytes:
        """The payload stored under `digest` for `scope`; `ContextNotFound` if the store lacks it.

        Without a scope it is read from the payloads of no workflow, or else from the earlier
        versions' folder (payloads claim-checked before they were scoped). Content whose
        SHA-256 is not `digest` (damaged on disk) is refused: `ContextNotFound`, "is corrupt".
        """
        paths = [self._payload_path(digest, scope)]
        if scope is None:
            paths.append(self._file(self.root, digest))
        path, data = self._read(paths, f"content {digest[:12]}… is not in {self.root}")
        if hashlib.sha256(data).hexdigest() != digest:
            raise ContextNotFound(f"content {digest[:12]}… in {self.root} is corrupt")
        self._touch(path)  # read: still in use
        return data

    @staticmethod
    def _read(paths: list[Path], missing: str) -> tuple[Path, bytes]:
        """The first of `paths` that exists, and its bytes; `ContextNotFound(missing)` if none."""
        for path in paths:
            try:
                return path, path.read_bytes()
            except FileNotFoundError:
                continue
        raise ContextNotFound(missing)

    def _touch(self, path: Path) -> None:
        """Record a use of `path` now."""
        now = self._clock()
        with contextlib.suppress(OSError):  # a read-only store still serves reads
            os.utime(path, (now, now))

    @staticmethod
    def _write(path: Path, data: bytes, now: float) -> None:
        """Write `data` to `path` atomically, or renew the file when it is already there."""
        try:
            # Storing it again renews it, so `prune` keeps what is still in use.
            os.utime(path, (now, now))
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("wb", dir=path.parent, delete=False) as tmp:
                tmp.write(data)
            os.utime(tmp.name, (now, now))
            os.replace(tmp.name, path)

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
        paths = [self._path(ref.digest, ref.tenant)]
        if ref.tenant is None and tenant is None:
            paths.append(self._file(self.root, ref.digest))  # earlier versions' shared text
        path, data = self._read(
            paths,
            f"context {ref.digest[:12]}… ({ref.size} bytes) is not in {self.root}; every "
            "worker must use the same context store directory",
        )
        text = data.decode("utf-8", "replace")
        if digest_of(text) != ref.digest:
            raise ContextNotFound(f"context {ref.digest[:12]}… in {self.root} is corrupt")
        self._touch(path)  # read: still in use
        return text

    def prune(self, older_than: timedelta, *, now: float | None = None) -> int:
        """Delete contents not stored or read for `older_than`; return how many.

        Temporary files of interrupted writes are deleted too. Only files of the store's own
        layout are touched (`_own_files`): a store pointed at a folder that holds other files
        (the ledger's `ledger.db`) leaves them alone. A task that still references pruned
        content fails with `ContextNotFound`, so choose `older_than` longer than the longest
        task (and any replay of its history) lasts.
        """
        cutoff = (self._clock() if now is None else now) - older_than.total_seconds()
        removed = 0
        for path in self._own_files():
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                continue  # another process pruned it first
        return removed

    def _own_files(self) -> Iterator[Path]:
        """Every file the store wrote: `<space>/ab/<digest starting ab>`, and its temp files."""
        spaces = [self.root, self.root / SHARED_DIR, self.root / PAYLOADS_DIR]
        spaces += _subfolders(self.root / TENANTS_DIR, _TENANT_FOLDER)
        spaces += _subfolders(self.root / PAYLOADS_DIR, _SCOPE)
        for space in spaces:
            for fan_out in _subfolders(space, _FAN_OUT):
                for path in _subfolders(fan_out, _OWN_FILE, files=True):
                    if _TEMP_FILE.fullmatch(path.name) or path.name[:2] == fan_out.name:
                        yield path

    async def aput(self, text: str, tenant: str | None = None) -> ContextRef:
        """`put` in a thread, for async activities."""
        return await asyncio.to_thread(self.put, text, tenant)

    async def aget(self, ref: ContextRef, tenant: str | None = None) -> str:
        """`get` in a thread, for async activities."""
        return await asyncio.to_thread(self.get, ref, tenant)


def is_store_url(spec: str | Path) -> bool:
    """Whether `spec` is a URL (`scheme://...`) rather than a directory path."""
    return isinstance(spec, str) and _URL.match(spec) is not None


def open_context_store(spec: str | Path, *, clock: Clock = time.time) -> ContextStore:
    """The context store `spec` names: a directory path, or a PostgreSQL or S3 URL.

    - a path (`Path`, or a string without `scheme://`): `DirectoryContextStore`, created on
      first write;
    - `postgresql://user[:password]@host:port/db`, optionally `?schema=NAME` and
      `&table=NAME` (default `kvflow_context`): `PostgresContextStore`, its table created if
      missing (needs `kvflow[postgres]`);
    - `s3://bucket[/prefix]`, optionally `?endpoint_url=http://host:9000` (else
      `$AWS_ENDPOINT_URL`, else AWS), `&region=NAME`, `&addressing_style=path|virtual`:
      `S3ContextStore`, credentials from boto3's usual places (`AWS_ACCESS_KEY_ID` and
      `AWS_SECRET_ACCESS_KEY`, `AWS_PROFILE`, an instance role); needs `kvflow[s3]`.

    A shared store is reached when it is opened, so a wrong URL fails here, not at the first
    task: `ContextStoreUrlError` for a spec kvflow cannot read, `ContextStoreUnavailable`
    for a store it cannot reach (each says how to fix it, with no password in it).
    """
    if not is_store_url(spec):
        return DirectoryContextStore(Path(spec), clock=clock)
    url = str(spec)
    scheme = url.split("://", 1)[0].lower()
    if scheme in {"postgresql", "postgres"}:
        try:
            from kvflow.activities.context_stores.postgres import PostgresContextStore
        except ImportError:
            raise ContextStoreUrlError(
                f"{redact_url(url)} needs the PostgreSQL driver: pip install 'kvflow[postgres]'"
            ) from None
        return PostgresContextStore(url, clock=clock)
    if scheme == "s3":
        try:
            from kvflow.activities.context_stores.s3 import S3ContextStore
        except ImportError:
            raise ContextStoreUrlError(
                f"{redact_url(url)} needs the S3 client: pip install 'kvflow[s3]'"
            ) from None
        return S3ContextStore(url, clock=clock)
    raise ContextStoreUrlError(
        f"unsupported context store {redact_url(url)!r}: give a directory, "
        "postgresql://user@host:5432/db or s3://bucket/prefix"
    )

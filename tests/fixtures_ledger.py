"""Ledger fixtures: every ledger test runs against SQLite and against PostgreSQL.

PostgreSQL is the server at `KVFLOW_TEST_POSTGRES_URL` (default the machine's own,
`postgresql://postgres@127.0.0.1:5432/test`). Other processes use the same database, so each
test session works in schemas of its own (a random prefix, one schema per test) and drops
them at the end. If the server is unreachable: under `CI=true` the PostgreSQL tests fail;
elsewhere a Docker engine, if there is one, runs PostgreSQL through testcontainers; otherwise
they skip with a message naming `KVFLOW_TEST_POSTGRES_URL`.
"""

from __future__ import annotations

import itertools
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from psycopg import sql

from kvflow.ledger import (
    AttemptOutcome,
    AttemptRecord,
    Ledger,
    TaskOutcome,
    TaskRecord,
    open_ledger,
)
from kvflow.ledger.metrics import METER_NAME
from kvflow.scheduler.fleet import TokenPrices

POSTGRES_URL_ENV = "KVFLOW_TEST_POSTGRES_URL"
DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"

PRICES = TokenPrices(
    input_per_mtok_usd=Decimal("2"),
    cached_input_per_mtok_usd=Decimal("0.5"),
    output_per_mtok_usd=Decimal("10"),
)
"""Test prices: 2, 0.5 and 10 micro-dollars per input, cached and output token."""

T0 = datetime(2025, 3, 3, 9, 0, tzinfo=UTC)


def attempt_record(
    workflow_id: str = "wf-1",
    *,
    run_id: str = "run-1",
    activity_id: str = "1",
    attempt: int = 1,
    step: str = "plan",
    tenant: str = "acme",
    workflow_type: str = "ResearchAgent",
    model: str = "llama-70b",
    pool: str = "h100",
    outcome: AttemptOutcome = AttemptOutcome.OK,
    prompt_tokens: int = 1000,
    cached_tokens: int = 0,
    completion_tokens: int = 100,
    reused_tokens: int = 0,
    started_at: datetime = T0,
    prices: TokenPrices = PRICES,
) -> AttemptRecord:
    """An attempt billed at `prices`, as the GPU worker computes it."""
    return AttemptRecord(
        workflow_id=workflow_id,
        run_id=run_id,
        activity_id=activity_id,
        attempt=attempt,
        step=step,
        tenant=tenant,
        workflow_type=workflow_type,
        model=model,
        pool=pool,
        replica=f"{pool}/0",
        gpu=pool.upper(),
        started_at=started_at,
        ended_at=started_at + timedelta(seconds=2),
        outcome=outcome,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        completion_tokens=completion_tokens,
        reused_tokens=reused_tokens,
        prices=prices,
        cost_micros=prices.cost_micros(prompt_tokens, cached_tokens, completion_tokens),
        error_type=None if outcome is AttemptOutcome.OK else "ReplicaError",
    )


def task_record(
    workflow_id: str = "wf-1",
    *,
    run_id: str = "run-1",
    tenant: str = "acme",
    workflow_type: str = "ResearchAgent",
    outcome: TaskOutcome = TaskOutcome.SUCCEEDED,
    closed_at: datetime = T0 + timedelta(minutes=1),
    steps: int = 1,
    attempts: int = 1,
    spend_micros: int = 0,
    chain_run_id: str | None = None,
) -> TaskRecord:
    """A task row as a workflow writes it when it closes (`chain_run_id`: the first run of a
    task that continued as new, on its later runs)."""
    return TaskRecord(
        workflow_id=workflow_id,
        run_id=run_id,
        tenant=tenant,
        workflow_type=workflow_type,
        started_at=closed_at - timedelta(minutes=1),
        closed_at=closed_at,
        outcome=outcome,
        steps=steps,
        attempts=attempts,
        spend_micros=spend_micros,
        chain_run_id=chain_run_id,
    )


def _unreachable(url: str) -> str | None:
    """Why PostgreSQL at `url` cannot be used, or None when it can."""
    try:
        with psycopg.connect(url, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        return str(exc).strip() or type(exc).__name__
    return None


def _docker_engine_running() -> bool:
    docker = shutil.which("docker")
    if docker is None:
        return False
    try:
        return subprocess.run([docker, "info"], capture_output=True, timeout=15).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def postgres_server_url() -> Iterator[str]:
    """A reachable PostgreSQL server (see the module docstring for where it comes from)."""
    url = os.environ.get(POSTGRES_URL_ENV) or DEFAULT_POSTGRES_URL
    problem = _unreachable(url)
    if problem is None:
        yield url
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"PostgreSQL is unreachable at {url} under CI=true: {problem}")
    if _docker_engine_running():
        try:
            from testcontainers.community.postgres import PostgresContainer
        except ImportError:  # testcontainers before its modules moved under `community`
            from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:16-alpine", driver=None) as container:
            yield container.get_connection_url()
        return
    pytest.skip(
        f"PostgreSQL is unreachable at {url} ({problem}) and there is no Docker engine; set "
        f"{POSTGRES_URL_ENV}=postgresql://USER@HOST:PORT/DB to run the PostgreSQL tests"
    )


@pytest.fixture(scope="session")
def postgres_schema_prefix(postgres_server_url: str) -> Iterator[str]:
    """A random schema-name prefix for this session; its schemas are dropped at the end."""
    prefix = f"kvflow_test_{secrets.token_hex(4)}"
    yield prefix
    with psycopg.connect(postgres_server_url, autocommit=True) as conn:
        names = conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE %s", (f"{prefix}%",)
        ).fetchall()
        for (name,) in names:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


_schema_numbers = itertools.count(1)


def with_schema(url: str, schema: str) -> str:
    """`url` with `schema=NAME` added to its query string."""
    parts = urlsplit(url)
    query = [*parse_qsl(parts.query), ("schema", schema)]
    return urlunsplit(parts._replace(query=urlencode(query)))


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def ledger_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The URL of an empty ledger database (not migrated): a SQLite file or a fresh schema."""
    if request.param == "sqlite":
        folder = tmp_path_factory.mktemp("ledger")
        return f"sqlite:///{folder}/ledger.db"
    server: str = request.getfixturevalue("postgres_server_url")
    prefix: str = request.getfixturevalue("postgres_schema_prefix")
    return with_schema(server, f"{prefix}_{next(_schema_numbers)}")


@pytest.fixture
def metric_reader() -> InMemoryMetricReader:
    """Collects the metrics that the `ledger` fixture's ledger records."""
    return InMemoryMetricReader()


@pytest.fixture
def meter_provider(metric_reader: InMemoryMetricReader) -> Iterator[MeterProvider]:
    """A meter provider that reports to `metric_reader`."""
    provider = MeterProvider(metric_readers=[metric_reader])
    yield provider
    provider.shutdown()


@pytest.fixture
def ledger(ledger_url: str, meter_provider: MeterProvider) -> Iterator[Ledger]:
    """A migrated, empty ledger whose metrics go to `metric_reader`."""
    with open_ledger(
        ledger_url, migrate=True, meter=meter_provider.get_meter(METER_NAME)
    ) as opened:
        yield opened

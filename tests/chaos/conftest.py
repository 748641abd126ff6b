"""Fixtures of the fault suite: per scenario module, a fresh ledger schema and a cluster.

A scenario is one module: a module-scoped fixture runs the faulty workload once and each test
checks one behaviour of that run, so a known defect fails (or xfails) its own test only.

The ledger URL carries a planted password (`SECRET_CANARY`): PostgreSQL here trusts local
connections and ignores it, and no log line or history of the run may contain it. A probe
(`SCAN_PROBE`) planted in every log and every task's memo shows that the scan looks there.
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

from kvflow.ledger.store import AsyncLedger, open_async_ledger
from tests.chaos.cluster import SECRET_CANARY, ChaosCluster
from tests.chaos.figures import OUT_DIR, SESSION, save, summary_table, write_summary
from tests.fixtures_ledger import with_schema

ClusterFactory = Callable[..., AbstractAsyncContextManager[ChaosCluster]]


def _with_password(url: str, password: str) -> str:
    parts = urlsplit(url)
    user = parts.username or "postgres"
    host = parts.hostname or "127.0.0.1"
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{host}{port}"))


@pytest.fixture(scope="module")
def chaos_ledger_url(postgres_server_url: str) -> Iterator[str]:
    """A fresh PostgreSQL schema for one scenario (dropped afterwards), URL with the canary."""
    schema = f"kvflow_chaos_{secrets.token_hex(4)}"
    url = with_schema(_with_password(postgres_server_url, SECRET_CANARY), schema)
    yield url
    with psycopg.connect(postgres_server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@pytest.fixture(scope="module")
async def chaos_ledger(chaos_ledger_url: str) -> AsyncIterator[AsyncLedger]:
    """The scenario's ledger, opened in the test process for the audit (migrated)."""
    ledger = await open_async_ledger(chaos_ledger_url, migrate=True)
    try:
        yield ledger
    finally:
        await ledger.close()


@pytest.fixture(scope="module")
async def chaos_cluster(
    request: pytest.FixtureRequest, chaos_ledger_url: str
) -> AsyncIterator[ClusterFactory]:
    """`async with chaos_cluster(**options) as cluster:` a started `ChaosCluster`.

    Its processes are stopped at the end of the block, or of the module at the latest. Its
    files (logs, the Temporal SQLite file, the context store) stay in
    `.kvflow/chaos/<scenario module>/` until the scenario runs again, for a reader of a
    failure (pytest's own temporary folders are pruned by every other pytest run).
    """
    clusters: list[ChaosCluster] = []
    folder = OUT_DIR / request.path.stem
    shutil.rmtree(folder, ignore_errors=True)

    @asynccontextmanager
    async def start(**options: Any) -> AsyncIterator[ChaosCluster]:
        root = folder / f"cluster-{len(clusters)}"
        cluster = ChaosCluster(root, ledger_url=chaos_ledger_url, **options)
        clusters.append(cluster)
        try:
            await cluster.start()
            yield cluster
        finally:
            await cluster.stop()
            print(f"[chaos] logs: {cluster.logs}")

    yield start
    for cluster in clusters:
        await cluster.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Add each test's outcome (passed, failed, xfailed) to its scenario's figures."""
    report = yield
    figures = SESSION.get(item.nodeid.split("::")[0])
    if figures is not None and (report.when == "call" or report.failed):
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        else:
            outcome = report.outcome
        figures.outcomes[item.name] = outcome
        save(figures)
    return report


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print the table of the scenarios that ran, and write `.kvflow/chaos-summary.md`."""
    if not SESSION:
        return
    figures = list(SESSION.values())
    command = " ".join(["pytest", *terminalreporter.config.invocation_params.args])
    path = write_summary(figures, command)
    terminalreporter.section("fault suite")
    terminalreporter.write_line(summary_table(figures))
    terminalreporter.write_line(f"written to {path}")

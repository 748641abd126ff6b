"""Writing and reading the ledger: idempotent rows, concurrent writers, schema versions, metrics."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, NumberDataPoint, Sum
from pydantic import ValidationError

from kvflow.ledger import (
    AsyncLedger,
    AttemptOutcome,
    AttemptRecord,
    Ledger,
    LedgerNotFound,
    LedgerSchemaError,
    LedgerUrlError,
    ReportQuery,
    TaskOutcome,
    TaskRecord,
    connect_ledger,
    default_ledger_url,
    open_async_ledger,
    open_ledger,
)
from kvflow.ledger.metrics import METER_NAME
from kvflow.ledger.migrations import LATEST_VERSION
from kvflow.ledger.store import postgres_conninfo, sqlite_path
from kvflow.scheduler.fleet import TokenPrices
from kvflow.scheduler.redact import redact_url
from tests.fixtures_ledger import PRICES, T0, attempt_record, task_record, with_schema

WRITERS = 8


def _sums(reader: InMemoryMetricReader, name: str) -> dict[frozenset[tuple[str, object]], int]:
    """Counter values by attribute set, from the in-memory reader."""
    data = reader.get_metrics_data()
    sums: dict[frozenset[tuple[str, object]], int] = {}
    if data is None:
        return sums
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name != name:
                    continue
                assert isinstance(metric.data, Sum), f"{name} should be a counter"
                for point in metric.data.data_points:
                    assert isinstance(point, NumberDataPoint)
                    sums[frozenset((point.attributes or {}).items())] = int(point.value)
    return sums


def test_attempt_row_reads_back_exactly_with_prices_and_times(ledger: Ledger) -> None:
    record = attempt_record(
        outcome=AttemptOutcome.RESUMED_ELSEWHERE,
        cached_tokens=512,
        reused_tokens=40,
        prices=TokenPrices(
            input_per_mtok_usd=Decimal("0.15"),
            cached_input_per_mtok_usd=Decimal("0.015"),
            output_per_mtok_usd=Decimal("0.6"),
        ),
        started_at=datetime(2025, 3, 3, 10, 0, 0, 123456, tzinfo=timezone(timedelta(hours=2))),
    )
    assert ledger.record_attempt(record) is True

    (stored,) = ledger.attempts_for("wf-1", "run-1")
    assert stored == record
    assert stored.prices.cached_input_per_mtok_usd == Decimal("0.015")
    assert stored.started_at.utcoffset() == timedelta(0)
    assert stored.started_at == datetime(2025, 3, 3, 8, 0, 0, 123456, tzinfo=UTC)


def test_retried_attempt_write_changes_nothing(ledger: Ledger) -> None:
    first = attempt_record(completion_tokens=100)
    retried_with_other_figures = attempt_record(completion_tokens=999)

    assert ledger.record_attempt(first) is True
    assert ledger.record_attempt(first) is False
    assert ledger.record_attempt(retried_with_other_figures) is False
    assert ledger.attempts_for("wf-1", "run-1") == [first]


def test_retried_task_write_changes_nothing(ledger: Ledger) -> None:
    task = task_record(outcome=TaskOutcome.FAILED, spend_micros=4000)

    assert ledger.record_task(task) is True
    assert ledger.record_task(task.model_copy(update={"outcome": TaskOutcome.SUCCEEDED})) is False
    book = ledger.task("wf-1", "run-1")
    assert book is not None and book.as_written() == task
    # The task has no attempt rows: the ledger books nothing, whatever the writer said.
    assert (book.spend_micros, book.spend_at_close_micros, book.moved_micros) == (0, 4000, -4000)
    assert ledger.task("wf-1", "other-run") is None


def test_eight_concurrent_writers_of_the_same_rows_write_each_row_once(
    ledger: Ledger, ledger_url: str, meter_provider: MeterProvider, metric_reader
) -> None:
    attempts = [attempt_record(activity_id=str(i), attempt=1 + i % 2) for i in range(20)]
    task = task_record(attempts=20, spend_micros=sum(a.cost_micros for a in attempts))
    meter = meter_provider.get_meter(METER_NAME)
    writers = [open_ledger(ledger_url, meter=meter) for _ in range(WRITERS)]
    start = threading.Barrier(WRITERS)
    written: Counter[object] = Counter()
    errors: list[BaseException] = []
    lock = threading.Lock()

    def write(own: Ledger) -> None:
        try:
            start.wait()
            for record in attempts:
                if own.record_attempt(record):
                    with lock:
                        written[record.key] += 1
            if own.record_task(task):
                with lock:
                    written[task.key] += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(w,)) for w in writers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for writer in writers:
        writer.close()

    assert errors == []
    expected: Counter[object] = Counter({a.key: 1 for a in attempts})
    expected[task.key] = 1
    assert written == expected
    assert len(ledger.attempts_for("wf-1", "run-1")) == 20
    # The spend counter counts each row once, however many writers tried.
    spend = _sums(metric_reader, "kvflow.ledger.spend")
    assert sum(spend.values()) == sum(a.cost_micros for a in attempts)
    tasks = _sums(metric_reader, "kvflow.ledger.tasks")
    assert tasks == {frozenset({("tenant", "acme"), ("outcome", "succeeded")}): 1}


def test_spend_and_task_counters_are_labelled_by_tenant_pool_and_outcome(
    ledger: Ledger, metric_reader: InMemoryMetricReader
) -> None:
    ok = attempt_record(activity_id="1", pool="h100")  # 2*1000 + 10*100 = 3000
    failed = attempt_record(activity_id="2", pool="l4", outcome=AttemptOutcome.FAILED)
    other = attempt_record("wf-2", activity_id="1", tenant="globex", completion_tokens=0)
    for record in (ok, failed, other, ok):
        ledger.record_attempt(record)
    ledger.record_task(task_record(outcome=TaskOutcome.FAILED, spend_micros=6000))
    ledger.record_task(task_record("wf-2", tenant="globex", spend_micros=2000))

    assert _sums(metric_reader, "kvflow.ledger.spend") == {
        frozenset({("tenant", "acme"), ("pool", "h100"), ("outcome", "ok")}): 3000,
        frozenset({("tenant", "acme"), ("pool", "l4"), ("outcome", "failed")}): 3000,
        frozenset({("tenant", "globex"), ("pool", "h100"), ("outcome", "ok")}): 2000,
    }
    assert _sums(metric_reader, "kvflow.ledger.tasks") == {
        frozenset({("tenant", "acme"), ("outcome", "failed")}): 1,
        frozenset({("tenant", "globex"), ("outcome", "succeeded")}): 1,
    }
    assert _sums(metric_reader, "kvflow.ledger.task_spend") == {
        frozenset({("tenant", "acme"), ("outcome", "failed")}): 6000,
        frozenset({("tenant", "globex"), ("outcome", "succeeded")}): 2000,
    }


def test_tasks_missing_lists_runs_without_a_task_row_in_order(ledger: Ledger) -> None:
    ledger.record_task(task_record("wf-1"))
    ledger.record_task(task_record("wf-3", run_id="run-b"))

    keys = [("wf-3", "run-a"), ("wf-1", "run-1"), ("wf-2", "run-1"), ("wf-3", "run-b")]
    assert ledger.tasks_missing(keys) == [("wf-3", "run-a"), ("wf-2", "run-1")]
    many = [(f"wf-x{i}", "r") for i in range(450)]
    assert ledger.tasks_missing(many) == many


async def test_async_ledger_writes_and_reads_from_async_code(ledger_url: str) -> None:
    ledger = await open_async_ledger(ledger_url, migrate=True)
    async with ledger:
        record = attempt_record()
        assert await ledger.record_attempt(record) is True
        assert await ledger.record_attempt(record) is False
        assert await ledger.record_task(task_record()) is True
        assert await ledger.attempts_for("wf-1", "run-1") == [record]
        assert await ledger.tasks_missing([("wf-1", "run-1"), ("wf-9", "r")]) == [("wf-9", "r")]
        assert isinstance(AsyncLedger(ledger.ledger).ledger, Ledger)


def test_migrate_is_idempotent_and_reports_what_it_applied(ledger_url: str) -> None:
    with connect_ledger(ledger_url, create=True) as ledger:
        assert ledger.schema_version() == 0
        assert ledger.migrate(to_version=1) == [1]
        assert ledger.migrate() == list(range(2, LATEST_VERSION + 1))
        assert ledger.migrate() == []
        assert ledger.schema_version() == LATEST_VERSION


def run_at_once(target: Callable[[], None], workers: int) -> None:
    """`target` in `workers` threads started together; returns when all have ended."""
    threads = [threading.Thread(target=target) for _ in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_concurrent_migrations_apply_each_version_once(ledger_url: str) -> None:
    results: list[list[int]] = []
    errors: list[BaseException] = []
    # Four workers open a new ledger at the same instant, then migrate it together. A worker
    # that fails breaks the barrier, so the others stop waiting and the failure is reported.
    opened = threading.Barrier(4, timeout=60)
    start = threading.Barrier(4, timeout=60)

    def migrate() -> None:
        try:
            opened.wait()
            with connect_ledger(ledger_url, create=True) as ledger:
                start.wait()
                results.append(ledger.migrate())
        except threading.BrokenBarrierError:
            pass
        except BaseException as exc:
            errors.append(exc)
            opened.abort()
            start.abort()

    run_at_once(migrate, 4)

    assert errors == []
    assert sorted(v for applied in results for v in applied) == list(range(1, LATEST_VERSION + 1))


def test_old_schema_is_refused_with_the_migrate_command(ledger_url: str) -> None:
    with connect_ledger(ledger_url, create=True) as ledger:
        ledger.migrate(to_version=1)

    with pytest.raises(LedgerSchemaError) as error:
        open_ledger(ledger_url)
    assert "schema version 1" in str(error.value)
    assert "kvflow ledger migrate --db" in str(error.value)


def test_task_rows_from_before_the_chain_key_are_chains_of_their_own_run(
    ledger_url: str,
) -> None:
    with connect_ledger(ledger_url, create=True) as ledger:
        ledger.migrate(to_version=4)
        for run, outcome in (("run-1", "continued_as_new"), ("run-2", "failed")):
            values = (
                "wf-old",
                run,
                "acme",
                "ResearchAgent",
                ledger._time_in(T0),
                ledger._time_in(T0),
                outcome,
                1,
                1,
                2000,
                0,
                "workflow",
                ledger._time_in(T0),
            )
            with ledger._write_transaction():
                ledger._execute(
                    "INSERT INTO tasks (workflow_id, run_id, tenant, workflow_type, started_at, "
                    "closed_at, outcome, steps, attempts_at_close, spend_at_close_micros, "
                    "compensation_micros, source, recorded_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    values,
                )  # fmt: skip
            assert ledger.record_attempt(attempt_record("wf-old", run_id=run))
        assert ledger.migrate() == [5]
        _, chains = ledger._execute("SELECT run_id, chain_run_id FROM tasks ORDER BY run_id")
        assert [tuple(row) for row in chains] == [("run-1", "run-1"), ("run-2", "run-2")]
        book = ledger.task("wf-old", "run-2")
        assert book is not None and book.chain_run_id is None and book.chain == "run-2"
        # Nothing says the runs are one task: the continued run's spend is not made waste.
        report = ledger.report(ReportQuery(group_by=()))
        spend = attempt_record("wf-old").cost_micros
        assert (report.totals.tasks, report.totals.wasted_micros) == (1, spend)


def test_empty_database_is_refused_with_the_migrate_command(ledger_url: str) -> None:
    connect_ledger(ledger_url, create=True).close()

    with pytest.raises(LedgerSchemaError, match=r"no kvflow ledger schema.*kvflow ledger migrate"):
        open_ledger(ledger_url)


def test_workers_opening_a_new_sqlite_ledger_at_once_all_open_it(tmp_path: Path) -> None:
    # Switching a new file to WAL takes its exclusive lock, and SQLite refuses a connection
    # that would wait for it while holding a lock another waiter needs, at once, past the
    # busy timeout: one worker in a few hundred failed with "database is locked". A race, so
    # many rounds of eight workers each (failures in about two runs of three before the fix).
    errors: list[BaseException] = []
    for attempt in range(200):
        url = f"sqlite:///{tmp_path}/ledger-{attempt}.db"
        together = threading.Barrier(8, timeout=60)

        def open_it(url: str = url, together: threading.Barrier = together) -> None:
            try:
                together.wait()
                connect_ledger(url, create=True).close()
            except BaseException as exc:
                errors.append(exc)

        run_at_once(open_it, 8)
    assert errors == []


def test_missing_sqlite_file_is_not_created_by_opening_it(tmp_path) -> None:
    path = tmp_path / "nested" / "ledger.db"

    with pytest.raises(LedgerNotFound, match="kvflow ledger migrate"):
        open_ledger(f"sqlite:///{path}")
    assert not path.exists()

    open_ledger(f"sqlite:///{path}", migrate=True).close()
    assert path.exists()


@pytest.mark.postgres
def test_missing_postgres_database_is_named_in_the_error(postgres_server_url: str) -> None:
    url = postgres_server_url.rsplit("/", 1)[0] + "/kvflow_no_such_database"

    with pytest.raises(LedgerNotFound, match="kvflow_no_such_database"):
        open_ledger(url)


def test_ledger_urls_are_parsed_and_passwords_kept_out_of_messages(monkeypatch) -> None:
    assert sqlite_path("sqlite:///.kvflow/ledger.db") == ".kvflow/ledger.db"
    assert sqlite_path("sqlite:////var/lib/kvflow/ledger.db") == "/var/lib/kvflow/ledger.db"
    assert postgres_conninfo("postgresql://u@h:5432/db?schema=s1&sslmode=require") == (
        "postgresql://u@h:5432/db?sslmode=require",
        "s1",
    )
    assert redact_url("postgresql://u:secret@h/db") == "postgresql://u:***@h/db"
    with pytest.raises(LedgerUrlError, match="sqlite:///path"):
        open_ledger("mysql://u@h/db")
    with pytest.raises(LedgerUrlError, match="bad SQLite ledger URL"):
        open_ledger("sqlite://relative.db")

    monkeypatch.delenv("KVFLOW_LEDGER_URL", raising=False)
    assert default_ledger_url() == "sqlite:///.kvflow/ledger.db"
    monkeypatch.setenv("KVFLOW_LEDGER_URL", "postgresql://u@h/db")
    assert default_ledger_url() == "postgresql://u@h/db"


def test_records_refuse_naive_times_and_impossible_token_counts() -> None:
    with pytest.raises(ValidationError, match="timezone"):
        attempt_record(started_at=datetime(2025, 3, 3, 9, 0))
    with pytest.raises(ValidationError, match="cannot exceed prompt_tokens"):
        AttemptRecord.model_validate(
            attempt_record().model_dump() | {"prompt_tokens": 10, "cached_tokens": 20}
        )
    with pytest.raises(ValidationError, match="closed_at is before started_at"):
        TaskRecord.model_validate(
            task_record().model_dump() | {"closed_at": T0 - timedelta(seconds=1)}
        )
    # Money travels as exact decimal strings and integers, never floats.
    dumped = attempt_record().model_dump(mode="json")
    assert dumped["prices"]["input_per_mtok_usd"] == str(PRICES.input_per_mtok_usd)
    assert dumped["cost_micros"] == 3000


@pytest.mark.postgres
def test_write_after_postgres_drops_the_session_is_not_lost(
    postgres_server_url: str, postgres_schema_prefix: str
) -> None:
    url = with_schema(postgres_server_url, f"{postgres_schema_prefix}_dropped")
    with open_ledger(url, migrate=True) as ledger:
        assert ledger.record_attempt(attempt_record(activity_id="1"))
        # What a server restart or failover does to the ledger's session.
        backend = ledger._conn.info.backend_pid  # type: ignore[attr-defined]
        with psycopg.connect(postgres_server_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (backend,))

        assert ledger.record_attempt(attempt_record(activity_id="2")) is True
        assert len(ledger.attempts_for("wf-1", "run-1")) == 2

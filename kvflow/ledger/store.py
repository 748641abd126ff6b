"""The `Ledger` interface, its SQL shared by both backends, and how to open one by URL.

`open_ledger("sqlite:///.kvflow/ledger.db")` or `open_ledger("postgresql://user@host:5432/db")`
returns a `Ledger`. Both backends run the same SQL (`INSERT ... ON CONFLICT DO NOTHING` for
idempotent writes) through plain drivers (stdlib `sqlite3`, psycopg 3); only the connection,
the transactions (an attempt write with the task row it moves; a migration) and two column
types differ.

A `Ledger` holds one connection and is safe to share between threads (calls are serialized).
Async code (activities) uses `AsyncLedger`, which runs each call in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from types import TracebackType
from typing import Any, Self
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from opentelemetry.metrics import Meter

from kvflow.ledger.errors import LedgerSchemaError, LedgerUrlError
from kvflow.ledger.metrics import LedgerMetrics
from kvflow.ledger.migrations import LATEST_VERSION, MIGRATIONS, SCHEMA_VERSION_TABLE
from kvflow.ledger.records import (
    AttemptOutcome,
    AttemptRecord,
    TaskBook,
    TaskOutcome,
    TaskRecord,
    chain_run_id,
)
from kvflow.ledger.report import (
    AttemptTotals,
    ChainEnds,
    Report,
    ReportQuery,
    SpendSlice,
    TaskFacts,
    build_report,
)
from kvflow.scheduler.fleet import TokenPrices
from kvflow.scheduler.redact import encode_password, redact_url

log = logging.getLogger(__name__)

LEDGER_URL_ENV = "KVFLOW_LEDGER_URL"
"""The environment variable that names the ledger database."""
DEFAULT_LEDGER_URL = "sqlite:///.kvflow/ledger.db"
"""The embedded default: a SQLite file under `.kvflow/` in the working directory."""

Row = tuple[Any, ...]

_ATTEMPT_COLUMNS = (
    "workflow_id",
    "run_id",
    "activity_id",
    "attempt",
    "step",
    "tenant",
    "workflow_type",
    "model",
    "pool",
    "replica",
    "gpu",
    "started_at",
    "ended_at",
    "outcome",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "reused_tokens",
    "input_per_mtok_usd",
    "cached_input_per_mtok_usd",
    "output_per_mtok_usd",
    "cost_micros",
    "error_type",
    "provisional",
)
_ATTEMPT_KEY = ("workflow_id", "run_id", "activity_id", "attempt")
_TASK_COLUMNS = (
    "workflow_id",
    "run_id",
    "tenant",
    "workflow_type",
    "started_at",
    "closed_at",
    "outcome",
    "steps",
    "attempts",
    "spend_micros",
    "compensation_micros",
    "source",
    "chain_run_id",
)
# How each TaskRecord field is stored: the writer's figures are kept as what it saw at close.
_TASK_STORED_COLUMNS = tuple(
    {"spend_micros": "spend_at_close_micros", "attempts": "attempts_at_close"}.get(c, c)
    for c in _TASK_COLUMNS
)
_WASTED_ATTEMPT_OUTCOMES = (AttemptOutcome.FAILED.value, AttemptOutcome.CANCELLED.value)
# Keeps `IN (...)` lists well under SQLite's and PostgreSQL's parameter limits.
_KEY_CHUNK = 200


@dataclass(frozen=True, slots=True)
class AttemptSums:
    """The attempts of one run on one pool and model, with one outcome and prices, summed.

    What the FOCUS export prices (`Ledger.report_and_attempt_sums`): tokens × prices is
    linear, so the sum of the parts is the parts of the sum.
    """

    workflow_id: str
    run_id: str
    pool: str
    model: str
    outcome: AttemptOutcome
    prices: TokenPrices
    input_tokens: int
    """Prompt tokens the engine computed (prompt less cached)."""
    cached_tokens: int
    completion_tokens: int
    cost_micros: int
    """What the attempts were billed, each rounded to the micro-dollar."""


def default_ledger_url() -> str:
    """`$KVFLOW_LEDGER_URL`, else the embedded SQLite file `sqlite:///.kvflow/ledger.db`."""
    return os.environ.get(LEDGER_URL_ENV) or DEFAULT_LEDGER_URL


class Ledger(ABC):
    """Where attempt and task rows are written and reports are read.

    Writes are idempotent: `record_attempt` and `record_task` return True when they wrote the
    row and False when a row with the same key was already there (the first write wins, later
    ones change nothing), with one exception: an exact attempt row replaces a *provisional*
    one (`AttemptRecord.provisional`, the workflow's estimate of an attempt it lost track of).
    Instances come from `open_ledger`.
    """

    _timestamp_type: str
    _decimal_type: str

    def __init__(self, url: str, meter: Meter | None = None) -> None:
        self.url = redact_url(url)
        """The ledger's URL, password redacted."""
        # Re-entrant: a migration holds it across its transaction and each statement in it.
        self._lock = threading.RLock()
        self._metrics = LedgerMetrics(meter)
        # Reads that join an open snapshot instead of opening another (`_read_snapshot`).
        self._snapshot_open = False

    # -- what each backend provides -------------------------------------------------------

    @abstractmethod
    def _execute(self, sql: str, params: Sequence[object] = ()) -> tuple[int, list[Row]]:
        """Run one statement written with `?` placeholders; return (rowcount, rows)."""

    @abstractmethod
    def _migration_transaction(self) -> AbstractContextManager[None]:
        """A transaction that no other migration of the same database runs alongside."""

    @abstractmethod
    def _write_transaction(self) -> AbstractContextManager[None]:
        """A transaction for writes that must land together or not at all."""

    @abstractmethod
    def _snapshot(self) -> AbstractContextManager[None]:
        """A read-only transaction whose statements all see the same committed state."""

    @abstractmethod
    def _serialize_task(self, workflow_id: str, run_id: str) -> None:
        """Make writes that touch one task's rows run one after another, until commit.

        A resumed mark and the failed row it marks may be written at the same moment: each
        must see the other once it is committed (see `_apply_resumed_mark`).
        """

    @abstractmethod
    def _schema_version_or_none(self) -> int | None:
        """The latest applied migration, or None when `schema_version` does not exist."""

    @abstractmethod
    def _time_in(self, moment: datetime) -> object:
        """A UTC datetime as the driver stores it."""

    @abstractmethod
    def _time_out(self, value: Any) -> datetime:
        """A stored timestamp as an aware UTC datetime."""

    @abstractmethod
    def _decimal_in(self, amount: Decimal) -> object:
        """A `Decimal` as the driver stores it exactly."""

    @abstractmethod
    def close(self) -> None:
        """Close the connection."""

    # -- schema ---------------------------------------------------------------------------

    def _ddl(self, statement: str) -> str:
        return statement.format(timestamp=self._timestamp_type, decimal=self._decimal_type)

    def schema_version(self) -> int:
        """The latest migration applied to this database (0 for none)."""
        with self._lock:
            return self._schema_version_or_none() or 0

    def check_schema(self) -> None:
        """Raise `LedgerSchemaError` unless the schema is exactly this kvflow's version."""
        version = self.schema_version()
        migrate = f"`kvflow ledger migrate --db {self.url}`"
        if version == 0:
            raise LedgerSchemaError(
                f"{self.url} has no kvflow ledger schema; create it with {migrate}"
            )
        if version < LATEST_VERSION:
            raise LedgerSchemaError(
                f"{self.url} has ledger schema version {version}, older than the version "
                f"{LATEST_VERSION} this kvflow uses; upgrade it with {migrate}"
            )
        if version > LATEST_VERSION:
            raise LedgerSchemaError(
                f"{self.url} has ledger schema version {version}, newer than the version "
                f"{LATEST_VERSION} this kvflow understands; upgrade kvflow"
            )

    def migrate(self, to_version: int | None = None) -> list[int]:
        """Apply the pending migrations up to `to_version` (default: the latest), in order.

        Safe to run from several processes at once: migrations are serialized by the backend
        and each runs in one transaction with its `schema_version` row. Returns the versions
        applied (empty when the schema was already current).
        """
        target = LATEST_VERSION if to_version is None else to_version
        if not 0 <= target <= LATEST_VERSION:
            raise LedgerSchemaError(
                f"no schema version {target}; versions are 1 to {LATEST_VERSION}"
            )
        applied: list[int] = []
        with self._lock, self._migration_transaction():
            self._execute(self._ddl(SCHEMA_VERSION_TABLE))
            current = self._schema_version_or_none() or 0
            if current > LATEST_VERSION:
                raise LedgerSchemaError(
                    f"{self.url} has ledger schema version {current}, newer than the version "
                    f"{LATEST_VERSION} this kvflow understands; upgrade kvflow"
                )
            for migration in MIGRATIONS:
                if not current < migration.version <= target:
                    continue
                for statement in migration.statements:
                    self._execute(self._ddl(statement))
                self._execute(
                    "INSERT INTO schema_version (version, description, applied_at) "
                    "VALUES (?, ?, ?)",
                    (migration.version, migration.description, self._time_in(datetime.now(UTC))),
                )
                applied.append(migration.version)
        if applied:
            log.info("ledger %s migrated to schema version %d", self.url, applied[-1])
        return applied

    # -- writes ---------------------------------------------------------------------------

    def record_attempt(self, record: AttemptRecord) -> bool:
        """Write one attempt row; True if written now, False if its key was already there.

        An exact row (not `provisional`) whose key holds a provisional row replaces it and
        returns True: the GPU worker's bill wins over the workflow's estimate from the last
        heartbeat, whichever was written first. A provisional row never replaces anything.

        Nothing else is touched: a task's spend is summed from its attempt rows when it is
        read (`task`, `report`), so a row that comes after its task row counts as any other.
        A `failed` or `cancelled` row whose attempt was marked resumed (`mark_resumed`, before
        or after the row came) is stored as `resumed_elsewhere`, in the same transaction.
        """
        prices = record.prices
        values: tuple[object, ...] = (
            record.workflow_id,
            record.run_id,
            record.activity_id,
            record.attempt,
            record.step,
            record.tenant,
            record.workflow_type,
            record.model,
            record.pool,
            record.replica,
            record.gpu,
            self._time_in(record.started_at),
            self._time_in(record.ended_at),
            record.outcome.value,
            record.prompt_tokens,
            record.cached_tokens,
            record.completion_tokens,
            record.reused_tokens,
            self._decimal_in(prices.input_per_mtok_usd),
            self._decimal_in(prices.cached_input_per_mtok_usd),
            self._decimal_in(prices.output_per_mtok_usd),
            record.cost_micros,
            record.error_type,
            record.provisional,
        )
        estimate: int | None = None
        with self._lock:
            with self._write_transaction():
                written = self._insert(
                    "attempts", _ATTEMPT_COLUMNS, values, ", ".join(_ATTEMPT_KEY)
                )
                if not written and not record.provisional:
                    estimate = self._supersede(record, values)
                if written or estimate is not None:
                    self._serialize_task(record.workflow_id, record.run_id)
                    self._apply_resumed_mark(record)
            # Counted once committed: a rolled-back write is retried and counted then.
            if written:
                self._metrics.attempt_written(record)
                return True
            if estimate is None:
                return False
            self._metrics.attempt_superseded(record, estimate_micros=estimate)
            return True

    def _supersede(self, record: AttemptRecord, values: Sequence[object]) -> int | None:
        """Replace the provisional row under `record`'s key with `record`.

        Returns the estimate's cost, or None when there was no provisional row to replace.
        """
        key = " AND ".join(f"{name} = ?" for name in _ATTEMPT_KEY)
        _, rows = self._execute(
            f"SELECT cost_micros FROM attempts WHERE {key} AND provisional", record.key
        )
        if not rows:
            return None
        assert _ATTEMPT_COLUMNS[: len(_ATTEMPT_KEY)] == _ATTEMPT_KEY
        columns = (*_ATTEMPT_COLUMNS[len(_ATTEMPT_KEY) :], "recorded_at")
        rest = (*values[len(_ATTEMPT_KEY) :], self._time_in(datetime.now(UTC)))
        # `AND provisional` again: of two exact writers racing here, only one replaces it.
        count, _ = self._execute(
            f"UPDATE attempts SET {', '.join(f'{c} = ?' for c in columns)} "
            f"WHERE {key} AND provisional",
            (*rest, *record.key),
        )
        if count != 1:
            return None
        return int(rows[0][0])

    def _apply_resumed_mark(self, record: AttemptRecord) -> None:
        """Store a failed or cancelled row as `resumed_elsewhere` if its attempt is marked."""
        if record.outcome.value not in _WASTED_ATTEMPT_OUTCOMES:
            return
        self._execute(
            "UPDATE attempts SET outcome = ? WHERE workflow_id = ? AND run_id = ? "
            "AND activity_id = ? AND attempt = ? AND outcome IN (?, ?) AND EXISTS ("
            "SELECT 1 FROM resumed_attempts r WHERE r.workflow_id = ? AND r.run_id = ? "
            "AND r.activity_id = ?)",
            (
                AttemptOutcome.RESUMED_ELSEWHERE.value,
                *record.key,
                *_WASTED_ATTEMPT_OUTCOMES,
                record.workflow_id,
                record.run_id,
                record.activity_id,
            ),
        )

    def record_task(self, record: TaskRecord) -> bool:
        """Write one task row; True if written now, False if its key was already there.

        The row keeps its writer's spend and attempt count as `spend_at_close_micros` and
        `attempts_at_close`; the task's own figures are summed from its attempt rows on
        every read, so no row that arrives later needs to move it.
        """
        values: tuple[object, ...] = (
            record.workflow_id,
            record.run_id,
            record.tenant,
            record.workflow_type,
            self._time_in(record.started_at),
            self._time_in(record.closed_at),
            record.outcome.value,
            record.steps,
            record.attempts,
            record.spend_micros,
            record.compensation_micros,
            record.source,
            record.chain,
        )
        with self._lock, self._write_transaction():
            written = self._insert("tasks", _TASK_STORED_COLUMNS, values, "workflow_id, run_id")
        if written:
            self._metrics.task_written(record)
        return written

    def mark_resumed(self, workflow_id: str, run_id: str, activity_ids: Sequence[str]) -> int:
        """Mark those attempts of one run whose partial output the next attempt reused.

        The mark is a fact of its own, decided by what happened to the tokens: the attempt's
        output was carried into another attempt, so its row becomes `resumed_elsewhere` (not
        wasted, in the report) now or whenever it arrives, and no later row (an exact row
        replacing an estimate) undoes it. That holds whatever word the GPU worker wrote for
        the cut: `failed`, or `cancelled` (what it writes for a call Temporal timed out). An
        `ok` row stays `ok` (it is no waste either way). Idempotent. Returns the rows changed
        now.
        """
        if not activity_ids:
            return 0
        marks = ", ".join("?" for _ in activity_ids)
        with self._lock, self._write_transaction():
            self._serialize_task(workflow_id, run_id)
            for activity_id in dict.fromkeys(activity_ids):
                self._execute(
                    "INSERT INTO resumed_attempts (workflow_id, run_id, activity_id, recorded_at) "
                    "VALUES (?, ?, ?, ?) ON CONFLICT (workflow_id, run_id, activity_id) DO NOTHING",
                    (workflow_id, run_id, activity_id, self._time_in(datetime.now(UTC))),
                )
            count, _ = self._execute(
                "UPDATE attempts SET outcome = ? WHERE workflow_id = ? AND run_id = ? "
                f"AND outcome IN (?, ?) AND activity_id IN ({marks})",
                (
                    AttemptOutcome.RESUMED_ELSEWHERE.value,
                    workflow_id,
                    run_id,
                    *_WASTED_ATTEMPT_OUTCOMES,
                    *activity_ids,
                ),
            )
        return count

    def _insert(
        self, table: str, columns: Sequence[str], values: Sequence[object], key: str
    ) -> bool:
        names = ", ".join((*columns, "recorded_at"))
        marks = ", ".join("?" for _ in range(len(columns) + 1))
        count, _ = self._execute(
            f"INSERT INTO {table} ({names}) VALUES ({marks}) ON CONFLICT ({key}) DO NOTHING",
            (*values, self._time_in(datetime.now(UTC))),
        )
        return count == 1

    # -- reads ----------------------------------------------------------------------------

    def attempts_for(self, workflow_id: str, run_id: str) -> list[AttemptRecord]:
        """Every attempt row of one workflow run, in the order they started."""
        _, rows = self._execute(
            f"SELECT {', '.join(_ATTEMPT_COLUMNS)} FROM attempts "
            "WHERE workflow_id = ? AND run_id = ? ORDER BY started_at, activity_id, attempt",
            (workflow_id, run_id),
        )
        return [self._attempt_from_row(row) for row in rows]

    def _attempt_from_row(self, row: Row) -> AttemptRecord:
        values = dict(zip(_ATTEMPT_COLUMNS, row, strict=True))
        prices = TokenPrices(
            input_per_mtok_usd=Decimal(values.pop("input_per_mtok_usd")),
            cached_input_per_mtok_usd=Decimal(values.pop("cached_input_per_mtok_usd")),
            output_per_mtok_usd=Decimal(values.pop("output_per_mtok_usd")),
        )
        values["started_at"] = self._time_out(values["started_at"])
        values["ended_at"] = self._time_out(values["ended_at"])
        return AttemptRecord.model_validate({**values, "prices": prices})

    def spend_by_tenant(self, since: datetime, until: datetime) -> dict[str, int]:
        """Micro-dollars of the attempts that started in `[since, until)`, by tenant.

        What the schedulers seed and refresh each tenant's daily budget from: the ledger is
        the one place every GPU worker's bills meet.
        """
        _, rows = self._execute(
            "SELECT tenant, SUM(cost_micros) FROM attempts "
            "WHERE started_at >= ? AND started_at < ? GROUP BY tenant",
            (self._time_in(since), self._time_in(until)),
        )
        # PostgreSQL sums BIGINT as NUMERIC (Decimal); int() makes both backends alike.
        return {str(tenant): int(total or 0) for tenant, total in rows}

    def task(self, workflow_id: str, run_id: str) -> TaskBook | None:
        """The task of one workflow run as the ledger books it, or None without a task row.

        Its spend, attempts and wasted spend are summed from its attempt rows now; what the
        task row's writer saw at the close is kept beside them (`TaskBook`).
        """
        with self._lock, self._snapshot():
            _, rows = self._execute(
                f"SELECT {self._task_book_columns('t')} FROM tasks t "
                "WHERE t.workflow_id = ? AND t.run_id = ?",
                (*_WASTED_ATTEMPT_OUTCOMES, workflow_id, run_id),
            )
        return self._task_book(rows[0]) if rows else None

    def tasks_moved(self, closed_since: datetime | None = None) -> list[TaskBook]:
        """Tasks whose ledger spend differs from their spend at the close, oldest close first.

        Rows that arrived or changed after the task closed: a spool replayed, an exact row
        that replaced the workflow's estimate, the attempt of a timed-out run that ended
        after `kvflow ledger reconcile` summed it. The ledger's figure is the one to bill.
        """
        since = "" if closed_since is None else "AND t.closed_at >= ? "
        params: tuple[object, ...] = () if closed_since is None else (self._time_in(closed_since),)
        with self._lock, self._snapshot():
            _, rows = self._execute(
                f"SELECT {self._task_book_columns('t')} FROM tasks t WHERE "
                "t.spend_at_close_micros <> (SELECT COALESCE(SUM(a.cost_micros), 0) "
                "FROM attempts a WHERE a.workflow_id = t.workflow_id AND a.run_id = t.run_id) "
                f"{since}ORDER BY t.closed_at, t.workflow_id, t.run_id",
                (*_WASTED_ATTEMPT_OUTCOMES, *params),
            )
        return [self._task_book(row) for row in rows]

    @staticmethod
    def _task_book_columns(alias: str) -> str:
        """The task row's columns, then its attempts' count, sum and wasted sum (two `?`)."""
        of_task = (
            f"FROM attempts a WHERE a.workflow_id = {alias}.workflow_id "
            f"AND a.run_id = {alias}.run_id"
        )
        stored = ", ".join(f"{alias}.{column}" for column in _TASK_STORED_COLUMNS)
        return (
            f"{stored}, (SELECT COUNT(*) {of_task}), "
            f"(SELECT COALESCE(SUM(a.cost_micros), 0) {of_task}), "
            "(SELECT COALESCE(SUM(CASE WHEN a.outcome IN (?, ?) THEN a.cost_micros ELSE 0 END), "
            f"0) {of_task})"
        )

    def _task_book(self, row: Row) -> TaskBook:
        stored = len(_TASK_STORED_COLUMNS)
        values = dict(zip(_TASK_STORED_COLUMNS, row[:stored], strict=True))
        values["started_at"] = self._time_out(values["started_at"])
        values["closed_at"] = self._time_out(values["closed_at"])
        # Stored for every row (the chain's key); a record names it only for a later run.
        values["chain_run_id"] = chain_run_id(str(values["run_id"]), values["chain_run_id"])
        # PostgreSQL sums BIGINT as NUMERIC (Decimal); int() makes both backends alike.
        attempts, spend, wasted = (int(value) for value in row[stored:])
        return TaskBook.model_validate(
            {**values, "attempts": attempts, "spend_micros": spend, "wasted_micros": wasted}
        )

    def tasks_missing(self, keys: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        """Those `(workflow_id, run_id)` keys that have no task row, in the order given."""
        wanted = list(dict.fromkeys(keys))
        present: set[tuple[str, str]] = set()
        workflow_ids = sorted({workflow_id for workflow_id, _ in wanted})
        for start in range(0, len(workflow_ids), _KEY_CHUNK):
            chunk = workflow_ids[start : start + _KEY_CHUNK]
            _, rows = self._execute(
                "SELECT workflow_id, run_id FROM tasks "
                f"WHERE workflow_id IN ({', '.join('?' for _ in chunk)})",
                chunk,
            )
            present.update((str(w), str(r)) for w, r in rows)
        return [key for key in wanted if key not in present]

    def _rows_by_chain(
        self, select: str, chains: Iterable[str], outcome: str, *, suffix: str = ""
    ) -> list[Row]:
        """`select ... IN (chains)` with `outcome` as its first parameter, by chunks."""
        wanted = sorted(chains)
        found: list[Row] = []
        for start in range(0, len(wanted), _KEY_CHUNK):
            chunk = wanted[start : start + _KEY_CHUNK]
            marks = ", ".join("?" for _ in chunk)
            _, rows = self._execute(f"{select} ({marks}) {suffix}", (outcome, *chunk))
            found.extend(rows)
        return found

    def report(self, query: ReportQuery) -> Report:
        """Compute the report for `query` (definitions in `kvflow.ledger.report`)."""
        task_filter, params = self._filter(query, "t.closed_at", "t.tenant")
        # Attempts with no task row yet are counted by when they started.
        unclosed_filter, unclosed_params = self._filter(query, "a.started_at", "a.tenant")
        # One snapshot: rows written meanwhile cannot make the three reads disagree.
        with self._lock, self._read_snapshot():
            _, task_rows = self._execute(
                "SELECT t.workflow_id, t.run_id, t.tenant, t.workflow_type, t.closed_at, "
                f"t.outcome, t.spend_at_close_micros, t.chain_run_id FROM tasks t "
                f"WHERE {task_filter}",
                params,
            )
            # Tasks that continued as new (see `kvflow.ledger.report`): how the chains of the
            # continued runs in range ended, in range or not, and what the earlier runs of the
            # chains whose last run is in range spent. Looked up by the chains the rows name,
            # so a ledger without such tasks reads nothing more.
            continued = TaskOutcome.CONTINUED_AS_NEW.value
            open_chains = {str(r[7]) for r in task_rows if r[5] == continued and r[7]}
            # A last run that is not its chain's first has earlier runs.
            ended_chains = {
                str(r[7]) for r in task_rows if r[5] != continued and r[7] not in (None, r[1])
            }
            chain_ends = self._rows_by_chain(
                "SELECT chain_run_id, run_id, closed_at, outcome FROM tasks "
                "WHERE outcome <> ? AND chain_run_id IN",
                open_chains | ended_chains,
                continued,
            )
            earlier_rows = self._rows_by_chain(
                "SELECT c.chain_run_id, c.closed_at, a.model, a.pool, SUM(a.cost_micros) "
                "FROM attempts a "
                "JOIN tasks c ON a.workflow_id = c.workflow_id AND a.run_id = c.run_id "
                "WHERE c.outcome = ? AND c.chain_run_id IN",
                ended_chains,
                continued,
                suffix="GROUP BY c.chain_run_id, c.run_id, c.closed_at, a.model, a.pool",
            )
            _, attempt_rows = self._execute(
                "SELECT a.workflow_id, a.run_id, a.model, a.pool, COUNT(*), SUM(a.cost_micros), "
                "SUM(CASE WHEN a.outcome IN (?, ?) THEN a.cost_micros ELSE 0 END), "
                "SUM(a.prompt_tokens), SUM(a.cached_tokens), SUM(a.reused_tokens) "
                "FROM attempts a JOIN tasks t "
                f"ON a.workflow_id = t.workflow_id AND a.run_id = t.run_id WHERE {task_filter} "
                "GROUP BY a.workflow_id, a.run_id, a.model, a.pool",
                (*_WASTED_ATTEMPT_OUTCOMES, *params),
            )
            _, unclosed = self._execute(
                "SELECT COUNT(*), SUM(a.cost_micros) FROM attempts a LEFT JOIN tasks t "
                "ON a.workflow_id = t.workflow_id AND a.run_id = t.run_id "
                f"WHERE t.workflow_id IS NULL AND {unclosed_filter}",
                unclosed_params,
            )
        ends = ChainEnds(
            (str(chain), str(run), self._time_out(closed), TaskOutcome(outcome))
            for chain, run, closed, outcome in chain_ends
        )
        earlier: dict[str, list[SpendSlice]] = defaultdict(list)
        for chain, closed, model, pool, spend in earlier_rows:
            end = ends.end_of(str(chain), self._time_out(closed))
            if end is not None:
                earlier[end[0]].append(SpendSlice(str(model), str(pool), int(spend)))
        tasks = []
        for r in task_rows:
            outcome = TaskOutcome(r[5])
            closed_at = self._time_out(r[4])
            end = None if outcome.final else ends.end_of(str(r[7] or r[1]), closed_at)
            tasks.append(
                TaskFacts(
                    workflow_id=str(r[0]),
                    run_id=str(r[1]),
                    tenant=str(r[2]),
                    workflow_type=str(r[3]),
                    closed_at=closed_at,
                    outcome=outcome,
                    spend_at_close_micros=int(r[6]),
                    chain_outcome=None if end is None else end[1],
                    earlier_spend=tuple(earlier.get(str(r[1]), ())) if outcome.final else (),
                )
            )
        # PostgreSQL sums BIGINT as NUMERIC (Decimal); int() makes both backends alike.
        attempts = [
            AttemptTotals(
                workflow_id=str(r[0]),
                run_id=str(r[1]),
                model=str(r[2]),
                pool=str(r[3]),
                attempts=int(r[4]),
                spend_micros=int(r[5]),
                wasted_micros=int(r[6]),
                prompt_tokens=int(r[7]),
                cached_tokens=int(r[8]),
                reused_tokens=int(r[9]),
            )
            for r in attempt_rows
        ]
        unclosed_count, unclosed_spend = unclosed[0]
        return build_report(
            query,
            tasks,
            attempts,
            unclosed_attempts=int(unclosed_count),
            unclosed_spend_micros=int(unclosed_spend or 0),
        )

    def report_and_attempt_sums(self, query: ReportQuery) -> tuple[Report, list[AttemptSums]]:
        """The report of `query` and the attempts of the tasks it counts, summed, in one snapshot.

        What the FOCUS export reads: one statement for the attempts whatever the number of
        tasks, and rows written meanwhile cannot make the file and the report disagree.
        """
        task_filter, params = self._filter(query, "t.closed_at", "t.tenant")
        keys = (
            "a.workflow_id, a.run_id, a.pool, a.model, a.outcome, a.input_per_mtok_usd, "
            "a.cached_input_per_mtok_usd, a.output_per_mtok_usd"
        )
        with self._lock, self._read_snapshot():
            report = self.report(query)
            _, rows = self._execute(
                f"SELECT {keys}, SUM(a.prompt_tokens - a.cached_tokens), SUM(a.cached_tokens), "
                "SUM(a.completion_tokens), SUM(a.cost_micros) FROM attempts a JOIN tasks t "
                f"ON a.workflow_id = t.workflow_id AND a.run_id = t.run_id WHERE {task_filter} "
                f"GROUP BY {keys}",
                params,
            )
        # One TokenPrices per price list, not per row: a ledger has few.
        prices: dict[tuple[object, ...], TokenPrices] = {}
        sums = []
        for row in rows:
            listed = tuple(row[5:8])
            if listed not in prices:
                inp, cached, out = (Decimal(str(price)) for price in listed)
                prices[listed] = TokenPrices(
                    input_per_mtok_usd=inp,
                    cached_input_per_mtok_usd=cached,
                    output_per_mtok_usd=out,
                )
            # PostgreSQL sums BIGINT as NUMERIC (Decimal); int() makes both backends alike.
            sums.append(
                AttemptSums(
                    workflow_id=str(row[0]),
                    run_id=str(row[1]),
                    pool=str(row[2]),
                    model=str(row[3]),
                    outcome=AttemptOutcome(row[4]),
                    prices=prices[listed],
                    input_tokens=int(row[8]),
                    cached_tokens=int(row[9]),
                    completion_tokens=int(row[10]),
                    cost_micros=int(row[11]),
                )
            )
        return report, sums

    @contextmanager
    def _read_snapshot(self) -> Iterator[None]:
        """`_snapshot`, or the one already open: a read inside another joins its snapshot."""
        with self._lock:
            if self._snapshot_open:
                yield
                return
            with self._snapshot():
                self._snapshot_open = True
                try:
                    yield
                finally:
                    self._snapshot_open = False

    def _filter(
        self, query: ReportQuery, time_column: str, tenant_column: str
    ) -> tuple[str, list[object]]:
        """A WHERE condition for the query's range and tenant, with its parameters."""
        clauses = ["1 = 1"]
        params: list[object] = []
        if query.since is not None:
            clauses.append(f"{time_column} >= ?")
            params.append(self._time_in(query.since))
        if query.until is not None:
            clauses.append(f"{time_column} < ?")
            params.append(self._time_in(query.until))
        if query.tenant is not None:
            clauses.append(f"{tenant_column} = ?")
            params.append(query.tenant)
        return " AND ".join(clauses), params

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def connect_ledger(
    url: str | None = None, *, create: bool = False, meter: Meter | None = None
) -> Ledger:
    """Connect to the ledger at `url` without checking its schema (for `migrate` and tools).

    With `create=True` a missing SQLite file (and its folder) is created; otherwise a missing
    file raises `LedgerNotFound`. Prefer `open_ledger`, which also checks the schema.
    """
    url = url or default_ledger_url()
    scheme = urlsplit(url).scheme.lower()
    if scheme == "sqlite":
        from kvflow.ledger.sqlite import SqliteLedger

        return SqliteLedger(url, sqlite_path(url), create=create, meter=meter)
    if scheme in {"postgresql", "postgres"}:
        # psycopg is the optional `postgres` extra: import it only for PostgreSQL URLs.
        try:
            from kvflow.ledger.postgres import PostgresLedger
        except ImportError:
            raise LedgerUrlError(
                f"{redact_url(url)} needs the PostgreSQL driver: pip install 'kvflow[postgres]'"
            ) from None
        conninfo, schema = postgres_conninfo(encode_password(url))
        return PostgresLedger(url, conninfo, schema=schema, meter=meter)
    raise LedgerUrlError(
        f"unsupported ledger URL {redact_url(url)!r}; use sqlite:///path/to/ledger.db or "
        "postgresql://user@host:5432/db"
    )


def open_ledger(
    url: str | None = None, *, migrate: bool = False, meter: Meter | None = None
) -> Ledger:
    """Open the ledger at `url` (default: `default_ledger_url()`).

    URLs: `sqlite:///relative/path.db`, `sqlite:////absolute/path.db`, or
    `postgresql://user[:password]@host:port/db`, optionally with `?schema=NAME` (the PostgreSQL
    schema to use; libpq parameters such as `options=-csearch_path%3DNAME` work as well).

    With `migrate=True` the database (a SQLite file and its folder, a PostgreSQL schema) is
    created if needed and pending migrations are applied: what a worker of the embedded stack
    wants. Without it the database must exist with the current schema, else
    `LedgerNotFound` / `LedgerSchemaError` say how to create or migrate it: what a report wants.
    `meter` receives the spend and task counters (default: the global `MeterProvider`).
    """
    ledger = connect_ledger(url, create=migrate, meter=meter)
    try:
        if migrate:
            ledger.migrate()
        else:
            ledger.check_schema()
    except BaseException:
        ledger.close()
        raise
    return ledger


def sqlite_path(url: str) -> str:
    """The file of a `sqlite:///path` URL (`sqlite:////abs/path` for an absolute path)."""
    prefix = "sqlite:///"
    if not url.lower().startswith(prefix) or len(url) == len(prefix):
        raise LedgerUrlError(
            f"bad SQLite ledger URL {redact_url(url)!r}; write sqlite:///relative/path.db or "
            "sqlite:////absolute/path.db"
        )
    return url[len(prefix) :]


def postgres_conninfo(url: str) -> tuple[str, str | None]:
    """Split the `schema` parameter off a PostgreSQL URL: (libpq URL, schema or None)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    schemas = [value for name, value in query if name == "schema"]
    rest = [(name, value) for name, value in query if name != "schema"]
    if schemas and not schemas[-1]:
        raise LedgerUrlError(f"{redact_url(url)}: the schema parameter is empty")
    return urlunsplit(parts._replace(query=urlencode(rest))), (schemas[-1] if schemas else None)


class AsyncLedger:
    """A `Ledger` for async code: each call runs in a worker thread (`asyncio.to_thread`)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        """The synchronous ledger underneath."""

    async def record_attempt(self, record: AttemptRecord) -> bool:
        """See `Ledger.record_attempt`."""
        return await asyncio.to_thread(self.ledger.record_attempt, record)

    async def record_task(self, record: TaskRecord) -> bool:
        """See `Ledger.record_task`."""
        return await asyncio.to_thread(self.ledger.record_task, record)

    async def attempts_for(self, workflow_id: str, run_id: str) -> list[AttemptRecord]:
        """See `Ledger.attempts_for`."""
        return await asyncio.to_thread(self.ledger.attempts_for, workflow_id, run_id)

    async def mark_resumed(self, workflow_id: str, run_id: str, activity_ids: Sequence[str]) -> int:
        """See `Ledger.mark_resumed`."""
        return await asyncio.to_thread(
            self.ledger.mark_resumed, workflow_id, run_id, list(activity_ids)
        )

    async def spend_by_tenant(self, since: datetime, until: datetime) -> dict[str, int]:
        """See `Ledger.spend_by_tenant`."""
        return await asyncio.to_thread(self.ledger.spend_by_tenant, since, until)

    async def task(self, workflow_id: str, run_id: str) -> TaskBook | None:
        """See `Ledger.task`."""
        return await asyncio.to_thread(self.ledger.task, workflow_id, run_id)

    async def tasks_moved(self, closed_since: datetime | None = None) -> list[TaskBook]:
        """See `Ledger.tasks_moved`."""
        return await asyncio.to_thread(self.ledger.tasks_moved, closed_since)

    async def tasks_missing(self, keys: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        """See `Ledger.tasks_missing`."""
        return await asyncio.to_thread(self.ledger.tasks_missing, list(keys))

    async def report(self, query: ReportQuery) -> Report:
        """See `Ledger.report`."""
        return await asyncio.to_thread(self.ledger.report, query)

    async def migrate(self, to_version: int | None = None) -> list[int]:
        """See `Ledger.migrate`."""
        return await asyncio.to_thread(self.ledger.migrate, to_version)

    async def close(self) -> None:
        """See `Ledger.close`."""
        await asyncio.to_thread(self.ledger.close)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


async def open_async_ledger(
    url: str | None = None, *, migrate: bool = False, meter: Meter | None = None
) -> AsyncLedger:
    """`open_ledger` for async code, without blocking the event loop while it connects."""
    ledger = await asyncio.to_thread(open_ledger, url, migrate=migrate, meter=meter)
    return AsyncLedger(ledger)

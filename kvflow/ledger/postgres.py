"""The production ledger: PostgreSQL through psycopg 3.

One autocommit connection; each write is an `INSERT ... ON CONFLICT DO NOTHING`, so
concurrent writers of the same key never fail and exactly one of them writes the row (an
attempt's runs in a short transaction with the update of its task row, if any). Migrations
take a transaction-scoped advisory lock so that workers starting together apply them once. A
connection the server dropped (restart, failover) is reopened and the statement run again,
which is safe because every statement the ledger runs outside a transaction is idempotent; a
connection lost inside a transaction raises `LedgerUnavailable`, and the caller's retry runs
the whole write again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import psycopg
from opentelemetry.metrics import Meter
from psycopg import pq, sql

from kvflow.ledger.errors import LedgerError, LedgerNotFound, LedgerUnavailable
from kvflow.ledger.records import utc
from kvflow.ledger.store import Ledger, Row
from kvflow.scheduler.redact import encode_password, scrub_secrets

log = logging.getLogger(__name__)

# Arbitrary but fixed: every kvflow process agrees on it ("kvflow" in ASCII).
_MIGRATION_LOCK_KEY = 0x6B76666C6F77
_SCHEMA_LOCK_KEY = "kvflow-create-schema:"
"""Prefix of the advisory lock every kvflow process takes to create a schema (with its name)."""
CONNECT_TIMEOUT_S = 10
APPLICATION_NAME = "kvflow-ledger"
"""How the ledger's sessions appear in `pg_stat_activity`."""


def create_schema(conn: psycopg.Connection[tuple[Any, ...]], schema: str) -> None:
    """Create `schema` unless it exists, in `conn`'s open transaction.

    Two sessions running `CREATE SCHEMA IF NOT EXISTS` together both find it absent and the
    second fails on `pg_namespace`'s unique index: every kvflow store (the ledger, the context
    store) creates a schema under this one lock per schema name, held to the commit.
    """
    conn.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (_SCHEMA_LOCK_KEY + schema,)
    )
    conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))


class PostgresLedger(Ledger):
    """A ledger in a PostgreSQL database, optionally in its own schema."""

    _timestamp_type = "TIMESTAMPTZ"
    _decimal_type = "NUMERIC"

    def __init__(
        self, url: str, conninfo: str, *, schema: str | None = None, meter: Meter | None = None
    ) -> None:
        super().__init__(url, meter)
        # A password written unencoded (`S3cr%t!pw`, `a/b#c`) is encoded as libpq reads URLs,
        # so that libpq neither refuses it nor connects elsewhere, quoting it in its error.
        self._conninfo = encode_password(conninfo)
        self._secret_urls = (url, conninfo)
        """What to scrub from a driver's message: libpq quotes parts of the URL it was given."""
        self.schema = schema
        """The schema the tables live in (None: the connection's search_path)."""
        with self._driver_errors():
            self._conn = self._connect()

    def _connect(self) -> psycopg.Connection[tuple[Any, ...]]:
        try:
            conn = psycopg.connect(
                self._conninfo,
                autocommit=True,
                connect_timeout=CONNECT_TIMEOUT_S,
                application_name=APPLICATION_NAME,
            )
        except psycopg.OperationalError as exc:
            message = self._scrubbed(exc)
            if "does not exist" in message:
                raise LedgerNotFound(
                    f"cannot open the ledger at {self.url}: {message}; create the database "
                    f"(createdb), then `kvflow ledger migrate --db {self.url}`"
                ) from None
            raise LedgerUnavailable(
                f"cannot connect to the ledger at {self.url}: {message}"
            ) from None
        if self.schema is not None:
            try:
                conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self.schema)))
            except psycopg.Error:
                conn.close()
                raise
        return conn

    def _live_connection(self) -> psycopg.Connection[tuple[Any, ...]]:
        # A server restart breaks the connection; the next call reconnects instead of failing.
        if self._conn.broken or self._conn.closed:
            self._conn = self._connect()
        return self._conn

    @contextmanager
    def _driver_errors(self) -> Iterator[None]:
        try:
            yield
        except psycopg.OperationalError as exc:
            raise LedgerUnavailable(f"ledger {self.url}: {self._scrubbed(exc)}") from None
        except psycopg.Error as exc:
            raise LedgerError(f"ledger {self.url}: {self._scrubbed(exc)}") from None

    def _scrubbed(self, exc: psycopg.Error) -> str:
        """The driver's message without the ledger URL's password, in any form."""
        return scrub_secrets(str(exc).strip(), *self._secret_urls)

    def _execute(self, sql_text: str, params: Sequence[object] = ()) -> tuple[int, list[Row]]:
        # The shared SQL uses `?`; none of it contains a literal `?` or `%`.
        statement, values = sql_text.replace("?", "%s"), tuple(params)
        with self._lock, self._driver_errors():
            conn = self._live_connection()
            outside_transaction = conn.info.transaction_status == pq.TransactionStatus.IDLE
            try:
                cursor = conn.execute(statement, values)
            except psycopg.OperationalError:
                # The server dropped the session (restart, failover). Every statement is
                # idempotent, so outside a transaction it is safe to run it once more.
                if not (conn.broken and outside_transaction):
                    raise
                log.warning("ledger %s: connection lost; reconnecting", self.url)
                cursor = self._live_connection().execute(statement, values)
            rows = cursor.fetchall() if cursor.description is not None else []
            return cursor.rowcount, rows

    @contextmanager
    def _migration_transaction(self) -> Iterator[None]:
        with self._lock, self._driver_errors():
            conn = self._live_connection()
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK_KEY,))
                if self.schema is not None:
                    create_schema(conn, self.schema)
                yield

    @contextmanager
    def _write_transaction(self) -> Iterator[None]:
        with self._lock:
            # Run as a statement, so that a session the server dropped while idle is reopened
            # (nothing has run yet). A connection lost later raises LedgerUnavailable, and the
            # caller runs the whole write again: each write is idempotent as a whole.
            self._execute("BEGIN")
            try:
                yield
                self._execute("COMMIT")
            except BaseException:
                conn = self._conn
                if not conn.broken and conn.info.transaction_status != pq.TransactionStatus.IDLE:
                    try:
                        conn.execute("ROLLBACK")
                    except psycopg.Error:
                        # The error that got us here is the one to report; a session this
                        # broken is reopened by the next call.
                        log.warning("ledger %s: rollback failed", self.url, exc_info=True)
                raise

    def _serialize_task(self, workflow_id: str, run_id: str) -> None:
        # Concurrent transactions see each other's rows only once committed: a transaction
        # lock per task orders an attempt row and a resumed mark written at the same moment.
        self._execute(
            "SELECT pg_advisory_xact_lock(hashtextextended(?, 0))", (f"{workflow_id}/{run_id}",)
        )

    @contextmanager
    def _snapshot(self) -> Iterator[None]:
        with self._lock, self._driver_errors():
            conn = self._live_connection()
            with conn.transaction():
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                yield

    def _schema_version_or_none(self) -> int | None:
        _, rows = self._execute("SELECT to_regclass('schema_version') IS NOT NULL")
        if not rows[0][0]:
            return None
        _, rows = self._execute("SELECT MAX(version) FROM schema_version")
        return int(rows[0][0] or 0)

    def _time_in(self, moment: datetime) -> object:
        return utc(moment)

    def _time_out(self, value: Any) -> datetime:
        if not isinstance(value, datetime):
            raise LedgerError(f"ledger {self.url}: expected a timestamp, got {value!r}")
        return value.astimezone(UTC)

    def _decimal_in(self, amount: Decimal) -> object:
        return amount

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with self._lock:
            self._conn.close()

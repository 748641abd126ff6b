"""The context store in PostgreSQL (kvflow's ledger database, or any other), through psycopg 3.

One table, `kvflow_context` unless the URL says `table=NAME`, in the connection's schema or in
`schema=NAME` (created if missing):

    space    TEXT         tenants/<tenant>, shared, payloads/<scope> or payloads
    digest   TEXT         the SHA-256 of the content
    data     BYTEA        the content
    used_at  TIMESTAMPTZ  when it was last stored or read (to `renew_after`); prune's key

The primary key is (space, digest) and `used_at` is indexed, so a read is one index lookup and
a prune one range delete. The table is created when the store opens, under a transaction-
scoped advisory lock so that workers starting together create it once, and its schema under
the lock the ledger takes for that schema (`kvflow.ledger.postgres.create_schema`), so that
the two may create one schema together; a database user that may not create tables can use a
table an administrator made with the same columns.

Every statement is idempotent (`INSERT ... ON CONFLICT`, `UPDATE ... WHERE used_at < ...`,
`DELETE`), so one run on a connection the server dropped (restart, failover) is run once more
on a new connection. Connections are kept for reuse, a few at most, so that threads of the
async methods do not wait on one another.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg
from psycopg import sql

from kvflow.activities.context_store import Clock, ContextStoreUnavailable, ContextStoreUrlError
from kvflow.activities.context_stores.base import RENEW_AFTER, SharedContextStore
from kvflow.ledger.postgres import create_schema
from kvflow.scheduler.redact import encode_password, redact_url, scrub_secrets

log = logging.getLogger(__name__)

DEFAULT_TABLE = "kvflow_context"
CONNECT_TIMEOUT_S = 10
APPLICATION_NAME = "kvflow-context"
"""How the store's sessions appear in `pg_stat_activity`."""
MAX_IDLE_CONNECTIONS = 4
# Arbitrary but fixed, and not the ledger's: every kvflow process agrees on it ("kvctxt").
_CREATE_LOCK_KEY = 0x6B7663747874
# The index is named after the table, and PostgreSQL names are at most 63 bytes.
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,54}")

Connection = psycopg.Connection[tuple[Any, ...]]


class PostgresContextStore(SharedContextStore):
    """Contents in one PostgreSQL table; see the module docstring for its columns."""

    def __init__(
        self,
        url: str,
        *,
        clock: Clock = time.time,
        renew_after: timedelta = RENEW_AFTER,
    ) -> None:
        """Open the store at `url`, `postgresql://...[?schema=NAME][&table=NAME]`.

        Other query parameters (`sslmode`, `connect_timeout`, ...) go to libpq as they are.
        The table is created if missing; `ContextStoreUnavailable` if the server cannot be
        reached or refuses, `ContextStoreUrlError` if the URL is malformed.
        """
        super().__init__(clock=clock, renew_after=renew_after)
        self._location = redact_url(url)
        # A password written unencoded (`S3cr%t!pw`) is encoded as libpq reads URLs, so that
        # libpq neither refuses it nor quotes it in its error.
        parts = urlsplit(encode_password(url))
        query = parse_qsl(parts.query, keep_blank_values=True)
        ours = {name: value for name, value in query if name in {"schema", "table"}}
        rest = [(name, value) for name, value in query if name not in ours]
        self._conninfo = urlunsplit(parts._replace(query=urlencode(rest)))
        self._secrets = (url, self._conninfo)
        """What to scrub from a driver's message: libpq quotes parts of the URL it was given."""
        self.schema = ours.get("schema")
        self.table = ours.get("table", DEFAULT_TABLE)
        for kind, name in (("schema", self.schema), ("table", self.table)):
            if name is not None and not _NAME.fullmatch(name):
                raise ContextStoreUrlError(
                    f"{self._location}: the {kind} {name!r} is not a plain name (letters, "
                    "digits and _, at most 55)"
                )
        self._name = (
            sql.Identifier(self.schema, self.table) if self.schema else sql.Identifier(self.table)
        )
        self._idle: list[Connection] = []
        self._idle_lock = threading.Lock()
        self._closed = False
        self._statements()
        try:
            self._create_table()
        except BaseException:
            self.close()
            raise

    @property
    def location(self) -> str:
        """The URL the store was opened with, its password masked."""
        return self._location

    def _statements(self) -> None:
        table = self._name
        self._insert = sql.SQL(
            "INSERT INTO {t} (space, digest, data, used_at) VALUES (%s, %s, %s, %s) "
            # Stored again: renewed, never moved back (another machine's clock may lag).
            "ON CONFLICT (space, digest) DO UPDATE SET used_at = EXCLUDED.used_at "
            "WHERE {t}.used_at < EXCLUDED.used_at"
        ).format(t=table)
        self._select = sql.SQL(
            "SELECT data, used_at FROM {t} WHERE space = %s AND digest = %s"
        ).format(t=table)
        self._renew = sql.SQL(
            "UPDATE {t} SET used_at = %s WHERE space = %s AND digest = %s AND used_at < %s"
        ).format(t=table)
        self._delete = sql.SQL("DELETE FROM {t} WHERE used_at < %s").format(t=table)

    def _create_table(self) -> None:
        """Create the schema, the table and its index unless the table is there."""
        exists = sql.SQL(
            "SELECT 1 FROM pg_catalog.pg_tables "
            "WHERE schemaname = COALESCE(%s, current_schema()) AND tablename = %s"
        )
        with self._driver_errors(), self._connection() as conn:
            if conn.execute(exists, (self.schema, self.table)).fetchone() is not None:
                return
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_CREATE_LOCK_KEY,))
                if self.schema is not None:
                    create_schema(conn, self.schema)  # the ledger may be creating it too
                conn.execute(
                    sql.SQL(
                        "CREATE TABLE IF NOT EXISTS {t} ("
                        "space TEXT NOT NULL, digest TEXT NOT NULL, data BYTEA NOT NULL, "
                        "used_at TIMESTAMPTZ NOT NULL, PRIMARY KEY (space, digest))"
                    ).format(t=self._name)
                )
                conn.execute(
                    sql.SQL("CREATE INDEX IF NOT EXISTS {i} ON {t} (used_at)").format(
                        i=sql.Identifier(f"{self.table}_used_at"), t=self._name
                    )
                )
        log.info("context store %s: created table %s", self._location, self.table)

    def _connect(self) -> Connection:
        try:
            return psycopg.connect(
                self._conninfo,
                autocommit=True,
                connect_timeout=CONNECT_TIMEOUT_S,
                application_name=APPLICATION_NAME,
            )
        except psycopg.OperationalError as exc:
            message = self._scrubbed(exc)
            if "does not exist" in message:
                hint = "create the database (createdb) or name another in the URL"
            else:
                hint = "check the host, the port, the user and that the server is running"
            raise ContextStoreUnavailable(
                f"cannot open the context store {self._location}: {message}; {hint}"
            ) from None

    @contextmanager
    def _connection(self) -> Iterator[Connection]:
        """A connection for one statement (or transaction), kept afterwards for reuse."""
        if self._closed:
            raise ContextStoreUnavailable(f"the context store {self._location} is closed")
        with self._idle_lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None or conn.closed or conn.broken:
            conn = self._connect()
        try:
            yield conn
        finally:
            keep = not (conn.closed or conn.broken or self._closed)
            with self._idle_lock:
                keep = keep and len(self._idle) < MAX_IDLE_CONNECTIONS
                if keep:
                    self._idle.append(conn)
            if not keep:
                conn.close()

    @contextmanager
    def _driver_errors(self) -> Iterator[None]:
        try:
            yield
        except psycopg.Error as exc:
            raise ContextStoreUnavailable(
                f"context store {self._location}: {self._scrubbed(exc)}"
            ) from None

    def _scrubbed(self, exc: psycopg.Error) -> str:
        """The driver's message without the URL's password, in any form."""
        return scrub_secrets(str(exc).strip() or type(exc).__name__, *self._secrets)

    def _execute(
        self, statement: sql.Composed, params: Sequence[object]
    ) -> tuple[int, tuple[Any, ...] | None]:
        """Run one idempotent statement: its row count and first row (None without one)."""
        with self._driver_errors():
            for attempt in (1, 2):
                with self._connection() as conn:
                    try:
                        cursor = conn.execute(statement, params)
                    except psycopg.OperationalError:
                        # A kept connection the server dropped: once more on a new one.
                        if attempt == 2 or not conn.broken:
                            raise
                        log.warning("context store %s: connection lost; again", self._location)
                        continue
                    row = cursor.fetchone() if cursor.description is not None else None
                    return cursor.rowcount, row
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _store(self, space: str, digest: str, data: bytes, now: float) -> None:
        self._execute(self._insert, (space, digest, data, _timestamp(now)))

    def _load(self, space: str, digest: str, now: float) -> bytes | None:
        _, row = self._execute(self._select, (space, digest))
        if row is None:
            return None
        data, used_at = row
        if self._stale(used_at.timestamp(), now):
            stale_before = _timestamp(now - self.renew_after.total_seconds())
            self._execute(self._renew, (_timestamp(now), space, digest, stale_before))
        return bytes(data)

    def _delete_unused_since(self, cutoff: float) -> int:
        removed, _ = self._execute(self._delete, (_timestamp(cutoff),))
        return removed

    def close(self) -> None:
        """Close the kept connections; the store is not used after."""
        self._closed = True
        with self._idle_lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _timestamp(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)

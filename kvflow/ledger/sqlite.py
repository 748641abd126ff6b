"""The embedded ledger: one SQLite file (stdlib `sqlite3`) in WAL mode.

Several processes may write the same file: WAL lets readers run during a write, and the busy
timeout makes a writer wait for the lock instead of failing. Timestamps are stored as ISO-8601
UTC text with microseconds (so text order is time order) and prices as exact decimal text.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from opentelemetry.metrics import Meter

from kvflow.ledger.errors import LedgerError, LedgerNotFound, LedgerUnavailable
from kvflow.ledger.records import utc
from kvflow.ledger.store import Ledger, Row

# How long a writer waits for another process's write lock before giving up.
BUSY_TIMEOUT_S = 30.0


class SqliteLedger(Ledger):
    """A ledger in one SQLite file."""

    _timestamp_type = "TEXT"
    _decimal_type = "TEXT"

    def __init__(
        self, url: str, path: str, *, create: bool = False, meter: Meter | None = None
    ) -> None:
        super().__init__(url, meter)
        self.path = path
        """The database file (`:memory:` for a private in-memory database)."""
        if path == ":memory:":
            target, uri = path, False
        else:
            file = Path(path)
            if create:
                file.parent.mkdir(parents=True, exist_ok=True)
            elif not file.exists():
                relative = "" if file.is_absolute() else " (relative to the working directory)"
                raise LedgerNotFound(
                    f"no ledger database at {file.absolute()}{relative} (from {self.url}); "
                    "create it with "
                    f"`kvflow ledger migrate --db {self.url}`, or point --db or "
                    "KVFLOW_LEDGER_URL at an existing ledger"
                )
            # mode=rw never creates the file, even if it vanished since the check above.
            target, uri = file.absolute().as_uri() + ("?mode=rwc" if create else "?mode=rw"), True
        with self._driver_errors():
            self._conn = sqlite3.connect(
                target,
                uri=uri,
                timeout=BUSY_TIMEOUT_S,
                isolation_level=None,  # autocommit; migrations open their own transaction
                check_same_thread=False,  # calls are serialized by the ledger's lock
            )
        try:
            self._use_wal()
        except LedgerError:
            self._conn.close()
            raise

    def _use_wal(self) -> None:
        """Switch the file to WAL, waiting out other connections that switch it at once.

        The switch needs the file's exclusive lock, and SQLite answers "database is locked"
        at once, without the busy timeout, to a connection that would wait for it while
        holding a read lock another waiter needs: so several workers opening a new ledger
        together failed one of them. Retried until the busy timeout; once one connection has
        switched, the others find WAL already set.
        """
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        pause = 0.005
        while True:
            try:
                with self._driver_errors():
                    self._conn.execute("PRAGMA journal_mode=WAL")
                return
            except LedgerUnavailable as exc:
                locked = "database is locked" in str(exc.__cause__)
                if not locked or time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)
            pause = min(pause * 2, 0.2)

    @contextmanager
    def _driver_errors(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.OperationalError as exc:
            # Locked or busy past the timeout, disk I/O, unable to open: worth retrying.
            raise LedgerUnavailable(f"ledger {self.url}: {exc}") from exc
        except sqlite3.DatabaseError as exc:
            raise LedgerError(f"ledger {self.url}: {exc} (is it a kvflow ledger?)") from exc

    def _execute(self, sql: str, params: Sequence[object] = ()) -> tuple[int, list[Row]]:
        with self._lock, self._driver_errors():
            cursor = self._conn.execute(sql, tuple(params))
            return cursor.rowcount, cursor.fetchall()

    @contextmanager
    def _migration_transaction(self) -> Iterator[None]:
        with self._write_transaction():
            yield

    @contextmanager
    def _write_transaction(self) -> Iterator[None]:
        with self._lock:
            # IMMEDIATE takes the write lock now: concurrent writers (and migrations) run one
            # at a time instead of failing to upgrade a read lock mid-transaction.
            self._execute("BEGIN IMMEDIATE")
            try:
                yield
                self._execute("COMMIT")
            except BaseException:
                # Also after a failed COMMIT: a transaction left open would refuse the next.
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise

    def _serialize_task(self, workflow_id: str, run_id: str) -> None:
        # Nothing to do: BEGIN IMMEDIATE already runs write transactions one at a time.
        return

    @contextmanager
    def _snapshot(self) -> Iterator[None]:
        with self._lock:
            # In WAL mode a read transaction sees one snapshot from its first read to its end.
            self._execute("BEGIN")
            try:
                yield
            finally:
                if self._conn.in_transaction:
                    self._execute("COMMIT")

    def _schema_version_or_none(self) -> int | None:
        _, rows = self._execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
        )
        if not rows:
            return None
        _, rows = self._execute("SELECT MAX(version) FROM schema_version")
        return int(rows[0][0] or 0)

    def _time_in(self, moment: datetime) -> object:
        return utc(moment).strftime("%Y-%m-%dT%H:%M:%S.%f+00:00")

    def _time_out(self, value: Any) -> datetime:
        return datetime.fromisoformat(str(value)).astimezone(UTC)

    def _decimal_in(self, amount: Decimal) -> object:
        return str(amount)

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with self._lock:
            self._conn.close()

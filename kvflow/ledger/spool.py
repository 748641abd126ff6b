"""A durable spool for the attempt rows the ledger could not take at once.

A GPU worker's bill must never vanish: when a write fails (PostgreSQL restarting or failing
over, a SQLite file locked past its busy timeout), `SpooledAttemptWriter` retries it with
exponential backoff for a bounded time, then appends the row to `AttemptSpool`, a SQLite file
on the worker's own disk. The spool is replayed into the ledger when the worker starts, after
every write that succeeds, and every `replay_interval_s` while the worker runs. Attempt rows
are idempotent by key, so a row replayed twice is still one row.

The finished call is never failed for its bookkeeping: the answer is returned, and the row
reaches the ledger once the ledger is back. Failing the call instead would not save the row:
an inference call is not retried on the same queue, and the workflow would bill the attempt
again from its error while the answer it paid for is thrown away.

When the spool itself cannot be written (the worker's disk is full or failing), the row is
kept in memory and retried with every replay, into the ledger first and the spool second.
A row the ledger refuses for good (it answers, but not for this row) is set aside in the spool
with the reason, logged at CRITICAL, and tried again when the worker restarts: it never stops
the rows behind it. Only a row still held when the worker stops, with neither the ledger nor
the disk back, is lost; it is logged at CRITICAL with its key and cost, and the workflow's
estimate from the attempt's last heartbeat (if its completion was lost too) stands in for it.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Protocol, Self

from kvflow.ledger.errors import LedgerError, LedgerUnavailable
from kvflow.ledger.records import AttemptRecord

log = logging.getLogger(__name__)

DEFAULT_SPOOL_DIR = Path(".kvflow/spool")
"""Where a GPU worker keeps its spool unless told otherwise (one file per replica)."""


class AttemptTarget(Protocol):
    """Where attempt rows go (`AsyncLedger` is one)."""

    async def record_attempt(self, record: AttemptRecord) -> bool:
        """Store the attempt; idempotent on (workflow, run, activity, attempt)."""
        ...


class AttemptSpool:
    """Attempt rows waiting for the ledger, in a local SQLite file (WAL, one row per key)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        # FULL: a row the worker was told is spooled survives a power cut.
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute(
            "CREATE TABLE IF NOT EXISTS spooled (key TEXT PRIMARY KEY, record TEXT NOT NULL, "
            "spooled_at TEXT NOT NULL)"
        )
        # Rows the ledger refused for good (not "unavailable": the row itself), kept aside so
        # that they do not stop the rows behind them, and tried again when the worker starts.
        self._conn.execute(
            "CREATE TABLE IF NOT EXISTS refused (key TEXT PRIMARY KEY, record TEXT NOT NULL, "
            "reason TEXT NOT NULL, refused_at TEXT NOT NULL)"
        )

    @staticmethod
    def _key(record: AttemptRecord) -> str:
        return "\x1f".join(str(part) for part in record.key)

    def add(self, record: AttemptRecord) -> None:
        """Keep `record` until it is replayed (a later row for the same key replaces it)."""
        with self._lock:
            self._conn.execute(
                "INSERT OR REPLACE INTO spooled (key, record, spooled_at) VALUES (?, ?, ?)",
                (self._key(record), record.model_dump_json(), datetime.now(UTC).isoformat()),
            )

    def pending(self, limit: int = 100) -> list[AttemptRecord]:
        """The oldest `limit` spooled rows."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT record FROM spooled ORDER BY spooled_at LIMIT ?", (limit,)
            ).fetchall()
        return [AttemptRecord.model_validate_json(row[0]) for row in rows]

    def refuse(self, record: AttemptRecord, reason: str) -> None:
        """Set `record` aside: the ledger refused it for good (see `requeue_refused`)."""
        key = self._key(record)
        with self._lock, self._conn:
            self._conn.execute(
                "INSERT OR REPLACE INTO refused (key, record, reason, refused_at) "
                "VALUES (?, ?, ?, ?)",
                (key, record.model_dump_json(), reason, datetime.now(UTC).isoformat()),
            )
            self._conn.execute("DELETE FROM spooled WHERE key = ?", (key,))

    def refused(self) -> list[AttemptRecord]:
        """The rows set aside because the ledger refused them."""
        with self._lock:
            rows = self._conn.execute("SELECT record FROM refused ORDER BY refused_at").fetchall()
        return [AttemptRecord.model_validate_json(row[0]) for row in rows]

    def requeue_refused(self) -> int:
        """Put the refused rows back in line (a fixed ledger may take them now)."""
        with self._lock, self._conn:
            self._conn.execute(
                "INSERT OR IGNORE INTO spooled (key, record, spooled_at) "
                "SELECT key, record, refused_at FROM refused"
            )
            count = self._conn.execute("DELETE FROM refused").rowcount
        return int(count)

    def remove(self, record: AttemptRecord) -> None:
        """Forget `record`: the ledger holds it now."""
        with self._lock:
            self._conn.execute("DELETE FROM spooled WHERE key = ?", (self._key(record),))

    def __len__(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM spooled").fetchone()[0])

    def close(self) -> None:
        """Close the file (idempotent)."""
        with self._lock:
            self._conn.close()


class SpooledAttemptWriter:
    """Writes attempt rows to `ledger`; retries, then spools what the ledger will not take.

    `retries` more tries follow a failed write, `backoff_s`, then twice that, and so on up to
    `max_backoff_s` apart: with the defaults a write is given up to about 3.5 s before its row
    is spooled (the inference activity keeps heartbeating meanwhile). Spooled rows are
    replayed after the next write that succeeds and every `replay_interval_s`: a row reaches
    the ledger within about 5 s of its return, when no call comes to replay it sooner.
    """

    def __init__(
        self,
        ledger: AttemptTarget,
        spool: AttemptSpool,
        *,
        retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 2.0,
        replay_interval_s: float = 5.0,
    ) -> None:
        self.ledger = ledger
        self.spool = spool
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.replay_interval_s = replay_interval_s
        self._replaying_task: asyncio.Task[None] | None = None
        self._replaying = asyncio.Lock()
        # Checked on every successful write; a cheap flag instead of a COUNT(*) each time.
        self._maybe_pending = True
        self.held: dict[tuple[str, str, str, int], AttemptRecord] = {}
        """Rows that neither the ledger nor the spool took, by key: retried with every replay."""

    async def record_attempt(self, record: AttemptRecord) -> bool:
        """Write `record`; True if the ledger wrote it now, False if it was there or spooled."""
        for attempt in range(self.retries + 1):
            try:
                written = await self.ledger.record_attempt(record)
            except Exception as exc:
                if attempt == self.retries:
                    break
                delay = min(self.max_backoff_s, self.backoff_s * 2**attempt)
                log.warning(
                    "ledger write of attempt %s failed (%s); retrying in %.1f s",
                    record.key,
                    exc,
                    delay,
                )
                await asyncio.sleep(delay)
            else:
                if self._maybe_pending:
                    await self.replay()
                return written
        await self._spool(record)
        return False

    async def _spool(self, record: AttemptRecord) -> None:
        try:
            await asyncio.to_thread(self.spool.add, record)
        except Exception:
            self.held[record.key] = record
            self._maybe_pending = True
            log.error(
                "neither the ledger nor the spool %s took attempt %s (%d micro-dollars); it is "
                "kept in memory and retried with every replay, and lost only if this worker "
                "stops before either is back",
                self.spool.path,
                record.key,
                record.cost_micros,
                exc_info=True,
            )
            return
        self._maybe_pending = True
        log.warning(
            "ledger unavailable: attempt %s (%d micro-dollars) spooled to %s; it is written "
            "when the ledger is back",
            record.key,
            record.cost_micros,
            self.spool.path,
        )

    async def replay(self) -> int:
        """Move held and spooled rows into the ledger until none is left or a write fails.

        Returns how many reached the ledger. A held row the ledger still refuses is moved to
        the spool if the disk takes it now.
        """
        replayed = 0
        async with self._replaying:
            ledger_up = True
            for key, record in list(self.held.items()):
                if ledger_up:
                    try:
                        await self.ledger.record_attempt(record)
                    except Exception as exc:
                        log.info("held rows stay held, the ledger still fails: %s", exc)
                        ledger_up = False
                    else:
                        del self.held[key]
                        replayed += 1
                        continue
                if await self._spool_held(record):
                    del self.held[key]
            while ledger_up:
                try:
                    batch = await asyncio.to_thread(self.spool.pending)
                except Exception:
                    # The spool's rows are safe on disk or lost with it; either way the next
                    # replay is the one to try.
                    log.warning("could not read the spool %s", self.spool.path, exc_info=True)
                    break
                if not batch:
                    self._maybe_pending = bool(self.held)
                    break
                for record in batch:
                    try:
                        await self.ledger.record_attempt(record)
                    except Exception as exc:
                        if not _refused_for_good(exc):
                            log.info("spool replay stopped, the ledger still fails: %s", exc)
                            return replayed
                        await self._set_aside(record, exc)
                        continue
                    replayed += 1
                    try:
                        await asyncio.to_thread(self.spool.remove, record)
                    except Exception:
                        # Replaying it again later writes nothing twice (idempotent by key).
                        log.warning("could not clear %s from the spool", record.key, exc_info=True)
                        return replayed
        if replayed:
            log.info("replayed %d spooled attempt rows into the ledger", replayed)
        return replayed

    async def _set_aside(self, record: AttemptRecord, exc: Exception) -> None:
        """Keep a row the ledger refused out of the way of the rows behind it."""
        log.critical(
            "the ledger refused attempt %s (%d micro-dollars) for good: %s; it is kept in "
            "the spool %s and tried again when the worker restarts",
            record.key,
            record.cost_micros,
            exc,
            self.spool.path,
        )
        try:
            await asyncio.to_thread(self.spool.refuse, record, str(exc))
        except Exception:
            log.warning("could not set %s aside in the spool", record.key, exc_info=True)

    async def _spool_held(self, record: AttemptRecord) -> bool:
        """Spool a held row; False (quietly: it was logged when held) if the disk still fails."""
        try:
            await asyncio.to_thread(self.spool.add, record)
        except Exception:
            return False
        return True

    async def replay_every(self, interval_s: float) -> None:
        """Replay the spool every `interval_s` seconds, until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            if self._maybe_pending:
                await self.replay()

    async def __aenter__(self) -> Self:
        """Replay what an earlier run of the worker spooled, then keep replaying meanwhile.

        Rows the ledger refused for good before are tried once more: the ledger may have
        been fixed (a migration, a constraint) since.
        """
        await asyncio.to_thread(self.spool.requeue_refused)
        await self.replay()
        self._replaying_task = asyncio.create_task(self.replay_every(self.replay_interval_s))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._replaying_task is not None:
            self._replaying_task.cancel()
            await asyncio.gather(self._replaying_task, return_exceptions=True)
        if self.held:
            # The last chance for rows only this process holds.
            await self.replay()
        for key, record in self.held.items():
            log.critical(
                "attempt %s (%d micro-dollars) is lost: the worker stops and neither the "
                "ledger nor the spool %s took it",
                key,
                record.cost_micros,
                self.spool.path,
            )
        self.spool.close()


def _refused_for_good(exc: Exception) -> bool:
    """Whether the ledger refused the row itself, rather than being unreachable."""
    return isinstance(exc, LedgerError) and not isinstance(exc, LedgerUnavailable)


def spooled_writer(ledger: AttemptTarget, spool_dir: Path, replica: str) -> SpooledAttemptWriter:
    """The writer a GPU worker for `replica` (`pool/index`) bills through.

    Its spool is `spool_dir/attempts-POOL-INDEX.db`: one file per replica, so that a worker
    restarted for the same replica replays what its predecessor could not write.
    """
    path = spool_dir / f"attempts-{replica.replace('/', '-')}.db"
    return SpooledAttemptWriter(ledger, AttemptSpool(path))

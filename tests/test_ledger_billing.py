"""No spend vanishes: exact rows beat estimates, failed writes are spooled, budgets are shared.

Every test runs against SQLite and PostgreSQL (the `ledger_url` fixture).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from temporalio.testing import ActivityEnvironment

from kvflow.activities.context_store import ContextNotFound, DirectoryContextStore
from kvflow.activities.control_plane import ControlPlaneActivities
from kvflow.activities.wire import LostAttempt
from kvflow.ledger import (
    AsyncLedger,
    AttemptOutcome,
    AttemptRecord,
    Ledger,
    LedgerUnavailable,
    TaskOutcome,
    open_ledger,
)
from kvflow.ledger.spool import AttemptSpool, SpooledAttemptWriter
from kvflow.scheduler.fleet import Fleet
from kvflow.scheduler.placement import PlacementRequest, Refusal, RefusalReason
from kvflow.scheduler.redact import redact_url
from kvflow.workers.control_plane import ControlPlane
from tests.fixtures_ledger import attempt_record, task_record
from tests.fleets import one_pool_fleet
from tests.test_ledger_store import _sums
from tests.waiting import eventually

# ---- the GPU worker's exact row wins over the workflow's estimate -----------------------------


def _estimate(exact: AttemptRecord) -> AttemptRecord:
    """What the workflow bills from the last heartbeat when it loses track of the attempt."""
    return exact.model_copy(
        update={
            "outcome": AttemptOutcome.FAILED,
            "completion_tokens": 45,
            "cost_micros": 33,
            "error_type": "TimeoutError",
            "provisional": True,
        }
    )


def test_exact_attempt_row_replaces_the_provisional_estimate_written_first(
    ledger: Ledger, metric_reader: InMemoryMetricReader
) -> None:
    exact = attempt_record(completion_tokens=102)
    assert ledger.record_attempt(_estimate(exact)) is True

    assert ledger.record_attempt(exact) is True
    assert ledger.attempts_for("wf-1", "run-1") == [exact]
    # Replaying either write changes nothing now.
    assert ledger.record_attempt(exact) is False
    assert ledger.record_attempt(_estimate(exact)) is False
    assert ledger.attempts_for("wf-1", "run-1") == [exact]
    # The spend counter ends at the exact bill, not estimate + bill.
    assert sum(_sums(metric_reader, "kvflow.ledger.spend").values()) == exact.cost_micros


def test_provisional_estimate_never_replaces_the_exact_row(ledger: Ledger) -> None:
    exact = attempt_record(completion_tokens=102)
    assert ledger.record_attempt(exact) is True

    assert ledger.record_attempt(_estimate(exact)) is False
    (stored,) = ledger.attempts_for("wf-1", "run-1")
    assert stored == exact and stored.provisional is False


def test_attempt_ending_while_reconcile_sums_is_counted_in_the_reconciled_row(
    ledger: Ledger,
) -> None:
    # A workflow timed out with a call still streaming. Reconcile reads its attempts (one
    # row) and sums them; the call's attempt ends and is written; then reconcile writes.
    first = attempt_record("wf-late", activity_id="1")
    assert ledger.record_attempt(first)
    summed = task_record(
        "wf-late",
        outcome=TaskOutcome.TIMED_OUT,
        attempts=1,
        spend_micros=first.cost_micros,
    ).model_copy(update={"source": "reconcile"})
    streaming = attempt_record("wf-late", activity_id="2", completion_tokens=900)
    assert ledger.record_attempt(streaming)
    assert ledger.record_task(summed)
    task = ledger.task("wf-late", "run-1")
    assert task is not None and task.attempts == 2
    assert task.spend_micros == first.cost_micros + streaming.cost_micros
    # One that ends after the row adds itself to it.
    last = attempt_record("wf-late", activity_id="3", completion_tokens=50)
    assert ledger.record_attempt(last)
    task = ledger.task("wf-late", "run-1")
    assert task is not None and task.attempts == 3
    assert task.spend_micros == sum(a.cost_micros for a in ledger.attempts_for("wf-late", "run-1"))
    # A workflow's own row keeps its own count as its view at the close; the ledger's figure
    # is its attempt rows, which for this run have not arrived.
    own = task_record("wf-own", attempts=1, spend_micros=first.cost_micros)
    assert ledger.record_task(own)
    book = ledger.task("wf-own", "run-1")
    assert book is not None and book.as_written() == own
    assert (book.spend_micros, book.attempts) == (0, 0)
    # Both moved after their close: wf-late by the two attempts reconcile did not sum.
    moved = {t.workflow_id: t.moved_micros for t in ledger.tasks_moved()}
    assert moved == {
        "wf-late": streaming.cost_micros + last.cost_micros,
        "wf-own": -first.cost_micros,
    }


async def test_lost_attempt_activity_writes_an_estimate_the_worker_supersedes(
    ledger_url: str,
) -> None:
    fleet = one_pool_fleet("m")
    ledger = AsyncLedger(open_ledger(ledger_url, migrate=True))
    async with ledger:
        activities = ControlPlaneActivities(
            _NoScheduler(), fleet=fleet, block_size=16, ledger=ledger
        )
        started = datetime.now(UTC)
        lost = LostAttempt(
            workflow_id="wf-1",
            run_id="run-1",
            activity_id="3",
            attempt=1,
            workflow_type="Agent",
            step="draft",
            tenant="acme",
            model="m",
            replica="cpu/0",
            started_at=started,
            ended_at=started + timedelta(seconds=2),
            prompt_tokens=100,
            completion_tokens=45,
            cost_micros=33,
            error_type="TimeoutError",
        )
        assert await ActivityEnvironment().run(activities.record_lost_attempt, lost) is True
        (estimate,) = await ledger.attempts_for("wf-1", "run-1")
        assert estimate.provisional is True

        exact = estimate.model_copy(
            update={
                "outcome": AttemptOutcome.OK,
                "completion_tokens": 102,
                "cost_micros": 68,
                "error_type": None,
                "provisional": False,
            }
        )
        assert await ledger.record_attempt(exact) is True
        assert await ledger.attempts_for("wf-1", "run-1") == [exact]


class _NoScheduler:
    def place(self, request: PlacementRequest) -> Refusal:
        raise AssertionError("not used")

    def observe(self, observation: object) -> None:
        raise AssertionError("not used")

    def settle(self) -> None:
        pass

    def end_task(self, workflow_id: str) -> bool:
        return False


# ---- a failed ledger write is retried, then spooled, never lost ------------------------------


class FlakyLedger:
    """A real ledger that refuses the next `failures` writes, or every write while `down`."""

    def __init__(self, ledger: AsyncLedger, failures: int = 0) -> None:
        self.ledger = ledger
        self.failures = failures
        self.down = False
        self.calls = 0

    async def record_attempt(self, record: AttemptRecord) -> bool:
        self.calls += 1
        if self.down or self.failures > 0:
            self.failures -= 1
            raise LedgerUnavailable(f"ledger {self.ledger.ledger.url}: connection refused")
        return await self.ledger.record_attempt(record)


def _writer(target: FlakyLedger, spool_dir: Path) -> SpooledAttemptWriter:
    spool = AttemptSpool(spool_dir / "attempts-cpu-0.db")
    return SpooledAttemptWriter(target, spool, retries=3, backoff_s=0.01, max_backoff_s=0.05)


async def test_ledger_that_fails_twice_then_succeeds_gets_the_row(
    ledger_url: str, tmp_path: Path
) -> None:
    async with AsyncLedger(open_ledger(ledger_url, migrate=True)) as ledger:
        flaky = FlakyLedger(ledger, failures=2)
        async with _writer(flaky, tmp_path) as writer:
            assert await writer.record_attempt(attempt_record()) is True
            assert flaky.calls == 3
            assert len(writer.spool) == 0
        assert await ledger.attempts_for("wf-1", "run-1") == [attempt_record()]


async def test_row_of_a_ledger_down_for_the_whole_attempt_appears_when_it_is_back(
    ledger_url: str, tmp_path: Path
) -> None:
    async with AsyncLedger(open_ledger(ledger_url, migrate=True)) as ledger:
        flaky = FlakyLedger(ledger)
        flaky.down = True
        lost_then_found = attempt_record(activity_id="1")
        async with _writer(flaky, tmp_path) as writer:
            assert await writer.record_attempt(lost_then_found) is False
            assert len(writer.spool) == 1
        assert await ledger.attempts_for("wf-1", "run-1") == []

        # The worker restarts (same replica, same spool) after the ledger is back.
        flaky.down = False
        async with _writer(flaky, tmp_path) as restarted:
            assert await ledger.attempts_for("wf-1", "run-1") == [lost_then_found]
            assert len(restarted.spool) == 0

            # And without a restart: the next successful write replays what was spooled.
            flaky.down = True
            spooled = attempt_record(activity_id="2")
            assert await restarted.record_attempt(spooled) is False
            flaky.down = False
            await restarted.record_attempt(attempt_record(activity_id="3"))
            assert {a.activity_id for a in await ledger.attempts_for("wf-1", "run-1")} == {
                "1",
                "2",
                "3",
            }
            assert len(restarted.spool) == 0


# ---- tenant daily budgets come from the shared ledger ----------------------------------------


def _budget_fleet() -> Fleet:
    fleet = one_pool_fleet("m").model_dump()
    fleet["tenants"] = [{"name": "acme", "tier": 2, "daily_budget_usd": "0.01"}]
    return Fleet.model_validate(fleet)


def _request() -> PlacementRequest:
    return PlacementRequest(model="m", prompt_tokens=100, max_output_tokens=10, tenant="acme")


NOON = datetime(2031, 3, 14, 12, tzinfo=UTC)
"""The day the budget test runs on, whatever the time of day it really runs at."""


def _noon_clock() -> Callable[[], float]:
    """A clock that starts at `NOON` and runs at the speed of real time."""
    started = time.monotonic()
    return lambda: NOON.timestamp() + time.monotonic() - started


def _spend_today(micros: int, activity_id: str) -> AttemptRecord:
    record = attempt_record(activity_id=activity_id, started_at=NOON - timedelta(seconds=5))
    return record.model_copy(update={"cost_micros": micros})


@pytest.mark.timeout(60)
async def test_tenant_budget_holds_across_a_restart_and_two_control_planes(
    ledger_url: str,
) -> None:
    fleet = _budget_fleet()
    endpoints = {"cpu/0": "http://127.0.0.1:9"}  # up as far as placement is concerned
    clock = _noon_clock()
    async with AsyncLedger(open_ledger(ledger_url, migrate=True)) as ledger:
        # Yesterday's spend does not count against today.
        yesterday = attempt_record(activity_id="0", started_at=NOON - timedelta(1))
        await ledger.record_attempt(yesterday.model_copy(update={"cost_micros": 50_000}))
        first = ControlPlane(
            fleet, endpoints=endpoints, ledger=ledger, spend_refresh_s=0.1, clock=clock
        )
        second = ControlPlane(
            fleet, endpoints=endpoints, ledger=ledger, spend_refresh_s=0.1, clock=clock
        )
        first.scraper.scrape_once = _no_scrape  # type: ignore[method-assign,assignment]
        second.scraper.scrape_once = _no_scrape  # type: ignore[method-assign,assignment]
        async with first, second:
            assert not isinstance(first.scheduler.place(_request()), Refusal)
            # GPU workers bill $0.006 of acme's calls placed by one, then $0.006 by the other.
            await ledger.record_attempt(_spend_today(6_000, "1"))
            await ledger.record_attempt(_spend_today(6_000, "2"))
            await eventually(
                lambda: all(
                    c.scheduler.tenant_spend_today("acme") == 12_000 for c in (first, second)
                ),
                within=10,
                what="both control planes' background refreshes read acme's $0.012 of today",
            )
            for control in (first, second):
                refusal = control.scheduler.place(_request())
                assert isinstance(refusal, Refusal)
                assert refusal.reason is RefusalReason.TENANT_OVER_QUOTA

        # A restarted control plane knows the day's spend before its first placement.
        restarted = ControlPlane(fleet, endpoints=endpoints, ledger=ledger, clock=clock)
        restarted.scraper.scrape_once = _no_scrape  # type: ignore[method-assign,assignment]
        async with restarted:
            refusal = restarted.scheduler.place(_request())
            assert isinstance(refusal, Refusal)
            assert refusal.reason is RefusalReason.TENANT_OVER_QUOTA


async def _no_scrape() -> None:
    """The test's replica URL serves nothing; placement needs no metrics."""


# ---- secrets and tenants ---------------------------------------------------------------------


def test_passwords_in_query_parameters_and_libpq_strings_are_redacted() -> None:
    assert redact_url("postgresql://u@h/db?password=s3cret&sslmode=require") == (
        "postgresql://u@h/db?password=***&sslmode=require"
    )
    assert redact_url("postgresql://u:s3cret@h/db?PASSWORD=s3cret") == (
        "postgresql://u:***@h/db?PASSWORD=***"
    )
    assert redact_url("host=h user=u password='se cr\\'et' dbname=d") == (
        "host=h user=u password=*** dbname=d"
    )
    assert redact_url("host=h sslpassword=k3y password = pw") == (
        "host=h sslpassword=*** password = ***"
    )
    assert redact_url("postgresql://u@h/db?schema=s1") == "postgresql://u@h/db?schema=s1"
    # Endpoint URLs: API keys and tokens too, but not a key file's path (libpq `sslkey`).
    assert redact_url("https://vllm.example/v1?api_key=k3y&x=1") == (
        "https://vllm.example/v1?api_key=***&x=1"
    )
    assert redact_url("http://h/?access_token=t0k") == "http://h/?access_token=***"
    assert redact_url("host=h sslkey=/etc/k.pem") == "host=h sslkey=/etc/k.pem"


def test_password_in_the_query_stays_out_of_ledger_errors() -> None:
    url = "postgresql://postgres@127.0.0.1:1/test?password=s3cret&connect_timeout=1"
    with pytest.raises(LedgerUnavailable) as error:
        open_ledger(url)
    assert "s3cret" not in str(error.value)


def test_context_stored_for_one_tenant_does_not_resolve_for_another(tmp_path: Path) -> None:
    store = DirectoryContextStore(tmp_path)
    ref = store.put("acme's plan " * 300, tenant="acme")
    assert ref.tenant == "acme"
    assert store.get(ref, tenant="acme").startswith("acme's plan")
    with pytest.raises(ContextNotFound, match="another tenant"):
        store.get(ref, tenant="globex")
    # A digest seen in a history does not open it either: the shared namespace lacks it.
    with pytest.raises(ContextNotFound):
        store.get(ref.model_copy(update={"tenant": None}), tenant="globex")
    with pytest.raises(ContextNotFound):
        store.get(ref.model_copy(update={"tenant": "globex"}), tenant="globex")


def test_prune_deletes_contents_unused_for_longer_than_asked(tmp_path: Path) -> None:
    store = DirectoryContextStore(tmp_path)
    old = store.put("old " * 1000, tenant="acme")
    used = store.put("used " * 1000)
    now = datetime.now(UTC).timestamp()
    assert store.prune(timedelta(hours=1), now=now) == 0
    # Two hours later; `used` was read in between, `old` was not.
    later = now + 2 * 3600
    path = next(p for p in tmp_path.rglob(used.digest))
    os.utime(path, (later, later))
    assert store.prune(timedelta(hours=1), now=later) == 1
    with pytest.raises(ContextNotFound):
        store.get(old)
    assert store.get(used).startswith("used")

"""A tenant's daily budget starts afresh at midnight UTC, even when a ledger read spans it.

The control plane reads each tenant's spend today from the shared ledger (at start-up and in
the background). A read that begins at 23:59:59 and returns after midnight counted yesterday;
were that kept for today, a tenant over yesterday's budget would be refused all day. The
scheduler's clock is injected here, so nothing depends on when the test runs.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from kvflow.ledger import AsyncLedger, open_ledger
from kvflow.scheduler.fleet import Fleet
from kvflow.scheduler.placement import PlacementRequest, Refusal, RefusalReason
from kvflow.workers.control_plane import ControlPlane
from tests.fixtures_ledger import attempt_record
from tests.fleets import one_pool_fleet

MIDNIGHT = datetime(2031, 3, 15, tzinfo=UTC)
"""The midnight the read spans: a fixed day, not today."""


class StoppedClock:
    """A clock that reads `now` (epoch seconds) until a test moves it."""

    def __init__(self, now: datetime) -> None:
        self.now = now.timestamp()

    def __call__(self) -> float:
        return self.now


class ReadThatEndsAfterMidnight(AsyncLedger):
    """The real ledger, whose first spend read takes until one second past midnight."""

    def __init__(self, ledger: AsyncLedger, clock: StoppedClock) -> None:
        super().__init__(ledger.ledger)
        self.clock = clock
        self.reads: list[datetime] = []

    async def spend_by_tenant(self, since: datetime, until: datetime) -> dict[str, int]:
        """Read the ledger; the clock is past midnight when the answer arrives."""
        spent = await super().spend_by_tenant(since, until)
        self.reads.append(since)
        self.clock.now = max(self.clock.now, (MIDNIGHT + timedelta(seconds=1)).timestamp())
        return spent


def _fleet() -> Fleet:
    fleet = one_pool_fleet("m").model_dump()
    fleet["tenants"] = [{"name": "acme", "tier": 2, "daily_budget_usd": "0.01"}]
    return Fleet.model_validate(fleet)


def _request() -> PlacementRequest:
    return PlacementRequest(model="m", prompt_tokens=100, max_output_tokens=10, tenant="acme")


async def _no_scrape() -> None:
    """The replica URL serves nothing; placement needs no metrics."""


@pytest.mark.timeout(60)
async def test_spend_read_across_midnight_is_not_counted_against_the_new_day(
    ledger_url: str,
) -> None:
    clock = StoppedClock(MIDNIGHT - timedelta(seconds=1))
    async with AsyncLedger(open_ledger(ledger_url, migrate=True)) as ledger:
        # Yesterday acme spent more than its budget; today, so far, $0.003.
        yesterday = attempt_record(activity_id="1", started_at=MIDNIGHT - timedelta(hours=1))
        await ledger.record_attempt(yesterday.model_copy(update={"cost_micros": 12_000}))
        today = attempt_record(activity_id="2", started_at=MIDNIGHT + timedelta(seconds=0.5))
        await ledger.record_attempt(today.model_copy(update={"cost_micros": 3_000}))

        source = ReadThatEndsAfterMidnight(ledger, clock)
        control = ControlPlane(
            _fleet(),
            endpoints={"cpu/0": "http://127.0.0.1:9"},
            ledger=source,
            spend_refresh_s=3600,  # the start-up read only
            clock=clock,
        )
        control.scraper.scrape_once = _no_scrape  # type: ignore[method-assign,assignment]
        async with control:
            placed = control.scheduler.place(_request())
            assert not isinstance(placed, Refusal), placed
            assert control.scheduler.tenant_spend_today("acme") == 3_000
            # The start-up read began on the 14th and ended on the 15th: it was read again.
            assert source.reads == [MIDNIGHT - timedelta(days=1), MIDNIGHT]


@pytest.mark.timeout(60)
async def test_a_day_over_budget_still_refuses_until_its_midnight(ledger_url: str) -> None:
    clock = StoppedClock(MIDNIGHT - timedelta(minutes=5))
    async with AsyncLedger(open_ledger(ledger_url, migrate=True)) as ledger:
        spent = attempt_record(activity_id="1", started_at=MIDNIGHT - timedelta(hours=1))
        await ledger.record_attempt(spent.model_copy(update={"cost_micros": 12_000}))
        control = ControlPlane(
            _fleet(),
            endpoints={"cpu/0": "http://127.0.0.1:9"},
            ledger=ledger,
            spend_refresh_s=3600,
            clock=clock,
        )
        control.scraper.scrape_once = _no_scrape  # type: ignore[method-assign,assignment]
        async with control:
            refusal = control.scheduler.place(_request())
            assert isinstance(refusal, Refusal)
            assert refusal.reason is RefusalReason.TENANT_OVER_QUOTA
            assert refusal.retry_after_s == pytest.approx(300)
            clock.now = MIDNIGHT.timestamp()
            assert control.scheduler.tenant_spend_today("acme") == 0
            assert not isinstance(control.scheduler.place(_request()), Refusal)

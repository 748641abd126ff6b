"""The control plane of a workflow worker: the scheduler with its telemetry, ledger, context store.

The scheduler lives in memory, fed by background telemetry: each replica's `/metrics` scraped
with httpx and, where the fleet lists them, the engines' KV-cache events. Its activities
(`place`, `observe`, `record_task`, `context_put`, `context_get`) run on the workflow worker;
`place` and `observe` as local activities.

Tenants' daily budgets are enforced from the ledger, which every GPU worker bills into: the
control plane seeds each tenant's spend today from it when it starts, and refreshes it in the
background every `spend_refresh_s`, so a restart does not reset a budget and N workflow
workers do not allow N times it. The refresh never runs on the placement path; between two
refreshes a worker also counts the calls it observes itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Protocol, runtime_checkable

from kvflow.activities.context_store import DirectoryContextStore
from kvflow.activities.control_plane import ControlPlaneActivities, LedgerSink
from kvflow.scheduler.config import SchedulerConfig
from kvflow.scheduler.core import Scheduler
from kvflow.scheduler.fleet import Fleet
from kvflow.scheduler.kv_events import KvEventSubscriber
from kvflow.scheduler.placement import Observation
from kvflow.scheduler.telemetry import MetricsScraper, fleet_endpoints

log = logging.getLogger(__name__)

SECONDS_PER_DAY = 86_400


@runtime_checkable
class TenantSpendSource(Protocol):
    """Reads every tenant's spend from the shared ledger (`AsyncLedger` does)."""

    async def spend_by_tenant(self, since: datetime, until: datetime) -> dict[str, int]:
        """Micro-dollars of the attempts started in `[since, until)`, by tenant."""
        ...


class ControlPlane:
    """The scheduler with its telemetry, the ledger and the context store of one worker.

    `endpoints` maps replica names (`pool/index`) to vLLM base URLs for the replicas whose pool
    says "simulated" (the embedded stack knows them only once it started the simulators);
    pools with real endpoints are taken from the fleet.
    """

    def __init__(
        self,
        fleet: Fleet,
        *,
        endpoints: Mapping[str, str] | None = None,
        ledger: LedgerSink | None = None,
        store: DirectoryContextStore | None = None,
        config: SchedulerConfig | None = None,
        scrape_interval_s: float = 1.0,
        spend_refresh_s: float = 5.0,
    ) -> None:
        self.scheduler = Scheduler(fleet, config)
        self.spend_source = ledger if isinstance(ledger, TenantSpendSource) else None
        """Where tenants' spend today is read from; None when the ledger cannot say."""
        self.spend_refresh_s = spend_refresh_s
        self._refreshing: asyncio.Task[None] | None = None
        self.endpoints = {**fleet_endpoints(fleet), **(endpoints or {})}
        self.activities = ControlPlaneActivities(
            self.scheduler,
            fleet=fleet,
            block_size=self.scheduler.block_size,
            ledger=ledger,
            store=store,
            triage=self,
        )
        for name in self.scheduler.replica_names():
            if name not in self.endpoints:
                # A simulated replica nobody said where to find cannot take calls.
                self.scheduler.set_replica_up(name, False)
        self.scraper = MetricsScraper(self.scheduler, self.endpoints, interval_s=scrape_interval_s)
        self._scraping: asyncio.Task[None] | None = None
        self.kv_subscribers = [
            KvEventSubscriber(
                self.scheduler,
                name,
                endpoint,
                topic=pool.kv_events_topic,
                model=pool.warm_models[0],
            )
            for pool in fleet.pools
            if pool.kv_events is not None
            for name, endpoint in zip(pool.replica_names(), pool.kv_events, strict=True)
        ]
        self._subscribing: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> ControlPlane:
        # Precise prefix index: the engines' KV-cache events, where the fleet lists them.
        for subscriber in self.kv_subscribers:
            self._subscribing.append(asyncio.create_task(subscriber.run()))
            await subscriber.wait_ready()
        if self.endpoints:
            # One scrape before the first placement, so it sees real load and cache sizes.
            await self.scraper.scrape_once()
            self._scraping = asyncio.create_task(self.scraper.run())
        if self.spend_source is not None:
            # Seeded before the first placement: a restarted worker keeps enforcing budgets.
            await self.refresh_tenant_spend()
            self._refreshing = asyncio.create_task(self._refresh_tenant_spend_forever())
        return self

    def triage(self, observation: Observation) -> Observation:
        """A call failed: scrape its replica now, so a crashed one is down before the retry."""
        if observation.replica_fault:
            self.scraper.check_soon(observation.replica)
        return observation

    async def refresh_tenant_spend(self) -> bool:
        """Set each tenant's spend today from the ledger; False (logged) when it fails.

        The ledger's figure covers every worker's calls; a worker's own count can be ahead of
        it only by rows not yet written (spooled), so the larger of the two is kept.
        """
        if self.spend_source is None:
            return False
        now = time.time()
        since = datetime.fromtimestamp(now // SECONDS_PER_DAY * SECONDS_PER_DAY, UTC)
        try:
            spent = await self.spend_source.spend_by_tenant(since, since + timedelta(days=1))
        except Exception as exc:
            log.warning("could not read tenants' spend today from the ledger: %s", exc)
            return False
        for tenant, micros in spent.items():
            # No await between the read and the write: an observation cannot slip in between.
            known = self.scheduler.tenant_spend_today(tenant)
            self.scheduler.set_tenant_spend_today(tenant, max(micros, known))
        return True

    async def _refresh_tenant_spend_forever(self) -> None:
        while True:
            await asyncio.sleep(self.spend_refresh_s)
            await self.refresh_tenant_spend()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.scraper.stop()
        if self._refreshing is not None:
            self._refreshing.cancel()
            await asyncio.gather(self._refreshing, return_exceptions=True)
        for subscriber in self.kv_subscribers:
            subscriber.stop()
        await asyncio.gather(*self._subscribing, return_exceptions=True)
        if self._scraping is not None:
            await asyncio.gather(self._scraping, return_exceptions=True)
        await self.scraper.aclose()
        await self.activities.tokenizers.aclose()

"""The control plane of a workflow worker: the scheduler with its telemetry, ledger, context store.

The scheduler lives in memory, fed by background telemetry: each replica's `/metrics` scraped
with httpx and, where the fleet lists them, the engines' KV-cache events. Its activities
(`place`, `observe`, `record_task`, `context_put`, `context_get`) run on the workflow worker;
`place` and `observe` as local activities.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from types import TracebackType

from kvflow.activities.context_store import DirectoryContextStore
from kvflow.activities.control_plane import ControlPlaneActivities, LedgerSink
from kvflow.scheduler.config import SchedulerConfig
from kvflow.scheduler.core import Scheduler
from kvflow.scheduler.fleet import Fleet
from kvflow.scheduler.kv_events import KvEventSubscriber
from kvflow.scheduler.telemetry import MetricsScraper, fleet_endpoints


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
    ) -> None:
        self.scheduler = Scheduler(fleet, config)
        self.endpoints = {**fleet_endpoints(fleet), **(endpoints or {})}
        self.activities = ControlPlaneActivities(
            self.scheduler,
            fleet=fleet,
            block_size=self.scheduler.block_size,
            ledger=ledger,
            store=store,
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
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.scraper.stop()
        for subscriber in self.kv_subscribers:
            subscriber.stop()
        await asyncio.gather(*self._subscribing, return_exceptions=True)
        if self._scraping is not None:
            await asyncio.gather(self._scraping, return_exceptions=True)
        await self.scraper.aclose()
        await self.activities.tokenizers.aclose()

"""The control plane of a workflow worker: the scheduler with its telemetry, ledger, context store.

The scheduler lives in memory, fed by background telemetry: each replica's `/metrics` scraped
with httpx and, where the fleet lists them, the engines' KV-cache events. Its activities
(`place`, `observe`, `record_task`, `context_put`, `context_get`) run on the workflow worker;
`place` and `observe` as local activities.

A replica takes calls only while its engine answers and a GPU worker polls its task queue:
given a Temporal client (`watch`, which `KvflowPlugin` calls for every workflow worker), the
control plane asks Temporal about each replica's queue (`WorkerWatch`) and marks a replica whose
worker is missing down (`kvflow.scheduler.config.LivenessConfig` gives the rule and its delay).
Through the same client it checks the server's health every second (`ServerProbe`): a call
that Temporal timed out during an outage it saw is the control plane's fault, not the
replica's, and its re-placement is no retry (`ControlPlane.triage`).

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

from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client
from temporalio.service import RPCError

from kvflow.activities.context_store import ContextStore
from kvflow.activities.control_plane import ControlPlaneActivities, LedgerSink
from kvflow.scheduler.config import LivenessConfig, SchedulerConfig
from kvflow.scheduler.core import Clock, Scheduler
from kvflow.scheduler.fleet import Fleet, task_queue_for
from kvflow.scheduler.kv_events import KvEventSubscriber
from kvflow.scheduler.placement import Observation
from kvflow.scheduler.reliability import (
    SCHEDULE_TO_START,
    ControlPlaneOutages,
    QueueView,
    WorkerLiveness,
)
from kvflow.scheduler.task_end import ReleaseTarget, TaskEndRelease
from kvflow.scheduler.telemetry import MetricsScraper, fleet_endpoints

log = logging.getLogger(__name__)

SECONDS_PER_DAY = 86_400


@runtime_checkable
class TenantSpendSource(Protocol):
    """Reads every tenant's spend from the shared ledger (`AsyncLedger` does)."""

    async def spend_by_tenant(self, since: datetime, until: datetime) -> dict[str, int]:
        """Micro-dollars of the attempts started in `[since, until)`, by tenant."""
        ...


class WorkerWatch:
    """Asks Temporal whether a GPU worker polls each replica's task queue (DescribeTaskQueue).

    Every `worker_check_interval_s`, and at once for a replica on which a call has just timed
    out waiting to start, it reads the queue's pollers and backlog, weighs them with the
    engine's load from `scraper` (`WorkerLiveness`), and tells the scraper when a worker goes
    missing or comes back. A describe that fails changes nothing.
    """

    def __init__(
        self,
        client: Client,
        queues: Mapping[str, str],
        scraper: MetricsScraper,
        config: LivenessConfig,
        *,
        rpc_timeout_s: float = 2.0,
    ) -> None:
        self.client = client
        self.queues = dict(queues)
        """Replica name → its GPU worker's task queue."""
        self.scraper = scraper
        self.config = config
        self.liveness = WorkerLiveness(config)
        self.rpc_timeout = timedelta(seconds=rpc_timeout_s)
        self._checks: set[asyncio.Task[None]] = set()

    async def view(self, replica: str) -> QueueView:
        """Temporal's view of the replica's queue now; raises `RPCError` when it cannot say."""
        response = await self.client.workflow_service.describe_task_queue(
            DescribeTaskQueueRequest(
                namespace=self.client.namespace,
                task_queue=TaskQueue(name=self.queues[replica]),
                task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
                report_stats=True,
            ),
            timeout=self.rpc_timeout,
        )
        polls = [
            p.last_access_time.seconds + p.last_access_time.nanos / 1e9
            for p in response.pollers
            if p.HasField("last_access_time")
        ]
        stats = response.stats
        return QueueView(
            last_poll_at=max(polls, default=None),
            backlog=stats.approximate_backlog_count,
            backlog_age_s=stats.approximate_backlog_age.ToTimedelta().total_seconds(),
        )

    async def check(self, replica: str) -> None:
        """Describe the replica's queue and apply the verdict."""
        try:
            view = await self.view(replica)
        except RPCError as exc:
            log.debug("could not describe the task queue of %s: %s", replica, exc)
            return
        idle_since = self.scraper.engine_idle_since(replica)
        change = self.liveness.assess(replica, view, idle_since, time.time())
        if change is True:
            log.warning(
                "no GPU worker polls %s (replica %s), though calls wait on it: marking the "
                "replica down until a worker polls again",
                self.queues[replica],
                replica,
            )
            self.scraper.set_worker_missing(replica, True)
        elif change is False:
            log.info(
                "a GPU worker polls %s again; replica %s is back", self.queues[replica], replica
            )
            self.scraper.set_worker_missing(replica, False)

    def stalled(self, replica: str, dispatched_at: float) -> None:
        """A call sent to the replica at `dispatched_at` timed out unstarted: check it now."""
        if replica not in self.queues:
            return
        self.liveness.stalled(replica, dispatched_at)
        check = asyncio.get_running_loop().create_task(self.check(replica))
        self._checks.add(check)
        check.add_done_callback(self._checks.discard)

    async def run(self) -> None:
        """Check every replica each `worker_check_interval_s`, until cancelled."""
        while True:
            await asyncio.gather(*(self.check(name) for name in self.queues))
            await asyncio.sleep(self.config.worker_check_interval_s)

    async def aclose(self) -> None:
        """Wait for the checks started by `stalled`."""
        await asyncio.gather(*self._checks, return_exceptions=True)


class OpenTaskWatch:
    """Ends the tasks counted open whose workflow is not running any more, as Temporal says.

    KV admission (`AdmissionConfig.open_task_kv_by_tier`) counts a task open in the
    scheduler that placed its calls until the workflow's `kvflow.end_task` reaches that
    scheduler. Some ends never do: a workflow terminated or timed out runs no code, and one
    that moved to another workflow worker (evicted from this worker's cache) ends there.
    Every `open_task_check_s`, the tasks that placed no call for that long are looked up in
    visibility (`ExecutionStatus = 'Running' AND WorkflowId IN (...)`, `BATCH` at a time);
    those not running stop counting then, not `open_task_idle_s` after their last call. A
    task that continued as new runs still. A lookup that fails ends nothing; an id with a
    quote or backslash is left to `open_task_idle_s`, not put in a query.
    """

    BATCH = 100

    def __init__(self, client: Client, scheduler: Scheduler, check_s: float) -> None:
        self.client = client
        self.scheduler = scheduler
        self.check_s = check_s
        self.ended = 0
        """Tasks this watch ended."""
        self.lookups = 0
        """Visibility queries answered."""

    async def check_once(self) -> int:
        """Look the idle open tasks up once; end those not running. Returns how many ended."""
        idle = [
            w
            for w in self.scheduler.idle_open_tasks(self.check_s)
            if "'" not in w and "\\" not in w
        ]
        ended = 0
        for start in range(0, len(idle), self.BATCH):
            batch = idle[start : start + self.BATCH]
            ids = ", ".join(f"'{w}'" for w in batch)
            query = f"ExecutionStatus = 'Running' AND WorkflowId IN ({ids})"
            try:
                running = {e.id async for e in self.client.list_workflows(query)}
            except RPCError as exc:
                log.debug("could not list the running tasks: %s", exc)
                continue
            self.lookups += 1
            for workflow_id in batch:
                if workflow_id not in running and self.scheduler.end_task(workflow_id):
                    ended += 1
        if ended:
            log.info("%d open task(s) no longer running: they stop counting for admission", ended)
        self.ended += ended
        return ended

    async def run(self) -> None:
        """Check every `check_s`, until cancelled."""
        while True:
            await asyncio.sleep(self.check_s)
            await self.check_once()


class ServerProbe:
    """Checks every `server_probe_interval_s` that Temporal answers; records its outages.

    The probe is the control plane's own view: it tells an outage of Temporal (or of the way
    to it) from a fault of a replica, for the calls the outage cut (`ControlPlaneOutages`).
    """

    def __init__(
        self,
        client: Client,
        outages: ControlPlaneOutages,
        config: LivenessConfig,
        *,
        rpc_timeout_s: float = 2.0,
    ) -> None:
        self.client = client
        self.outages = outages
        self.config = config
        self.rpc_timeout = timedelta(seconds=rpc_timeout_s)

    async def probe_once(self) -> bool:
        """Ask the server's health once and record the answer; True when it answered."""
        try:
            ok = await self.client.service_client.check_health(timeout=self.rpc_timeout)
        except Exception as exc:  # whatever fails, the server did not answer
            log.debug("Temporal health check failed: %s", exc)
            ok = False
        if self.outages.record_probe(ok, time.time()):
            if ok:
                log.warning("Temporal answers again; the calls its outage cut are not retries")
            else:
                log.warning("Temporal does not answer the control plane's health checks")
        return ok

    async def run(self) -> None:
        """Probe every `server_probe_interval_s` until cancelled."""
        while True:
            await self.probe_once()
            await asyncio.sleep(self.config.server_probe_interval_s)


class ControlPlane:
    """The scheduler with its telemetry, the ledger and the context store of one worker.

    `endpoints` maps replica names (`pool/index`) to vLLM base URLs for the replicas whose pool
    says "simulated" (the embedded stack knows them only once it started the simulators);
    pools with real endpoints are taken from the fleet. `clock` is the scheduler's: the UTC
    day of tenants' budgets follows it.
    """

    def __init__(
        self,
        fleet: Fleet,
        *,
        endpoints: Mapping[str, str] | None = None,
        ledger: LedgerSink | None = None,
        store: ContextStore | None = None,
        config: SchedulerConfig | None = None,
        scrape_interval_s: float = 1.0,
        spend_refresh_s: float = 5.0,
        client: Client | None = None,
        clock: Clock = time.time,
    ) -> None:
        self.scheduler = Scheduler(fleet, config, clock=clock)
        self.fleet = fleet
        self.spend_source = ledger if isinstance(ledger, TenantSpendSource) else None
        """Where tenants' spend today is read from; None when the ledger cannot say."""
        self.spend_refresh_s = spend_refresh_s
        self._refreshing: asyncio.Task[None] | None = None
        self.endpoints = {**fleet_endpoints(fleet), **(endpoints or {})}
        self.releases = TaskEndRelease(
            {
                name: ReleaseTarget(self.endpoints[name], pool.warm_models[0])
                for pool in fleet.pools
                if pool.task_end_release
                for name in pool.replica_names()
                if name in self.endpoints
            }
        )
        """Tells engines running `kvflow_vllm`'s scheduler that a task ended."""
        self.activities = ControlPlaneActivities(
            self.scheduler,
            fleet=fleet,
            block_size=self.scheduler.block_size,
            ledger=ledger,
            store=store,
            triage=self,
            on_task_end=self._release_task if self.releases.targets else None,
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
        self.outages = ControlPlaneOutages(self.scheduler.config.liveness)
        """When this control plane could not reach Temporal (known once `watch` is called)."""
        self.worker_watch: WorkerWatch | None = None
        """Whether each replica's GPU worker polls its queue; None until `watch` is called."""
        self.server_probe: ServerProbe | None = None
        self.open_task_watch: OpenTaskWatch | None = None
        """Ends the open tasks whose workflow stopped running (with KV admission on)."""
        self._watching: list[asyncio.Task[None]] = []
        self._entered = False
        if client is not None:
            self.watch(client)

    def watch(self, client: Client) -> None:
        """Watch Temporal and the replicas' GPU workers through `client` (once: the first wins).

        Replicas without an endpoint are left out: they are down already.
        """
        if self.worker_watch is not None:
            return
        liveness = self.scheduler.config.liveness
        self.server_probe = ServerProbe(client, self.outages, liveness)
        queues = {
            name: task_queue_for(pool.name, index)
            for pool in self.fleet.pools
            for index, name in enumerate(pool.replica_names())
            if name in self.endpoints
        }
        self.worker_watch = WorkerWatch(client, queues, self.scraper, liveness)
        admission = self.scheduler.config.admission
        if admission.open_task_kv_by_tier is not None:
            self.open_task_watch = OpenTaskWatch(
                client, self.scheduler, admission.open_task_check_s
            )
        if self._entered:
            self._start_watching()

    def _start_watching(self) -> None:
        assert self.worker_watch is not None and self.server_probe is not None
        self._watching = [
            asyncio.create_task(self.server_probe.run()),
            asyncio.create_task(self.worker_watch.run()),
        ]
        if self.open_task_watch is not None:
            self._watching.append(asyncio.create_task(self.open_task_watch.run()))

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
        if self.worker_watch is not None:
            self._start_watching()
        self._entered = True
        return self

    def _release_task(self, workflow_id: str) -> None:
        """The task ended: the engine of its latest call may reuse its KV first (a hint)."""
        replica = self.scheduler.last_replica(workflow_id)
        if replica is not None:
            self.releases.release(workflow_id, replica)

    def triage(self, observation: Observation) -> Observation:
        """A call failed: whose fault was it? Look at its replica now if it was the replica's.

        A timeout that an outage of Temporal explains (`ControlPlaneOutages`) is the control
        plane's: it is marked so, and the replica is left alone. Otherwise a call that timed
        out unstarted makes the worker watch describe the replica's queue, and any other fault
        of the replica makes the scraper scrape its engine, so that a dead replica is down
        before the call is placed again.
        """
        if self.outages.explains(
            observation.error, observation.dispatched_at, observation.ended_at, time.time()
        ):
            log.info(
                "%s of a call on %s came with an outage of Temporal: not the replica's fault, "
                "and its re-placement is no retry",
                observation.error,
                observation.replica,
            )
            return observation.model_copy(
                update={"replica_fault": False, "control_plane_fault": True}
            )
        if observation.replica_fault:
            if observation.error == SCHEDULE_TO_START:
                if self.worker_watch is not None and observation.dispatched_at is not None:
                    self.worker_watch.stalled(observation.replica, observation.dispatched_at)
            else:
                self.scraper.check_soon(observation.replica)
        return observation

    async def refresh_tenant_spend(self) -> bool:
        """Set each tenant's spend today from the ledger; False (logged) when it fails.

        The ledger's figure covers every worker's calls; a worker's own count can be ahead of
        it only by rows not yet written (spooled), so the larger of the two is kept. A read
        that ends on another UTC day than it began (midnight fell during it) counted the day
        before: it is dropped, and today's spend read instead.
        """
        if self.spend_source is None:
            return False
        for _ in range(2):  # midnight passes during one read at most
            day = self.scheduler.utc_day()
            since = datetime.fromtimestamp(day * SECONDS_PER_DAY, UTC)
            try:
                spent = await self.spend_source.spend_by_tenant(since, since + timedelta(days=1))
            except Exception as exc:
                log.warning("could not read tenants' spend today from the ledger: %s", exc)
                return False
            if self.scheduler.merge_tenant_spend(spent, day):
                return True
            log.info("midnight UTC passed while tenants' spend was read; reading today's")
        return False

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
        self._entered = False
        self.scraper.stop()
        for task in self._watching:
            task.cancel()
        await asyncio.gather(*self._watching, return_exceptions=True)
        if self.worker_watch is not None:
            await self.worker_watch.aclose()
        if self._refreshing is not None:
            self._refreshing.cancel()
            await asyncio.gather(self._refreshing, return_exceptions=True)
        for subscriber in self.kv_subscribers:
            subscriber.stop()
        await asyncio.gather(*self._subscribing, return_exceptions=True)
        if self._scraping is not None:
            await asyncio.gather(self._scraping, return_exceptions=True)
        await self.scraper.aclose()
        await self.releases.aclose()
        await self.activities.tokenizers.aclose()

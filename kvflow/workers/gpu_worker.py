"""The GPU worker: one Temporal worker per vLLM replica, polling `kvflow.gpu.<pool>.<index>`.

It checks its vLLM endpoint before it polls (a worker in front of a dead server would only
collect calls to fail them), runs at most the pool's `max_concurrency` calls at once, and on
shutdown gives in-flight calls `graceful_shutdown_s` to finish before they are cancelled; a
cancelled call reaches the workflow as a failure and is re-placed elsewhere. The stop itself
ends `STOP_ALLOWANCE` after that at the latest, even with a call that does not (`BoundedWorker`).

Attempt rows go to the ledger through a `SpooledAttemptWriter`: a write the ledger refuses is
retried, then kept in a spool file under `spool_dir` (in memory while that disk refuses it too)
and replayed when the ledger is back; a call is never failed for its row. A worker restarted
for the same replica replays what its predecessor spooled, so give it the same `spool_dir`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AsyncExitStack
from datetime import timedelta
from pathlib import Path
from types import TracebackType

import httpx
from temporalio.client import Client

from kvflow.activities.context_store import DEFAULT_CONTEXT_DIR, ContextStore
from kvflow.activities.inference import (
    AttemptSink,
    InferenceActivities,
    ReplicaBinding,
    default_http_client,
)
from kvflow.ledger.spool import DEFAULT_SPOOL_DIR, SpooledAttemptWriter, spooled_writer
from kvflow.scheduler.fleet import task_queue_for
from kvflow.workers.config import FleetConfig
from kvflow.workers.plugin import KvflowPlugin, role_worker
from kvflow.workers.replica import check_endpoint

log = logging.getLogger(__name__)


class GpuWorker:
    """A running GPU worker; use `async with GpuWorker(...)` or `await run()`."""

    def __init__(
        self,
        client: Client,
        binding: ReplicaBinding,
        *,
        ledger: AttemptSink | None = None,
        store: ContextStore | None = None,
        http: httpx.AsyncClient | None = None,
        graceful_shutdown_s: float = 10.0,
        heartbeat_interval_s: float = 0.5,
        spool_dir: Path | None = DEFAULT_SPOOL_DIR,
    ) -> None:
        self.binding = binding
        self.http = http or default_http_client()
        self.spooler: SpooledAttemptWriter | None = None
        """Where attempt rows go when a ledger is given (None: `spool_dir` is None)."""
        if ledger is not None and spool_dir is not None:
            self.spooler = spooled_writer(ledger, spool_dir, binding.name)
            ledger = self.spooler
        self.activities = InferenceActivities(
            binding, self.http, ledger, store=store, heartbeat_interval_s=heartbeat_interval_s
        )
        self._running = AsyncExitStack()
        self.task_queue = task_queue_for(binding.pool.name, binding.index)
        self.worker = role_worker(
            client,
            KvflowPlugin(inference=self.activities),
            task_queue=self.task_queue,
            graceful_shutdown_timeout=timedelta(seconds=graceful_shutdown_s),
        )

    async def run(self, on_ready: Callable[[], None] | None = None) -> None:
        """Check the endpoint, call `on_ready`, then poll until `shutdown()`."""
        await check_endpoint(self.binding, self.http)
        async with AsyncExitStack() as running:
            if self.spooler is not None:
                await running.enter_async_context(self.spooler)
            log.info("GPU worker for %s polls %s", self.binding.name, self.task_queue)
            if on_ready is not None:
                on_ready()
            try:
                await self.worker.run()
            finally:
                await self.http.aclose()

    async def shutdown(self) -> None:
        """Stop polling; in-flight calls get the graceful period, then are cancelled."""
        await self.worker.shutdown()

    async def __aenter__(self) -> GpuWorker:
        await check_endpoint(self.binding, self.http)
        if self.spooler is not None:
            await self._running.enter_async_context(self.spooler)
        try:
            await self.worker.__aenter__()
        except BaseException:
            await self._running.aclose()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.worker.__aexit__(exc_type, exc, tb)
        finally:
            await self.http.aclose()
            await self._running.aclose()


async def connect(fleet: FleetConfig, context_dir: Path = DEFAULT_CONTEXT_DIR) -> Client:
    """A Temporal client for the fleet's connection, configured by `KvflowPlugin`.

    Its codec keeps large payloads in the context store at `context_dir`: the store the
    worker that uses the client serves.
    """
    return await Client.connect(
        **fleet.temporal.connect_config(), plugins=[KvflowPlugin(context_dir=context_dir)]
    )

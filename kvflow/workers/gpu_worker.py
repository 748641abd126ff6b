"""The GPU worker: one Temporal worker per vLLM replica, polling `kvflow.gpu.<pool>.<index>`.

It checks its vLLM endpoint before it polls (a worker in front of a dead server would only
collect calls to fail them), runs at most the pool's `max_concurrency` calls at once, and on
shutdown gives in-flight calls `graceful_shutdown_s` to finish before they are cancelled; a
cancelled call reaches the workflow as a failure and is re-placed elsewhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from types import TracebackType

import httpx
from temporalio.client import Client
from temporalio.contrib.opentelemetry import TracingInterceptor
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker

from kvflow.activities.context_store import DirectoryContextStore
from kvflow.activities.inference import (
    AttemptSink,
    InferenceActivities,
    ReplicaBinding,
    default_http_client,
)
from kvflow.scheduler.fleet import task_queue_for
from kvflow.workers.config import FleetConfig

log = logging.getLogger(__name__)


class GpuWorkerError(Exception):
    """The GPU worker cannot start: bad replica name, no endpoint, or vLLM not answering."""


def resolve_replica(fleet: FleetConfig, replica: str, endpoint: str | None) -> ReplicaBinding:
    """Find `POOL/INDEX` in the fleet and the vLLM URL that serves it."""
    pool_name, _, index_text = replica.partition("/")
    try:
        pool = fleet.pool(pool_name)
    except KeyError:
        known = ", ".join(p.name for p in fleet.pools)
        raise GpuWorkerError(f"no pool {pool_name!r} in the fleet; pools: {known}") from None
    if not index_text.isdigit() or int(index_text) >= pool.replicas:
        raise GpuWorkerError(
            f"replica {replica!r}: write POOL/INDEX with INDEX from 0 to {pool.replicas - 1}"
        )
    index = int(index_text)
    if endpoint is None:
        if isinstance(pool.endpoints, str):
            raise GpuWorkerError(
                f"pool {pool.name!r} is simulated: pass --endpoint with the URL of the simulator "
                f"that serves {replica} (`kvflow sim serve --fleet FILE --replica {replica}`)"
            )
        endpoint = str(pool.endpoints[index])
    return ReplicaBinding(pool=pool, index=index, base_url=endpoint.rstrip("/"))


async def check_endpoint(binding: ReplicaBinding, http: httpx.AsyncClient) -> None:
    """Raise `GpuWorkerError` unless the replica's vLLM server answers `/health` with 200."""
    url = f"{binding.base_url}/health"
    try:
        response = await http.get(url, timeout=5.0)
    except httpx.HTTPError as exc:
        raise GpuWorkerError(
            f"vLLM for {binding.name} is not answering at {url} ({type(exc).__name__}); "
            "start it, or fix the endpoint in fleet.toml / --endpoint"
        ) from None
    if response.status_code != 200:
        raise GpuWorkerError(
            f"vLLM for {binding.name} at {url} answered {response.status_code}; it is not healthy"
        )


class GpuWorker:
    """A running GPU worker; use `async with GpuWorker(...)` or `await run()`."""

    def __init__(
        self,
        client: Client,
        binding: ReplicaBinding,
        *,
        ledger: AttemptSink | None = None,
        store: DirectoryContextStore | None = None,
        http: httpx.AsyncClient | None = None,
        graceful_shutdown_s: float = 10.0,
        heartbeat_interval_s: float = 0.5,
    ) -> None:
        self.binding = binding
        self.http = http or default_http_client()
        self.activities = InferenceActivities(
            binding, self.http, ledger, store=store, heartbeat_interval_s=heartbeat_interval_s
        )
        self.task_queue = task_queue_for(binding.pool.name, binding.index)
        self.worker = Worker(
            client,
            task_queue=self.task_queue,
            activities=[self.activities.infer],
            max_concurrent_activities=binding.pool.max_concurrency,
            graceful_shutdown_timeout=timedelta(seconds=graceful_shutdown_s),
        )

    async def run(self, on_ready: Callable[[], None] | None = None) -> None:
        """Check the endpoint, call `on_ready`, then poll until `shutdown()`."""
        await check_endpoint(self.binding, self.http)
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
        await self.worker.__aenter__()
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


async def connect(fleet: FleetConfig) -> Client:
    """A Temporal client for the fleet's connection, with pydantic payloads and tracing."""
    return await Client.connect(
        **fleet.temporal.connect_config(),
        data_converter=pydantic_data_converter,
        interceptors=[TracingInterceptor()],
    )

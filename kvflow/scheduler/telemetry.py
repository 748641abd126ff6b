"""Scraping vLLM's `/metrics` into the scheduler, off the decision path.

`MetricsScraper` polls every replica's Prometheus endpoint with httpx, parses the text with
`prometheus_client`'s parser and pushes a `ReplicaMetrics` into `Scheduler.update_metrics`.

A replica that refuses the connection is marked down (`Scheduler.set_replica_up`) by that one
scrape: nothing listens where it answered, so its server is gone (a crash). Any other failure
(a timeout, an HTTP error, text that is not vLLM's) is confirmed at once, `confirm_after_s`
later instead of a scrape interval later, and `failures_before_down` failures in a row mark it
down; so a crashed replica is down within one `interval_s` plus a request, and a slow scrape
does not drop a healthy replica (and its prefix-index entries). `check_soon` scrapes a replica
out of turn, when a call on it has just failed. A good scrape marks the replica up again,
unless its GPU worker is missing (`set_worker_missing`): a replica serves calls only when its
engine answers and a worker polls its task queue.

Metrics read (summed over engines for counts, the maximum for usage):
`vllm:kv_cache_usage_perc` (or the older `vllm:gpu_cache_usage_perc`),
`vllm:num_requests_running`, `vllm:num_requests_waiting`, and the `block_size` and
`num_gpu_blocks` labels of `vllm:cache_config_info`; `model_name` labels name the served models.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from types import TracebackType

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvflow.scheduler.core import Scheduler
from kvflow.scheduler.engine_http import engine_limits
from kvflow.scheduler.fleet import Fleet
from kvflow.scheduler.redact import redact_url
from kvflow.scheduler.state import ReplicaMetrics

logger = logging.getLogger(__name__)

_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_CACHE_INFO = "vllm:cache_config_info"


class MetricsParseError(ValueError):
    """The text is not Prometheus exposition format, or carries none of vLLM's metrics."""


def _label_int(labels: Mapping[str, str], name: str) -> int | None:
    value = labels.get(name)
    if value is None:
        return None
    try:
        number = int(float(value))
    except ValueError:
        return None  # vLLM writes "None" before the cache is sized
    return number if number > 0 else None


def parse_vllm_metrics(text: str) -> ReplicaMetrics:
    """The scheduler's view of one vLLM `/metrics` page."""
    usage: float | None = None
    running: int | None = None
    waiting: int | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    models: set[str] = set()
    seen = False
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = sample.name
                if not name.startswith("vllm:"):
                    continue
                seen = True
                model = sample.labels.get("model_name")
                if model:
                    models.add(model)
                if name in _USAGE:
                    usage = max(usage or 0.0, sample.value)
                elif name == _RUNNING:
                    running = (running or 0) + int(sample.value)
                elif name == _WAITING:
                    waiting = (waiting or 0) + int(sample.value)
                elif name == _CACHE_INFO:
                    block_size = _label_int(sample.labels, "block_size") or block_size
                    blocks = _label_int(sample.labels, "num_gpu_blocks")
                    if blocks is not None:
                        num_gpu_blocks = (num_gpu_blocks or 0) + blocks
    except ValueError as exc:
        raise MetricsParseError(f"not Prometheus text: {exc}") from exc
    if not seen:
        raise MetricsParseError("no vllm:* metrics in the page; is this a vLLM server?")
    return ReplicaMetrics(
        kv_cache_usage=usage,
        running=running,
        waiting=waiting,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        models=tuple(sorted(models)),
    )


def fleet_endpoints(fleet: Fleet) -> dict[str, str]:
    """Replica name → base URL for the pools whose `endpoints` list real servers."""
    endpoints: dict[str, str] = {}
    for pool in fleet.pools:
        if isinstance(pool.endpoints, list):
            for name, url in zip(pool.replica_names(), pool.endpoints, strict=True):
                endpoints[name] = str(url).rstrip("/")
    return endpoints


class MetricsScraper:
    """Polls each replica's `/metrics` and feeds the scheduler; see the module docstring."""

    def __init__(
        self,
        scheduler: Scheduler,
        endpoints: Mapping[str, str],
        *,
        interval_s: float = 1.0,
        timeout_s: float = 1.0,
        failures_before_down: int = 2,
        confirm_after_s: float = 0.1,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        known = set(scheduler.replica_names())
        unknown = sorted(set(endpoints) - known)
        if unknown:
            raise ValueError(
                f"endpoints name unknown replicas {unknown}; replicas are {sorted(known)}"
            )
        if failures_before_down < 1:
            raise ValueError("failures_before_down must be at least 1")
        self.scheduler = scheduler
        self.endpoints = {name: url.rstrip("/") for name, url in endpoints.items()}
        self.interval_s = interval_s
        self.failures_before_down = failures_before_down
        self.confirm_after_s = confirm_after_s
        self._owns_client = client is None
        self._client = client or httpx.AsyncClient(timeout=timeout_s, limits=engine_limits())
        self._failures = dict.fromkeys(self.endpoints, 0)
        self._down: set[str] = set()
        """Replicas this scraper marked down; a good scrape marks them up."""
        self._latest: dict[str, ReplicaMetrics] = {}
        self._idle_since: dict[str, float] = {}
        self._worker_missing: set[str] = set()
        self._checks: dict[str, asyncio.Task[ReplicaMetrics | None]] = {}
        self._served: dict[str, set[str]] = {}
        self._stop = asyncio.Event()

    async def scrape_replica(self, replica: str) -> ReplicaMetrics | None:
        """Scrape one replica and apply the result; None when it did not answer well.

        A refused connection marks it down at once; another failure is tried again after
        `confirm_after_s`, up to `failures_before_down` failures in a row (module docstring).
        """
        url = f"{self.endpoints[replica]}/metrics"
        while True:
            try:
                response = await self._client.get(url)
                response.raise_for_status()
                metrics = parse_vllm_metrics(response.text)
                break
            except (httpx.HTTPError, MetricsParseError) as exc:
                failures = self._failures[replica] + 1
                self._failures[replica] = failures
                logger.debug("scrape of %s (%s) failed: %s", replica, redact_url(url), exc)
                # Refused: nothing listens where the replica answered, so its server is gone.
                if isinstance(exc, httpx.ConnectError) or failures >= self.failures_before_down:
                    self._mark_down(replica, url, failures, exc)
                    return None
            await asyncio.sleep(self.confirm_after_s)
        self._failures[replica] = 0
        served = await self._served_models(replica)
        if served - set(metrics.models):
            metrics = replace(metrics, models=tuple(sorted(served | set(metrics.models))))
        self._latest[replica] = metrics
        if metrics.running is not None and metrics.running + (metrics.waiting or 0) == 0:
            self._idle_since.setdefault(replica, time.time())
        else:
            self._idle_since.pop(replica, None)
        self._down.discard(replica)
        if replica not in self._worker_missing:
            self.scheduler.update_metrics(replica, metrics)
        return metrics

    def _mark_down(self, replica: str, url: str, failures: int, exc: Exception) -> None:
        self._latest.pop(replica, None)
        self._idle_since.pop(replica, None)
        if replica in self._down:
            return
        self._down.add(replica)
        logger.warning(
            "replica %s stopped answering %s (%d failure(s): %s); marking it down",
            replica,
            redact_url(url),
            failures,
            str(exc) or type(exc).__name__,
        )
        self.scheduler.set_replica_up(replica, False)

    def check_soon(self, replica: str) -> None:
        """Scrape `replica` now, in the background (a call on it has just failed).

        A crashed replica is then down before the failed call is placed again, instead of at
        the next scrape. A check already running for the replica is not doubled.
        """
        if replica not in self.endpoints or replica in self._checks:
            return
        check = asyncio.get_running_loop().create_task(self.scrape_replica(replica))
        self._checks[replica] = check
        check.add_done_callback(lambda _: self._checks.pop(replica, None))

    def engine_idle_since(self, replica: str) -> float | None:
        """Since when the replica's engine has been idle, as scraped (epoch seconds).

        The first of the unbroken run of scrapes, up to the last one, that found it running
        and queueing nothing; None while it is busy, unscraped, or its last scrape failed.
        """
        return self._idle_since.get(replica)

    def set_worker_missing(self, replica: str, missing: bool) -> None:
        """Say whether the replica's GPU worker is missing (it stopped polling its queue).

        A replica with a missing worker is down whatever its engine answers; when the worker
        is back, the replica is up again if its last scrape was good.
        """
        if missing:
            if replica not in self._worker_missing:
                self._worker_missing.add(replica)
                self.scheduler.set_replica_up(replica, False)
            return
        if replica not in self._worker_missing:
            return
        self._worker_missing.discard(replica)
        latest = self._latest.get(replica)
        if latest is not None and replica not in self._down:
            self.scheduler.update_metrics(replica, latest)

    async def _served_models(self, replica: str) -> set[str]:
        """Every name the server answers to, from `/v1/models` (asked once per replica).

        vLLM labels its metrics with the first `--served-model-name` only, so a server that
        answers to several names would look as if it served one.
        """
        if replica not in self._served:
            try:
                response = await self._client.get(f"{self.endpoints[replica]}/v1/models")
                response.raise_for_status()
                self._served[replica] = {str(m["id"]) for m in response.json()["data"]}
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                # Not asked again: the metrics' own labels are then all there is to go on.
                logger.debug("could not list the models of %s: %s", replica, exc)
                self._served[replica] = set()
        return self._served[replica]

    async def scrape_once(self) -> dict[str, ReplicaMetrics | None]:
        """Scrape every replica concurrently; replica → metrics, or None for a failure."""
        names = list(self.endpoints)
        results = await asyncio.gather(*(self.scrape_replica(n) for n in names))
        return dict(zip(names, results, strict=True))

    async def run(self) -> None:
        """Scrape every `interval_s` until `stop()`."""
        self._stop.clear()
        while not self._stop.is_set():
            await self.scrape_once()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=self.interval_s)

    def stop(self) -> None:
        """Make `run()` return after the scrape in progress."""
        self._stop.set()

    async def aclose(self) -> None:
        """Stop, wait for out-of-turn checks, close the HTTP client (when the scraper made it)."""
        self.stop()
        await asyncio.gather(*self._checks.values(), return_exceptions=True)
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> MetricsScraper:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

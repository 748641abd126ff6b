"""Scraping vLLM's `/metrics` into the scheduler, off the decision path.

`MetricsScraper` polls every replica's Prometheus endpoint with httpx, parses the text with
`prometheus_client`'s parser and pushes a `ReplicaMetrics` into `Scheduler.update_metrics`. A
replica that fails `failures_before_down` scrapes in a row (connection refused, timeout, an
HTTP error, text that is not vLLM's) is marked down with `Scheduler.set_replica_up`; its next
good scrape marks it up again.

Metrics read (summed over engines for counts, the maximum for usage):
`vllm:kv_cache_usage_perc` (or the older `vllm:gpu_cache_usage_perc`),
`vllm:num_requests_running`, `vllm:num_requests_waiting`, and the `block_size` and
`num_gpu_blocks` labels of `vllm:cache_config_info`; `model_name` labels name the served models.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import replace
from types import TracebackType

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvflow.scheduler.core import Scheduler
from kvflow.scheduler.fleet import Fleet
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
        self._owns_client = client is None
        self._client = client or httpx.AsyncClient(timeout=timeout_s)
        self._failures = dict.fromkeys(self.endpoints, 0)
        self._served: dict[str, set[str]] = {}
        self._stop = asyncio.Event()

    async def scrape_replica(self, replica: str) -> ReplicaMetrics | None:
        """Scrape one replica and apply the result; None when it did not answer well."""
        url = f"{self.endpoints[replica]}/metrics"
        try:
            response = await self._client.get(url)
            response.raise_for_status()
            metrics = parse_vllm_metrics(response.text)
        except (httpx.HTTPError, MetricsParseError) as exc:
            failures = self._failures[replica] + 1
            self._failures[replica] = failures
            logger.debug("scrape of %s (%s) failed: %s", replica, url, exc)
            if failures == self.failures_before_down:
                logger.warning(
                    "replica %s stopped answering %s (%d failures: %s); marking it down",
                    replica,
                    url,
                    failures,
                    exc,
                )
                self.scheduler.set_replica_up(replica, False)
            return None
        self._failures[replica] = 0
        served = await self._served_models(replica)
        if served - set(metrics.models):
            metrics = replace(metrics, models=tuple(sorted(served | set(metrics.models))))
        self.scheduler.update_metrics(replica, metrics)
        return metrics

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
        """Stop and close the HTTP client (when the scraper created it)."""
        self.stop()
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

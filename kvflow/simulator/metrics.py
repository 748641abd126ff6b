"""`/metrics` with vLLM's metric names, types and labels (`model_name`, `engine`).

Gauges and counters are read from the engines when scraped, so they are never stale:
`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (0..1),
`vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` (in tokens),
`vllm:prompt_tokens_total`, `vllm:prompt_tokens_cached_total`, `vllm:generation_tokens_total`,
`vllm:num_preemptions_total`, `vllm:request_success_total` (by `finished_reason`) and
`vllm:cache_config_info` (value 1; labels `block_size`, `num_gpu_blocks`, ...).
Histograms (seconds, vLLM's buckets) are observed as requests progress:
`vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
`vllm:request_queue_time_seconds`, `vllm:e2e_request_latency_seconds`,
`vllm:request_prefill_time_seconds`, `vllm:request_decode_time_seconds`.

Times are the engine's simulated seconds (equal to wall seconds at `time_scale` 1).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvflow.simulator.engine import EngineCore, SimRequest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_LABELS = ("model_name", "engine")


class _EngineCollector(Collector):
    def __init__(self, engines: list[EngineCore], finished: Counter[tuple[str, str]]) -> None:
        self._engines = engines
        self._finished = finished

    def collect(self) -> Iterator[Metric]:
        gauges = {
            "vllm:num_requests_running": "Number of requests in model execution batches.",
            "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
            "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
        }
        counters = {
            "vllm:prefix_cache_queries": "Prefix cache queries, in number of queried tokens.",
            "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
            "vllm:prompt_tokens": "Number of prefill tokens processed.",
            "vllm:prompt_tokens_cached": "Number of cached prompt tokens (local prefix cache).",
            "vllm:generation_tokens": "Number of generation tokens processed.",
            "vllm:num_preemptions": "Cumulative number of preemption from the engine.",
        }
        gauge_families = {n: GaugeMetricFamily(n, d, labels=_LABELS) for n, d in gauges.items()}
        counter_families = {
            n: CounterMetricFamily(n, d, labels=_LABELS) for n, d in counters.items()
        }
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=(*_LABELS, "finished_reason"),
        )
        info_labels = (
            "block_size",
            "num_gpu_blocks",
            "enable_prefix_caching",
            "prefix_caching_hash_algo",
            "gpu_memory_utilization",
            "cache_dtype",
            "engine",
            "model_name",
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=info_labels
        )
        for index, engine in enumerate(self._engines):
            labels = [engine.model.name, str(index)]
            stats = engine.stats
            gauge_families["vllm:num_requests_running"].add_metric(labels, engine.num_running)
            gauge_families["vllm:num_requests_waiting"].add_metric(labels, engine.num_waiting)
            gauge_families["vllm:kv_cache_usage_perc"].add_metric(labels, engine.kv_cache_usage())
            values = {
                "vllm:prefix_cache_queries": stats.prefix_cache_queries,
                "vllm:prefix_cache_hits": stats.prefix_cache_hits,
                "vllm:prompt_tokens": stats.prompt_tokens,
                "vllm:prompt_tokens_cached": stats.cached_prompt_tokens,
                "vllm:generation_tokens": stats.generation_tokens,
                "vllm:num_preemptions": stats.num_preemptions,
            }
            for name, value in values.items():
                counter_families[name].add_metric(labels, value)
            for reason in ("stop", "length", "abort"):
                success.add_metric([*labels, reason], self._finished[(engine.model.name, reason)])
            config = engine.config
            info.add_metric(
                [
                    str(engine.block_size),
                    str(engine.num_gpu_blocks),
                    str(config.enable_prefix_caching),
                    "blake2b_64",
                    str(config.gpu_memory_utilization),
                    "auto",
                    str(index),
                    engine.model.name,
                ],
                1.0,
            )
        yield from gauge_families.values()
        yield from counter_families.values()
        yield success
        yield info


class VllmMetrics:
    """The metrics of one simulated server (its own registry, so servers can share a process)."""

    def __init__(self, engines: list[EngineCore]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._finished: Counter[tuple[str, str]] = Counter()
        self._index = {engine.model.name: str(i) for i, engine in enumerate(engines)}
        self.registry.register(_EngineCollector(engines, self._finished))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, _LABELS, buckets=buckets, registry=self.registry)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            _TTFT_BUCKETS,
        )  # fmt: skip
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            _ITL_BUCKETS,
        )  # fmt: skip
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _REQUEST_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _REQUEST_BUCKETS,
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            _REQUEST_BUCKETS,
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            _REQUEST_BUCKETS,
        )

    def _labels(self, model: str) -> tuple[str, str]:
        return model, self._index.get(model, "0")

    def observe_token(self, model: str, request: SimRequest, previous: float | None) -> None:
        """Record a new output token of `request` (TTFT for the first, ITL after)."""
        labels = self._labels(model)
        now = request.last_token_time
        if now is None:
            return
        if previous is None:
            ttft = request.ttft
            if ttft is not None:
                self.ttft.labels(*labels).observe(ttft)
        else:
            self.itl.labels(*labels).observe(now - previous)

    def observe_finished(self, model: str, request: SimRequest) -> None:
        """Record a finished (or aborted) request's latencies and finish reason."""
        labels = self._labels(model)
        self._finished[(model, request.finish_reason or "abort")] += 1
        if request.first_scheduled_time is not None:
            self.queue.labels(*labels).observe(request.first_scheduled_time - request.arrival_time)
        e2e = request.e2e_latency
        if e2e is not None:
            self.e2e.labels(*labels).observe(e2e)
        first = request.first_token_time
        if first is not None and request.first_scheduled_time is not None:
            self.prefill.labels(*labels).observe(first - request.first_scheduled_time)
            if request.finish_time is not None:
                self.decode.labels(*labels).observe(request.finish_time - first)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)

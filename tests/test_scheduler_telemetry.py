"""The `/metrics` scraper against a real HTTP server speaking vLLM's metric names."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvflow.scheduler.core import Scheduler
from kvflow.scheduler.fleet import Fleet
from kvflow.scheduler.placement import Placement, PlacementRequest
from kvflow.scheduler.telemetry import (
    MetricsParseError,
    MetricsScraper,
    fleet_endpoints,
    parse_vllm_metrics,
)
from tests.fleets import one_pool_fleet
from tests.waiting import eventually

MODEL = "tiny-llama"

# The shape of vLLM's /metrics page (v1 engine): gauges, a counter, an info-style gauge and a
# histogram, with the engine and model_name labels vLLM puts on them.
VLLM_METRICS = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 1234.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny-llama"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 1.0
vllm:num_requests_waiting{engine="1",model_name="tiny-llama"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny-llama"} 0.375
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",\
engine="0",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="455",\
prefix_caching_hash_algo="sha256",swap_space="4"} 1.0
vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",\
engine="1",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="455",\
prefix_caching_hash_algo="sha256",swap_space="4"} 1.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny-llama"} 1200.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny-llama"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny-llama"} 7.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny-llama"} 7.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny-llama"} 0.42
"""


class MetricsServer(ThreadingHTTPServer):
    """A vLLM-like server that serves whatever /metrics text the test sets."""

    daemon_threads = True
    text = VLLM_METRICS
    status = 200
    scrapes = 0
    models: list[str] | None = None
    """When set, `/v1/models` lists these names (as vLLM does); otherwise it answers 404."""


class Handler(BaseHTTPRequestHandler):
    server: MetricsServer

    def do_GET(self) -> None:
        if self.path == "/v1/models" and self.server.models:
            body = json.dumps({"data": [{"id": m} for m in self.server.models]}).encode()
            status = 200
        else:
            self.server.scrapes += self.path == "/metrics"
            body = self.server.text.encode() if self.path == "/metrics" else b"not found"
            status = self.server.status if self.path == "/metrics" else 404
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve(port: int = 0) -> tuple[MetricsServer, threading.Thread]:
    server = MetricsServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread


def stop(server: MetricsServer, thread: threading.Thread) -> None:
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.fixture
def vllm_like() -> Iterator[MetricsServer]:
    server, thread = serve()
    try:
        yield server
    finally:
        stop(server, thread)


def fleet_with(urls: list[str]) -> Fleet:
    return one_pool_fleet(MODEL, replicas=len(urls), endpoints=urls, context_length=1024)


def url_of(server: MetricsServer) -> str:
    host, port = server.server_address[:2]
    return f"http://{host!s}:{port}"


def test_parser_reads_vllms_load_cache_and_served_model() -> None:
    metrics = parse_vllm_metrics(VLLM_METRICS)
    assert metrics.running == 5 and metrics.waiting == 1
    assert metrics.kv_cache_usage == 0.375  # the fullest engine
    assert metrics.block_size == 128
    assert metrics.num_gpu_blocks == 910  # both engines
    assert metrics.models == (MODEL,)


def test_parser_refuses_a_page_that_is_not_vllms() -> None:
    with pytest.raises(MetricsParseError, match="no vllm"):
        parse_vllm_metrics("# TYPE up gauge\nup 1.0\n")
    with pytest.raises(MetricsParseError, match="not Prometheus"):
        parse_vllm_metrics("<html>a login page</html>\n")


def test_cache_size_unknown_before_vllm_sizes_it() -> None:
    text = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n'
    metrics = parse_vllm_metrics(text)
    assert metrics.block_size == 16 and metrics.num_gpu_blocks is None


async def test_scraper_feeds_the_scheduler_what_the_server_reports(
    vllm_like: MetricsServer,
) -> None:
    fleet = fleet_with([url_of(vllm_like)])
    scheduler = Scheduler(fleet)
    async with MetricsScraper(scheduler, fleet_endpoints(fleet)) as scraper:
        results = await scraper.scrape_once()
    assert results["cpu/0"] is not None
    (status,) = scheduler.status()
    assert (status.running, status.waiting, status.kv_cache_usage) == (5, 1, 0.375)
    assert (status.block_size, status.num_gpu_blocks, status.up) == (128, 910, True)
    assert status.warm_models == [MODEL]
    assert vllm_like.scrapes == 1


async def test_a_replica_that_stops_answering_is_marked_down_and_back_up_when_it_returns() -> None:
    first, first_thread = serve()
    second, second_thread = serve()
    port = first.server_address[1]
    fleet = fleet_with([url_of(first), url_of(second)])
    scheduler = Scheduler(fleet)
    request = PlacementRequest(
        model=MODEL, prompt_tokens=100, max_output_tokens=10, tenant="acme", workflow_id="wf"
    )
    try:
        async with MetricsScraper(
            scheduler, fleet_endpoints(fleet), timeout_s=1.0, failures_before_down=2
        ) as scraper:
            await scraper.scrape_once()
            stop(first, first_thread)  # cpu/0 stops answering: its connection is refused
            await scraper.scrape_once()
            assert {s.replica: s.up for s in scheduler.status()} == {
                "cpu/0": False,
                "cpu/1": True,
            }
            for i in range(5):
                result = scheduler.place(request.model_copy(update={"workflow_id": f"w{i}"}))
                assert isinstance(result, Placement) and result.replica == "cpu/1"

            second.status = 500  # an error page is a failure too, confirmed at once
            await scraper.scrape_once()
            refusal = scheduler.place(request)
            assert not isinstance(refusal, Placement)
            assert refusal.reason == "no_replica" and refusal.retryable

            first, first_thread = serve(port)  # cpu/0 is back on its address
            await scraper.scrape_once()
            assert {s.replica: s.up for s in scheduler.status()}["cpu/0"] is True
    finally:
        stop(first, first_thread)
        stop(second, second_thread)


async def test_the_scrape_loop_runs_until_stopped(vllm_like: MetricsServer) -> None:
    fleet = fleet_with([url_of(vllm_like)])
    scheduler = Scheduler(fleet)
    async with MetricsScraper(scheduler, fleet_endpoints(fleet), interval_s=0.02) as scraper:
        task = asyncio.create_task(scraper.run())
        await eventually(lambda: vllm_like.scrapes >= 3, within=5, what="three scrapes")
        scraper.stop()
        await asyncio.wait_for(task, timeout=5)


def test_endpoints_must_name_replicas_of_the_fleet() -> None:
    scheduler = Scheduler(fleet_with(["http://127.0.0.1:1"]))
    with pytest.raises(ValueError, match="unknown replicas"):
        MetricsScraper(scheduler, {"gpu/9": "http://127.0.0.1:1"})


async def test_every_served_name_counts_as_warm_not_only_the_metrics_label(
    vllm_like: MetricsServer,
) -> None:
    # vLLM started with --served-model-name A B labels its metrics with A only.
    vllm_like.models = [MODEL, "tiny-alias"]
    fleet = Fleet.model_validate(
        {
            **fleet_with([url_of(vllm_like)]).model_dump(mode="json"),
            "models": [
                *fleet_with([url_of(vllm_like)]).model_dump(mode="json")["models"],
                {
                    "name": "tiny-alias",
                    "parameters_b": 0.01,
                    "layers": 2,
                    "kv_heads": 4,
                    "head_dim": 32,
                    "context_length": 1024,
                },
            ],
        }
    )
    scheduler = Scheduler(fleet)
    async with MetricsScraper(scheduler, fleet_endpoints(fleet)) as scraper:
        await scraper.scrape_once()
        await scraper.scrape_once()
    (status,) = scheduler.status()
    assert set(status.warm_models) == {MODEL, "tiny-alias"}
    assert vllm_like.scrapes == 2

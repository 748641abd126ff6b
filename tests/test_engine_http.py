"""kvflow's clients of engines never reuse a connection the engine may be closing.

Engines' HTTP servers (uvicorn, under vLLM, SGLang and the simulator) close a connection after
5 s idle; a request sent on it just then fails before any answer and costs a re-placed call.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn

from kvflow.activities.inference import default_http_client
from kvflow.activities.tokenize import VllmTokenize
from kvflow.scheduler.core import Scheduler
from kvflow.scheduler.engine_http import ENGINE_KEEPALIVE_EXPIRY_S
from kvflow.scheduler.telemetry import MetricsScraper
from tests.stacks import MODEL, PoolPlan, fleet_for
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(60)

SERVER_KEEPALIVE_S = 5
"""vLLM's and uvicorn's default idle timeout (`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`)."""


async def client_port(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An ASGI app answering with the port the request came from (one per connection).

    As an engine would: `/tokenize` the port as the only token id, `/metrics` as the number of
    waiting requests, `/v1/models` one model; any other path, the port as text.
    """
    if scope["type"] != "http":
        return
    port = scope["client"][1]
    body: bytes = str(port).encode()
    if scope["path"] == "/tokenize":
        body = json.dumps({"tokens": [port]}).encode()
    elif scope["path"] == "/metrics":
        body = f'vllm:num_requests_waiting{{model_name="{MODEL}"}} {port}\n'.encode()
    elif scope["path"] == "/v1/models":
        body = json.dumps({"data": [{"id": MODEL}]}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
async def engine_like() -> AsyncIterator[str]:
    """A uvicorn server with an engine's keep-alive timeout; yields its base URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = uvicorn.Config(
        client_port,
        host="127.0.0.1",
        port=port,
        timeout_keep_alive=SERVER_KEEPALIVE_S,
        log_level="warning",
        lifespan="off",
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    await eventually(lambda: server.started, within=20, what="the server listens", interval=0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    await task


async def test_an_idle_connection_is_dropped_before_the_engine_closes_it(engine_like: str):
    assert ENGINE_KEEPALIVE_EXPIRY_S < SERVER_KEEPALIVE_S
    async with default_http_client() as http:  # the GPU worker's client
        first = (await http.get(engine_like)).text
        # Back to back, the pooled connection is reused...
        assert (await http.get(engine_like)).text == first
        # ...but not once it has idled for longer than the client keeps it, well before the
        # engine would close it under a request.
        await asyncio.sleep(ENGINE_KEEPALIVE_EXPIRY_S + 0.5)
        assert (await http.get(engine_like)).text != first


async def test_the_tokenizer_drops_an_idle_connection_too(engine_like: str):
    tokenizer = VllmTokenize([engine_like], MODEL)  # the client it makes for itself
    try:
        # Each text its own round trip (answers are cached by request).
        [first] = await tokenizer.encode("one")
        assert await tokenizer.encode("two") == [first]
        await asyncio.sleep(ENGINE_KEEPALIVE_EXPIRY_S + 0.5)
        assert await tokenizer.encode("three") != [first]
    finally:
        await tokenizer.aclose()


async def test_the_metrics_scraper_drops_an_idle_connection_too(engine_like: str):
    scheduler = Scheduler(fleet_for([PoolPlan("cpu")]))
    async with MetricsScraper(scheduler, {"cpu/0": engine_like}) as scraper:
        first = await scraper.scrape_replica("cpu/0")
        assert first is not None and first.models == (MODEL,)
        again = await scraper.scrape_replica("cpu/0")
        assert again is not None and again.waiting == first.waiting
        await asyncio.sleep(ENGINE_KEEPALIVE_EXPIRY_S + 0.5)
        later = await scraper.scrape_replica("cpu/0")
        assert later is not None and later.waiting != first.waiting

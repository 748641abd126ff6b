"""kvflow's clients of engines never reuse a connection the engine may be closing.

Engines' HTTP servers (uvicorn, under vLLM, SGLang and the simulator) close a connection after
5 s idle; a request sent on it just then fails before any answer and costs a re-placed call.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn

from kvflow.activities.inference import default_http_client
from kvflow.scheduler.engine_http import ENGINE_KEEPALIVE_EXPIRY_S
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(60)

SERVER_KEEPALIVE_S = 5
"""vLLM's and uvicorn's default idle timeout (`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`)."""


async def client_port(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An ASGI app answering with the port the request came from (one per connection)."""
    if scope["type"] != "http":
        return
    body = str(scope["client"][1]).encode()
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

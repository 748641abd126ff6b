"""A reverse proxy in front of a vLLM-compatible server that breaks calls on command.

It lets the same test cut a stream, answer 503 or stall, whether the server behind it is the
simulator or real vLLM. In front of the simulator it can instead pass each model call a
simulator fault header of its choosing (`fault_header`), so that a share of calls fail in the
simulator's own ways. It runs uvicorn in a thread on a free port.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvflow.ports import free_port
from kvflow.simulator.faults import FAULT_HEADER


class CutConnection(Exception):
    """Raised inside the streaming body: uvicorn then drops the connection mid-response."""


@dataclass
class Fault:
    """What the proxy does to the next calls (applies to every call until cleared)."""

    cut_after_chunks: int | None = None
    status: int | None = None
    stall_s: float = 0.0
    chunk_delay_s: float = 0.0
    """Delay before each streamed chunk: makes a fast server stream slowly."""
    hold_after_chunks: int | None = None
    """Hold every stream after this many chunks until `FaultyProxy.release` is set."""


class FaultyProxy:
    """Forwards `/v1/*`, `/health` and the rest to `upstream`, applying `fault`."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.fault = Fault()
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.cuts = 0
        self.streams_closed_early = 0
        self.fault_header: Callable[[], str | None] | None = None
        """Chooses each model call's `x-kvflow-fault` value (None: send none)."""
        self.headers_sent: Counter[str] = Counter()
        """How many calls got each fault header value."""
        self.holding = threading.Event()
        """Set once a stream is held (`Fault.hold_after_chunks`)."""
        self.release = threading.Event()
        """Set it to let held streams go on."""
        self.cut_on_release = False
        """Cut held streams when released instead of letting them go on."""
        app = Starlette(routes=[Route("/{path:path}", self._forward, methods=["GET", "POST"])])
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def start(self) -> FaultyProxy:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("proxy did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    async def _forward(self, request: Request) -> Response:
        fault = self.fault
        if fault.status is not None:
            return JSONResponse(
                {
                    "error": {
                        "message": "injected by proxy",
                        "type": "ServiceUnavailable",
                        "param": None,
                        "code": fault.status,
                    }
                },
                status_code=fault.status,
            )
        if fault.stall_s:
            await asyncio.sleep(fault.stall_s)
        client = httpx.AsyncClient(timeout=None)
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        if self.fault_header is not None and request.method == "POST":
            value = self.fault_header()
            if value is not None:
                headers[FAULT_HEADER] = value
                self.headers_sent[value] += 1
        upstream = client.build_request(
            request.method,
            f"{self.upstream}{request.url.path}",
            content=await request.body(),
            headers=headers,
        )
        response = await client.send(upstream, stream=True)

        async def body() -> AsyncIterator[bytes]:
            chunks = 0
            try:
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        chunks += 1
                        if fault.chunk_delay_s:
                            await asyncio.sleep(fault.chunk_delay_s)
                        if fault.hold_after_chunks is not None and chunks > fault.hold_after_chunks:
                            self.holding.set()
                            # Bounded, so that a test that never releases cannot hang it.
                            await asyncio.to_thread(self.release.wait, 60)
                            if self.cut_on_release:
                                self.cuts += 1
                                raise CutConnection
                        if fault.cut_after_chunks is not None and chunks > fault.cut_after_chunks:
                            self.cuts += 1
                            raise CutConnection
                    yield (line + "\n").encode()
            except BaseException:
                self.streams_closed_early += 1
                raise
            finally:
                await response.aclose()
                await client.aclose()

        return StreamingResponse(
            body(),
            status_code=response.status_code,
            media_type=response.headers.get("content-type"),
        )

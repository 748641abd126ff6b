"""How kvflow's HTTP clients keep their connections to engines (vLLM, SGLang, llm-d, Dynamo).

An engine's HTTP server closes a connection that has been idle for its keep-alive timeout:
5 s for vLLM (`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`) and for uvicorn, which serves vLLM, SGLang and
kvflow's simulator. httpx keeps an idle pooled connection for 5 s by default as well, so a
request sent on a connection just as the server closes it fails before any answer (a
`ReadError` or "Server disconnected without sending a response"): an inference call is then
cut and re-placed as a failed attempt, a scrape fails, a tokenize call tries the next
replica. Keeping idle connections for less than the server does removes that race.
"""

from __future__ import annotations

import httpx

__all__ = ["ENGINE_KEEPALIVE_EXPIRY_S", "engine_limits"]

ENGINE_KEEPALIVE_EXPIRY_S = 2.0
"""How long an idle connection to an engine stays pooled: well under the engines' 5 s."""


def engine_limits(
    max_connections: int | None = 100, max_keepalive_connections: int | None = 20
) -> httpx.Limits:
    """Connection limits for a client of engines; the counts are httpx's defaults."""
    return httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_keepalive_connections,
        keepalive_expiry=ENGINE_KEEPALIVE_EXPIRY_S,
    )

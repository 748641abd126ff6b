"""One replica of the fleet as a GPU worker sees it: its pool, index and vLLM server."""

from __future__ import annotations

import httpx

from kvflow.activities.inference import ReplicaBinding
from kvflow.scheduler.redact import redact_url
from kvflow.workers.config import FleetConfig


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
    return ReplicaBinding(
        pool=pool,
        index=index,
        base_url=endpoint.rstrip("/"),
        shared_prefixes=fleet.cache.shared_prefixes,
    )


async def check_endpoint(binding: ReplicaBinding, http: httpx.AsyncClient) -> None:
    """Raise `GpuWorkerError` unless the replica's vLLM server answers `/health` with 200."""
    url = f"{binding.base_url}/health"
    try:
        response = await http.get(url, timeout=5.0)
    except httpx.HTTPError as exc:
        raise GpuWorkerError(
            f"vLLM for {binding.name} is not answering at {redact_url(url)} "
            f"({type(exc).__name__}); "
            "start it, or fix the endpoint in fleet.toml / --endpoint"
        ) from None
    if response.status_code != 200:
        raise GpuWorkerError(
            f"vLLM for {binding.name} at {redact_url(url)} answered {response.status_code}; "
            "it is not healthy"
        )

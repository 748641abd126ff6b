"""Small fleets for the scheduler's tests against one tiny model (simulator or real vLLM)."""

from __future__ import annotations

import uuid

from kvflow.activities.inference import ReplicaBinding
from kvflow.scheduler.fleet import Fleet


def one_pool_fleet(
    model: str,
    *,
    replicas: int = 1,
    endpoints: list[str] | None = None,
    context_length: int = 4096,
) -> Fleet:
    """One pool of `replicas` CPU-sized replicas serving `model`, one tenant (acme, tier 2)."""
    pool: dict[str, object] = {
        "name": "cpu",
        "gpu": "L4",
        "replicas": replicas,
        "price_per_gpu_hour_usd": "0.5",
        "token_prices": {
            "input_per_mtok_usd": "0.1",
            "cached_input_per_mtok_usd": "0.01",
            "output_per_mtok_usd": "0.3",
        },
        "warm_models": [model],
    }
    if endpoints is not None:
        pool["endpoints"] = endpoints
    return Fleet.model_validate(
        {
            "models": [
                {
                    "name": model,
                    "parameters_b": 0.01,
                    "layers": 2,
                    "kv_heads": 4,
                    "head_dim": 32,
                    "context_length": context_length,
                }
            ],
            "pools": [pool],
            "tenants": [{"name": "acme", "tier": 2}],
        }
    )


def unshared_binding(index: int = 0) -> ReplicaBinding:
    """Replica `index` of a pool named for this call alone; no server answers it.

    For tests that build a GPU worker without running it: Temporal refuses a second worker on
    one task queue of one client, and a worker built but never run keeps its queue for the
    session, so each such worker gets a queue of its own.
    """
    fleet = one_pool_fleet("tiny", replicas=index + 1)
    pool = fleet.pool("cpu").model_copy(update={"name": f"unshared-{uuid.uuid4().hex[:12]}"})
    return ReplicaBinding(pool=pool, index=index, base_url="http://127.0.0.1:9")

"""Small fleets for the scheduler's tests against one tiny model (simulator or real vLLM)."""

from __future__ import annotations

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

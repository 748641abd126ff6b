"""NVIDIA Dynamo's KV router: the lowest expected work after the prompt's cached overlap.

Source: Dynamo, router concepts docs (`docs/router/kv_cache_routing.md`) and
`lib/llm/src/kv_router/scheduler.rs` (`DefaultWorkerSelector`):

    potential prefill blocks = active prefill blocks + prompt blocks − overlap blocks
    cost(w) = prefill_load_scale · max(potential prefill blocks, 0)
              + active decode blocks + incoming blocks
    the lowest cost wins (`router_temperature` 0: no softmax sampling; ties at random)

`prefill_load_scale` (`kv_overlap_score_weight`) is 1.0 by default. The overlap comes from
the engines' KV events (read here from the engines' caches), the active blocks from the
router's own tracking of the sequences it sent (read here from the engines' live requests:
tokens still to prefill, and KV of decoding requests).
"""

from __future__ import annotations

import random

from kvflow.simulator.des import FleetRequest, FleetView, candidates
from kvflow.simulator.policies.base import PolicySetup, RequestRouter, prompt_blocks

PREFILL_LOAD_SCALE = 1.0


class DynamoKvPolicy(RequestRouter):
    """Dynamo's KV-aware worker selection (module docstring)."""

    name = "dynamo"

    def __init__(self, setup: PolicySetup) -> None:
        self.block_size = setup.block_size
        self._rng = random.Random(setup.seed)

    def route(self, request: FleetRequest, fleet: FleetView, now: float) -> int | None:
        """The worker of least cost."""
        serving = candidates(request, fleet)
        if not serving:
            return None
        size = self.block_size
        blocks = prompt_blocks(request, size)
        incoming = -(-request.prompt_tokens // size)
        best: list[int] = []
        best_cost = 0.0
        for i in serving:
            overlap = fleet.cached_tokens(i, request.model, blocks) // size
            prefill_tokens, decode_tokens = fleet.active_tokens(i)
            potential = -(-prefill_tokens // size) + incoming - overlap
            cost = PREFILL_LOAD_SCALE * max(potential, 0) + decode_tokens / size + incoming
            if not best or cost < best_cost - 1e-9:
                best, best_cost = [i], cost
            elif abs(cost - best_cost) <= 1e-9:
                best.append(i)
        return best[0] if len(best) == 1 else self._rng.choice(best)

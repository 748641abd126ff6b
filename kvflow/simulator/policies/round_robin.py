"""round-robin: each replica that serves the model in turn.

What a Kubernetes Service does for HTTP, and vLLM production-stack's default router
(`src/vllm_router/routers/routing_logic.py`, `RoundRobinRouter`).
"""

from __future__ import annotations

import itertools

from kvflow.simulator.des import FleetRequest, FleetView, candidates
from kvflow.simulator.policies.base import PolicySetup, RequestRouter


class RoundRobinPolicy(RequestRouter):
    """The next candidate in turn."""

    name = "round-robin"

    def __init__(self, setup: PolicySetup) -> None:
        self._turn = itertools.count()

    def route(self, request: FleetRequest, fleet: FleetView, now: float) -> int | None:
        """The next replica in turn."""
        serving = candidates(request, fleet)
        return serving[next(self._turn) % len(serving)] if serving else None

"""random: every call to a replica drawn uniformly at random (seeded).

The baseline that knows nothing: llm-d's published comparison runs it ("random", 93 s p90
TTFT on 8 pods), and AIBrix reports its TTFT against it. Source: no system's default; the
`random` picker of llm-d's scheduler (`pkg/epp/scheduling/framework/plugins/picker/
random_picker.go`) is the same rule.
"""

from __future__ import annotations

import random

from kvflow.simulator.des import FleetRequest, FleetView, candidates
from kvflow.simulator.policies.base import PolicySetup, RequestRouter


class RandomPolicy(RequestRouter):
    """A uniformly random replica among those that serve the model and are up."""

    name = "random"

    def __init__(self, setup: PolicySetup) -> None:
        self._rng = random.Random(setup.seed)

    def route(self, request: FleetRequest, fleet: FleetView, now: float) -> int | None:
        """A random candidate."""
        serving = candidates(request, fleet)
        return self._rng.choice(serving) if serving else None

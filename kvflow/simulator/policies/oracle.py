"""greedy-reference: a greedy placement that reads every engine's cache and load exactly.

    candidates = replicas whose load (running + waiting, live) ≤ 1.5 · mean load + 1
    the candidate holding the most of the prompt's prefix wins; ties: the least loaded

It reads the engines themselves (no index, no staleness) and keeps load within the bound the
hotspot goal asks of every policy. It is a reference, not a bound: greedy on each call, it
knows nothing of a task's later steps, and a policy may beat it (on hit rate by piling load,
on cost by keeping a paused conversation's cache). The bound on cost is the zero-miss floor
(`kvflow.bench.policies.zero_miss_floor`). The benchmark also uses it to measure a
workload's capacity (`capacity_tasks_per_s`), since it needs no telemetry to warm up.
"""

from __future__ import annotations

from kvflow.simulator.des import FleetRequest, FleetView, candidates
from kvflow.simulator.policies.base import PolicySetup, RequestRouter, prompt_blocks

LOAD_BOUND = 1.5
GREEDY_REFERENCE = "greedy-reference"


class GreedyReferencePolicy(RequestRouter):
    """Most cached prefix under a bound on load (module docstring)."""

    name = GREEDY_REFERENCE

    def __init__(self, setup: PolicySetup) -> None:
        self.block_size = setup.block_size

    def route(self, request: FleetRequest, fleet: FleetView, now: float) -> int | None:
        """The best-cached replica within the load bound."""
        serving = candidates(request, fleet)
        if not serving:
            return None
        loads = {i: fleet.load(i) for i in serving}
        bound = LOAD_BOUND * sum(loads.values()) / len(loads) + 1
        blocks = prompt_blocks(request, self.block_size)
        return max(
            (i for i in serving if loads[i] <= bound),
            key=lambda i: (fleet.cached_tokens(i, request.model, blocks), -loads[i]),
        )

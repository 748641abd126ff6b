"""least-loaded: the replica with the fewest waiting + running requests (scraped).

load = `vllm:num_requests_waiting` + `vllm:num_requests_running` from the last scrape;
lowest load wins, ties to the lowest index: the "load-only" comparison point of llm-d's
published benchmark. AIBrix's `least-request` strategy
(`pkg/plugins/gateway/algorithms/least_request.go`) differs: it counts the requests the
gateway itself has in flight to each pod and breaks ties at random.
"""

from __future__ import annotations

from kvflow.simulator.des import FleetRequest, FleetView, candidates
from kvflow.simulator.policies.base import PolicySetup, RequestRouter


class LeastLoadedPolicy(RequestRouter):
    """Fewest waiting + running requests (scraped)."""

    name = "least-loaded"

    def __init__(self, setup: PolicySetup) -> None:
        pass

    def route(self, request: FleetRequest, fleet: FleetView, now: float) -> int | None:
        """The least loaded candidate."""
        metrics = fleet.metrics
        return min(
            candidates(request, fleet),
            key=lambda i: metrics[i].running + metrics[i].waiting,
            default=None,
        )

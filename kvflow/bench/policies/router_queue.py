"""A router-side queue with admission: what the benchmark harness puts in front of every policy.

Flow control as llm-d's endpoint picker does it (Gateway API Inference Extension,
`pkg/epp/saturationdetector/config.go` and `pkg/epp/flowcontrol/`):

    a replica has capacity  ⇔  scraped waiting < 5  and  scraped KV-cache usage < 0.8
    the model is saturated  ⇔  no replica that serves it, is up, has capacity
    while saturated a call waits; otherwise the waiting calls are dispatched in strict
    priority (tier 1 first), first come first served within a tier

Each dispatch cycle (a call's arrival, and every 50 ms while calls wait: the metrics refresh)
sends at most the free queue places of the replicas with capacity, Σ (5 − waiting), less the
calls already sent since the last scrape, which the metrics do not show yet. The policy then
places each dispatched call as it would any other. A call's task may end (its deadline) while
it waits; it is dropped when reached.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from kvflow.simulator.des import FleetRequest, FleetView

QUEUE_DEPTH_THRESHOLD = 5
"""A replica with this many waiting requests is saturated (llm-d's default)."""
KV_CACHE_UTIL_THRESHOLD = 0.8
"""A replica whose KV cache is this full is saturated (llm-d's default)."""
DISPATCH_INTERVAL_S = 0.05
"""How often waiting calls are reconsidered: the metrics refresh interval."""


@dataclass(frozen=True, slots=True)
class QueuedCall:
    """A call waiting for admission, with when it was queued."""

    request: FleetRequest
    tier: int
    queued_at: float


class RouterQueue:
    """Strict-priority waiting calls and the saturation test that releases them."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, QueuedCall]] = []
        self._order = itertools.count()
        self._sent_since_scrape = 0
        self._scraped_at = float("-inf")

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, request: FleetRequest, tier: int, now: float) -> None:
        """Queue `request` behind the calls of its tier (ahead of every lower tier)."""
        call = QueuedCall(request, tier, now)
        heapq.heappush(self._heap, (tier, next(self._order), call))

    def free_places(self, fleet: FleetView, model: str) -> int:
        """Calls the replicas serving `model` with capacity can take now (module docstring)."""
        if fleet.scraped_at != self._scraped_at:
            self._scraped_at = fleet.scraped_at
            self._sent_since_scrape = 0
        places = 0
        for index, snapshot in enumerate(fleet.metrics):
            if not fleet.up[index] or not fleet.serves(index, model):
                continue
            if (
                snapshot.waiting < QUEUE_DEPTH_THRESHOLD
                and snapshot.kv_cache_usage < KV_CACHE_UTIL_THRESHOLD
            ):
                places += QUEUE_DEPTH_THRESHOLD - snapshot.waiting
        return max(0, places - self._sent_since_scrape)

    def dispatch(
        self,
        fleet: FleetView,
        send: Callable[[FleetRequest], None],
        alive: Callable[[FleetRequest], bool],
    ) -> int:
        """Send the waiting calls admission lets through, best tier first; how many were sent.

        `alive(request)` says whether the call's task still runs (dead calls are dropped).
        """
        sent = 0
        places: dict[str, int] = {}
        heap = self._heap
        while heap:
            call = heap[0][2]
            request = call.request
            if not alive(request):
                heapq.heappop(heap)
                continue
            free = places.get(request.model)
            if free is None:
                free = places[request.model] = self.free_places(fleet, request.model)
            if free <= 0:
                # Strict priority: nothing of a lower tier passes a waiting higher one.
                break
            heapq.heappop(heap)
            places[request.model] = free - 1
            self._sent_since_scrape += 1
            send(request)
            sent += 1
        return sent

"""The placement interface of the discrete-event fleet, and what the anchor policies share.

A `PlacementPolicy` is a `kvflow.simulator.des.Router` (it chooses the replica of each call,
or refuses it) that also hears what a router in production hears: each refresh of the
replicas' `/metrics` (`on_scrape`), each engine step with its KV-cache events (`on_step`),
how each attempt ended (`on_attempt_end`) and that a replica was found down
(`on_replica_down`). A policy ignores what its source system does not use.

Every policy is built from one `PolicySetup` and sees the same calls: a `FleetRequest` whose
`context` is the call's `TaskContext`. Anchors (request routers) look only at the prompt, the
model and the fleet; kvflow also reads the task context, as its workflow sends it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvflow.scheduler.fleet import Fleet
from kvflow.simulator.des import FleetRequest, FleetView
from kvflow.simulator.engine import StepResult


@dataclass(slots=True)
class TaskContext:
    """What the workflow of a call knows about its task (what kvflow's step API sends)."""

    workflow_id: str
    tenant: str
    tier: int
    deadline_at: float | None
    """Simulated time by which every step must have finished."""
    steps_remaining: int
    """Model calls left, this one included."""
    max_tokens: int
    """The call's output cap (what the workflow asks for, not what it will get)."""
    spent_micros: int = 0
    previous_replica: int | None = None
    task_retries: int = 0


@dataclass(slots=True)
class AttemptEnd:
    """How one attempt of a call ended, as the workflow reports it."""

    request: FleetRequest
    replica: int
    ok: bool
    replica_fault: bool = True
    """False when the call was cancelled (its task's deadline passed), not failed."""
    queue_s: float = 0.0
    ttft_s: float = 0.0
    duration_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost_micros: int = 0


TokensOf = Callable[[int, int], Sequence[int]]
"""(parent block hash, block hash) → the block's token ids, for KV events of the fleet."""


@dataclass
class PolicySetup:
    """What every policy may be built from: the fleet and how to read its KV events."""

    fleet: Fleet
    replica_names: list[str]
    """Replica index in the simulated fleet → its name in `fleet` (`pool/index`)."""
    block_size: int
    clock: Callable[[], float]
    tokens_of: TokensOf
    seed: int = 0
    extra: dict[str, object] = field(default_factory=dict)
    """Policy-specific settings (e.g. kvflow's `SchedulerConfig` under "scheduler_config")."""


class PlacementPolicy(Protocol):
    """A router of the discrete-event fleet with the telemetry hooks (module docstring)."""

    name: str

    def route(self, request: FleetRequest, fleet: FleetView, now: float) -> int | None:
        """The replica that gets `request`, or None to refuse it."""
        ...

    def retry_after(self, request: FleetRequest) -> float | None:
        """After a refusal: seconds after which the call may be placed again, or None."""
        ...

    def on_scrape(self, fleet: FleetView, now: float) -> None:
        """The replicas' metrics were scraped (`fleet.metrics`)."""
        ...

    def on_step(self, replica: int, result: StepResult) -> None:
        """An engine step ended on `replica` (its KV events in `result.kv_events`)."""
        ...

    def on_attempt_end(self, end: AttemptEnd) -> None:
        """An attempt finished or failed."""
        ...

    def on_replica_down(self, replica: int) -> None:
        """A health check found `replica` down."""
        ...


class RequestRouter:
    """Base of the anchor policies: no-op telemetry hooks, never asks for a later retry."""

    name = "router"

    def retry_after(self, request: FleetRequest) -> float | None:
        """Routers do not refuse with a retry-after."""
        return None

    def on_scrape(self, fleet: FleetView, now: float) -> None:
        """Nothing to do: the policy reads `fleet.metrics` when it routes."""

    def on_step(self, replica: int, result: StepResult) -> None:
        """Nothing to do."""

    def on_attempt_end(self, end: AttemptEnd) -> None:
        """Nothing to do."""

    def on_replica_down(self, replica: int) -> None:
        """Nothing to do: `fleet.up` says it."""


def prompt_blocks(request: FleetRequest, block_size: int) -> list[int]:
    """The hashes of the prompt's full blocks (a workload's chain may run into the output)."""
    return request.block_hashes[: request.prompt_tokens // block_size]


class InflightCounter:
    """A router's own count of the requests it sent to each replica that have not ended."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}

    def sent(self, replica: int) -> None:
        """A request went to `replica`."""
        self.counts[replica] = self.counts.get(replica, 0) + 1

    def ended(self, replica: int) -> None:
        """A request on `replica` ended."""
        if replica >= 0 and self.counts.get(replica, 0) > 0:
            self.counts[replica] -= 1

    def __getitem__(self, replica: int) -> int:
        return self.counts.get(replica, 0)


class ApproximatePrefixCache:
    """Which server was sent which prompt blocks: an LRU of block hashes per server.

    The index a router builds from its own routing decisions (llm-d's prefix-cache scorer,
    SGLang's approximate radix tree, AIBrix's prefix indexer): after routing a prompt to a
    server, its blocks are assumed cached there; each server keeps at most
    `capacity_blocks`, least recently used evicted first. `match` counts the leading blocks of
    a prompt each server holds, at most `max_blocks` (O(blocks × holders), through the
    inverted map block → servers).
    """

    def __init__(self, capacity_blocks: int, max_blocks: int | None = None) -> None:
        self.capacity_blocks = capacity_blocks
        self.max_blocks = max_blocks
        self._holders: dict[int, set[int]] = {}
        self._lru: dict[int, OrderedDict[int, None]] = {}

    def match(self, hashes: Sequence[int]) -> dict[int, int]:
        """Server → leading blocks of `hashes` it holds (servers holding none are left out)."""
        if self.max_blocks is not None:
            hashes = hashes[: self.max_blocks]
        matched: dict[int, int] = {}
        alive: set[int] | None = None
        for depth, h in enumerate(hashes, start=1):
            holders = self._holders.get(h)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for server in alive:
                matched[server] = depth
        return matched

    def record(self, server: int, hashes: Sequence[int]) -> None:
        """`hashes` were sent to `server`: they are its most recently used blocks."""
        if self.max_blocks is not None:
            hashes = hashes[: self.max_blocks]
        lru = self._lru.setdefault(server, OrderedDict())
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._holders.setdefault(h, set()).add(server)
        while len(lru) > self.capacity_blocks:
            old, _ = lru.popitem(last=False)
            holders = self._holders.get(old)
            if holders is not None:
                holders.discard(server)
                if not holders:
                    del self._holders[old]

    def forget(self, server: int) -> None:
        """Drop everything `server` holds (it went down)."""
        for h in self._lru.pop(server, OrderedDict()):
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(server)
                if not holders:
                    del self._holders[h]

"""The placement interface of the discrete-event fleet, and what the anchor policies share.

A `PlacementPolicy` is a `kvflow.simulator.des.Router` (it chooses the replica of each call,
or refuses it) that also hears what a router in production hears: each refresh of the
replicas' `/metrics` (`on_scrape`), each engine step with its KV-cache events (`on_step`),
how each attempt ended (`on_attempt_end`), that a replica was found down
(`on_replica_down`) and that a task ended (`on_task_end`, which kvflow's workflow sends when it
writes the task's ledger row). A policy ignores what its source system does not use.

Every policy is built from one `PolicySetup` and sees the same calls: a `FleetRequest` whose
`context` is the call's `TaskContext`, holding only what production would know when the call
is placed (what the task declared, what was observed so far; never the task's future). Anchors
(request routers) look only at the prompt, the model and the fleet; kvflow also reads the task
context, as its workflow sends it; the anchors' tuned variants read the hints in it.

**Mechanisms** around placement are the harness's, the same for every policy
(`PolicySetup.extra["mechanisms"]`, a frozenset of the names below):

- `ENGINE_PRIORITY`: each call carries its tier as the engine's priority (vLLM's
  `--scheduling-policy priority`, lower first); kvflow may refine the order within it;
- `ROUTER_QUEUE`: calls wait in a router-side queue, strict priority by tier, while every
  replica is saturated (llm-d's flow control); a refusal with a retry-after waits there too;
- `HINTS`: `TaskContext.session_id` and `expected_output_tokens` are filled (Dynamo's agent
  hints `osl` and session id, llm-d's session key); a policy that documents hints reads them
  only when this is on;
- `KV_RETENTION`: the engines keep a finished call's KV blocks at the retention priority and
  for the duration the call asked for (TensorRT-LLM's KV cache retention, which Dynamo's
  `agent_hints.priority` drives; `EngineConfig.kv_retention`); a policy that documents such
  hints sets `FleetRequest.retention_priority` and `retention_s`, the others leave the engine
  evicting least recently used first, as vLLM does;
- `TASK_END`: when a task ends, the client tells the engines its conversation will not be
  back, and they evict its blocks before any other cached block (Dynamo's
  `nvext.session_control` close, which frees an SGLang session's KV; vLLM takes no such
  request). Blocks another task shares (a system prompt) are not named. Every client knows
  when its own task ends, so every policy gets it or none does;
- `DEADLINE_PAUSE`: each call carries its step's deadline to the engine, and the engines pause
  the calls of lower tiers (another band of priority, `TIER_PRIORITY_SPAN`) while a call
  would miss its deadline at the batch's pace (`EngineConfig.deadline_pause`;
  `kvflow_vllm.scheduler.DeadlinePauseScheduler` for vLLM). The deadline is the workload's
  step allowance, which every client knows, so every policy gets it or none does;
- `FALLBACK`: a policy may degrade a call to the model's cheaper fallback
  (`extra["allow_fallback"]`); a task with a degraded call is counted apart, never as a
  success. Off in the comparison.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvflow.scheduler.fleet import Fleet
from kvflow.simulator.des import FleetRequest, FleetView
from kvflow.simulator.engine import StepResult

ENGINE_PRIORITY = "engine-priority"
ROUTER_QUEUE = "router-queue"
HINTS = "hints"
KV_RETENTION = "kv-retention"
TASK_END = "task-end"
FALLBACK = "fallback"
DEADLINE_PAUSE = "deadline-pause"
MECHANISMS = (
    ENGINE_PRIORITY,
    ROUTER_QUEUE,
    HINTS,
    KV_RETENTION,
    TASK_END,
    DEADLINE_PAUSE,
    FALLBACK,
)
"""Every mechanism the harness can apply around placement (module docstring)."""
DEFAULT_MECHANISMS = frozenset({ENGINE_PRIORITY, ROUTER_QUEUE, HINTS, DEADLINE_PAUSE})
"""What the comparison gives every policy: all but fallback, task end and KV retention. The
deadline pause acts only where a workload declares step deadlines (overload). Retention is
off because every hint that drives it cost its policy: Dynamo's priority by tier, which keeps
finished tier-1 conversations above everything else, took dynamo-tuned on overload at 1.5×
from a 92.5% hit rate to 76.9% and 1.57× the cost; kvflow's expected return cost 1.4% on
long-agent. `--mechanisms ...,kv-retention` turns it on for all."""


@dataclass(slots=True)
class TaskContext:
    """What the workflow of a call knows about its task (what kvflow's step API sends).

    Only what production knows when the call is placed: the task's declarations (tenant,
    budget, expected calls), what it has done and spent, and hints estimated from observed
    calls. Never the task's own future (its remaining steps, pauses or outputs).
    """

    workflow_id: str
    tenant: str
    tier: int
    deadline_at: float | None
    """Simulated time of the task's deadline: its arrival plus its declared budget."""
    started_at: float
    """Simulated time the task arrived (what a workflow knows of its own start)."""
    steps_remaining: int
    """Model calls left, this one included, as kvflow's step API estimates it:
    max(1, declared expected calls − calls done)."""
    max_tokens: int
    """The call's output cap (what the workflow asks for, not what it will get)."""
    spent_micros: int = 0
    previous_replica: int | None = None
    task_retries: int = 0
    step_deadline_at: float | None = None
    """When the call's step is due, where the workload sets per-step deadlines (else None)."""
    session_id: str | None = None
    """Hint: the agent session (the workflow id); None when hints are off."""
    expected_output_tokens: int | None = None
    """Hint: expected output length (Dynamo's `osl`), the running mean of the completion
    tokens of finished calls of the same application (workflow type), the workload's typical
    output before the first; None when hints are off."""
    queued_s: float = 0.0
    """How long this call has waited for admission (since its first refusal with a
    retry-after), as the workflow counts it (`PlacementRequest.queued_s`)."""
    expected_pause_s: float | None = None
    """Hint: how long the task's tool pause after this call is expected to last, the running
    mean of the pauses observed so far in tasks of the same application (kvflow learns it from
    its workflows' histories); None before the first, or when hints are off."""
    steps_done: int = 0
    """Model calls (steps) the task has completed, as its workflow counts them."""


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
    cache_salts: Mapping[int, str] = field(default_factory=dict)
    """A prompt's first block hash → the `cache_salt` hashed into it, for re-hashing KV events
    (`kvflow.simulator.workloads.Workload.cache_salts`); unsalted blocks are not in it."""
    extra: dict[str, object] = field(default_factory=dict)
    """Policy-specific settings (e.g. kvflow's `SchedulerConfig` under "scheduler_config"),
    and the harness's: "mechanisms" (a frozenset of `MECHANISMS`), "priority_dispatch" and
    "allow_fallback" (booleans derived from them)."""

    @property
    def mechanisms(self) -> frozenset[str]:
        """The mechanisms the harness applies in this run (`extra["mechanisms"]`)."""
        value = self.extra.get("mechanisms", DEFAULT_MECHANISMS)
        if isinstance(value, frozenset | set | tuple | list):
            return frozenset(str(v) for v in value)
        return frozenset()


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

    def on_task_end(self, workflow_id: str) -> None:
        """The task ended, whatever its outcome (every client knows when its task ends)."""
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

    def on_task_end(self, workflow_id: str) -> None:
        """Nothing to do: a request router keeps no state per task."""


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

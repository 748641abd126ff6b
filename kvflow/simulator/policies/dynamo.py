"""NVIDIA Dynamo's KV router: the lowest expected work after the prompt's cached overlap.

Source: Dynamo (`ai-dynamo/dynamo`), `lib/kv-router/src/scheduling/config.rs`
(`KvRouterConfig::default`), `scheduling/selector/mod.rs` (`WorkerSelectionInput::row`) and
`selector/default.rs` (`DefaultWorkerScorer::worker_logit`, `minimum_cost_index`); the
router's own tracking of the sequences it sent in `lib/kv-router/src/sequences/`
(`block_tracker.rs`, `prefill_tracker.rs`, `prompt_registry.rs` `WorkerLoadProjection`):

    raw prefill blocks(w) = (active prefill tokens(w) + prompt tokens) / block size
    cost(w) = prefill_load_scale · max(raw prefill blocks(w) − overlap_score_credit · overlap(w), 0)
              + active blocks(w) + prompt blocks not active on w
              + decode_active_request_weight · active requests(w)
    the lowest cost wins (`router_temperature` 0: no softmax sampling; ties at random)

Defaults: `overlap_score_credit` 1.0, `prefill_load_scale` 1.0, `router_temperature` 0,
`decode_active_request_weight` 0, `router_track_output_blocks` false. `overlap(w)` is the
prompt's leading blocks the engine of w reported stored (KV events; read here from the
engines' caches). The rest is the router's own bookkeeping of what it routed:

- active prefill tokens: each routed request adds its prompt tokens not cached on w when
  it was routed, until its first token comes back (no prefill load model: no decay);
- active blocks: the distinct prompt blocks of the live requests on w (a block shared by
  several requests counts once), released when a request ends; no output blocks.

`dynamo-tuned` follows Dynamo's agent guidance (`docs/pages/components/router/
agent-hints.md`, `router-guide.md`): `--router-track-output-blocks` on (each block of output
counted as it is generated); with hints, `nvext.agent_hints.osl` from the context's expected
output length (the call's output cap when it has none; each output block and the request's
exclusive prompt suffix weigh `max(0, 1 − generated / osl)`, `request_guard.rs`
`OutputBlockTracker::observe`) and the session id `X-Dynamo-Session-ID` from the context's
session (its workflow id when it has none) with
`--router-session-affinity-ttl-secs` (a session's calls stay on the worker its first call
was routed to while that worker serves and the session is not idle past the TTL). The
router queue (`router_queue_threshold`, `latency_sensitivity`) and engine priority are the
harness's mechanisms, not this policy's. Where the engines keep KV by retention (the
kv-retention mechanism), `agent_hints.priority`, which Dynamo forwards to backends that
support priority eviction (`docs/.../agents/agent-hints.md`; TensorRT-LLM's retention
priority), is the client's priority by tier (`RETENTION_BY_TIER`), with no duration: the
hint carries none.
"""

from __future__ import annotations

import random
from collections.abc import Collection
from dataclasses import dataclass, field

from kvflow.simulator.des import FleetRequest, FleetView, candidates
from kvflow.simulator.engine import StepResult
from kvflow.simulator.policies.base import (
    KV_RETENTION,
    AttemptEnd,
    PolicySetup,
    RequestRouter,
    TaskContext,
    prompt_blocks,
)

OVERLAP_SCORE_CREDIT = 1.0
PREFILL_LOAD_SCALE = 1.0
ROUTER_TEMPERATURE = 0.0
DECODE_ACTIVE_REQUEST_WEIGHT = 0.0
ROUTER_TRACK_OUTPUT_BLOCKS = False
SESSION_AFFINITY_TTL_S = 600.0
"""`--router-session-affinity-ttl-secs` of `dynamo-tuned`: past the longest tool pause."""


@dataclass(slots=True)
class _Sequence:
    """One request the router sent: what it charges its worker."""

    worker: int
    blocks: list[int]
    prompt_tokens: int
    prefill_tokens: int
    """Tokens charged to the worker's prefill load until the first token (0 after)."""
    osl: int | None
    counted_blocks: int
    """Blocks of prompt and output accounted so far (`current_total_blocks`)."""
    output_blocks: int = 0
    output_weight: float = 1.0


@dataclass
class _WorkerLoad:
    """The router's view of one worker: its active prefill tokens and active blocks."""

    prefill_tokens: int = 0
    requests: int = 0
    block_refs: dict[int, int] = field(default_factory=dict)
    """Prompt block → live requests whose prompt has it."""
    fractions: dict[int, float] = field(default_factory=dict)
    """Prompt block → its weight, for blocks decayed with an `osl` hint (1 otherwise)."""
    output: float = 0.0
    """Weight of the output blocks of the live requests."""

    def active_blocks(self) -> int:
        """`BlockTracker::active_blocks`: prompt blocks by weight, plus output blocks."""
        prompt = len(self.block_refs) - sum(1.0 - f for f in self.fractions.values())
        return round(prompt + self.output)


def hints_enabled(setup: PolicySetup) -> bool:
    """Whether the harness sends the hints a project documents (`extra["mechanisms"]`)."""
    mechanisms = setup.extra.get("mechanisms")
    return (
        isinstance(mechanisms, Collection)
        and not isinstance(mechanisms, str)
        and "hints" in mechanisms
    )


def session_hint(context: object) -> str | None:
    """The call's session id as a client sends it: the context's hint, else its workflow."""
    if not isinstance(context, TaskContext):
        return None
    session = getattr(context, "session_id", None)
    return str(session) if session else context.workflow_id or None


def output_length_hint(context: object) -> int | None:
    """Expected output tokens: the context's estimate if it has one, else the call's cap."""
    if not isinstance(context, TaskContext):
        return None
    expected = getattr(context, "expected_output_tokens", None)
    if isinstance(expected, int) and expected > 0:
        return expected
    return context.max_tokens if context.max_tokens > 0 else None


class DynamoKvPolicy(RequestRouter):
    """Dynamo's KV-aware worker selection at its defaults (module docstring)."""

    name = "dynamo"
    track_output_blocks = ROUTER_TRACK_OUTPUT_BLOCKS
    session_affinity = False

    def __init__(self, setup: PolicySetup) -> None:
        self.block_size = setup.block_size
        self.overlap_score_credit = OVERLAP_SCORE_CREDIT
        self.prefill_load_scale = PREFILL_LOAD_SCALE
        self.decode_active_request_weight = DECODE_ACTIVE_REQUEST_WEIGHT
        self.hints = hints_enabled(setup)
        self._rng = random.Random(setup.seed)
        self.loads: dict[int, _WorkerLoad] = {}
        self._sequences: dict[str, _Sequence] = {}
        self._sessions: dict[str, tuple[int, float]] = {}
        """Session id → (worker, last use) for session affinity."""

    def load(self, worker: int) -> _WorkerLoad:
        """The router's tracked load of `worker`."""
        return self.loads.setdefault(worker, _WorkerLoad())

    def cost(self, request: FleetRequest, worker: int, fleet: FleetView) -> float:
        """`worker_logit` of `request` on `worker`."""
        size = self.block_size
        blocks = prompt_blocks(request, size)
        load = self.load(worker)
        overlap = fleet.cached_tokens(worker, request.model, blocks) // size
        raw_prefill = (load.prefill_tokens + request.prompt_tokens) / size
        adjusted = max(raw_prefill - self.overlap_score_credit * overlap, 0.0)
        additional = sum(1 for h in set(blocks) if h not in load.block_refs)
        decode = load.active_blocks() + additional
        return (
            self.prefill_load_scale * adjusted
            + decode
            + self.decode_active_request_weight * load.requests
        )

    def route(self, request: FleetRequest, fleet: FleetView, now: float) -> int | None:
        """The worker of least cost (or the session's worker, with session affinity)."""
        serving = candidates(request, fleet)
        if not serving:
            return None
        session = self._session_id(request)
        chosen: int | None = None
        if session is not None:
            bound = self._sessions.get(session)
            if (
                bound is not None
                and bound[0] in serving
                and now - bound[1] <= (SESSION_AFFINITY_TTL_S)
            ):
                chosen = bound[0]
        if chosen is None:
            best: list[int] = []
            best_cost = 0.0
            for i in serving:
                cost = self.cost(request, i, fleet)
                if not best or cost < best_cost - 1e-9:
                    best, best_cost = [i], cost
                elif abs(cost - best_cost) <= 1e-9:
                    best.append(i)
            chosen = best[0] if len(best) == 1 else self._rng.choice(best)
        if session is not None:
            self._sessions[session] = (chosen, now)
        self._add(request, chosen, fleet)
        return chosen

    def _session_id(self, request: FleetRequest) -> str | None:
        if not (self.session_affinity and self.hints):
            return None
        return session_hint(request.context)

    def _osl(self, request: FleetRequest) -> int | None:
        return output_length_hint(request.context) if self.hints else None

    def _add(self, request: FleetRequest, worker: int, fleet: FleetView) -> None:
        size = self.block_size
        blocks = prompt_blocks(request, size)
        cached = fleet.cached_tokens(worker, request.model, blocks)
        uncached = request.prompt_tokens - min(cached, request.prompt_tokens)
        load = self.load(worker)
        load.prefill_tokens += uncached
        load.requests += 1
        for h in blocks:
            load.block_refs[h] = load.block_refs.get(h, 0) + 1
        self._sequences[request.request_id] = _Sequence(
            worker=worker,
            blocks=blocks,
            prompt_tokens=request.prompt_tokens,
            prefill_tokens=uncached,
            osl=self._osl(request),
            counted_blocks=-(-request.prompt_tokens // size),
        )

    def on_step(self, replica: int, result: StepResult) -> None:
        """First tokens end prefills; with output tracking, new output blocks are counted."""
        for sim in result.outputs:
            sequence = self._sequences.get(sim.request_id)
            if sequence is None or sequence.worker != replica:
                continue
            load = self.load(replica)
            if sequence.prefill_tokens:
                load.prefill_tokens -= sequence.prefill_tokens
                sequence.prefill_tokens = 0
            if self.track_output_blocks:
                self._observe_output(sequence, load, sim.num_output_tokens)

    def _observe_output(self, sequence: _Sequence, load: _WorkerLoad, generated: int) -> None:
        total = -(-(sequence.prompt_tokens + generated) // self.block_size)
        if total <= sequence.counted_blocks:
            return
        added = total - sequence.counted_blocks
        sequence.counted_blocks = total
        load.output += added * sequence.output_weight
        sequence.output_blocks += added
        if sequence.osl is None:
            return
        fraction = max(0.0, 1.0 - generated / max(sequence.osl, 1))
        load.output += sequence.output_blocks * (fraction - sequence.output_weight)
        sequence.output_weight = fraction
        # The request's exclusive prompt suffix decays with its output.
        for h in reversed(sequence.blocks):
            if load.block_refs.get(h, 0) != 1:
                break
            load.fractions[h] = fraction

    def on_attempt_end(self, end: AttemptEnd) -> None:
        """The request ended: its blocks and any prefill it still held are released."""
        sequence = self._sequences.pop(end.request.request_id, None)
        if sequence is None:
            return
        load = self.load(sequence.worker)
        load.prefill_tokens -= sequence.prefill_tokens
        load.requests -= 1
        load.output -= sequence.output_blocks * sequence.output_weight
        if load.requests == 0:
            load.output = 0.0
        for h in sequence.blocks:
            left = load.block_refs.get(h, 0) - 1
            if left > 0:
                load.block_refs[h] = left
            else:
                load.block_refs.pop(h, None)
                load.fractions.pop(h, None)


RETENTION_BY_TIER = (90, 80, 70, 60, 50)
"""`agent_hints.priority` a client sends by tier, as the backend's retention priority (the
same scale kvflow asks for: 0–100, 35 the engine's default)."""


class DynamoAgentPolicy(DynamoKvPolicy):
    """Dynamo's KV router as its docs configure it for agents (module docstring)."""

    name = "dynamo-tuned"
    track_output_blocks = True
    session_affinity = True

    def __init__(self, setup: PolicySetup) -> None:
        super().__init__(setup)
        self.retention = self.hints and KV_RETENTION in setup.mechanisms

    def route(self, request: FleetRequest, fleet: FleetView, now: float) -> int | None:
        """As Dynamo's router; the priority hint rides along as the retention priority."""
        chosen = super().route(request, fleet, now)
        context = request.context
        if chosen is not None and self.retention and isinstance(context, TaskContext):
            request.retention_priority = RETENTION_BY_TIER[min(max(context.tier, 1), 5) - 1]
        return chosen

"""Agent workloads for the policy benchmark: tasks of model calls, generated from parameters.

A task belongs to a tenant (and so a tier), arrives at a time, and runs steps one after the
other; a step is one model call, or a fan-out of several calls on the same context that run
at once. Between steps the task pauses (a tool call) for seconds to minutes. Each call's
prompt is the task's whole conversation so far: an application's shared system prompt, the
task's own context, and every earlier step's output and next instruction. The task must
finish all its steps before its deadline: arrival + its pauses + a per-step allowance of its
tier (interactive tiers get seconds per step, batch tiers minutes).

Tokens are synthetic but exact: each block's token ids are a function of its parent block's
hash and a salt (`block_tokens`), so a task's blocks chain like vLLM's and any block can be
turned back into token ids (`Workload.tokens_of`) for KV events. Only blocks where a
conversation departs from a shared one (an application's first block, a task's first own
block, a fan-out branch) carry a salt, kept in a small map.

Generation is lazy and deterministic: task i is drawn from its own generator seeded by
(seed, i), so the same tasks arrive at every offered load; only arrival times change.
Arrivals are Poisson with bursts (a two-state modulated process: `burst_factor` times the
rate for `burst_share` of the time).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvflow.scheduler.blocks import ROOT_HASH, hash_block

_MIX = 0x9E3779B97F4A7C15
_TOKEN_SPACE = 1 << 40


def block_tokens(parent: int, salt: int, block_size: int) -> range:
    """The synthetic token ids of the block after `parent` (`salt` 0 except at departures)."""
    start = ((parent ^ (salt * _MIX)) & ((1 << 63) - 1)) % _TOKEN_SPACE
    return range(start, start + block_size)


@dataclass(frozen=True, slots=True)
class TierProfile:
    """Pauses and deadline allowance of one tier's tasks."""

    pause_s: tuple[float, float]
    """Tool pause between steps: log-uniform in this range."""
    step_allowance_s: float
    """Seconds of model time a task of this tier is allowed per step (its deadline)."""


INTERACTIVE = TierProfile(pause_s=(0.2, 3.0), step_allowance_s=6.0)
STANDARD = TierProfile(pause_s=(1.0, 20.0), step_allowance_s=20.0)
BATCH = TierProfile(pause_s=(5.0, 120.0), step_allowance_s=90.0)


def tier_profile(tier: int) -> TierProfile:
    """Tiers 1–2 are interactive (seconds), 3–4 standard, 5 batch (minutes)."""
    return INTERACTIVE if tier <= 2 else STANDARD if tier <= 4 else BATCH


@dataclass(frozen=True)
class WorkloadSpec:
    """The parameters of a workload (module docstring); `WORKLOADS` names the built-in ones."""

    name: str
    description: str
    steps: tuple[int, int] = (3, 12)
    applications: int = 6
    """Distinct shared system prompts (one per application)."""
    system_tokens: tuple[int, int] = (1024, 3072)
    context_tokens: tuple[int, int] = (200, 2000)
    turn_tokens: tuple[int, int] = (40, 400)
    output_median: int = 120
    output_sigma: float = 0.8
    max_tokens: int = 512
    """Each call's output cap (what it asks for); outputs are lognormal below it."""
    fanout_probability: float = 0.15
    fanout_width: tuple[int, int] = (2, 4)
    max_context_tokens: int = 12_000
    """A task stops adding steps once its conversation would pass this."""
    tenant_weights: tuple[float, ...] = (1.0, 1.0, 1.0)
    """Share of tasks per fleet tenant, in the fleet's tenant order."""
    burst_factor: float = 3.0
    burst_share: float = 0.1
    burst_seconds: float = 20.0


WORKLOADS: dict[str, WorkloadSpec] = {
    "agent": WorkloadSpec(
        name="agent",
        description=(
            "3–12 steps, 6 applications' system prompts, growing conversations, tool pauses "
            "of seconds to minutes, 15% fan-out steps, tiers 1/3/5, bursty Poisson arrivals"
        ),
    ),
    "hotspot": WorkloadSpec(
        name="hotspot",
        description=(
            "many short sessions behind one long (6k-token) system prompt: the case where "
            "cache-aware routers pile load on one replica"
        ),
        steps=(1, 3),
        applications=1,
        system_tokens=(6144, 6144),
        context_tokens=(50, 400),
        turn_tokens=(20, 200),
        output_median=80,
        fanout_probability=0.0,
    ),
    "heterogeneous": WorkloadSpec(
        name="heterogeneous",
        description=(
            "the agent workload on H200, H100 and L4 pools with their prices, and a cheaper "
            "fallback model on its own L4 pool"
        ),
    ),
    "faults": WorkloadSpec(
        name="faults",
        description=(
            "the agent workload; one replica crashes a third of the way through the "
            "arrivals (found down 2 s later), another runs 4× slow throughout"
        ),
    ),
}


@dataclass(slots=True)
class Call:
    """One model call of a step."""

    prompt_tokens: int
    output_tokens: int
    block_hashes: list[int]
    """The chain of the prompt and the output's full blocks."""


@dataclass(slots=True)
class Step:
    """One or several calls at once (a fan-out), then a pause before the next step."""

    calls: list[Call]
    pause_after_s: float


@dataclass(slots=True)
class Task:
    """One agent task: its tenant, arrival, deadline and steps."""

    index: int
    tenant: str
    tier: int
    arrival: float
    deadline_at: float
    steps: list[Step] = field(default_factory=list)

    @property
    def calls(self) -> int:
        """Model calls in the whole task."""
        return sum(len(s.calls) for s in self.steps)


class Workload:
    """Tasks of a `WorkloadSpec` for a fleet's tenants, lazily and deterministically.

    `tenants` are (name, tier) pairs; `task_rate` is the mean arrival rate in tasks per second.
    """

    def __init__(
        self,
        spec: WorkloadSpec,
        tenants: Sequence[tuple[str, int]],
        *,
        tasks: int,
        task_rate: float,
        seed: int = 0,
        block_size: int = 16,
    ) -> None:
        if task_rate <= 0:
            raise ValueError(f"task_rate must be positive, got {task_rate}")
        self.spec = spec
        self.tenants = list(tenants)
        self.tasks = tasks
        self.task_rate = task_rate
        self.seed = seed
        self.block_size = block_size
        self.salts: dict[int, int] = {}
        """Block hash → salt, for the blocks where a conversation departs (module docstring)."""
        weights = list(spec.tenant_weights[: len(self.tenants)])
        weights += [1.0] * (len(self.tenants) - len(weights))
        self._weights = weights
        rng = random.Random(f"{seed}/applications")
        self._systems: list[list[int]] = []
        for app in range(spec.applications):
            tokens = rng.randint(*spec.system_tokens)
            self._systems.append(self._chain(ROOT_HASH, salt=app + 1, blocks=tokens // block_size))

    def tokens_of(self, parent: int, block_hash: int) -> range:
        """The token ids of the block `block_hash` whose parent is `parent`."""
        return block_tokens(parent, self.salts.get(block_hash, 0), self.block_size)

    def _chain(self, parent: int, *, salt: int, blocks: int) -> list[int]:
        """`blocks` new blocks after `parent`, the first one salted (a departure)."""
        chain: list[int] = []
        size = self.block_size
        for j in range(blocks):
            block_salt = salt if j == 0 else 0
            parent = hash_block(parent, block_tokens(parent, block_salt, size))
            if block_salt:
                self.salts[parent] = block_salt
            chain.append(parent)
        return chain

    def _extend(self, chain: list[int], tokens: int) -> None:
        """Grow `chain` (a conversation) to cover `tokens` tokens (unsalted continuation)."""
        size = self.block_size
        missing = tokens // size - len(chain)
        if missing > 0:
            chain.extend(self._chain(chain[-1] if chain else ROOT_HASH, salt=0, blocks=missing))

    def arrivals(self) -> Iterator[float]:
        """Arrival times: Poisson at `task_rate` on average, with bursts (module docstring)."""
        spec = self.spec
        rng = random.Random(f"{self.seed}/arrivals")
        share, factor = spec.burst_share, spec.burst_factor
        calm_rate = self.task_rate / (1 - share + share * factor)
        calm_mean = spec.burst_seconds * (1 - share) / share if share > 0 else math.inf
        now, bursting = 0.0, False
        switch = rng.expovariate(1 / calm_mean) if share > 0 else math.inf
        while True:
            rate = calm_rate * (factor if bursting else 1.0)
            gap = rng.expovariate(rate)
            if now + gap > switch:
                now = switch
                bursting = not bursting
                mean = spec.burst_seconds if bursting else calm_mean
                switch = now + rng.expovariate(1 / mean)
                continue
            now += gap
            yield now

    def __iter__(self) -> Iterator[Task]:
        """The tasks in arrival order."""
        for index, arrival in zip(range(self.tasks), self.arrivals(), strict=False):
            yield self.task(index, arrival)

    def task(self, index: int, arrival: float) -> Task:
        """Task `index`, arriving at `arrival` (the same task whatever the arrival)."""
        spec = self.spec
        size = self.block_size
        rng = random.Random(f"{self.seed}/task/{index}")
        tenant, tier = rng.choices(self.tenants, weights=self._weights)[0]
        profile = tier_profile(tier)
        system = self._systems[rng.randrange(len(self._systems))]
        salt = (index + 1) << 8
        chain = list(system)
        own = rng.randint(*spec.context_tokens)
        chain.extend(self._chain(system[-1], salt=salt, blocks=max(1, own // size)))
        tokens = len(chain) * size
        steps: list[Step] = []
        low, high = (math.log(p) for p in profile.pause_s)
        for step in range(rng.randint(*spec.steps)):
            if step:
                tokens += rng.randint(*spec.turn_tokens)
            width = 1
            if step and rng.random() < spec.fanout_probability:
                width = rng.randint(*spec.fanout_width)
            if tokens + width * (spec.max_tokens + spec.turn_tokens[1]) > spec.max_context_tokens:
                break
            calls: list[Call] = []
            if width > 1:
                # Branches depart at a block boundary: the shared prompt is padded to one.
                tokens = -(-tokens // size) * size
                self._extend(chain, tokens)
                shared = chain[: tokens // size]
                for branch in range(width):
                    extra = rng.randint(*spec.turn_tokens)
                    output = self._output(rng)
                    blocks = (extra + output) // size
                    branch_chain = shared + self._chain(
                        shared[-1], salt=salt + 1 + step * 16 + branch, blocks=max(1, blocks)
                    )
                    calls.append(Call(tokens + extra, output, branch_chain))
                chain = list(calls[0].block_hashes)
                tokens = calls[0].prompt_tokens + calls[0].output_tokens
            else:
                output = self._output(rng)
                self._extend(chain, tokens + output)
                calls.append(Call(tokens, output, chain[: (tokens + output) // size]))
                tokens += output
            pause = math.exp(rng.uniform(low, high))
            steps.append(Step(calls, pause))
        if not steps:
            output = self._output(rng)
            self._extend(chain, tokens + output)
            steps.append(Step([Call(tokens, output, chain[: (tokens + output) // size])], 0.0))
        steps[-1].pause_after_s = 0.0
        pauses = sum(s.pause_after_s for s in steps)
        deadline = arrival + pauses + profile.step_allowance_s * len(steps)
        return Task(index, tenant, tier, arrival, deadline, steps)

    def _output(self, rng: random.Random) -> int:
        spec = self.spec
        drawn = int(rng.lognormvariate(math.log(spec.output_median), spec.output_sigma))
        return max(8, min(spec.max_tokens, drawn))

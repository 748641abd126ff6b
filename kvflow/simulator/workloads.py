"""Agent workloads for the policy benchmark: tasks of model calls, generated from parameters.

A task belongs to a tenant (and so a tier), arrives at a time, and runs steps one after the
other; a step is one model call, or a fan-out of several calls on the same context that run
at once. Between steps the task pauses (a tool call) for seconds to minutes. Each call's
prompt is the task's whole conversation so far: an application's shared system prompt, the
task's own context, and every earlier step's output and the tool's result.

**What a task declares, and what it hides.** Like a workflow started with a `kvflow.TaskSpec`,
a task declares its tenant, how many model calls it expects (`expected_calls`, kvflow's
`expected_steps`) and its latency budget (`deadline_at` = arrival + budget). Both come from
the workload's rules (`budget_rule`), computed once from a calibration sample of other tasks
of the same workload: the expected calls are the sample's median, a tier's budget the
`budget_quantile` of the sample's tool time plus the tier's allowance per step. Neither reads
this task's own steps or pauses, which stay its future: the harness reveals a step only when
it issues it. A workload with per-step deadlines (`step_deadlines`) also gives each step its
tier's allowance from the moment it is issued.

Tokens are synthetic but exact: each block's token ids are a function of its parent block's
hash and a salt (`block_tokens`), so a task's blocks chain like vLLM's and any block can be
turned back into token ids (`Workload.tokens_of`) for KV events. Only blocks where a
conversation departs from a shared one (an application's first block, a task's first own
block, a fan-out branch) carry a salt, kept in a small map. A task's calls share one chain
(`Call.chain`, `Call.blocks`), so a 60-turn task holds its conversation once.

**Tenants and the prefix cache.** As kvflow sends them, each tenant's calls carry their own
`cache_salt`, hashed into the prompt's first block, and a fleet names the prompts shared on
purpose (`[cache] shared_prefixes`). The built-in workloads name their applications' system
prompts shared (`WorkloadSpec.shared_system_prompts`), so tasks of every tenant reuse them and
their own blocks after them; with it off each tenant hashes its own copy (`Workload.cache_salts`).

Generation is lazy and deterministic: task i is drawn from its own generator seeded by
(seed, i), so the same tasks arrive at every offered load; only arrival times change
(`Workload.at_rate` shares the drawn tasks between rates). Arrivals are Poisson with bursts
(a two-state modulated process: `burst_factor` times the rate for `burst_share` of the time).
"""

from __future__ import annotations

import functools
import itertools
import math
import random
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvflow.scheduler.blocks import ROOT_HASH, hash_block, tenant_cache_salt

_MIX = 0x9E3779B97F4A7C15
_TOKEN_SPACE = 1 << 40
BENCH_NAMESPACE = "default"
"""The Temporal namespace the benchmark's tenants' salts are derived in."""
CALIBRATION_TASKS = 600
"""Tasks in the calibration sample behind a workload's declared calls and budgets."""


def block_tokens(parent: int, salt: int, block_size: int) -> range:
    """The synthetic token ids of the block after `parent` (`salt` 0 except at departures)."""
    start = ((parent ^ (salt * _MIX)) & ((1 << 63) - 1)) % _TOKEN_SPACE
    return range(start, start + block_size)


@dataclass(frozen=True, slots=True)
class TierProfile:
    """Tool pauses and model-time allowance of one tier's tasks."""

    pause_s: tuple[float, float]
    """Tool pause between steps: log-uniform in this range (workloads without `tools`)."""
    step_allowance_s: float
    """Seconds of model time a task of this tier is allowed per step (its budget)."""


INTERACTIVE = TierProfile(pause_s=(0.2, 3.0), step_allowance_s=6.0)
STANDARD = TierProfile(pause_s=(1.0, 20.0), step_allowance_s=20.0)
BATCH = TierProfile(pause_s=(5.0, 120.0), step_allowance_s=90.0)


def tier_profile(tier: int) -> TierProfile:
    """Tiers 1–2 are interactive (seconds), 3–4 standard, 5 batch (minutes)."""
    return INTERACTIVE if tier <= 2 else STANDARD if tier <= 4 else BATCH


def tier_class(tier: int) -> int:
    """0 for interactive tiers (1–2), 1 for standard (3–4), 2 for batch (5)."""
    return 0 if tier <= 2 else 1 if tier <= 4 else 2


@dataclass(frozen=True, slots=True)
class ToolKind:
    """One kind of tool an agent calls between model calls: how long it runs, what it returns.

    The pause is lognormal (`pause_median_s`, `pause_sigma`), capped at `pause_max_s`; the
    tokens it appends to the conversation are log-uniform in `output_tokens`.
    """

    name: str
    share: float
    pause_median_s: float
    pause_sigma: float
    pause_max_s: float
    output_tokens: tuple[int, int]


@dataclass(frozen=True)
class WorkloadSpec:
    """The parameters of a workload (module docstring); `WORKLOADS` names the built-in ones."""

    name: str
    description: str
    steps: tuple[int, int] = (3, 12)
    applications: int = 6
    """Distinct shared system prompts (one per application)."""
    shared_system_prompts: bool = True
    """The applications' system prompts are named shared (`[cache] shared_prefixes`): every
    tenant's calls reuse them. False: each tenant's calls carry its own `cache_salt` (kvflow's
    default), so each tenant caches its own copy and tenants share no block."""
    system_tokens: tuple[int, int] = (1024, 3072)
    context_tokens: tuple[int, int] = (200, 2000)
    turn_tokens: tuple[int, int] = (40, 400)
    """Tokens a step adds before its call (tool result and instruction), uniform; workloads
    with `tools` take them from the tool kind instead."""
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
    tools: tuple[ToolKind, ...] = ()
    """Tool kinds between steps; empty: tier pauses (`TierProfile.pause_s`), `turn_tokens`."""
    step_allowance_s: tuple[float, float, float] = (
        INTERACTIVE.step_allowance_s,
        STANDARD.step_allowance_s,
        BATCH.step_allowance_s,
    )
    """Model-time allowance per step of interactive, standard and batch tiers (`tier_class`)."""
    budget_quantile: float = 0.99
    """A tier's budget covers this share of the calibration sample (`budget_rule`)."""
    step_deadlines: bool = False
    """Each step must also end within its tier's allowance from when it is issued."""
    max_model_len: int = 16_384
    """The engines' `max_model_len` for this workload (prompt and output)."""
    block_size: int = 16
    """The engines' KV block size (vLLM's `--block-size`) and the workload's hash blocks."""
    default_load: float = 0.8
    """Offered load of the headline table, as a multiple of the measured capacity."""
    key_figure: str = "cost_per_successful_task_usd"
    """The figure the workload is about (the sweep follows the anchor best on it)."""
    quick_replicas: int = 4
    """Replicas of a quick run (`kvflow bench policies --quick`)."""
    sources: tuple[str, ...] = ()
    """Where the parameters come from (published traces), for the reader."""


# Tool kinds of a coding agent (long-agent). Sub-second file reads, edits and searches, and
# test or build runs of a minute with a tail to ten minutes, as in the SWE-bench and BFCL
# agents' tool traces of CacheTTL/Continuum (arXiv 2511.02230: "milliseconds to tens of
# seconds", a heavy tail; test runs are what takes minutes). Shares: SWE-agent's action mix
# (arXiv 2405.15793, §5: viewing/searching files dominate, then edits, then runs).
_CODING_TOOLS = (
    ToolKind("read", 0.30, 0.15, 0.8, 1.0, (500, 6_000)),
    ToolKind("search", 0.25, 0.8, 0.8, 10.0, (500, 2_000)),
    ToolKind("edit", 0.15, 0.4, 0.6, 3.0, (500, 1_200)),
    ToolKind("test", 0.30, 120.0, 0.8, 1_200.0, (800, 5_000)),
)


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
            "counted arrivals (found down 2 s later), another runs 4× slow throughout"
        ),
    ),
    "long-agent": WorkloadSpec(
        name="long-agent",
        description=(
            "coding agents: 10–60 turns, contexts from 4–8k to 18–94k tokens (mean 66k), tool "
            "results of 0.5–6k tokens, sub-second reads and edits, test runs of minutes; the "
            "running and paused conversations need about twice the fleet's KV cache (KV-bound)"
        ),
        steps=(10, 60),
        applications=4,
        system_tokens=(2_000, 4_000),
        context_tokens=(2_000, 4_000),
        output_median=150,
        output_sigma=0.7,
        max_tokens=1_024,
        fanout_probability=0.0,
        max_context_tokens=100_000,
        tools=_CODING_TOOLS,
        step_allowance_s=(15.0, 40.0, 120.0),
        max_model_len=131_072,
        block_size=64,
        burst_share=0.0,
        default_load=1.0,
        quick_replicas=2,
        sources=(
            "turns and context growth: SWE-bench agent trajectories (SWE-agent, arXiv "
            "2405.15793; OpenHands token study, openreview.net/forum?id=ZQPRZBxWEG: input "
            "tokens dominate and grow every turn; failed runs are the long ones, arXiv "
            "2511.00197)",
            "tool pauses per kind, heavy-tailed: CacheTTL/Continuum (arXiv 2511.02230), "
            "SWE-bench and BFCL tool traces",
            "output per call: Mooncake's tool&agent trace (FAST'25) has short outputs, a "
            "few hundred tokens, against inputs of thousands",
        ),
    ),
    "overload": WorkloadSpec(
        name="overload",
        description=(
            "the agent mix above capacity (compute-bound), each step due within its tier's "
            "allowance (6 s, 20 s, 90 s) as well as the task's budget"
        ),
        step_deadlines=True,
        default_load=1.5,
        key_figure="goodput_tasks_per_s",
    ),
}


@dataclass(slots=True)
class Call:
    """One model call of a step.

    `chain` is the hash chain of the conversation the call belongs to (shared by a task's
    calls); the call's prompt and output cover its first `blocks` full blocks (all of them
    when `blocks` is None).
    """

    prompt_tokens: int
    output_tokens: int
    chain: list[int]
    blocks: int | None = None

    @property
    def block_hashes(self) -> list[int]:
        """The chain of the prompt and the output's full blocks."""
        return self.chain if self.blocks is None else self.chain[: self.blocks]


@dataclass(slots=True)
class Step:
    """One or several calls at once (a fan-out), then a pause before the next step."""

    calls: list[Call]
    pause_after_s: float
    tool: str = ""
    """The kind of tool called after the step (workloads with `tools`)."""


@dataclass(slots=True)
class Task:
    """One agent task: what it declares (tenant, budget, expected calls) and its steps."""

    index: int
    tenant: str
    tier: int
    arrival: float
    deadline_at: float
    """Arrival plus the declared latency budget."""
    steps: list[Step] = field(default_factory=list)
    expected_calls: int = 1
    """Declared model calls (the workload's rule, not this task's count)."""
    step_allowance_s: float | None = None
    """Each step is due this long after it is issued (workloads with `step_deadlines`)."""
    application: int = 0
    """The application (workflow type) whose system prompt the task uses."""

    @property
    def calls(self) -> int:
        """Model calls in the whole task."""
        return sum(len(s.calls) for s in self.steps)


@dataclass(frozen=True)
class BudgetRule:
    """What every task of a workload declares: expected calls and a budget per tier."""

    expected_calls: int
    budget_s: dict[int, float]
    """Tier → latency budget in seconds from arrival."""
    step_allowance_s: dict[int, float]
    """Tier → model-time allowance per step (and per-step deadline where the workload has one)."""


@dataclass(slots=True)
class _Body:
    """A drawn task without its arrival (the same at every rate)."""

    tenant: str
    tier: int
    application: int
    steps: list[Step]


class _Drawer:
    """Draws tasks of one workload and seed (module docstring), sharing salts and chains.

    Without `hashing` it draws only shapes: the same random draws, no hash chains (the
    calibration sample behind `budget_rule`).
    """

    def __init__(
        self,
        spec: WorkloadSpec,
        tenants: Sequence[tuple[str, int]],
        *,
        seed: int | str,
        block_size: int,
        hashing: bool = True,
    ) -> None:
        self.spec = spec
        self.tenants = list(tenants)
        self.block_size = block_size
        self.hashing = hashing
        weights = list(spec.tenant_weights[: len(self.tenants)])
        self.weights = weights + [1.0] * (len(self.tenants) - len(weights))
        self.salts: dict[int, int] = {}
        self.cache_salts: dict[int, str] = {}
        """First block's hash → the `cache_salt` hashed into it (unshared system prompts)."""
        self.bodies: dict[int, _Body] = {}
        self._tenant_systems: dict[tuple[int, str], list[int]] = {}
        rng = random.Random(f"{seed}/applications")
        self.systems: list[list[int]] = []
        for app in range(spec.applications):
            blocks = rng.randint(*spec.system_tokens) // block_size
            self.systems.append(
                self._chain(ROOT_HASH, salt=app + 1, blocks=blocks) if hashing else [0] * blocks
            )

    def _chain(
        self, parent: int, *, salt: int, blocks: int, cache_salt: str | None = None
    ) -> list[int]:
        """`blocks` new blocks after `parent`, the first one salted (a departure).

        `cache_salt` enters the first block's hash (a prompt's first block: `parent` is the
        root), as vLLM hashes a request's salt; the block's tokens are the same without it.
        """
        chain: list[int] = []
        size = self.block_size
        salts = self.salts
        for j in range(blocks):
            block_salt = salt if j == 0 else 0
            key = cache_salt if j == 0 else None
            parent = hash_block(parent, block_tokens(parent, block_salt, size), key)
            if block_salt:
                salts[parent] = block_salt
            if key:
                self.cache_salts[parent] = key
            chain.append(parent)
        return chain

    def _system(self, application: int, tenant: str) -> list[int]:
        """The application's system prompt as `tenant`'s calls hash it."""
        system = self.systems[application]
        if self.spec.shared_system_prompts or not self.hashing or not system:
            return system
        chain = self._tenant_systems.get((application, tenant))
        if chain is None:
            chain = self._chain(
                ROOT_HASH,
                salt=application + 1,
                blocks=len(system),
                cache_salt=tenant_cache_salt(BENCH_NAMESPACE, tenant),
            )
            self._tenant_systems[(application, tenant)] = chain
        return chain

    def _extend(self, chain: list[int], tokens: int) -> None:
        """Grow `chain` (a conversation) to cover `tokens` tokens (unsalted continuation)."""
        missing = tokens // self.block_size - len(chain)
        if missing > 0 and self.hashing:
            chain.extend(self._chain(chain[-1] if chain else ROOT_HASH, salt=0, blocks=missing))

    def draw(self, rng: random.Random, index: int) -> _Body:
        """Draw task `index` from `rng`."""
        spec = self.spec
        size = self.block_size
        hashing = self.hashing
        tenant, tier = rng.choices(self.tenants, weights=self.weights)[0]
        application = rng.randrange(spec.applications)
        system = self._system(application, tenant)
        salt = (index + 1) << 8
        own = max(1, rng.randint(*spec.context_tokens) // size)
        tokens = (len(system) + own) * size
        chain = list(system) if hashing else []
        if hashing:
            # Without a system prompt the task's own first block is the prompt's first.
            first_salt = None
            if not system and not spec.shared_system_prompts:
                first_salt = tenant_cache_salt(BENCH_NAMESPACE, tenant)
            chain.extend(
                self._chain(
                    system[-1] if system else ROOT_HASH,
                    salt=salt,
                    blocks=own,
                    cache_salt=first_salt,
                )
            )
        steps: list[Step] = []
        low, high = (math.log(p) for p in tier_profile(tier).pause_s)
        turn_max = max((t.output_tokens[1] for t in spec.tools), default=spec.turn_tokens[1])
        added = 0
        for step in range(rng.randint(*spec.steps)):
            tokens += added
            width = 1
            if step and rng.random() < spec.fanout_probability:
                width = rng.randint(*spec.fanout_width)
            if tokens + width * (spec.max_tokens + turn_max) > spec.max_context_tokens:
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
                    branch_chain = shared
                    if hashing:
                        branch_chain = shared + self._chain(
                            shared[-1],
                            salt=salt + 1 + step * 16 + branch,
                            blocks=max(1, (extra + output) // size),
                        )
                    calls.append(Call(tokens + extra, output, branch_chain))
                chain = list(calls[0].chain)
                tokens = calls[0].prompt_tokens + calls[0].output_tokens
            else:
                output = self._output(rng)
                self._extend(chain, tokens + output)
                calls.append(Call(tokens, output, chain, (tokens + output) // size))
                tokens += output
            tool, pause, added = self._tool(rng, low, high)
            steps.append(Step(calls, pause, tool))
        if not steps:
            output = self._output(rng)
            self._extend(chain, tokens + output)
            steps.append(Step([Call(tokens, output, chain, (tokens + output) // size)], 0.0))
        steps[-1].pause_after_s = 0.0
        steps[-1].tool = ""
        return _Body(tenant, tier, application, steps)

    def _tool(self, rng: random.Random, low: float, high: float) -> tuple[str, float, int]:
        """(tool kind, pause, tokens it adds to the next prompt) after a step."""
        spec = self.spec
        if not spec.tools:
            return "", math.exp(rng.uniform(low, high)), rng.randint(*spec.turn_tokens)
        kind = rng.choices(spec.tools, weights=[t.share for t in spec.tools])[0]
        drawn = rng.lognormvariate(math.log(kind.pause_median_s), kind.pause_sigma)
        lo, hi = (math.log(t) for t in kind.output_tokens)
        return kind.name, min(kind.pause_max_s, drawn), int(math.exp(rng.uniform(lo, hi)))

    def _output(self, rng: random.Random) -> int:
        spec = self.spec
        drawn = int(rng.lognormvariate(math.log(spec.output_median), spec.output_sigma))
        return max(8, min(spec.max_tokens, drawn))


class Workload:
    """Tasks of a `WorkloadSpec` for a fleet's tenants, lazily and deterministically.

    `tenants` are (name, tier) pairs; `task_rate` is the mean arrival rate in tasks per second.
    Iterating gives `tasks` tasks, or (with `until_s`) every task arriving before `until_s`.
    `even_arrivals` spaces the same tasks exactly 1 / `task_rate` apart instead: a
    relaxation, the smoothest starts any admission could give without making a task wait.
    """

    def __init__(
        self,
        spec: WorkloadSpec,
        tenants: Sequence[tuple[str, int]],
        *,
        tasks: int | None = None,
        task_rate: float,
        seed: int = 0,
        block_size: int = 16,
        until_s: float | None = None,
        even_arrivals: bool = False,
        _drawer: _Drawer | None = None,
    ) -> None:
        if task_rate <= 0:
            raise ValueError(f"task_rate must be positive, got {task_rate}")
        if tasks is None and until_s is None:
            raise ValueError("give tasks or until_s")
        self.spec = spec
        self.tenants = list(tenants)
        self.tasks = tasks
        self.until_s = until_s
        self.even_arrivals = even_arrivals
        self.task_rate = task_rate
        self.seed = seed
        self.block_size = block_size
        self.rule = budget_rule(spec, tuple(self.tenants))
        self._drawer = _drawer or _Drawer(spec, self.tenants, seed=seed, block_size=block_size)
        self.salts = self._drawer.salts
        """Block hash → salt, for the blocks where a conversation departs (module docstring)."""
        self.cache_salts = self._drawer.cache_salts
        """First block's hash → the tenant's `cache_salt` in it (`shared_system_prompts`
        off): what a KV event's re-hashing needs besides `tokens_of`."""

    def at_rate(
        self, task_rate: float, *, tasks: int | None = None, until_s: float | None = None
    ) -> Workload:
        """The same tasks arriving at `task_rate` (drawn tasks and chains are shared)."""
        return Workload(
            self.spec,
            self.tenants,
            tasks=tasks,
            task_rate=task_rate,
            seed=self.seed,
            block_size=self.block_size,
            until_s=until_s,
            even_arrivals=self.even_arrivals,
            _drawer=self._drawer,
        )

    def tokens_of(self, parent: int, block_hash: int) -> range:
        """The token ids of the block `block_hash` whose parent is `parent`."""
        return block_tokens(parent, self.salts.get(block_hash, 0), self.block_size)

    def arrivals(self) -> Iterator[float]:
        """Arrival times: Poisson at `task_rate` on average, with bursts (module docstring)."""
        if self.even_arrivals:
            yield from (n / self.task_rate for n in itertools.count(1))
            return
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
        for index, arrival in enumerate(self.arrivals()):
            if self.tasks is not None and index >= self.tasks:
                return
            if self.until_s is not None and arrival >= self.until_s:
                return
            yield self.task(index, arrival)

    def task(self, index: int, arrival: float) -> Task:
        """Task `index`, arriving at `arrival` (the same task whatever the arrival)."""
        bodies = self._drawer.bodies
        body = bodies.get(index)
        if body is None:
            body = self._drawer.draw(random.Random(f"{self.seed}/task/{index}"), index)
            bodies[index] = body
        rule = self.rule
        return Task(
            index=index,
            tenant=body.tenant,
            tier=body.tier,
            arrival=arrival,
            deadline_at=arrival + rule.budget_s[body.tier],
            steps=body.steps,
            expected_calls=rule.expected_calls,
            step_allowance_s=rule.step_allowance_s[body.tier] if self.spec.step_deadlines else None,
            application=body.application,
        )


def calibration_sample(
    spec: WorkloadSpec, tenants: tuple[tuple[str, int], ...]
) -> list[tuple[int, list[Step]]]:
    """(tier, steps) of `CALIBRATION_TASKS` tasks drawn apart from every run's tasks (shapes)."""
    drawer = _Drawer(spec, tenants, seed="calibration", block_size=16, hashing=False)
    sample: list[tuple[int, list[Step]]] = []
    for index in range(CALIBRATION_TASKS):
        body = drawer.draw(random.Random(f"calibration/task/{index}"), index)
        sample.append((body.tier, body.steps))
    return sample


@functools.cache
def budget_rule(spec: WorkloadSpec, tenants: tuple[tuple[str, int], ...]) -> BudgetRule:
    """Declared calls and per-tier budgets of `spec`'s tasks, from its calibration sample.

    expected calls = the median calls of the sample's tasks;
    budget(tier)   = the `budget_quantile` over the sample's tasks of that tier (all tasks
                     when the tier has none) of Σ tool pauses + allowance(tier) × steps.
    """
    sample = calibration_sample(spec, tenants)
    expected = max(1, round(statistics.median(sum(len(s.calls) for s in st) for _, st in sample)))
    budgets: dict[int, float] = {}
    allowances: dict[int, float] = {}
    for _, tier in tenants:
        allowance = spec.step_allowance_s[tier_class(tier)]
        allowances[tier] = allowance
        own = [steps for t, steps in sample if t == tier] or [steps for _, steps in sample]
        totals = sorted(sum(s.pause_after_s for s in st) + allowance * len(st) for st in own)
        at = min(len(totals) - 1, max(0, math.ceil(spec.budget_quantile * len(totals)) - 1))
        budgets[tier] = totals[at]
    return BudgetRule(expected_calls=expected, budget_s=budgets, step_allowance_s=allowances)

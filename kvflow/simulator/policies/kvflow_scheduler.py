"""kvflow: the production `Scheduler`, unchanged, fed as the control plane feeds it.

Source: `kvflow.scheduler.core.Scheduler` with a `SchedulerConfig` (default: every axis of
`kvflow.scheduler.config.DEFAULT_AXES`, default weights). Its objective, per replica that
passes every filter (warm weights, health, memory headroom, latency budget, ...):

    J = (expected cost + λ · spent so far · (1 − p)) / p  × load, KV-usage and cold penalties

with the cost from the pool's token prices and the prefix the replica is expected to hold,
p the probability the call succeeds in the step's share of the deadline; the lowest J wins,
rendezvous hashing with bounded load when no replica holds the prefix.

Fed as `kvflow.workers.control_plane.ControlPlane` feeds it:

- every `scrape_interval_s` (1 s, `MetricsScraper`'s default) each replica's `/metrics`
  (`update_metrics`: running, waiting, KV usage, cache size, served models);
- every engine step's KV-cache events (`apply_kv_events`: the precise prefix index). vLLM
  sends the blocks' token ids, which the index hashes again with kvflow's hash; the simulated
  engines hash as kvflow does, so their hashes go in alone (`BlockStored.kvflow_hashes`) and
  the index takes them as they are: the same entries, without hashing every stored block
  again (a thrashing run stores each recomputed block anew). `extra["kv_event_token_ids"] =
  True` sends token ids as vLLM does;
- a replica found down (`set_replica_up(False)`);
- every attempt's end (`observe`: timings, tokens, cost; failures count against the circuit).

Each call is a `PlacementRequest` built as `kvflow.workflows.agent` builds it: the task's
tenant, remaining deadline and steps, previous replica, spend so far, excluded replicas,
attempt and retries. A refusal with a retry-after is tried again after it (saturation); any
other refusal fails the call. A placement on a fallback model runs that model;
`extra["allow_fallback"] = False` forbids degrading (`PlacementRequest.allow_fallback`).

Dispatched as kvflow dispatches: a call waits in its replica's Temporal task queue with
`Priority(priority_key=tier)`, so a replica's backlog is served tier 1 first, then by arrival.
The simulation has no Temporal queue in front of the engine; it orders the engine's waiting
queue by the placement's `priority_key` instead (`FleetRequest.priority`, vLLM's priority
scheduling), the same order for the calls that wait. `extra["priority_dispatch"] = False`
sends every call first come, first served, as the routers' calls are.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from kvflow.scheduler.blocks import ROOT_HASH
from kvflow.scheduler.config import SchedulerConfig
from kvflow.scheduler.core import Scheduler
from kvflow.scheduler.placement import Observation, Placement, PlacementRequest, kv_retention
from kvflow.scheduler.prefix_index import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from kvflow.scheduler.state import ReplicaMetrics
from kvflow.simulator import kv_events as sim_events
from kvflow.simulator.des import FleetRequest, FleetView
from kvflow.simulator.engine import StepResult
from kvflow.simulator.policies.base import (
    KV_RETENTION,
    AttemptEnd,
    PolicySetup,
    TaskContext,
    prompt_blocks,
)

SCRAPE_INTERVAL_S = 1.0
LEVERS = {
    "task_order": True,
    "kv_retention": False,
    "tier_headroom": False,
    "task_admission": False,
    "running_first": False,
    "late_headroom": False,
    "step_headroom": True,
    "keep_conversation": True,
    "objective_bound": True,
    "kv_admission": True,
}
"""kvflow's task-aware levers beyond the scheduler's axes, each a `PolicySetup.extra` switch,
with its default; `kvflow bench policies --ablate` runs kvflow with each flipped in turn:

- `task_order`: a tier's calls run in the engine oldest task first (`engine_priority`:
  tier · 10¹³ + the task's start in ms), where off, by each call's own arrival;
- `kv_retention`: where the engines keep KV by retention (the kv-retention mechanism), each
  call asks for its conversation to be kept by tier for twice the pause its workflow type's
  tools usually take (`kvflow.scheduler.placement.kv_retention`), where off, for nothing
  (least recently used first). Off by default: on long-agent at 1× (seeds 0–2) it found
  75.3% of prompt tokens cached against 75.8% without, at 1.4% more per successful task;
- `tier_headroom`: calls of tiers 3 to 5 wait for admission (a retry-after, in the router
  queue) while the replicas serving the model run more than `TIER_HEADROOM` of their slots,
  each for at most its tier's `admission.max_wait_s_by_tier`, so that they do not join the
  batches that slow tier 1's steps; where off, the production defaults, which wait only
  beyond the replicas' slots. Off by default: it is a configuration for a fleet under
  overload, where it bought tier 1's SLO (overload at 1.5×: 99.1% of tier-1 tasks, against
  92.6% without, seeds 0–2) with the lower tiers' model time; at 0.95× of the agent
  workload, where tier 1 already meets its SLO, it made the mean model time 5.8× the best
  anchor's (124 s against 22 s) for nothing;
- `task_admission`: a new task that the fleet's load would make late (its whole task past
  its deadline, or its first step past the step's allowance where the workload declares
  one) is refused at its first step, before it spends (`LatencyConfig.task_admission`,
  `RefusalReason.OVERLOADED`); its tool time is the expected pause (the hint) after each
  remaining step. Where off, every task starts and fails when it runs out of time. Off by
  default: on overload (seeds 0–2) it refused tasks the estimate called late that would
  have finished: at 2× capacity success 88.9% against 91.6% without, tier-1 SLO 66%
  against 75%, for a wasted share of 5.0% against 6.5%; at 1.5×, success 96.6% against
  99.1%. A margin of 2 or more refuses nothing;
- `late_headroom`: tier headroom (`TIER_HEADROOM`, as `tier_headroom` sets it) only for a
  minute after a tier-1 call ended past its step's deadline (`admission.headroom_by_tier`,
  `Observation.late`): the trade `tier_headroom` makes, made only while tier 1 is late. Where
  the workload declares no step deadlines no call is ever late, and it never acts. Off by
  default, as `tier_headroom` is (the thresholds are the fleet's): on overload at 1.5×
  (seeds 0–2) it took tier-1 SLO from 97.0% to 98.5% and the wasted share from 0.89% to
  0.62%, for a mean model time of 23.4 s against 14.0 s; a hold of 120 s or 300 s gave the
  same within the seeds' spread, and headroom held all the time 99.3% and 0.14%. Lateness
  is seen when the burst that caused it has already been admitted: reacting to it cannot
  do what keeping the headroom does. With `step_headroom` on (the default) it adds
  nothing: a late tier-1 call had a step objective, whose arrival already held the
  headroom on, so `--ablate`'s "late_headroom on" row equals the defaults; the figures
  above were measured before `step_headroom`;
- `step_headroom`: tier headroom (`TIER_HEADROOM`) for a minute after a tier-1 call with a
  step objective is placed (`admission.headroom_for_step_objectives`): while
  latency-sensitive tier-1 work runs, lower tiers keep out of its batches before a burst
  makes it late. On by default: it acts only where tier-1 tasks declare step objectives
  (the overload workload), so it makes there the trade `tier_headroom` makes and leaves the
  agent workload, where tier 1 declares none and headroom cost 5.8× the model time, alone;
- `running_first`: under saturation a call of a task that has completed a step is admitted
  as one tier better (`admission.running_task_tiers` = 1), so new tasks wait before tasks
  that have spent (sunk cost); where off, every call by its own tier. Off by default: with
  tier headroom on overload at 1.5× (seeds 0–2) it cut the mean model time from 34.0 s to
  22.8 s but let tier 1's steps slow again: tier-1 SLO 97.3% against 99.3%, wasted share
  0.87% against 0.14% (most calls belong to running tasks, so few wait at all);
- `keep_conversation`: a call stays on its workflow's previous replica past the affinity
  load bound while that engine has a free slot and no call waiting
  (`PrefixConfig.affinity_keeps_conversation`); where off, the bound passes over any prefix
  holder above 1.25× the mean load, the conversation's own replica included, and the call
  recomputes its whole conversation elsewhere. On by default: on the agent workload at 0.8×
  (seeds 0–2) the bound moved 3–5% of conversations' calls, and keeping them cut kvflow's
  cost per successful task by 3–4%;
- `objective_bound`: a call whose step has an objective leaves a prefix holder above the
  mean load (`PrefixConfig.affinity_load_factor_with_objective` = 1.0); where off, above
  1.25× it, as every other call. Such a call waits on each decode step of its batch, and a
  batch above the mean decodes each step slower. Continuing conversations stay with
  `keep_conversation`, so it moves new tasks. On by default: it acts only where steps
  declare objectives (the overload workload), and there over seeds 0–19 it kept 98.3% of
  tier-1 tasks in time against 97.4% (paired: +0.9 points [−0.0, +1.8]), at 0.999× the
  cost;
- `kv_admission`: past capacity, a new task waits at its first step (a retry-after of 10 s;
  it spends and holds nothing) while the KV that the tasks already open will come back to,
  with its own prompt, exceeds `OPEN_TASK_KV` times the caches (`admission.
  open_task_kv_by_tier`); holding starts at `OPEN_TASK_KV_SLACK` times that and lasts until
  five minutes pass without a task held. A task is open from its first call until it ends
  (`on_task_end`, as the workflow's close tells the scheduler in production). Where off,
  every task starts at once. On by default: past capacity it keeps the fleet out of the
  collapse in which returning conversations recompute and evict each other; at capacity the
  figures are those without it (benchmarks/README.md, "Admission before a KV collapse")."""
TIER_HEADROOM = (4.0, 2.0, 0.05, 0.04, 0.03)
"""`admission.saturation_by_tier` for the benchmark's fleet (256 slots per replica): tier 3
waits above about 13 calls per replica, tier 4 above 10, tier 5 above 8, where a burst's
prefills start to stretch a tier-1 step past its 6 s. A deployment sets its own from the
batch at which its tier-1 steps slow; `--ablate` shows what the setting trades."""


OPEN_TASK_KV = (2.0, 2.0, 1.75, 1.75, 1.75)
"""`admission.open_task_kv_by_tier` for the benchmark's fleets: once holding, a new task of
tier 3 or 5 waits while the open tasks' own KV (shared system prompts counted once) would
pass 1.75× the caches, tier 1 2×. On long-agent the open conversations need about 2× the
caches at capacity, and past that the caches thrash. Set from a calibration on long-agent
(its table is in benchmarks/README.md); a deployment sets its own from where its hit rate
falls, and `kvflow bench policies --ablate` shows what it trades."""
OPEN_TASK_KV_SLACK = 1.5
"""`admission.open_task_kv_slack`: holding starts only past 1.5× `OPEN_TASK_KV`, which the
open tasks' KV does not reach at capacity (long-agent at 1×: every figure as without the
lever), and at 2× reaches at once."""


def lever_config(config: SchedulerConfig, extra: Mapping[str, object]) -> SchedulerConfig:
    """`config` with the fields the levers of `LEVERS` set, each as `extra` switches it.

    A lever not in `extra` takes its default; the levers decide those fields. A field that
    `config` set itself to another value than its lever decides is an error, not silently
    replaced: switch that lever off to run with your own value.
    """

    def on(lever: str) -> bool:
        return bool(extra.get(lever, LEVERS[lever]))

    # (section, field) → (value, the lever that decides it)
    decided: dict[tuple[str, str], tuple[object, str]] = {}
    if on("tier_headroom"):
        decided["admission", "saturation_by_tier"] = (TIER_HEADROOM, "tier_headroom")
    for lever in ("late_headroom", "step_headroom"):
        if on(lever):
            decided["admission", "headroom_by_tier"] = (TIER_HEADROOM, lever)
    decided["admission", "headroom_for_step_objectives"] = (on("step_headroom"), "step_headroom")
    if on("running_first"):
        decided["admission", "running_task_tiers"] = (1, "running_first")
    if on("kv_admission"):
        decided["admission", "open_task_kv_by_tier"] = (OPEN_TASK_KV, "kv_admission")
        decided["admission", "open_task_kv_slack"] = (OPEN_TASK_KV_SLACK, "kv_admission")
    decided["latency", "task_admission"] = (on("task_admission"), "task_admission")
    decided["prefix", "affinity_keeps_conversation"] = (
        on("keep_conversation"),
        "keep_conversation",
    )
    decided["prefix", "affinity_load_factor_with_objective"] = (
        (
            config.prefix.affinity_load_factor_with_objective
            if on("objective_bound")
            else config.prefix.affinity_load_factor
        ),
        "objective_bound",
    )
    sections: dict[str, dict[str, object]] = {}
    for (section, name), (value, lever) in decided.items():
        part = getattr(config, section)
        given = getattr(part, name)
        if name in part.model_fields_set and given != value:
            state, other = ("on", "off") if on(lever) else ("off", "on")
            raise ValueError(
                f"scheduler_config sets {section}.{name} = {given!r}, but the {lever} lever "
                f"({state}) sets it to {value!r}: switch the lever {other} (extra "
                f"{{{lever!r}: {state == 'off'}}}, `--levers {lever}={other}`) or drop the field"
            )
        sections.setdefault(section, {})[name] = value
    return config.model_copy(
        update={
            name: getattr(config, name).model_copy(update=fields)
            for name, fields in sections.items()
        }
    )


class KvflowPolicy:
    """kvflow's `Scheduler` behind the placement interface (module docstring)."""

    name = "kvflow"

    def __init__(self, setup: PolicySetup) -> None:
        config = setup.extra.get("scheduler_config")
        if config is not None and not isinstance(config, SchedulerConfig):
            raise TypeError("scheduler_config must be a SchedulerConfig")
        config = lever_config(config or SchedulerConfig(), setup.extra)
        self.scheduler = Scheduler(setup.fleet, config, clock=setup.clock)
        self.clock = setup.clock
        self.names = setup.replica_names
        scheduler_names = self.scheduler.replica_names()
        if scheduler_names != self.names:
            raise ValueError("the simulated fleet must list the fleet's replicas in order")
        self.rid = {name: i for i, name in enumerate(self.names)}
        self.block_size = setup.block_size
        self.tokens_of = setup.tokens_of
        self.cache_salts = setup.cache_salts
        interval = setup.extra.get("scrape_interval_s", SCRAPE_INTERVAL_S)
        self.scrape_interval_s = float(interval) if isinstance(interval, int | float) else 1.0
        self.kv_events = bool(setup.extra.get("kv_events", True))
        self.kv_event_token_ids = bool(setup.extra.get("kv_event_token_ids", False)) or (
            setup.block_size != self.scheduler.block_size
        )
        """Send token ids with stored blocks: asked for, or needed because the engines' blocks
        are not the index's (their hashes are then not its keys)."""
        self.priority_dispatch = bool(setup.extra.get("priority_dispatch", True))
        self.task_order = bool(setup.extra.get("task_order", LEVERS["task_order"]))
        """Order a tier's calls in the engine by their task's start (task-level FCFS);
        False orders them by the call's own arrival, as the routers' calls are."""
        self.kv_retention = (
            bool(setup.extra.get("kv_retention", LEVERS["kv_retention"]))
            and KV_RETENTION in setup.mechanisms
        )
        """Ask the engine to keep the call's KV by expected return (`kv_retention`)."""
        self.allow_fallback = bool(setup.extra.get("allow_fallback", True))
        self._scraped_at = -math.inf
        self._retry_after: dict[str, float] = {}
        self._placed: dict[str, Placement] = {}
        self._down: set[int] = set()

    # ---------------------------------------------------------------- decisions

    def route(self, request: FleetRequest, fleet: FleetView, now: float) -> int | None:
        """Ask the scheduler; None (and a retry-after, when it gives one) on a refusal."""
        task = request.context
        if not isinstance(task, TaskContext):
            raise TypeError("kvflow needs the call's TaskContext in FleetRequest.context")
        names = self.names
        answer = self.scheduler.place(
            PlacementRequest(
                model=request.model,
                block_hashes=prompt_blocks(request, self.block_size),
                prompt_tokens=request.prompt_tokens,
                max_output_tokens=task.max_tokens,
                tenant=task.tenant,
                deadline_s_remaining=(
                    None if task.deadline_at is None else max(0.0, task.deadline_at - now)
                ),
                step_deadline_s_remaining=(
                    None if task.step_deadline_at is None else max(0.0, task.step_deadline_at - now)
                ),
                steps_remaining=max(1, task.steps_remaining),
                previous_replica=(
                    None if task.previous_replica is None else names[task.previous_replica]
                ),
                spent_micros=task.spent_micros,
                exclude=[names[i] for i in sorted(request.exclude)],
                workflow_id=task.workflow_id,
                task_started_at=task.started_at if self.task_order else None,
                queued_s=task.queued_s,
                steps_done=task.steps_done,
                expected_tool_s=(
                    0.0
                    if task.expected_pause_s is None
                    else task.expected_pause_s * (max(1, task.steps_remaining) - 1)
                ),
                attempt=request.attempt,
                task_retries=task.task_retries,
                allow_fallback=self.allow_fallback,
            )
        )
        self.scheduler.settle()
        if not isinstance(answer, Placement):
            if answer.retryable and answer.retry_after_s is not None:
                self._retry_after[request.request_id] = answer.retry_after_s
            return None
        self._placed[request.request_id] = answer
        if self.kv_retention:
            tier = answer.priority_key
            request.retention_priority, request.retention_s = kv_retention(
                tier, task.expected_pause_s
            )
        request.model = answer.model
        if self.priority_dispatch:
            # Tier, then the task's start (`engine_priority`): the oldest task of a tier first.
            request.priority = (
                answer.engine_priority
                if answer.engine_priority is not None
                else answer.priority_key
            )
        return self.rid[answer.replica]

    def retry_after(self, request: FleetRequest) -> float | None:
        """The refusal's retry-after, when it was a retryable one."""
        return self._retry_after.pop(request.request_id, None)

    # ---------------------------------------------------------------- telemetry

    def on_scrape(self, fleet: FleetView, now: float) -> None:
        """Every `scrape_interval_s`: each replica's metrics, as `MetricsScraper` sends them."""
        if now - self._scraped_at < self.scrape_interval_s:
            return
        self._scraped_at = now
        for index, snapshot in enumerate(fleet.metrics):
            if index in self._down:
                continue
            replica = fleet.replicas[index]
            engine = next(iter(replica.engines.values()))
            self.scheduler.update_metrics(
                self.names[index],
                ReplicaMetrics(
                    kv_cache_usage=snapshot.kv_cache_usage,
                    running=snapshot.running,
                    waiting=snapshot.waiting,
                    block_size=engine.block_size,
                    num_gpu_blocks=engine.num_gpu_blocks,
                    models=tuple(replica.engines),
                ),
            )

    def on_step(self, replica: int, result: StepResult) -> None:
        """The step's KV events into the precise prefix index (module docstring)."""
        if not self.kv_events or not result.kv_events or replica in self._down:
            return
        events: list[KvEvent] = []
        tokens_of = self.tokens_of
        with_tokens = self.kv_event_token_ids
        for event in result.kv_events:
            if getattr(event, "medium", None) not in (None, sim_events.MEDIUM_GPU):
                continue  # a host-memory copy: the GPU index skips it, as vLLM's decoder does
            if isinstance(event, sim_events.BlockStored) and not with_tokens:
                events.append(
                    BlockStored(
                        block_hashes=tuple(event.block_hashes),
                        parent_block_hash=event.parent_block_hash,
                        token_ids=(),
                        block_size=event.block_size,
                        kvflow_hashes=True,
                    )
                )
            elif isinstance(event, sim_events.BlockStored):
                parent = event.parent_block_hash
                chained = ROOT_HASH if parent is None else parent
                tokens: list[int] = []
                for h in event.block_hashes:
                    tokens.extend(tokens_of(chained, h))
                    chained = h
                salt = None
                if parent is None and event.block_hashes:
                    salt = self.cache_salts.get(event.block_hashes[0])
                events.append(
                    BlockStored(
                        block_hashes=tuple(event.block_hashes),
                        parent_block_hash=parent,
                        token_ids=tuple(tokens),
                        block_size=event.block_size,
                        # As vLLM's extra_keys carry it: the salt of the prompt's first block.
                        cache_salt=salt,
                    )
                )
            elif isinstance(event, sim_events.BlockRemoved):
                events.append(BlockRemoved(block_hashes=tuple(event.block_hashes)))
            elif isinstance(event, sim_events.AllBlocksCleared):
                events.append(AllBlocksCleared())
        self.scheduler.apply_kv_events(self.names[replica], events, result.model)

    def on_attempt_end(self, end: AttemptEnd) -> None:
        """The attempt's outcome, as the workflow's `observe` reports it."""
        placement = self._placed.pop(end.request.request_id, None)
        if placement is None:
            return
        task = end.request.context
        assert isinstance(task, TaskContext)
        due = task.step_deadline_at
        self.scheduler.observe(
            Observation(
                replica=placement.replica,
                model=placement.model,
                tenant=task.tenant,
                ok=end.ok,
                # Ended at or past its step's deadline (a call the deadline cut ends there).
                late=None if due is None else self.clock() >= due,
                replica_fault=end.replica_fault,
                queue_s=end.queue_s if end.ok else None,
                ttft_s=end.ttft_s if end.ok else None,
                duration_s=end.duration_s if end.ok else None,
                prompt_tokens=end.prompt_tokens,
                cached_tokens=end.cached_tokens,
                completion_tokens=end.completion_tokens,
                cost_micros=end.cost_micros,
                probe=placement.probe,
                cold_start=placement.cold_start,
            )
        )

    def on_replica_down(self, replica: int) -> None:
        """Its scrapes failed: the scheduler marks it down and drops its prefix entries."""
        self._down.add(replica)
        self.scheduler.set_replica_up(self.names[replica], False)

    def on_task_end(self, workflow_id: str) -> None:
        """The task's ledger row is written: its conversation stops counting as open."""
        self.scheduler.end_task(workflow_id)

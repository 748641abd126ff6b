"""The benchmark harness: runs a workload's tasks on the discrete-event fleet with one policy.

Every policy gets the same treatment; only `PlacementPolicy.route` differs:

- **Tasks drive calls.** A task's first step is issued when it arrives; each next step when
  every call of the step before has finished, plus the step's tool pause. A task succeeds when
  all its steps finish before its deadline (and, where the workload sets them, each step
  before its own); when a deadline passes first, its calls in flight are cancelled (billed
  for what they processed) and the task fails.
- **What production knows, nothing more.** Each call carries a `TaskContext` built from the
  task's declarations and its past: steps remaining = max(1, declared calls − calls done)
  (kvflow's step API), the deadline = arrival + declared budget, spend so far, the previous
  replica; with hints on, the session id and an expected output length from finished calls of
  the same application. A policy is handed a copy of the call with its prompt's blocks and
  its output cap only (`_policy_view`): where the output ends, and the task's later steps,
  stay with the harness and the engine.
- **Same mechanisms for all** (`kvflow.simulator.policies.base`, "Mechanisms"): the call's
  tier as engine priority; a router-side queue with admission (`RouterQueue`), where a
  refusal with a retry-after waits too; hints (the session, expected output and, learned
  from pauses already observed, the expected tool pause); engines that keep KV by the
  retention a call asks for; fallback to a cheaper model, off by default,
  and where on, a task with a degraded call is counted apart, never as a success.
- **Same failure handling.** A call that fails on a replica (crash, or sent to a replica
  that is down) is re-placed with that replica excluded, up to `RETRY_BUDGET` re-placements
  per task; then the task fails. A refusal without a retry-after (or with the queue off)
  fails the task.
- **Money is exact.** Each attempt is billed in integer micro-dollars at its pool's token
  prices, failed and cancelled attempts included (the input was processed).

Only tasks arriving in the `CountWindow` are counted; the fleet's busy time is measured over
the same window; the run stops once every counted task has ended.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from heapq import heappop, heappush
from typing import Any

from kvflow.bench.policies.router_queue import DISPATCH_INTERVAL_S, RouterQueue
from kvflow.scheduler.fleet import ExactPrices, Fleet
from kvflow.scheduler.placement import engine_priority
from kvflow.simulator.des import DiscreteEventFleet, FleetRequest, FleetView, RequestRecord
from kvflow.simulator.engine import SimReplica, SimRequest, StepResult
from kvflow.simulator.kvcache import (
    MAX_RETENTION_PRIORITY,
    MIN_RETENTION_PRIORITY,
    BlockPool,
    RetentionBlockPool,
    TaskBlocks,
)
from kvflow.simulator.policies.base import (
    DEFAULT_MECHANISMS,
    ENGINE_PRIORITY,
    HINTS,
    ROUTER_QUEUE,
    TASK_END,
    AttemptEnd,
    PlacementPolicy,
    TaskContext,
)
from kvflow.simulator.workloads import Task

logger = logging.getLogger(__name__)

RETRY_BUDGET = 3
"""Re-placements per task after failed calls, for every policy (kvflow's default)."""
DEFAULT_MODEL = "llama-3.1-8b"
KV_SAMPLES = 50
"""Samples of the open conversations' KV demand over the window."""


def _call_id(request_id: str) -> str:
    """The call a request id names, whatever its attempt (`task-3/2/0#17` → `task-3/2/0`)."""
    return request_id.split("#")[0]


@dataclass(frozen=True, slots=True)
class CountWindow:
    """Tasks arriving in [start, end) are counted; busy time is measured over it."""

    start: float
    end: float

    @property
    def seconds(self) -> float:
        """The window's length."""
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Decision:
    """One placement as the harness saw it: what the policy was given and what it chose."""

    at: float
    request_id: str
    replica: int | None
    priority: int
    model: str
    context: tuple[object, ...]
    """The call's `TaskContext`, field by field."""
    retention: tuple[int | None, float | None] = (None, None)
    """The KV retention the policy asked the engine for: (priority, seconds)."""


@dataclass(frozen=True, slots=True)
class LateStep:
    """A call still running when its step's deadline passed, and the fleet around it.

    Loads are running plus waiting calls on a replica serving the model, as a router reads
    them: at the placement (before the call joined) and at the deadline (the call counted).
    """

    task: int
    """The task's index in its workload."""
    tier: int
    output_tokens: int
    """The whole answer the call was to decode."""
    replica: int
    placed_load: int
    """The chosen replica's load when the call was placed."""
    placed_least_load: int
    """The least load of any replica serving the model then."""
    placed_mean_load: float
    load: int
    """The replica's load when the deadline passed."""
    lower_tier_calls: int
    """Of those, calls of tasks of lower tiers (a larger tier number)."""
    least_load: int
    mean_load: float


@dataclass(slots=True)
class _TaskState:
    task: Task
    step: int = 0
    pending: int = 0
    calls_done: int = 0
    spent_micros: int = 0
    retries: int = 0
    previous: int | None = None
    done: bool = False
    ok: bool = False
    degraded: bool = False
    end: float = 0.0
    tool_s: float = 0.0
    step_serial: int = 0
    step_deadline_at: float | None = None
    context_tokens: int = 0
    """The conversation's tokens so far (its last issued prompt)."""
    inflight: dict[str, tuple[int, FleetRequest]] = field(default_factory=dict)
    placed: dict[str, tuple[int, int, float]] = field(default_factory=dict)
    """Call with a step deadline → (its replica's load, the least, the mean) when placed."""
    refused_at: dict[str, float] = field(default_factory=dict)
    """Call (request id before its `#attempt`) → when admission first refused it."""
    counted: bool = True
    """False for tasks outside the window: they load the fleet but no figure counts them."""


@dataclass
class Outcome:
    """Everything measured in one run of one policy (figures come from `figures`)."""

    policy: str
    replicas: int
    tasks: int
    successes: int
    tasks_by_tier: dict[int, int]
    successes_by_tier: dict[int, int]
    spend_micros: int
    wasted_micros: int
    ttfts: list[float]
    prompt_tokens: int
    cached_tokens: int
    span_s: float
    """The counting window's length (the whole run without a window)."""
    busy_s: float
    """Engine busy seconds over the window, all replicas."""
    attempts_by_replica: list[int]
    failed_attempts: int
    refusals: int
    warmup_s: float = 0.0
    """From the first arrival to the window's start: how long the fleet had to fill."""
    mean_task_s: float = 0.0
    """Mean time from arrival to end of the counted tasks, failed ones included."""
    degraded: int = 0
    """Counted tasks that ended with a call degraded to another model (not successes)."""
    busy_gpu_s: float = 0.0
    """GPU-seconds the engines were busy over the window (busy time × GPUs per replica)."""
    task_times: list[float] = field(default_factory=list)
    """Arrival to end of each counted successful task."""
    model_times: list[float] = field(default_factory=list)
    """Task time less the task's own tool pauses, of each counted successful task."""
    succeeded: list[int] = field(default_factory=list)
    """Indexes of the counted successful tasks."""
    kv_demand: float = 0.0
    """Mean over the window of the open conversations' tokens (running and paused) over the
    fleet's KV-cache tokens: above 1, the fleet cannot keep every conversation cached."""


OVERDUE_S = 10.0
"""How long past its conversation's return `ClairvoyantBlockPool` still keeps a block for it
(the next call's queueing): unused by then, the call went elsewhere."""


def oracle_retention(pause_s: float, *, last: bool) -> tuple[int, float | None]:
    """What a call tells `ClairvoyantBlockPool` of its conversation's return: (priority, seconds).

    From the call's true pause, which no policy knows: the seconds from the call's end to its
    conversation's next call (the pool's next use). A task's last call never comes back:
    priority 0 with no seconds, evicted before any conversation that will.
    """
    if last:
        return MIN_RETENTION_PRIORITY, None
    return MAX_RETENTION_PRIORITY, pause_s


class ClairvoyantBlockPool(RetentionBlockPool):
    """A KV block pool that evicts the free block whose next use is furthest away (Belady).

    Each release says when its blocks are next needed (`release`): `now + retention_s`, the
    conversation's known return; never, for a release with a priority and no seconds (a
    task's last call, `oracle_retention`); at once, for one with neither (the engine's
    preemptions and aborts, whose requests come straight back). Free blocks without a hash
    still go first, as in `BlockPool`; then a heap keyed by next use gives the block needed
    last. A block several conversations share (a system prompt, a fan-out's prefix) keeps
    the soonest next use still ahead. Belady's order: no eviction order misses fewer blocks
    on the same sequence of uses. A relaxation, never a policy: no engine knows the future.

    A conversation's return says when it is back at the router, not where its next call
    goes: a block still unused `OVERDUE_S` after its return is taken as never needed (the
    call went to another replica, or its task failed), else it would be kept for ever.
    """

    __slots__ = ("_due", "_heap", "_next_use")

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        events: list[Any] | None = None,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_caching, events)
        self._heap: list[tuple[float, int, int]] = []
        """(−next use, release number, block) per free block with a hash; stale entries
        (the block taken or freed again since: another release number) are skipped."""
        self._next_use: list[float] = [math.inf] * num_blocks
        self._due: list[tuple[float, int, int]] = []
        """(next use, release number, block) of the same entries, soonest first: to find the
        overdue ones."""

    def next_expiry(self, now: float) -> float | None:
        """Nothing lapses in this order."""
        return None

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached `blocks`, taking free ones out of the free structure."""
        ref_cnt = self._ref_cnt
        for block in blocks:
            if ref_cnt[block] == 0:
                if block in self._free:
                    del self._free[block]
                self._seq[block] = 0  # its heap entry, if any, goes stale
                self._next_use[block] = math.inf  # the use it was kept for is this one
                self._num_free -= 1
            ref_cnt[block] += 1

    def allocate(self, count: int, now: float = 0.0) -> list[int] | None:
        """Take `count` free blocks, those without a hash first, then the ones needed last."""
        if count > self._num_free:
            return None
        self._expire_overdue(now)
        taken: list[int] = []
        free = self._free
        while free and len(taken) < count:
            taken.append(free.popitem(False)[0])
        heap, seq, ref_cnt = self._heap, self._seq, self._ref_cnt
        while len(taken) < count:
            _, number, block = heappop(heap)
            if ref_cnt[block] == 0 and seq[block] == number:
                seq[block] = 0
                taken.append(block)
        for block in taken:
            self._next_use[block] = math.inf
        self._claim(taken)
        self._num_free -= count
        return taken

    def release(
        self,
        blocks: Sequence[int],
        now: float = 0.0,
        priority: int | None = None,
        retention_s: float | None = None,
    ) -> None:
        """Drop one reference on each of `blocks`; when next a freed one is needed: above."""
        if retention_s is not None:
            needed = now + retention_s
        else:
            needed = now if priority is None else math.inf
        ref_cnt, block_hash, seq = self._ref_cnt, self._block_hash, self._seq
        next_use, heap = self._next_use, self._heap
        freed = 0
        reuse_first: list[int] = []
        for block in reversed(blocks):
            ref_cnt[block] -= 1
            # A sharer's return still ahead counts too: the soonest one decides.
            known = next_use[block]
            if known <= now or needed < known:
                next_use[block] = known = needed
            if ref_cnt[block]:
                continue
            freed += 1
            if block_hash[block] is None:
                reuse_first.append(block)
                seq[block] = 0
                continue
            self._clock += 1
            seq[block] = self._clock
            heappush(heap, (-known, self._clock, block))
            if known != math.inf:
                heappush(self._due, (known, self._clock, block))
        self.releases += freed
        self._num_free += freed
        free = self._free
        for block in reversed(reuse_first):
            free[block] = None
            free.move_to_end(block, last=False)

    def _expire_overdue(self, now: float) -> None:
        """Blocks unused `OVERDUE_S` past their next use are never needed (class docstring)."""
        due, seq, ref_cnt = self._due, self._seq, self._ref_cnt
        while due and due[0][0] + OVERDUE_S < now:
            _, number, block = heappop(due)
            if ref_cnt[block] == 0 and seq[block] == number:
                self._next_use[block] = math.inf
                self._clock += 1
                seq[block] = self._clock
                heappush(self._heap, (-math.inf, self._clock, block))

    def evict_first(self, block_hashes: Sequence[int]) -> int:
        """The free blocks holding `block_hashes` are never needed again (a task ended)."""
        moved = 0
        for block in self.blocks_of(block_hashes):
            if self._ref_cnt[block] == 0 and block not in self._free:
                self._next_use[block] = math.inf
                self._clock += 1
                self._seq[block] = self._clock
                heappush(self._heap, (-math.inf, self._clock, block))
                moved += 1
        return moved

    def reset(self) -> bool:
        """Forget every cached hash; only possible when no request holds a block."""
        if self._num_free != self.num_blocks - 1:
            return False
        free = self._free
        for _, number, block in self._heap:
            if self._seq[block] == number and self._ref_cnt[block] == 0:
                free[block] = None
        self._heap.clear()
        self._due.clear()
        self._seq = [0] * self.num_blocks
        self._next_use = [math.inf] * self.num_blocks
        return BlockPool.reset(self)


def install_clairvoyant_pools(replicas: Sequence[SimReplica]) -> None:
    """Give every engine of `replicas` a `ClairvoyantBlockPool`, before its first request.

    The engines must evict by retention (`EngineConfig.kv_retention`): the pool reads each
    call's return from the retention it releases its blocks with.
    """
    for replica in replicas:
        for engine in replica.engines.values():
            if engine._retention_pool is None or engine.requests:
                raise ValueError(
                    "clairvoyant eviction needs fresh engines that evict by retention "
                    "(EngineConfig.kv_retention)"
                )
            pool = ClairvoyantBlockPool(
                engine.num_gpu_blocks,
                engine.block_size,
                engine.config.enable_prefix_caching,
                engine._events,
            )
            # The engine reads its pool through these two names only.
            engine._retention_pool = pool
            engine.pool = pool


class TaskRunner:
    """Runs a workload's tasks on a fleet with one policy (module docstring)."""

    def __init__(
        self,
        fleet: Fleet,
        replicas: Sequence[SimReplica],
        policy: PlacementPolicy,
        *,
        max_tokens: int,
        mechanisms: frozenset[str] = DEFAULT_MECHANISMS,
        retry_budget: int = RETRY_BUDGET,
        window: CountWindow | None = None,
        model: str = DEFAULT_MODEL,
        typical_output_tokens: int = 120,
        record_decisions: bool = False,
        retention_oracle: bool = False,
        kind_pauses: dict[str, float] | None = None,
    ) -> None:
        self.policy = policy
        self.retention_oracle = retention_oracle
        """Engines that evict the block needed last (`ClairvoyantBlockPool`), each call
        telling them when its conversation comes back, read from its task's future
        (`oracle_retention`): a relaxation that bounds what eviction order can buy, never a
        policy (needs engines that evict by retention, the kv-retention mechanism)."""
        self.kind_pauses = kind_pauses
        """With `retention_oracle`: read only the kind of the tool the call's answer will
        ask for, and take its return as that kind's typical pause away (the tool kind →
        seconds given here), never the pause itself. What knowing the tool is worth."""
        if retention_oracle:
            install_clairvoyant_pools(replicas)
        self.mechanisms = mechanisms
        self.window = window
        self.model = model
        self.max_tokens = max_tokens
        self.retry_budget = retry_budget
        self.name = policy.name
        self.sim = DiscreteEventFleet(
            replicas,
            self,
            on_step=self._on_step,
            on_finish=self._on_finish,
            on_fail=self._on_fail,
            on_scrape=self._on_scrape,
        )
        prices: list[ExactPrices] = []
        gpus: list[int] = []
        for pool in fleet.pools:
            prices.extend([pool.token_prices.exact()] * pool.replicas)
            gpus.extend([pool.gpus_per_replica] * pool.replicas)
        self.prices = prices
        self.gpus = gpus
        self.queue = RouterQueue() if ROUTER_QUEUE in mechanisms else None
        self._task_blocks = TaskBlocks() if TASK_END in mechanisms else None
        """The blocks each task alone asked for (`TASK_END` only)."""
        self.decisions: list[Decision] | None = [] if record_decisions else None
        self.late_steps: list[LateStep] = []
        """Every counted call cut by its step's deadline, and the loads around it."""
        """Every placement in order, when `record_decisions` (tests)."""
        self.attempt_log: list[tuple[float, int, bool]] = []
        """(time, replica, finished) of every attempt that reached a replica."""
        self.states: list[_TaskState] = []
        self.spend_micros = 0
        self.wasted_micros = 0
        self.ttfts: list[float] = []
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.attempts = [0] * len(replicas)
        self.failed_attempts = 0
        self.refusals = 0
        self._ids = 0
        self._tasks: Iterator[Task] = iter(())
        self._owner: dict[str, _TaskState] = {}
        """Request id of every attempt in flight or queued → its task."""
        self._outputs: dict[int, tuple[int, int]] = {}
        """Application → (finished calls, their completion tokens): the output hint."""
        self._typical_output = typical_output_tokens
        self._pauses: dict[int, tuple[int, float]] = {}
        """Application → (pauses observed, their seconds): the pause hint."""
        self._first_arrival: float | None = None
        self._busy_at: dict[str, list[float]] = {}
        self._open_counted = 0
        self._open_context = 0
        self._kv_samples: list[float] = []
        self._kv_tokens = sum(
            e.num_gpu_blocks * e.block_size for r in replicas for e in r.engines.values()
        )
        self._closed = window is None
        self._tick_pending = False

    # ---- driving

    def run(self, tasks: Iterator[Task], faults: Callable[[DiscreteEventFleet], None]) -> Outcome:
        """Run every task to its end; `faults` may schedule crashes on the fleet first."""
        faults(self.sim)
        if self.window is not None:
            self.sim.schedule(self.window.start, lambda: self._snapshot("start"))
            self.sim.schedule(self.window.end, self._close_window)
            self.sim.schedule(self.window.start, self._sample_kv)
        self._tasks = tasks
        self._next_task()
        result = self.sim.run()
        return self._outcome(result.simulated_seconds)

    def _snapshot(self, name: str) -> None:
        self._busy_at[name] = self._busy_by_replica()

    def _sample_kv(self) -> None:
        """Every 1/50 of the window: the open conversations' tokens over the KV cache's."""
        window = self.window
        if window is None or self.sim.now >= window.end:
            return
        self._kv_samples.append(self._open_context / self._kv_tokens if self._kv_tokens else 0)
        self.sim.schedule(self.sim.now + window.seconds / KV_SAMPLES, self._sample_kv)

    def _close_window(self) -> None:
        self._snapshot("end")
        self._closed = True
        if self._open_counted == 0:
            self.sim.stop()

    def _next_task(self) -> None:
        """Schedule the next task's arrival (tasks are generated as they arrive)."""
        task = next(self._tasks, None)
        if task is not None:
            self.sim.schedule(task.arrival, functools.partial(self._arrive, task))

    def _counts(self, task: Task) -> bool:
        window = self.window
        return window is None or window.start <= task.arrival < window.end

    def _arrive(self, task: Task) -> None:
        if self._first_arrival is None:
            self._first_arrival = self.sim.now
        state = _TaskState(task, counted=self._counts(task))
        self._open_counted += state.counted
        self.states.append(state)
        self.sim.schedule(task.deadline_at, functools.partial(self._expire, state, None))
        self._issue_step(state)
        self._next_task()

    def _issue_step(self, state: _TaskState) -> None:
        if state.done:
            return
        task = state.task
        now = self.sim.now
        if state.step:
            # The pause before this step has just been observed: what kvflow learns from
            # its workflows' histories, per workflow type.
            count, total = self._pauses.get(task.application, (0, 0.0))
            self._pauses[task.application] = (
                count + 1,
                total + task.steps[state.step - 1].pause_after_s,
            )
        step = task.steps[state.step]
        state.pending = len(step.calls)
        if self._task_blocks is not None:
            for call in step.calls:
                self._task_blocks.note(state.task.index, call.block_hashes)
        context = step.calls[0].prompt_tokens
        self._open_context += context - state.context_tokens
        state.context_tokens = context
        state.step_serial += 1
        state.step_deadline_at = None
        if task.step_allowance_s is not None:
            state.step_deadline_at = now + task.step_allowance_s
            self.sim.schedule(
                state.step_deadline_at,
                functools.partial(self._expire, state, state.step_serial),
            )
        hints = HINTS in self.mechanisms
        for number, call in enumerate(step.calls):
            self._submit(
                state,
                FleetRequest(
                    arrival_time=now,
                    model=self.model,
                    prompt_tokens=call.prompt_tokens,
                    output_tokens=call.output_tokens,
                    block_hashes=call.block_hashes,
                    tenant=task.tenant,
                    session=f"task-{task.index}" if hints else "",
                    request_id=f"task-{task.index}/{state.step}/{number}",
                    deadline_at=state.step_deadline_at,
                    max_tokens=self.max_tokens,
                ),
            )

    def _expected_output(self, application: int) -> int:
        calls, tokens = self._outputs.get(application, (0, 0))
        return round(tokens / calls) if calls else self._typical_output

    def _expected_pause(self, application: int) -> float | None:
        count, total = self._pauses.get(application, (0, 0.0))
        return total / count if count else None

    def _submit(self, state: _TaskState, request: FleetRequest, *, attempt: int = 1) -> None:
        if state.done:
            return
        task = state.task
        self._ids += 1
        request.request_id = f"{_call_id(request.request_id)}#{self._ids}"
        request.attempt = attempt
        request.arrival_time = self.sim.now
        request.model = self.model
        hints = HINTS in self.mechanisms
        request.context = TaskContext(
            workflow_id=f"task-{task.index}",
            tenant=task.tenant,
            tier=task.tier,
            deadline_at=task.deadline_at,
            started_at=task.arrival,
            steps_remaining=max(1, task.expected_calls - state.calls_done),
            max_tokens=self.max_tokens,
            spent_micros=state.spent_micros,
            previous_replica=state.previous,
            task_retries=state.retries,
            step_deadline_at=state.step_deadline_at,
            session_id=f"task-{task.index}" if hints else None,
            expected_output_tokens=self._expected_output(task.application) if hints else None,
            expected_pause_s=self._expected_pause(task.application) if hints else None,
            steps_done=state.calls_done,
            queued_s=self.sim.now
            - state.refused_at.get(_call_id(request.request_id), self.sim.now),
        )
        state.inflight[request.request_id] = (-1, request)
        self._owner[request.request_id] = state
        if self.queue is None:
            self.sim.submit(request)
            return
        self.queue.push(request, task.tier, self.sim.now)
        self._dispatch()

    def _alive(self, request: FleetRequest) -> bool:
        state = self._owner.get(request.request_id)
        return state is not None and not state.done

    def _dispatch(self) -> None:
        """Let the router queue release what admission allows; look again in 50 ms."""
        queue = self.queue
        if queue is None:
            return
        self.sim.refresh_metrics()
        queue.dispatch(self.sim.view, self.sim.submit, self._alive)
        if len(queue) and not self._tick_pending:
            self._tick_pending = True
            self.sim.schedule(self.sim.now + DISPATCH_INTERVAL_S, self._tick)

    def _tick(self) -> None:
        self._tick_pending = False
        self._dispatch()

    def _expire(self, state: _TaskState, step_serial: int | None) -> None:
        """The task's deadline (`step_serial` None) or a step's deadline passed."""
        if state.done or (step_serial is not None and step_serial != state.step_serial):
            return
        if step_serial is not None and state.counted:
            self._note_late(state)
        self._finish_task(state, ok=False)
        for request_id, (replica, request) in list(state.inflight.items()):
            self._owner.pop(request_id, None)
            if replica < 0:
                continue
            sim = self.sim.abort(replica, request.model, request_id)
            if sim is not None:
                self._bill_partial(state, replica, request, sim, replica_fault=False)
        state.inflight.clear()
        self._conversation_over(state)  # now that the aborted calls freed their blocks

    @staticmethod
    def _loads(fleet: FleetView, model: str) -> list[int]:
        """The load of every replica that is up and serves `model`."""
        return [
            fleet.load(i) for i in range(len(fleet)) if fleet.up[i] and fleet.serves(i, model)
        ] or [0]

    def _note_late(self, state: _TaskState) -> None:
        """Record where each call of a step that just passed its deadline stood."""
        fleet = self.sim.view
        tier = state.task.tier
        for request_id, (replica, request) in state.inflight.items():
            placed = state.placed.get(request_id)
            if replica < 0 or placed is None:
                continue
            lower = sum(
                1
                for other_id, other in self._owner.items()
                if other.task.tier > tier and other.inflight.get(other_id, (-1,))[0] == replica
            )
            loads = self._loads(fleet, request.model)
            self.late_steps.append(
                LateStep(
                    task=state.task.index,
                    tier=tier,
                    output_tokens=request.output_tokens,
                    replica=replica,
                    placed_load=placed[0],
                    placed_least_load=placed[1],
                    placed_mean_load=placed[2],
                    load=fleet.load(replica),
                    lower_tier_calls=lower,
                    least_load=min(loads),
                    mean_load=sum(loads) / len(loads),
                )
            )

    def _finish_task(self, state: _TaskState, *, ok: bool) -> None:
        self._open_context -= state.context_tokens
        state.done = True
        self.policy.on_task_end(f"task-{state.task.index}")
        self._conversation_over(state)
        state.ok = ok
        state.end = self.sim.now
        if not state.counted:
            return
        if not ok:
            self.wasted_micros += state.spent_micros
        self._open_counted -= 1
        if self._closed and self._open_counted == 0:
            self.sim.stop()

    def _conversation_over(self, state: _TaskState) -> None:
        """The task ended and none of its calls runs: its own blocks go first (`TASK_END`).

        Every engine evicts them before any other cached block; once per task.
        """
        if self._task_blocks is None or not state.done or state.inflight:
            return
        own = self._task_blocks.end(state.task.index)
        if not own:
            return
        for replica in self.sim.replicas:
            engine = replica.engines.get(self.model)
            if engine is not None:
                engine.evict_first(own)

    # ---- fleet callbacks

    def route(self, request: FleetRequest, fleet: FleetView, now: float) -> int | None:
        """The policy's choice, noted so that a deadline can cancel the attempt."""
        state = self._owner.get(request.request_id)
        if state is None or state.done:
            return None
        context = request.context
        if isinstance(context, TaskContext):
            # What the workflow knows when the call is placed, not when it was issued.
            context.spent_micros = state.spent_micros
            context.previous_replica = state.previous
        # The tier's band of kvflow's engine priorities (`engine_priority`), in the order of
        # tiers alone: an engine pausing by priority band (`EngineConfig.
        # deadline_priority_span`) reads every policy's calls alike.
        request.priority = (
            engine_priority(state.task.tier, None) if ENGINE_PRIORITY in self.mechanisms else 0
        )
        view = self._policy_view(request, fleet)
        index = self.policy.route(view, fleet, now)
        request.model, request.priority = view.model, view.priority
        request.retention_priority, request.retention_s = view.retention_priority, view.retention_s
        if self.retention_oracle:
            steps = state.task.steps
            last = state.step >= len(steps) - 1
            pause = 0.0 if last else steps[state.step].pause_after_s
            if self.kind_pauses is not None and not last:
                pause = self.kind_pauses.get(steps[state.step].tool or "", pause)
            request.retention_priority, request.retention_s = oracle_retention(pause, last=last)
        if self.decisions is not None:
            self.decisions.append(
                Decision(
                    at=now,
                    request_id=request.request_id,
                    replica=index,
                    priority=request.priority,
                    model=request.model,
                    context=dataclasses.astuple(context)
                    if isinstance(context, TaskContext)
                    else (),
                    retention=(request.retention_priority, request.retention_s),
                )
            )
        if index is not None and state.step_deadline_at is not None and state.counted:
            loads = self._loads(fleet, request.model)
            state.placed[request.request_id] = (
                fleet.load(index),
                min(loads),
                sum(loads) / len(loads),
            )
        if index is not None:
            state.refused_at.pop(_call_id(request.request_id), None)
            if request.model != self.model:
                state.degraded = True
            state.inflight[request.request_id] = (index, request)
        return index

    def _policy_view(self, request: FleetRequest, fleet: FleetView) -> FleetRequest:
        """The call as a policy may see it: its prompt's blocks and its output cap only.

        Where the output will end (`output_tokens`) and the blocks of the output (the tail of
        `block_hashes`, which the engine caches for the next step) are the call's future.
        """
        block = fleet.replicas[0].config.block_size
        return FleetRequest(
            arrival_time=request.arrival_time,
            model=request.model,
            prompt_tokens=request.prompt_tokens,
            output_tokens=self.max_tokens,
            block_hashes=request.block_hashes[: request.prompt_tokens // block],
            max_tokens=self.max_tokens,
            tenant=request.tenant,
            session=request.session,
            request_id=request.request_id,
            exclude=request.exclude,
            attempt=request.attempt,
            priority=request.priority,
            context=request.context,
        )

    def _on_scrape(self, now: float) -> None:
        self.policy.on_scrape(self.sim.view, now)

    def _on_step(self, replica: int, result: StepResult) -> None:
        self.policy.on_step(replica, result)

    def _bill(self, state: _TaskState, micros: int) -> None:
        state.spent_micros += micros
        if not state.counted:
            return
        self.spend_micros += micros
        if state.done and not state.ok:
            self.wasted_micros += micros

    def _on_finish(self, record: RequestRecord) -> None:
        request = record.request
        state = self._owner.pop(request.request_id)
        state.inflight.pop(request.request_id, None)
        replica = record.replica
        self.attempt_log.append((self.sim.now, replica, True))
        cost = self.prices[replica].cost_micros(
            request.prompt_tokens, record.cached_tokens, record.output_tokens
        )
        self._bill(state, cost)
        if state.counted:
            self.attempts[replica] += 1
            self.ttfts.append(record.ttft)
            self.prompt_tokens += request.prompt_tokens
            self.cached_tokens += record.cached_tokens
        app = state.task.application
        calls, tokens = self._outputs.get(app, (0, 0))
        self._outputs[app] = (calls + 1, tokens + record.output_tokens)
        self.policy.on_attempt_end(
            AttemptEnd(
                request=request,
                replica=replica,
                ok=True,
                queue_s=record.queue_time,
                ttft_s=record.ttft,
                duration_s=record.e2e_latency,
                prompt_tokens=request.prompt_tokens,
                cached_tokens=record.cached_tokens,
                completion_tokens=record.output_tokens,
                cost_micros=cost,
            )
        )
        if state.done:
            self._conversation_over(state)  # the last sibling of an ended task
            return
        state.previous = replica
        state.calls_done += 1
        state.pending -= 1
        if state.pending:
            return
        state.step += 1
        state.step_serial += 1  # the step is done: its deadline no longer applies
        if state.step == len(state.task.steps):
            self._finish_task(state, ok=True)
            return
        pause = state.task.steps[state.step - 1].pause_after_s
        state.tool_s += pause
        self.sim.schedule(self.sim.now + pause, functools.partial(self._issue_step, state))

    def _bill_partial(
        self,
        state: _TaskState,
        replica: int,
        request: FleetRequest,
        sim: SimRequest | None,
        *,
        replica_fault: bool,
    ) -> None:
        """An attempt that did not finish: bill what it processed, tell the policy."""
        if state.counted:
            self.failed_attempts += 1
        prompt = cached = output = 0
        if sim is not None and sim.first_scheduled_time is not None:
            prompt = min(max(sim.num_computed_tokens, 0), request.prompt_tokens)
            cached = min(max(sim.num_cached_tokens, 0), prompt)
            output = sim.num_output_tokens
            if output:
                prompt = request.prompt_tokens
        cost = self.prices[replica].cost_micros(prompt, cached, output) if replica >= 0 else 0
        self._bill(state, cost)
        if replica >= 0:
            self.attempt_log.append((self.sim.now, replica, False))
            if state.counted:
                self.attempts[replica] += 1
        self.policy.on_attempt_end(
            AttemptEnd(
                request=request,
                replica=replica,
                ok=False,
                replica_fault=replica_fault,
                prompt_tokens=prompt,
                cached_tokens=cached,
                completion_tokens=output,
                cost_micros=cost,
            )
        )

    def _on_fail(self, request: FleetRequest, replica: int, sim: SimRequest | None) -> None:
        state = self._owner.pop(request.request_id, None)
        if state is None:
            return
        state.inflight.pop(request.request_id, None)
        if replica < 0:
            wait = self.policy.retry_after(request)
            if state.done:
                self._conversation_over(state)
                return
            if state.counted:
                self.refusals += 1
            state.refused_at.setdefault(_call_id(request.request_id), self.sim.now)
            if (
                wait is not None
                and self.queue is not None
                and self.sim.now + wait < state.task.deadline_at
            ):
                self.sim.schedule(
                    self.sim.now + wait,
                    functools.partial(self._submit, state, request, attempt=request.attempt),
                )
                return
            self._finish_task(state, ok=False)
            return
        self._bill_partial(state, replica, request, sim, replica_fault=True)
        if state.done:
            self._conversation_over(state)
            return
        if state.retries >= self.retry_budget:
            self._finish_task(state, ok=False)
            return
        state.retries += 1
        request.exclude = request.exclude | {replica}
        self._submit(state, request, attempt=request.attempt + 1)

    # ---- figures

    def _busy_by_replica(self) -> list[float]:
        return [sum(e.stats.busy_seconds for e in r.engines.values()) for r in self.sim.replicas]

    def _outcome(self, simulated_s: float) -> Outcome:
        tasks_by_tier: dict[int, int] = {}
        successes_by_tier: dict[int, int] = {}
        counted = degraded = 0
        lifetimes = 0.0
        task_times: list[float] = []
        model_times: list[float] = []
        succeeded: list[int] = []
        for state in self.states:
            if not state.counted:
                continue
            if not state.done:
                logger.warning("task %d never ended", state.task.index)
            counted += 1
            lifetime = state.end - state.task.arrival
            lifetimes += lifetime
            tier = state.task.tier
            tasks_by_tier[tier] = tasks_by_tier.get(tier, 0) + 1
            if state.ok and state.degraded:
                degraded += 1
            elif state.ok:
                successes_by_tier[tier] = successes_by_tier.get(tier, 0) + 1
                task_times.append(lifetime)
                model_times.append(lifetime - state.tool_s)
                succeeded.append(state.task.index)
        now = self._busy_by_replica()
        start = self._busy_at.get("start", [0.0] * len(now))
        end = self._busy_at.get("end", now)
        busy = [b - a for a, b in zip(start, end, strict=True)]
        window = self.window
        span = window.seconds if window is not None else simulated_s
        warmup = 0.0
        if window is not None and self._first_arrival is not None:
            warmup = window.start - self._first_arrival
        return Outcome(
            policy=self.policy.name,
            replicas=len(self.sim.replicas),
            tasks=counted,
            successes=sum(successes_by_tier.values()),
            tasks_by_tier=tasks_by_tier,
            successes_by_tier=successes_by_tier,
            spend_micros=self.spend_micros,
            wasted_micros=self.wasted_micros,
            ttfts=self.ttfts,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            span_s=span,
            busy_s=sum(busy),
            attempts_by_replica=self.attempts,
            failed_attempts=self.failed_attempts,
            refusals=self.refusals,
            warmup_s=warmup,
            mean_task_s=lifetimes / counted if counted else 0.0,
            degraded=degraded,
            busy_gpu_s=sum(b * g for b, g in zip(busy, self.gpus, strict=True)),
            task_times=task_times,
            model_times=model_times,
            succeeded=succeeded,
            kv_demand=sum(self._kv_samples) / len(self._kv_samples) if self._kv_samples else 0.0,
        )

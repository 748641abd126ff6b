"""vLLM V1 schedulers that know kvflow's tasks: a finished task's KV goes first; deadlines pause.

Two behaviours, each a scheduler class to load into a vLLM server (0.32) with
`--scheduler-cls` (the `...Async...` variant where vLLM schedules asynchronously, its default
on GPUs; the CPU build always schedules synchronously):

- `TaskEndScheduler`: when kvflow says a task has ended, the engine reuses that task's own
  KV-cache blocks before any other cached block.
- `DeadlinePauseScheduler` (with `--scheduling-policy priority`): the same, and it pauses less
  urgent work while a call with a deadline would miss it.

The engine process must be able to import this package: put a directory that holds
`kvflow_vllm` (and nothing else of kvflow's environment) on the server's `PYTHONPATH`.

A call opts in with its sampling parameters' `extra_args`, which the OpenAI-compatible server
fills from the request body's `vllm_xargs` object.

**A finished task's KV first.** vLLM keeps the blocks of finished requests cached and reuses
the least recently used first. A conversation whose task has ended will never be asked for
again, yet LRU evicts a paused conversation that is older before it. kvflow tags each call
with its task (`kvflow_task`: the workflow id); the scheduler notes which cached blocks each
task's calls held. When the task ends, kvflow's control plane sends the engine that served its
last call a one-token request carrying `kvflow_release` (the same id): vLLM has no request
that evicts chosen blocks, so the release rides on the smallest request there is. On its
arrival the scheduler takes the task's blocks that no other task has used (a shared system
prompt stays, also when the tasks that used it before have ended) and that no running request
holds, drops them from the prefix cache
(vLLM emits its `BlockRemoved` KV events for them) and puts them at the front of the free
queue, where the next allocation takes them. Nothing else changes: the blocks were free
already, so the engine's KV usage is the same. Tagged tasks are remembered up to
`MAX_TRACKED_TASKS`, the least recently finished forgotten first (a task that never ends is
forgotten, its blocks left to LRU).

**Deadline pause.** A call with a deadline carries:

- `kvflow_deadline`: when the call must be finished, in POSIX seconds (a float);
- `kvflow_priority_span` (default 1): the width of a priority band. The priorities
  `tier * span + offset` (kvflow sends `tier * 10**13 + task start in ms`) fall into one band
  per tier.

On every step the scheduler projects, for each running call that carries a deadline, has
finished its prefill and whose deadline has not passed yet, when it would finish at the
engine's current pace: now + tokens still to generate × the measured step interval. When some
call would finish after its deadline ("at risk"), the most urgent such call (lowest priority
value) names a band, and for that step every running request of a greater band is left out of
the batch (it keeps its KV blocks and its place among the running requests) and no waiting
request of a greater band is admitted. Requests of the same or a better band run as usual.
When no call is at risk, or none carries a deadline, it schedules exactly as vLLM's own
scheduler.

A call whose deadline has already passed no longer pauses anyone: the other calls would be
held for a call that is late either way.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import RequestQueue, SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

__all__ = [
    "DEADLINE_KEY",
    "PRIORITY_SPAN_KEY",
    "RELEASE_KEY",
    "TASK_KEY",
    "DeadlinePauseAsyncScheduler",
    "DeadlinePauseScheduler",
    "TaskEndAsyncScheduler",
    "TaskEndScheduler",
]

# Under the `vllm` logger hierarchy, so that vLLM's logging configuration (its handler and
# format, in the server's log) applies to these lines too; a logger outside it has no handler.
logger = init_logger(f"vllm.{__name__}")

DEADLINE_KEY = "kvflow_deadline"
"""`extra_args` key (`vllm_xargs` in the request body): the deadline, POSIX seconds."""
PRIORITY_SPAN_KEY = "kvflow_priority_span"
"""`extra_args` key: the width of a priority band (a positive integer, default 1)."""

TASK_KEY = "kvflow_task"
"""`extra_args` key: the task the call belongs to (kvflow sends its workflow id)."""
RELEASE_KEY = "kvflow_release"
"""`extra_args` key: the task that has ended; its own cached blocks are reused first."""
MAX_TRACKED_TASKS = 100_000
"""Tasks whose blocks are remembered; past it the least recently finished is forgotten. A
task's entry holds one block id and hash per block its calls held (a 100k-token conversation
in 16-token blocks: about 6,000)."""
GIVEN_OUT_PER_BLOCK = 2
"""Hashes of ended tasks' blocks remembered, per block of the KV cache: a hash older than
that many newer ones has most likely left the cache, and forgetting it costs at most one more
release of a block that a later task will compute again."""

PACE_SMOOTHING = 0.3
"""Weight of the newest step interval in the pace's exponential moving average."""


@dataclass(frozen=True)
class _Deadline:
    """What a request asked for in its `extra_args`."""

    at: float
    """POSIX seconds."""
    span: int
    """Width of a priority band."""


def _deadline_of(request: Request) -> _Deadline | None:
    """The request's deadline, or None when it has none (or an unusable one)."""
    params = request.sampling_params
    extra_args: dict[str, Any] | None = params.extra_args if params is not None else None
    if not extra_args:
        return None
    raw = extra_args.get(DEADLINE_KEY)
    if raw is None:
        return None
    try:
        at = float(raw)
        span = int(extra_args.get(PRIORITY_SPAN_KEY, 1))
    except (TypeError, ValueError, OverflowError):
        return None
    if not math.isfinite(at) or span < 1:
        return None
    return _Deadline(at=at, span=span)


@dataclass(frozen=True)
class _Pause:
    """One step's decision: the request it is for, and the band that still runs."""

    urgent: Request
    """The most urgent request that would miss its deadline at the current pace."""
    band: int
    """`urgent.priority // span`: requests of a greater band do not run this step."""
    span: int


def _text_arg(request: Request, key: str) -> str | None:
    """The request's `extra_args[key]` when it is a non-empty string, else None."""
    params = request.sampling_params
    extra_args: dict[str, Any] | None = params.extra_args if params is not None else None
    if not extra_args:
        return None
    value = extra_args.get(key)
    return value if isinstance(value, str) and value else None


class TaskEndScheduler(Scheduler):
    """vLLM's V1 scheduler, reusing an ended task's own KV blocks before any other cached block.

    See the module's documentation for the request parameters (`kvflow_task` on every call,
    `kvflow_release` once the task has ended). Without prefix caching there is nothing to
    release, and requests without these parameters are scheduled exactly as by vLLM.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._task_blocks: OrderedDict[str, dict[int, Hashable]] = OrderedDict()
        """Task → the cached blocks its finished calls held (block id → the block's hash then),
        least recently finished first."""
        self._block_tasks: dict[Hashable, set[str]] = {}
        """Block hash → the remembered tasks whose calls held it (more than one: shared)."""
        self._given_out: OrderedDict[Hashable, None] = OrderedDict()
        """Hashes of the blocks of tasks that ended or were forgotten, oldest first: a later
        task that holds one shares it with them (a system prompt its first user released),
        so its end does not release it again. At most `GIVEN_OUT_PER_BLOCK` per KV block."""
        self.released_blocks = 0
        """Blocks moved to the front of the free queue by releases since the engine started."""

    def add_request(self, request: Request) -> None:
        """Queue a request; one carrying `kvflow_release` first releases that task's blocks."""
        task = _text_arg(request, RELEASE_KEY)
        if task is not None:
            released = self.release_task(task)
            logger.debug("task %s ended: %d of its KV blocks go first", task, released)
        super().add_request(request)

    def _free_request_blocks(self, request: Request) -> None:
        # The one place every finished request's blocks pass through (finished, aborted or
        # deferred while a GPU step may still write them): note them before they are freed.
        task = _text_arg(request, TASK_KEY)
        if task is not None:
            self._note_blocks(task, request)
        super()._free_request_blocks(request)

    def _note_blocks(self, task: str, request: Request) -> None:
        """Remember the cached blocks the request held as its task's."""
        held = self._task_blocks.pop(task, None)
        if held is None:
            held = {}
        for group in self.kv_cache_manager.get_blocks(request.request_id).blocks:
            for block in group:
                block_hash = block.block_hash
                if block_hash is None or block.is_null:
                    continue  # never found by a prefix lookup: LRU has nothing to keep
                if held.get(block.block_id) != block_hash:
                    held[block.block_id] = block_hash
                    self._block_tasks.setdefault(block_hash, set()).add(task)
        self._task_blocks[task] = held  # now the most recently finished
        while len(self._task_blocks) > MAX_TRACKED_TASKS:
            oldest, blocks = self._task_blocks.popitem(last=False)
            self._forget(oldest, blocks)

    def _forget(self, task: str, blocks: dict[int, Hashable]) -> None:
        """Drop the task from every block's holders; its hashes count as given out."""
        given_out = self._given_out
        for block_hash in blocks.values():
            holders = self._block_tasks.get(block_hash)
            if holders is not None:
                holders.discard(task)
                if not holders:
                    del self._block_tasks[block_hash]
            given_out[block_hash] = None
            given_out.move_to_end(block_hash)
        limit = GIVEN_OUT_PER_BLOCK * self.kv_cache_manager.block_pool.num_gpu_blocks
        while len(given_out) > limit:
            given_out.popitem(last=False)

    def release_task(self, task: str) -> int:
        """The task has ended: its own free cached blocks go first. Returns how many moved.

        A block is the task's own when no other task's calls held it: no other remembered
        task, and no task that ended or was forgotten before (`_given_out`). Only free
        blocks (no running request holds them) that still hold what the task's calls left
        there move: a block reused since then belongs to someone else now.
        """
        blocks = self._task_blocks.pop(task, None)
        if not blocks:
            return 0
        pool = self.kv_cache_manager.block_pool
        own: list[KVCacheBlock] = []
        for block_id, block_hash in blocks.items():
            holders = self._block_tasks.get(block_hash)
            if (holders is not None and holders != {task}) or block_hash in self._given_out:
                continue  # shared with another task (a system prompt): it stays
            block = pool.blocks[block_id]
            if block.ref_cnt == 0 and block.block_hash == block_hash:
                own.append(block)
        self._forget(task, blocks)
        if not own:
            return 0
        # Out of the prefix cache (vLLM emits `BlockRemoved` for each, so an index fed by
        # its KV events forgets them), then from their place in the free queue to its front.
        pool.evict_blocks({block.block_id for block in own})
        for block in own:
            pool.free_block_queue.remove(block)
        pool.free_block_queue.prepend_n(own)
        self.released_blocks += len(own)
        return len(own)


class TaskEndAsyncScheduler(TaskEndScheduler, AsyncScheduler):
    """`TaskEndScheduler` on vLLM's asynchronous scheduler (`--async-scheduling`)."""


class DeadlinePauseScheduler(TaskEndScheduler):
    """vLLM's V1 scheduler, pausing greater priority bands while a deadline is at risk.

    Needs `--scheduling-policy priority` (it refuses to start otherwise: under fcfs vLLM
    ignores priorities, so there would be no bands to pause). It releases ended tasks' blocks
    as `TaskEndScheduler` does. See the module's documentation for the request parameters.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.policy != SchedulingPolicy.PRIORITY:
            raise ValueError(
                f"{type(self).__name__} needs --scheduling-policy priority "
                f"(this server schedules by {self.policy.value})"
            )
        self.step_interval_s: float | None = None
        """Exponential moving average of the interval between two steps that ran requests.

        An average rather than the last interval: a single slow step (a prefill joining the
        batch, a garbage collection) would otherwise pause or resume the batch on its own; at
        `PACE_SMOOTHING` the average still follows a lasting change within a few steps.
        """
        self._last_schedule_at: float | None = None
        self._last_step_ran = False
        self._paused_for: str | None = None
        """The request the current pause is for (to log when a pause begins and ends)."""
        self._announced_for: str | None = None
        """The last request whose pause was logged at info."""
        self._skip_unhonoured = False

    def add_request(self, request: Request) -> None:
        """Queue a request; warn when it carries a deadline this scheduler cannot read."""
        super().add_request(request)
        params = request.sampling_params
        extra_args = params.extra_args if params is not None else None
        if extra_args and DEADLINE_KEY in extra_args and _deadline_of(request) is None:
            logger.warning(
                "request %s: ignoring %s=%r / %s=%r (needs a finite number of POSIX seconds "
                "and a positive integer span)",
                request.request_id,
                DEADLINE_KEY,
                extra_args.get(DEADLINE_KEY),
                PRIORITY_SPAN_KEY,
                extra_args.get(PRIORITY_SPAN_KEY),
            )

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        """The next step's batch: vLLM's, less the paused bands while a deadline is at risk."""
        started = time.monotonic()
        self._measure_pace(started)
        pause = self._pause_for(time.time())
        self._log_transition(pause)
        if pause is None:
            output = super().schedule(throttle_prefills)
        else:
            output = self._schedule_paused(pause, throttle_prefills)
        self._last_schedule_at = started
        self._last_step_ran = output.total_num_scheduled_tokens > 0
        return output

    def _measure_pace(self, now: float) -> None:
        """Fold the interval since the previous step into the pace, if that step ran requests.

        The interval after an empty step, or after which nothing is running, may include the
        engine waiting for work: it says nothing of how fast a batch decodes.
        """
        if self._last_schedule_at is None or not self._last_step_ran or not self.running:
            return
        interval = now - self._last_schedule_at
        if self.step_interval_s is None:
            self.step_interval_s = interval
        else:
            self.step_interval_s += PACE_SMOOTHING * (interval - self.step_interval_s)

    def _pause_for(self, now: float) -> _Pause | None:
        """The pause this step needs, or None when no running request is at risk."""
        pace = self.step_interval_s
        if pace is None:
            return None
        urgent: Request | None = None
        urgent_span = 1
        for request in self.running:
            deadline = _deadline_of(request)
            if deadline is None or deadline.at <= now:
                continue
            if request.num_computed_tokens < request.num_prompt_tokens:
                # Still prefilling: its prefill steps say nothing of its decode pace.
                continue
            remaining = request.max_tokens - request.num_output_tokens
            if now + remaining * pace <= deadline.at:
                continue
            if urgent is None or request.priority < urgent.priority:
                urgent, urgent_span = request, deadline.span
        if urgent is None:
            return None
        return _Pause(urgent=urgent, band=urgent.priority // urgent_span, span=urgent_span)

    def _schedule_paused(self, pause: _Pause, throttle_prefills: bool) -> SchedulerOutput:
        """The parent's step, greater bands' running requests skipped and waiting ones held."""
        paused = [r for r in self.running if r.priority // pause.span > pause.band]
        for request in paused:
            # The hook vLLM's own schedulers use to leave a running request out of one step
            # (V2 pipeline cadence; DiffusionAsyncScheduler): `schedule()` advances
            # `current_step` first and skips a request while `current_step` is below this, so
            # `current_step + 2` skips this call only. The request stays in `self.running`,
            # in its place: preemption still sees it (the lowest priority, it is the first to
            # give up its blocks when memory runs short) and the running count that caps
            # admissions at max_num_seqs still includes it.
            request.next_decode_eligible_step = max(
                request.next_decode_eligible_step, self.current_step + 2
            )
        # Waiting requests of a greater band are taken out of the queues for the step and put
        # back after it; the queues are heaps ordered by (priority, arrival), so adding them
        # back restores their order whatever the step popped or pushed meanwhile.
        held = {
            queue_name: _take_greater_band(getattr(self, queue_name), pause)
            for queue_name in ("waiting", "kv_holding_waiting")
        }
        try:
            output = super().schedule(throttle_prefills)
        finally:
            for queue_name, requests in held.items():
                queue: RequestQueue = getattr(self, queue_name)
                for request in requests:
                    queue.add_request(request)
        if not self._skip_unhonoured and any(
            r.request_id in output.num_scheduled_tokens for r in paused
        ):
            # A vLLM whose `schedule()` no longer honours `next_decode_eligible_step`: the
            # pause has no effect on running requests. Say so once rather than fail the step.
            self._skip_unhonoured = True
            logger.warning(
                "%s: this vLLM scheduled a paused request anyway; running requests are not "
                "paused (waiting ones still are)",
                type(self).__name__,
            )
        return output

    def _log_transition(self, pause: _Pause | None) -> None:
        """Log when a pause begins or ends: at info the first pause for a request, else debug.

        While a call is at risk the pause usually comes and goes every few steps: paused, the
        batch is smaller and faster, so the call looks on time again and the batch resumes.
        Only the first pause for a call is worth a line in the server's log.
        """
        paused_for = pause.urgent.request_id if pause is not None else None
        if paused_for == self._paused_for:
            return
        self._paused_for = paused_for
        if pause is None:
            logger.debug("no deadline at risk: all priority bands run again")
            return
        deadline = _deadline_of(pause.urgent)
        assert deadline is not None and self.step_interval_s is not None
        first = pause.urgent.request_id != self._announced_for
        self._announced_for = pause.urgent.request_id
        (logger.info if first else logger.debug)(
            "request %s (priority %d) would miss its deadline in %.2f s: %d tokens at "
            "%.1f ms a step; pausing priority bands above %d (span %d)",
            pause.urgent.request_id,
            pause.urgent.priority,
            deadline.at - time.time(),
            pause.urgent.max_tokens - pause.urgent.num_output_tokens,
            self.step_interval_s * 1000,
            pause.band,
            pause.span,
        )


def _take_greater_band(queue: RequestQueue, pause: _Pause) -> list[Request]:
    """Remove and return the queue's requests of a band greater than the pause's."""
    taken = [r for r in queue if r.priority // pause.span > pause.band]
    if taken:
        queue.remove_requests(taken)
    return taken


class DeadlinePauseAsyncScheduler(DeadlinePauseScheduler, AsyncScheduler):
    """`DeadlinePauseScheduler` on vLLM's asynchronous scheduler (`--async-scheduling`).

    For servers that schedule the next step while the current one runs (vLLM's default on
    GPUs): a synchronous scheduler there keeps the engine from overlapping its steps.
    """

"""Drives `DeadlinePauseScheduler` step by step inside vLLM's own interpreter; prints JSON.

Run by `tests/test_vllm_deadline_pause.py` with vLLM's python (`make vllm-env`) and only the
`kvflow_vllm` package on `PYTHONPATH`: `python tests/vllm_deadline_pause_steps.py`. It imports
nothing of kvflow's own environment.

The scheduler is vLLM's real one (its KV cache manager, queues, preemption and output
processing) under kvflow's subclass. What is scripted is the model runner and the clock: each
step "samples" one token for every request that finished its prompt, and takes
`STEP_BASE_S + STEP_PER_REQUEST_S` × the requests it ran, on a clock the scheduler module reads
in place of `time`. So which requests a step leaves out is the scheduler's decision alone, and
the same scene gives the same steps on any machine, however busy.

Each scene prints one JSON object per line: the steps (the time each began and the requests it
ran), when each request finished, the requests the engine preempted, whether each request of
tier 3 held the same KV blocks throughout, and the scheduler's log lines.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm_scheduler_setup import scheduler_args  # this folder: see its docstring

import kvflow_vllm.scheduler as pause_module
from kvflow_vllm.scheduler import DEADLINE_KEY, PRIORITY_SPAN_KEY, DeadlinePauseScheduler

SPAN = 10**13
"""kvflow's priority band width (`TIER_PRIORITY_SPAN`): priority = tier × span + start in ms."""
STEP_BASE_S = 0.004
STEP_PER_REQUEST_S = 0.004
"""A step's duration: a batch of five takes 24 ms, a call alone 8 ms."""
URGENT_TOKENS = 100
"""The tier-1 call's answer: 2.4 s amid four tier-3 calls, 0.8 s alone."""
URGENT_DEADLINE_S = 1.2
"""From the tier-1 call's arrival: between the two."""
LOW_CALLS = 4
LOW_TOKENS = 1000
"""Long enough to decode through every scene."""
WARMUP_STEPS = 20
"""Steps the tier-3 calls decode alone before the tier-1 call arrives (the pace is known)."""
BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048
START = 1_765_000_000.0
"""The clock's POSIX time at the first step."""


class Clock:
    """The scheduler module's `time`: a clock this script advances, one step at a time."""

    def __init__(self) -> None:
        self.elapsed = 0.0

    def time(self) -> float:
        """POSIX seconds."""
        return START + self.elapsed

    def monotonic(self) -> float:
        """Seconds, monotonic."""
        return self.elapsed


class Lines(logging.Handler):
    """Collects the scheduler's log lines."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def scheduler(policy: str = "priority") -> DeadlinePauseScheduler:
    """kvflow's scheduler over vLLM's, configured as a server with the tiny model would be."""
    return DeadlinePauseScheduler(
        **scheduler_args(
            block_size=BLOCK_SIZE,
            blocks=1024,
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=16,
            prefix_caching=False,
            policy=policy,
        )
    )


def request(
    request_id: str,
    tier: int,
    max_tokens: int,
    *,
    deadline: float | None = None,
    xargs: dict[str, Any] | None = None,
) -> Request:
    """A completion request as vLLM's API server hands it to the engine."""
    extra_args: dict[str, Any] = {PRIORITY_SPAN_KEY: SPAN, **(xargs or {})}
    if deadline is not None:
        extra_args[DEADLINE_KEY] = deadline
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(1, 21)),
        sampling_params=params,
        pooling_params=None,
        priority=tier * SPAN,
    )


@dataclass
class Scene:
    """One engine, stepped on a scripted clock."""

    clock: Clock = field(default_factory=Clock)
    steps: list[dict[str, Any]] = field(default_factory=list)
    finished_at: dict[str, float] = field(default_factory=dict)
    blocks: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    blocks_kept: dict[str, bool] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)
    """Requests the engine preempted at any step (a finished request leaves `requests`)."""
    log: Lines = field(default_factory=Lines)

    def __post_init__(self) -> None:
        # The clock the scheduler module reads as `time` (its pace and deadlines), for this scene.
        vars(pause_module)["time"] = self.clock
        logging.getLogger(pause_module.logger.name).addHandler(self.log)
        pause_module.logger.setLevel(logging.DEBUG)
        self.engine = scheduler()

    def add(self, req: Request) -> None:
        """A request arrives now."""
        self.engine.add_request(req)

    def step(self) -> None:
        """One engine step: schedule, "run" it, advance the clock, take its outputs."""
        began = self.clock.elapsed
        output: SchedulerOutput = self.engine.schedule()
        scheduled = dict(output.num_scheduled_tokens)
        ids = list(scheduled)
        sampled: list[list[int]] = []
        for request_id in ids:
            req = self.engine.requests[request_id]
            # A request whose prompt this step completes (or that is decoding) gets a token.
            done = req.num_computed_tokens + scheduled[request_id] >= req.num_prompt_tokens
            sampled.append([7] if done else [])
        self.clock.elapsed += STEP_BASE_S + STEP_PER_REQUEST_S * len(ids)
        for request_id, req in self.engine.requests.items():
            if req.num_preemptions:
                self.preempted.add(request_id)
            blocks = self.engine.kv_cache_manager.get_block_ids(request_id)
            seen = self.blocks.setdefault(request_id, blocks)
            # A request's blocks only grow while it keeps them: each list starts with the
            # blocks it had.
            kept = all(
                now[: len(before)] == before for now, before in zip(blocks, seen, strict=True)
            )
            self.blocks_kept[request_id] = self.blocks_kept.get(request_id, True) and kept
            self.blocks[request_id] = blocks
        runner = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={request_id: i for i, request_id in enumerate(ids)},
            sampled_token_ids=sampled,
        )
        for outputs in self.engine.update_from_output(output, runner).values():
            for out in outputs.outputs:
                if out.finish_reason is not None:
                    self.finished_at[out.request_id] = self.clock.elapsed
        self.steps.append({"at": round(began, 6), "ran": sorted(ids)})

    def run_until(self, request_id: str, limit: int = 2000) -> None:
        """Step until `request_id` has finished."""
        for _ in range(limit):
            if request_id in self.finished_at:
                return
            self.step()
        raise AssertionError(f"{request_id} did not finish in {limit} steps")

    def report(self, name: str, **extra: Any) -> None:
        """Print the scene as one JSON line."""
        print(
            json.dumps(
                {
                    "scene": name,
                    "steps": self.steps,
                    "finished_at": self.finished_at,
                    "preempted": sorted(self.preempted),
                    "blocks_kept": self.blocks_kept,
                    "log": self.log.lines,
                    "step_s": {"base": STEP_BASE_S, "per_request": STEP_PER_REQUEST_S},
                    **extra,
                }
            )
        )
        logging.getLogger(pause_module.logger.name).removeHandler(self.log)


def tier3_decoding(scene: Scene) -> None:
    """Four tier-3 calls, decoding for `WARMUP_STEPS` steps."""
    for i in range(LOW_CALLS):
        scene.add(request(f"low-{i}", 3, LOW_TOKENS))
    for _ in range(WARMUP_STEPS):
        scene.step()


def urgent_call(name: str, *, deadline_in_s: float | None) -> None:
    """The tier-1 call amid the tier-3 calls, with or without a deadline."""
    scene = Scene()
    tier3_decoding(scene)
    arrived = scene.clock.elapsed
    deadline = None if deadline_in_s is None else scene.clock.time() + deadline_in_s
    scene.add(request("urgent", 1, URGENT_TOKENS, deadline=deadline))
    scene.run_until("urgent")
    for _ in range(WARMUP_STEPS):
        scene.step()
    scene.report(name, arrived=arrived, deadline_in_s=deadline_in_s, tokens=URGENT_TOKENS)


def arrivals_during_the_pause() -> None:
    """While a tier-1 call is at risk, a tier-3 and a second tier-1 call arrive."""
    scene = Scene()
    tier3_decoding(scene)
    arrived = scene.clock.elapsed
    scene.add(request("urgent", 1, URGENT_TOKENS, deadline=scene.clock.time() + URGENT_DEADLINE_S))
    for _ in range(10):
        scene.step()
    scene.add(request("late-low", 3, 50))
    scene.add(request("late-peer", 1, 50))
    scene.run_until("urgent")
    scene.run_until("late-low")
    scene.report("arrivals", arrived=arrived, deadline_in_s=URGENT_DEADLINE_S)


def a_deadline_already_passed() -> None:
    """A tier-1 call whose deadline passed before it arrived pauses no one."""
    scene = Scene()
    tier3_decoding(scene)
    scene.add(request("urgent", 1, URGENT_TOKENS, deadline=scene.clock.time() - 1))
    scene.run_until("urgent")
    scene.report("passed")


def an_unreadable_deadline() -> None:
    """A deadline that is not a number is ignored, with a warning that says so."""
    scene = Scene()
    tier3_decoding(scene)
    scene.add(request("urgent", 1, URGENT_TOKENS, xargs={DEADLINE_KEY: "tomorrow"}))
    scene.run_until("urgent")
    scene.report("unreadable")


def under_fcfs() -> None:
    """The scheduler refuses a server without the priority policy."""
    try:
        scheduler("fcfs")
    except ValueError as exc:
        print(json.dumps({"scene": "fcfs", "error": str(exc)}))
    else:
        print(json.dumps({"scene": "fcfs", "error": None}))


SCENES = {
    "unhurried": lambda: urgent_call("unhurried", deadline_in_s=None),
    "hurried": lambda: urgent_call("hurried", deadline_in_s=URGENT_DEADLINE_S),
    "arrivals": arrivals_during_the_pause,
    "passed": a_deadline_already_passed,
    "unreadable": an_unreadable_deadline,
    "fcfs": under_fcfs,
}


if __name__ == "__main__":
    for name in sys.argv[1:] or list(SCENES):
        SCENES[name]()

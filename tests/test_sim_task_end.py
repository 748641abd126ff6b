"""A conversation that will not come back is evicted first (the `task-end` mechanism).

When a task ends, its client tells the engines (Dynamo's `nvext.session_control` close):
the free blocks only that task used go to the head of the eviction order, on vLLM's
least-recently-used pool and on the retention pool alike; blocks a running request holds,
and blocks other tasks share, stay where they are.
"""

from __future__ import annotations

import pytest

from kvflow.bench.policies.fleet import bench_fleet
from kvflow.bench.policies.runs import run_policy
from kvflow.scheduler.blocks import block_hashes
from kvflow.simulator import BUILTIN_MODELS, EngineConfig, EngineCore, SimRequest
from kvflow.simulator.kvcache import TaskBlocks
from kvflow.simulator.policies.base import DEFAULT_MECHANISMS, TASK_END
from kvflow.simulator.workloads import WORKLOADS

SMALL = BUILTIN_MODELS["llama-3.2-1b"]
BLOCK = 16


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 + 1 for i in range(length)]


def engine_of(num_gpu_blocks: int, *, retention: bool) -> EngineCore:
    config = EngineConfig(
        block_size=BLOCK, num_gpu_blocks=num_gpu_blocks, max_model_len=384, kv_retention=retention
    )
    return EngineCore("H100", SMALL, config)


def send(
    engine: EngineCore,
    name: str,
    tokens: list[int],
    now: float,
    retention_priority: int | None = None,
    retention_s: float | None = None,
) -> None:
    """One request alone on the engine at `now`, run until it finishes."""
    request = SimRequest(
        name,
        max_tokens=1,
        prompt_token_ids=tokens,
        retention_priority=retention_priority,
        retention_s=retention_s,
    )
    engine.add_request(request, now)
    while engine.has_unfinished_requests():
        now = engine.step(now).end


def cached(engine: EngineCore, tokens: list[int]) -> int:
    return engine.cached_prefix_tokens(block_hashes(tokens, BLOCK))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("retention", [False, True], ids=["vllm-lru", "retention-pool"])
def test_an_ended_conversation_is_evicted_before_an_older_one(retention: bool) -> None:
    # 40 blocks hold two 20-block conversations; a third evicts one of them.
    def after_overflow(end_it: bool) -> tuple[int, int]:
        engine = engine_of(41, retention=retention)
        older, ended = prompt(1, 320), prompt(2, 320)
        send(engine, "older", older, 0.0)
        send(engine, "ended", ended, 1.0)  # freed later: least recently used keeps it
        if end_it:
            assert engine.evict_first(block_hashes(ended, BLOCK)) == 20
        send(engine, "overflow", prompt(3, 320), 2.0)
        return cached(engine, older), cached(engine, ended)

    assert after_overflow(end_it=False) == (0, 320)
    assert after_overflow(end_it=True) == (320, 0)


@pytest.mark.timeout(30)
def test_an_ended_conversation_goes_before_a_low_retention_priority() -> None:
    engine = engine_of(41, retention=True)
    low, ended = prompt(1, 320), prompt(2, 320)
    send(engine, "low", low, 0.0, retention_priority=10)
    # Kept long at the highest priority, then ended: the retention no longer holds, nor
    # does it come back when the 60 s would have lapsed.
    send(engine, "ended", ended, 1.0, retention_priority=100, retention_s=60)
    engine.evict_first(block_hashes(ended, BLOCK))
    send(engine, "overflow", prompt(3, 320), 90.0)
    assert (cached(engine, low), cached(engine, ended)) == (320, 0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("retention", [False, True], ids=["vllm-lru", "retention-pool"])
def test_blocks_a_running_request_holds_are_not_moved(retention: bool) -> None:
    engine = engine_of(41, retention=retention)
    tokens = prompt(1, 320)
    running = SimRequest("running", max_tokens=50, prompt_token_ids=tokens)
    engine.add_request(running, 0.0)
    engine.step(0.0)
    assert engine.evict_first(block_hashes(tokens, BLOCK)) == 0
    assert engine.evict_first(block_hashes(prompt(9, 320), BLOCK)) == 0  # nothing cached


@pytest.mark.timeout(120)
def test_the_harness_names_only_the_ended_tasks_own_blocks() -> None:
    """After a run with `task-end`, the engine's next evictions are ended tasks' own blocks,
    never the system prompt every task of an application shares."""
    spec = WORKLOADS["agent"]
    fleet = bench_fleet("agent", 1)
    run = run_policy(
        "least-loaded",
        spec=spec,
        fleet=fleet,
        task_rate=0.5,
        seed=3,
        tasks=12,
        mechanisms=DEFAULT_MECHANISMS | {TASK_END},
    )
    runner = run.runner
    engine = next(iter(runner.sim.replicas[0].engines.values()))
    pool = engine.pool
    users: dict[int, set[int]] = {}
    for state in runner.states:
        for step in state.task.steps:
            for call in step.calls:
                for value in call.block_hashes:
                    users.setdefault(value, set()).add(state.task.index)
    shared = [h for h, tasks in users.items() if len(tasks) > 1 and pool.is_cached(h)]
    assert shared, "no block of two tasks is cached: the test proves nothing"
    # What only one task used: every ended task names all of it.
    ended = [h for h, tasks in users.items() if len(tasks) == 1 and pool.is_cached(h)]
    assert ended, "the ended conversations were evicted already: nothing to check"
    # Evict one block at a time until no ended block is left: no shared block goes first.
    for _ in range(len(pool.blocks_of(ended)) + 16):  # 16: room for partial blocks
        if not any(pool.is_cached(h) for h in ended):
            break
        assert all(pool.is_cached(h) for h in shared)
        pool.allocate(1)
    assert not any(pool.is_cached(h) for h in ended)
    assert all(pool.is_cached(h) for h in shared)


# ---- which blocks are a task's own (`TaskBlocks`, as `TaskEndScheduler` in vLLM) ----------------

SYSTEM_HASHES = [1, 2]


def test_a_block_is_given_out_once_by_its_first_user_alone() -> None:
    tracked = TaskBlocks()
    tracked.note("a", [*SYSTEM_HASHES, 10, 11])
    assert sorted(tracked.end("a")) == [1, 2, 10, 11]  # no one else asked for the prompt
    tracked.note("b", [*SYSTEM_HASHES, 20])
    assert tracked.end("b") == [20]  # the prompt was given out: A used it first
    assert tracked.end("b") == []  # ended already


def test_a_block_two_open_tasks_asked_for_is_neither_ones_own() -> None:
    tracked = TaskBlocks()
    tracked.note("a", [*SYSTEM_HASHES, 10])
    tracked.note("b", [*SYSTEM_HASHES, 20])
    tracked.note("a", [*SYSTEM_HASHES, 10, 12])  # the conversation grows
    assert sorted(tracked.end("a")) == [10, 12]
    assert tracked.end("b") == [20]


def test_a_bounded_memory_gives_a_long_forgotten_block_out_again() -> None:
    tracked = TaskBlocks(max_shared=2)
    tracked.note("a", [1, 2])
    assert sorted(tracked.end("a")) == [1, 2]
    tracked.note("c", [30, 31])
    assert sorted(tracked.end("c")) == [30, 31]  # 1 and 2 are the oldest remembered: gone
    tracked.note("b", [1, 2])
    assert sorted(tracked.end("b")) == [1, 2]
    unbounded = TaskBlocks()
    for task, hashes in (("a", [1, 2]), ("c", [30, 31]), ("b", [1, 2])):
        unbounded.note(task, hashes)
        ended = unbounded.end(task)
    assert ended == []


def test_past_its_task_bound_the_least_recently_noted_task_is_forgotten() -> None:
    tracked = TaskBlocks(max_tasks=2)
    tracked.note("a", [10])
    tracked.note("b", [20])
    tracked.note("a", [10, 11])  # A is now the most recently noted
    tracked.note("c", [30])  # three open tasks: B is forgotten, its blocks given out
    assert tracked.end("b") == []
    assert sorted(tracked.end("a")) == [10, 11]
    tracked.note("d", [20])
    assert tracked.end("d") == []  # B asked for it first
    assert tracked.end("c") == [30]

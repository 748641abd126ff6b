"""KV-cache retention priorities (`EngineConfig.kv_retention`), as TensorRT-LLM has them.

A finished request's blocks stay cached under its retention priority: under pressure the
lowest priority is evicted first, least recently freed first within a priority, and a
priority lapses to the default (35) after `retention_s`. Off, the engine is vLLM's.
"""

from __future__ import annotations

import random

import pytest

from kvflow.scheduler.blocks import block_hashes
from kvflow.simulator import BUILTIN_MODELS, EngineConfig, EngineCore, SimRequest
from kvflow.simulator.des import AgentWorkload, simulate
from kvflow.simulator.engine import SimReplica
from kvflow.simulator.kvcache import DEFAULT_RETENTION_PRIORITY, RetentionBlockPool

SMALL = BUILTIN_MODELS["llama-3.2-1b"]
BLOCK = 16


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 + 1 for i in range(length)]


def run_to_end(engine: EngineCore, now: float) -> float:
    """Step until idle; the time the last step ended."""
    while engine.has_unfinished_requests():
        now = engine.step(now).end
    return now


def send(
    engine: EngineCore,
    name: str,
    tokens: list[int],
    now: float,
    max_tokens: int = 1,
    priority: int | None = None,
    retention_s: float | None = None,
) -> SimRequest:
    """One request alone on the engine at `now`, run until it finishes."""
    request = SimRequest(
        name,
        max_tokens=max_tokens,
        prompt_token_ids=tokens,
        retention_priority=priority,
        retention_s=retention_s,
    )
    engine.add_request(request, now)
    run_to_end(engine, now)
    return request


def cached(engine: EngineCore, tokens: list[int]) -> int:
    """Tokens of `tokens` cached now (whole blocks from the first)."""
    return engine.cached_prefix_tokens(block_hashes(tokens, BLOCK))


def retention_engine(num_gpu_blocks: int, retention: bool = True) -> EngineCore:
    config = EngineConfig(
        block_size=BLOCK, num_gpu_blocks=num_gpu_blocks, max_model_len=384, kv_retention=retention
    )
    return EngineCore("H100", SMALL, config)


# -- off: vLLM's engine, unchanged ---------------------------------------------------------


class Answer:
    """Deterministic answer tokens, different per request."""

    def __init__(self, seed: int) -> None:
        self._seed = seed
        self._count = 0

    def next_token(self) -> tuple[int, bool]:
        self._count += 1
        return 40000 + (self._seed * 131 + self._count * 17) % 9000, False


def conversations(config: EngineConfig, priorities: bool) -> list[tuple[str, int, int, int]]:
    """Six agent conversations of four turns on a cache too small for their last turns.

    Each round sends every conversation's next turn at once (prompt: the last prompt, its
    answer and new tokens), so rounds overflow the cache, evict and preempt. With
    `priorities`, requests carry retention priorities and durations. (name, cached tokens,
    preemptions, output tokens) of each request, in order.
    """
    engine = EngineCore("H100", SMALL, config)
    history = {c: prompt(100 + c, 96 + 16 * c) for c in range(6)}
    rows = []
    now = 0.0
    for turn in range(4):
        requests = []
        for c in range(6):
            tokens = history[c] + prompt(10 * turn + c, 40)
            request = SimRequest(
                f"c{c}.{turn}",
                max_tokens=24 + 8 * c,
                prompt_token_ids=tokens,
                sampler=Answer(10 * turn + c),
                ignore_eos=True,
                retention_priority=(0, 10, 35, 60, 90, 100)[c] if priorities else None,
                retention_s=(None, 0.5, 3.0)[c % 3] if priorities else None,
            )
            engine.add_request(request, now)
            requests.append(request)
        now = run_to_end(engine, now) + 1.0
        for c, request in enumerate(requests):
            assert request.token_ids is not None
            history[c] = request.token_ids
            rows.append(
                (
                    request.request_id,
                    request.num_cached_tokens,
                    request.num_preemptions,
                    request.num_output_tokens,
                )
            )
    return rows


def overflowing_config(**options: bool) -> EngineConfig:
    return EngineConfig(block_size=BLOCK, num_gpu_blocks=121, max_model_len=1024, **options)


@pytest.mark.timeout(60)
def test_off_gives_the_same_cached_tokens_as_an_engine_without_the_option() -> None:
    today = conversations(overflowing_config(), priorities=False)
    off = conversations(overflowing_config(kv_retention=False), priorities=True)
    assert off == today
    # The sequence does put the cache under pressure: later turns find some of their prompt
    # cached, some none, and a request is preempted.
    later = [cached_tokens for _, cached_tokens, _, _ in today[6:]]
    assert any(later) and not all(later)
    assert any(preempted for _, _, preempted, _ in today)
    # And the priorities, given effect, keep other blocks.
    assert conversations(overflowing_config(kv_retention=True), priorities=True) != today


@pytest.mark.timeout(60)
def test_on_with_every_priority_the_default_evicts_as_vllm_does() -> None:
    today = conversations(overflowing_config(), priorities=False)
    assert conversations(overflowing_config(kv_retention=True), priorities=False) == today


@pytest.mark.timeout(120)
def test_on_with_default_priorities_matches_vllm_in_the_discrete_event_fleet() -> None:
    def run(retention: bool) -> list[tuple[str, int, int, float]]:
        config = EngineConfig(max_model_len=16384, num_gpu_blocks=1100, kv_retention=retention)
        replicas = [SimReplica("H100", [SMALL], config, name="r")]
        workload = AgentWorkload(model=SMALL.name, tasks=20, task_rate=4.0, seed=3)
        result = simulate(list(workload), replicas)
        return sorted(
            (r.request.request_id, r.cached_tokens, r.preemptions, round(r.ttft, 9))
            for r in result.records
        )

    assert run(True) == run(False)


# -- on: priorities, durations, usage ------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_high_priority_conversation_outlives_a_low_priority_one_freed_later() -> None:
    # 40 blocks hold two 20-block conversations; a third evicts one of them.
    def next_turn_cached(retention: bool) -> tuple[int, int]:
        engine = retention_engine(41, retention)
        kept, dropped = prompt(1, 320), prompt(2, 320)
        send(engine, "kept", kept, 0.0, priority=90)
        send(engine, "dropped", dropped, 1.0, priority=10)  # freed later: LRU keeps it
        send(engine, "overflow", prompt(3, 320), 2.0)
        dropped_cached = cached(engine, dropped)
        kept_next = send(engine, "kept.2", kept + prompt(4, 16), 3.0)
        return kept_next.num_cached_tokens, dropped_cached

    assert next_turn_cached(retention=True) == (320, 0)
    # The same requests without the option: vLLM evicts the least recently freed.
    assert next_turn_cached(retention=False) == (0, 320)


@pytest.mark.timeout(30)
def test_after_its_retention_lapses_a_conversation_is_evicted_as_a_default_one() -> None:
    def next_turn_cached(overflow_at: float) -> tuple[int, int]:
        engine = retention_engine(41)
        kept, default = prompt(1, 320), prompt(2, 320)
        send(engine, "kept", kept, 0.0, priority=90, retention_s=5.0)
        send(engine, "default", default, 1.0)
        send(engine, "overflow", prompt(3, 320), overflow_at)
        default_cached = cached(engine, default)
        kept_next = send(engine, "kept.2", kept + prompt(4, 16), overflow_at + 1.0)
        return kept_next.num_cached_tokens, default_cached

    # Within its 5 s the priority holds: the default conversation goes.
    assert next_turn_cached(overflow_at=2.0) == (320, 0)
    # After it, the conversation is a default one freed before the other: LRU evicts it
    # first (it is not treated as freed when its retention lapsed).
    assert next_turn_cached(overflow_at=10.0) == (0, 320)


@pytest.mark.timeout(30)
def test_retained_free_blocks_are_not_counted_as_usage() -> None:
    engine = retention_engine(41)
    tokens = prompt(1, 320)
    running = SimRequest(
        "held", max_tokens=2, prompt_token_ids=tokens, retention_priority=100, retention_s=60.0
    )
    engine.add_request(running, 0.0)
    now = engine.step(0.0).end
    assert engine.kv_cache_usage() == 20 / 40  # the prompt's 320 tokens
    run_to_end(engine, now)
    assert cached(engine, tokens) == 320  # retained, reusable
    assert engine.kv_cache_usage() == 0.0
    assert engine.pool.num_free_blocks == 40


@pytest.mark.timeout(30)
def test_a_conversation_freed_with_priority_zero_is_evicted_before_any_other() -> None:
    # 30 blocks hold three 10-block conversations; each further one evicts one of them.
    engine = retention_engine(31)
    oldest, low, zero = prompt(1, 160), prompt(2, 160), prompt(3, 160)
    send(engine, "oldest", oldest, 0.0)  # default priority, least recently freed
    send(engine, "low", low, 1.0, priority=10)
    send(engine, "zero", zero, 2.0, priority=0)  # freed last
    send(engine, "new1", prompt(4, 160), 3.0)
    assert (cached(engine, oldest), cached(engine, low), cached(engine, zero)) == (160, 160, 0)
    # Then the next lowest priority, then least recently freed among the defaults.
    send(engine, "new2", prompt(5, 160), 4.0)
    assert (cached(engine, oldest), cached(engine, low)) == (160, 0)
    send(engine, "new3", prompt(6, 160), 5.0)
    assert cached(engine, oldest) == 0


@pytest.mark.timeout(30)
def test_an_aborted_request_frees_at_the_default_priority() -> None:
    engine = retention_engine(41)
    gone, other = prompt(1, 320), prompt(2, 320)
    request = SimRequest("gone", max_tokens=50, prompt_token_ids=gone, retention_priority=100)
    engine.add_request(request, 0.0)
    now = engine.step(0.0).end
    assert engine.abort_request("gone", now)
    send(engine, "other", other, now + 1.0)
    send(engine, "overflow", prompt(3, 320), now + 2.0)
    # Aborted first, so least recently freed: its priority 100 did not apply.
    assert (cached(engine, gone), cached(engine, other)) == (0, 320)


@pytest.mark.timeout(30)
def test_resetting_the_prefix_cache_drops_retained_blocks_too() -> None:
    engine = retention_engine(41)
    kept = prompt(1, 320)
    send(engine, "kept", kept, 0.0, priority=100, retention_s=1.0)
    assert engine.reset_prefix_cache()
    assert cached(engine, kept) == 0
    assert engine.pool.num_free_blocks == 40
    # The pool still hands out every block, lapsed retention or not.
    full = send(engine, "full", prompt(2, 383), 5.0)
    assert full.num_cached_tokens == 0 and full.finish_reason == "length"


@pytest.mark.timeout(30)
def test_retention_fields_are_checked() -> None:
    with pytest.raises(ValueError, match="retention_priority"):
        SimRequest("x", max_tokens=1, num_prompt_tokens=8, retention_priority=101)
    with pytest.raises(ValueError, match="retention_s"):
        SimRequest("x", max_tokens=1, num_prompt_tokens=8, retention_s=-1.0)


@pytest.mark.timeout(30)
def test_a_run_of_decode_steps_ends_before_a_retention_lapses() -> None:
    def run_end(retention_s: float | None) -> tuple[float, float]:
        engine = retention_engine(41)
        kept = send(engine, "kept", prompt(1, 320), 0.0, priority=90, retention_s=retention_s)
        start = kept.finish_time or 0.0
        decoder = SimRequest("decoder", max_tokens=300, prompt_token_ids=prompt(2, 60))
        engine.add_request(decoder, start)
        now = start + (engine.begin_step(start) or 0.0)
        engine.end_step()
        # Decoding needs new blocks, taken when the run's result is applied.
        duration = engine.begin_step(now, horizon=10.0)
        assert duration is not None
        engine.end_step()
        return start, now + duration

    start, uncut = run_end(None)
    assert uncut > start + 0.1
    start, cut = run_end(0.1)
    assert start + 0.05 < cut <= start + 0.1


# -- the pool against a plain model of the rules --------------------------------------------


@pytest.mark.timeout(60)
def test_the_pool_evicts_as_a_sort_by_effective_priority_then_release_order() -> None:
    rng = random.Random(7)
    num_blocks = 64
    pool = RetentionBlockPool(num_blocks, BLOCK)
    # Model: free hashed block -> (priority, expires_at, release number); never-used blocks
    # go first, in id order.
    never_used = list(range(1, num_blocks))
    model: dict[int, tuple[int, float | None, int]] = {}
    held: list[list[int]] = []
    number = 0
    next_hash = 1
    now = 0.0
    for _ in range(3000):
        now += rng.random()
        action = rng.random()
        if action < 0.45:
            count = rng.randint(1, 6)
            if count > pool.num_free_blocks:
                assert pool.allocate(count, now) is None
                continue

            def key(block: int, now: float = now) -> tuple[int, int]:
                priority, expires_at, released = model[block]
                lapsed = expires_at is not None and expires_at <= now
                return (DEFAULT_RETENTION_PRIORITY if lapsed else priority, released)

            expected = never_used[:count]
            del never_used[:count]
            rest = sorted(model, key=key)[: count - len(expected)]
            for block in rest:
                del model[block]
            expected += rest
            blocks = pool.allocate(count, now)
            assert blocks == expected
            pool.cache_blocks(blocks, list(range(next_hash, next_hash + count)), None, [])
            next_hash += count
            held.append(blocks)
        elif action < 0.85 and held:
            blocks = held.pop(rng.randrange(len(held)))
            priority = rng.choice([None, 0, 10, 35, 60, 100])
            retention_s = rng.choice([None, 0.0, 2.0, 10.0])
            pool.release(blocks, now, priority, retention_s)
            for block in reversed(blocks):
                number += 1
                effective = DEFAULT_RETENTION_PRIORITY if priority is None else priority
                expires_at = None if retention_s is None else now + retention_s
                model[block] = (effective, expires_at, number)
        elif model:
            # A cache hit on some free blocks: they leave the free structure.
            hits = rng.sample(sorted(model), min(len(model), rng.randint(1, 4)))
            pool.touch(hits)
            for block in hits:
                del model[block]
            held.append(hits)
        assert pool.num_free_blocks == len(model) + len(never_used)
        assert pool.usage() == pytest.approx(1 - pool.num_free_blocks / (num_blocks - 1))

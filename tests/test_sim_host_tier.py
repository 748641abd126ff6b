"""The simulated engine's host-memory KV tier (vLLM's native CPU offloading).

No test sleeps: time is what the engine and the host link say a step or a copy costs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.bench.policies import run_policy
from kvflow.bench.policies.fleet import bench_fleet
from kvflow.bench.policies.task_runner import Outcome
from kvflow.scheduler.blocks import block_hashes
from kvflow.simulator import (
    BUILTIN_MODELS,
    AgentWorkload,
    EngineConfig,
    EngineCore,
    SimReplica,
    SimRequest,
    simulate,
)
from kvflow.simulator.des import DiscreteEventFleet, FleetRequest
from kvflow.simulator.engine import RequestStatus
from kvflow.simulator.kv_events import MEDIUM_CPU, MEDIUM_GPU, BlockRemoved, BlockStored
from kvflow.simulator.kvcache import HostTier
from kvflow.simulator.perf import GB
from kvflow.simulator.workloads import WORKLOADS

pytestmark = pytest.mark.timeout(60)

MODEL = BUILTIN_MODELS["llama-3.1-8b"]
BLOCK = 16
GPU_BLOCKS = 65
"""64 usable blocks of 16 tokens: a 640-token prompt takes 40 of them."""
KVFLOW = str(Path(sys.executable).with_name("kvflow"))


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 + 1 for i in range(length)]


def engine(host_tier: float = 4.0, **options: object) -> EngineCore:
    config = EngineConfig(
        block_size=BLOCK,
        num_gpu_blocks=GPU_BLOCKS,
        max_model_len=1024,
        host_tier=host_tier,
        enable_kv_events=True,
        **options,
    )
    return EngineCore("H100", MODEL, config)


def run_to_end(core: EngineCore, now: float, events: list[object] | None = None) -> float:
    """Step until idle (waking for copies from host memory); when the last step ended."""
    while True:
        duration = core.begin_step(now)
        if duration is None:
            wake = core.next_wake_time()
            if wake is None:
                return now
            now = wake
            continue
        result = core.end_step()
        if events is not None:
            events.extend(result.kv_events)
        now += duration


def send(
    core: EngineCore,
    name: str,
    tokens: list[int],
    now: float,
    max_tokens: int = 1,
    events: list[object] | None = None,
) -> tuple[SimRequest, float]:
    request = SimRequest(name, max_tokens=max_tokens, prompt_token_ids=tokens)
    core.add_request(request, now)
    return request, run_to_end(core, now, events)


def evicted_from_gpu_but_in_host() -> tuple[EngineCore, list[int], float]:
    """A 640-token conversation pushed out of the GPU cache by a 1,020-token one (64 blocks)."""
    core = engine()
    conversation = prompt(1, 640)
    _, now = send(core, "first", conversation, 0.0)
    _, now = send(core, "other", prompt(2, 1020), now)
    hashes = SimRequest("probe", max_tokens=1, prompt_token_ids=conversation)
    core.add_request(hashes, now)
    core.abort_request("probe", now)
    assert hashes.block_hashes is not None
    assert core.pool.cached_prefix_blocks(hashes.block_hashes) == 0
    assert core.host is not None and all(h in core.host for h in hashes.block_hashes)
    # Well after every copy to host memory ended: the link is idle.
    return core, conversation, now + 1.0


def test_only_full_blocks_are_written_to_host_memory() -> None:
    core = engine()
    # 87 prompt tokens and 20 generated: 106 computed, 6 full blocks and a partial one.
    request, now = send(core, "r", prompt(3, 87), 0.0, max_tokens=20)
    assert core.host is not None and request.block_hashes is not None
    core.host.complete_stores(now + 1.0)
    full = request.block_hashes[: (87 + 20 - 1) // BLOCK]
    assert len(full) == 6
    assert len(core.host) == 6
    assert all(core.host.is_ready(h) for h in full)


def test_host_memory_evicts_the_least_recently_used_block_and_a_prefix_tail_first() -> None:
    events: list[object] = []
    host = HostTier(4, BLOCK, 1000, 1e9, events=events)
    for pair in ([11, 12], [21, 22]):
        stored = host.prepare_store(pair)
        assert stored == pair
        host.store(stored, 0.0)
    host.complete_stores(1.0)
    host.touch([11, 12])  # the first conversation is used again: now 21, 22, 12, 11
    assert host.prepare_store([31]) == [31]
    assert host.prepare_store([32, 33]) == [32, 33]
    removed = [e.block_hashes for e in events if isinstance(e, BlockRemoved)]
    assert removed == [[21], [22, 12]]
    assert 11 in host and 12 not in host


def test_blocks_being_copied_are_not_evicted_and_a_store_without_room_stores_nothing() -> None:
    host = HostTier(2, BLOCK, 1000, 1e9)
    stored = host.prepare_store([1, 2])
    assert stored is not None
    host.store(stored, 0.0)  # in flight until 2 µs
    assert host.prepare_store([3]) is None
    host.complete_stores(1.0)
    host.begin_load([1], 1.0)  # 1 is pinned while it is copied back
    assert host.prepare_store([3]) == [3]
    assert 1 in host and 2 not in host
    assert host.prepare_store([4]) is None


def test_a_prefix_evicted_from_gpu_is_copied_back_from_host_memory_not_recomputed() -> None:
    core, conversation, now = evicted_from_gpu_but_in_host()
    assert core.host is not None
    request, _ = send(core, "again", conversation, now)
    # All but the last block (vLLM computes at least the last token): 39 blocks.
    assert request.num_cached_tokens == 39 * BLOCK
    copy = 39 * BLOCK * core.perf.kv_bytes_per_token / (50 * GB)
    assert core.host.bytes_per_second == 50 * GB  # an H100's PCIe Gen5 link, one way
    assert request.queue_time == pytest.approx(copy)
    assert core.stats.host_hit_tokens == 39 * BLOCK and core.stats.host_loads == 1

    # Without the tier the evicted conversation is computed again, as on a cold engine.
    recomputed, _ = send(engine(host_tier=0), "again", conversation, 0.0)
    assert recomputed.num_cached_tokens == 0
    assert request.ttft is not None and recomputed.ttft is not None
    assert request.ttft < recomputed.ttft


def test_a_copy_from_host_memory_waits_for_free_gpu_blocks() -> None:
    core, conversation, now = evicted_from_gpu_but_in_host()
    # A long answer holds 56 of the 64 blocks: the 40 blocks of the conversation do not fit.
    holder = SimRequest("holder", max_tokens=40, prompt_token_ids=prompt(4, 850))
    core.add_request(holder, now)
    duration = core.begin_step(now)
    assert duration is not None
    core.end_step()
    now += duration
    request = SimRequest("again", max_tokens=1, prompt_token_ids=conversation)
    core.add_request(request, now)
    duration = core.begin_step(now)
    assert duration is not None
    assert request.status is RequestStatus.WAITING and core.stats.host_loads == 0
    core.end_step()
    run_to_end(core, now + duration)
    assert holder.finish_time is not None and request.first_scheduled_time is not None
    assert request.first_scheduled_time > holder.finish_time
    assert request.num_cached_tokens == 39 * BLOCK and core.stats.host_loads == 1


def test_copies_both_ways_share_the_host_link() -> None:
    host = HostTier(100, BLOCK, 1_000_000, 1e9)  # a block takes 1 ms
    stored = host.prepare_store(list(range(10)))
    assert stored is not None
    assert host.store(stored, 0.0) == pytest.approx(0.010)
    host.complete_stores(0.010)
    more = host.prepare_store(list(range(10, 20)))
    assert more is not None
    assert host.store(more, 0.010) == pytest.approx(0.020)
    # A load issued while that store is on the link ends after it.
    assert host.begin_load(list(range(5)), 0.012) == pytest.approx(0.025)
    assert host.begin_load(list(range(5, 10)), 0.012) == pytest.approx(0.030)


def test_two_requests_copying_back_at_once_share_the_link() -> None:
    core = engine()
    first, second = prompt(5, 320), prompt(6, 320)
    _, now = send(core, "a", first, 0.0)
    _, now = send(core, "b", second, now)
    _, now = send(core, "other", prompt(2, 1020), now)  # both leave the GPU cache
    now += 1.0
    assert core.host is not None
    one_copy = core.host.transfer_seconds(19)
    a = SimRequest("a2", max_tokens=1, prompt_token_ids=first)
    b = SimRequest("b2", max_tokens=1, prompt_token_ids=second)
    core.add_request(a, now)
    core.add_request(b, now)
    run_to_end(core, now)
    assert a.num_cached_tokens == b.num_cached_tokens == 19 * BLOCK
    assert a.queue_time == pytest.approx(one_copy)
    # The second copy waited for the first on the link: it ended twice as late.
    assert a.load_end == pytest.approx(now + one_copy)
    assert b.load_end == pytest.approx(now + 2 * one_copy)
    assert b.queue_time is not None and b.queue_time >= 2 * one_copy
    assert core.host.busy_until == pytest.approx(now + 2 * one_copy)


def test_kv_events_name_the_medium_of_each_tier() -> None:
    events: list[object] = []
    core = engine(host_tier=1)
    request, now = send(core, "a", prompt(7, 640), 0.0, events=events)
    send(core, "b", prompt(8, 1000), now + 1.0, events=events)
    assert request.block_hashes is not None
    stored = {
        medium: {
            h
            for e in events
            if isinstance(e, BlockStored) and e.medium == medium
            for h in e.block_hashes
        }
        for medium in (MEDIUM_GPU, MEDIUM_CPU)
    }
    assert set(request.block_hashes[:40]) <= stored[MEDIUM_GPU]
    assert set(request.block_hashes[:40]) <= stored[MEDIUM_CPU]
    cpu_stored = [e for e in events if isinstance(e, BlockStored) and e.medium == MEDIUM_CPU]
    assert all(e.token_ids == [] and e.parent_block_hash is None for e in cpu_stored)
    # One GPU cache's worth of host memory: the second prompt pushed the first one out.
    removed = {e.medium for e in events if isinstance(e, BlockRemoved) and e.block_hashes}
    assert removed == {MEDIUM_GPU, MEDIUM_CPU}


def test_the_store_threshold_keeps_blocks_asked_for_once_out_of_host_memory() -> None:
    host = HostTier(10, BLOCK, 1000, 1e9, store_threshold=2)
    host.lookup([1, 2])
    assert host.prepare_store([1, 2]) == []
    host.lookup([1])
    assert host.prepare_store([1, 2]) == [1]


def test_no_host_tier_gives_the_same_run_as_an_engine_without_the_option() -> None:
    def run(config: EngineConfig) -> list[tuple[str, int, float, float]]:
        replicas = [SimReplica("H100", [MODEL], config, name=f"h{i}") for i in range(2)]
        requests = list(AgentWorkload(model=MODEL.name, tasks=30, task_rate=4.0, seed=3))
        result = simulate(requests, replicas)
        return sorted(
            (r.request.request_id or "", r.cached_tokens, r.ttft, r.e2e_latency)
            for r in result.records
        )

    small = {"max_model_len": 16384, "num_gpu_blocks": 2048}
    before = run(EngineConfig(**small))
    assert run(EngineConfig(**small, host_tier=0)) == before
    with_host = run(EngineConfig(**small, host_tier=2))
    assert sum(r[1] for r in with_host) > sum(r[1] for r in before)


@pytest.mark.timeout(300)
def test_a_benchmark_run_with_a_host_tier_reloads_evicted_conversations_as_cached() -> None:
    spec = WORKLOADS["long-agent"]
    fleet = bench_fleet("long-agent", 2)

    def run(host_tier: float) -> Outcome:
        return run_policy(
            "round-robin", spec=spec, fleet=fleet, task_rate=0.5, tasks=6, seed=3,
            host_tier=host_tier, kv_cache_scale=0.35,  # a small GPU cache: conversations leave it
        ).outcome  # fmt: skip

    without, with_host = run(0), run(2)
    assert with_host.tasks == without.tasks == 6
    assert with_host.prompt_tokens == without.prompt_tokens
    assert with_host.cached_tokens > without.cached_tokens


def test_bench_policies_refuses_a_negative_host_tier_in_words() -> None:
    done = subprocess.run(
        [KVFLOW, "bench", "policies", "--host-tier", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "--host-tier" in done.stderr and "multiple of the GPU KV cache" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_call_arriving_during_a_pending_copy_runs_and_the_copy_still_completes() -> None:
    config = EngineConfig(
        block_size=BLOCK, num_gpu_blocks=GPU_BLOCKS, max_model_len=1024, host_tier=4
    )
    replica = SimReplica("H100", [MODEL], config, name="h0")

    def call(at: float, name: str, tokens: list[int]) -> FleetRequest:
        return FleetRequest(
            arrival_time=at, model=MODEL.name, prompt_tokens=len(tokens), output_tokens=1,
            block_hashes=block_hashes(tokens, BLOCK), request_id=name,
        )  # fmt: skip

    conversation = prompt(1, 640)
    calls = [
        call(0.0, "first", conversation),
        call(1.0, "other", prompt(2, 1020)),  # pushes the conversation out of the GPU cache
        call(2.0, "again", conversation),  # its copy back takes 1.7 ms, the replica idle
        call(2.001, "small", prompt(3, 48)),  # steps while that copy is on the link
    ]
    result = simulate(calls, [replica])
    assert result.unfinished == 0 and len(result.records) == 4
    again = next(r for r in result.records if r.request.request_id == "again")
    assert again.cached_tokens == 39 * BLOCK


def test_a_call_waiting_for_a_copy_counts_as_waiting_and_fails_if_its_replica_crashes() -> None:
    config = EngineConfig(
        block_size=BLOCK, num_gpu_blocks=GPU_BLOCKS, max_model_len=1024, host_tier=4
    )
    replica = SimReplica("H100", [MODEL], config, name="h0")
    conversation = prompt(1, 640)
    calls = [
        FleetRequest(
            arrival_time=at,
            model=MODEL.name,
            prompt_tokens=len(tokens),
            output_tokens=1,
            block_hashes=block_hashes(tokens, BLOCK),
            request_id=name,
        )
        for at, name, tokens in [
            (0.0, "first", conversation),
            (1.0, "other", prompt(2, 1020)),
            (2.0, "again", conversation),  # copied back from 2.0 to 2.0017
        ]
    ]
    failed: list[str] = []
    fleet = DiscreteEventFleet(
        [replica], on_fail=lambda request, index, sim: failed.append(request.request_id)
    )
    seen: list[tuple[int, int]] = []
    # While the copy runs, routers see the call on the replica, as vLLM counts it waiting.
    fleet.schedule(2.0005, lambda: seen.append((replica.load(), replica.num_waiting)))
    fleet.schedule(2.001, lambda: fleet.crash(0))
    result = fleet.run(calls)
    assert seen == [(1, 1)]
    assert failed == ["again"]
    assert result.unfinished == 0

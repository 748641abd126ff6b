"""KV events whose hashes are kvflow's own go into the prefix index without token ids.

The simulator hashes blocks as the scheduler does (`kvflow.scheduler.blocks`), so kvflow's
policy in the simulated fleet sends stored blocks as hashes alone (`kvflow_hashes`). The index
must end up exactly as if it had hashed the blocks' token ids, as it does for vLLM's events.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from kvflow.bench.policies import bench_fleet
from kvflow.scheduler.blocks import ROOT_HASH, block_hashes, hash_block
from kvflow.scheduler.prefix_index import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    PrefixIndex,
)
from kvflow.simulator import BUILTIN_MODELS, EngineConfig, SimReplica
from kvflow.simulator import kv_events as sim_events
from kvflow.simulator.des import DiscreteEventFleet, FleetRequest
from kvflow.simulator.engine import StepResult
from kvflow.simulator.policies.base import PolicySetup, TaskContext
from kvflow.simulator.policies.kvflow_scheduler import KvflowPolicy

BLOCK = 16
BIG = "llama-3.1-8b"


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(count)]


def events_of(prompts: list[list[int]], rng: random.Random) -> list[KvEvent]:
    """Stored batches of each prompt's blocks in random-sized pieces; the first prompt's tail
    and some others' are evicted."""
    events: list[KvEvent] = []
    for number, prompt in enumerate(prompts):
        chain = block_hashes(prompt, BLOCK)
        start = 0
        while start < len(chain):
            end = min(len(chain), start + rng.randint(1, 7))
            events.append(
                BlockStored(
                    block_hashes=tuple(chain[start:end]),
                    parent_block_hash=chain[start - 1] if start else None,
                    token_ids=tuple(prompt[start * BLOCK : end * BLOCK]),
                    block_size=BLOCK,
                )
            )
            start = end
        if number == 0 or rng.random() < 0.5:
            # vLLM evicts a prompt's tail first.
            events.append(BlockRemoved(block_hashes=tuple(chain[-rng.randint(1, 9) :])))
    return events


def without_tokens(events: list[KvEvent]) -> list[KvEvent]:
    return [
        dataclasses.replace(e, token_ids=(), kvflow_hashes=True)
        if isinstance(e, BlockStored)
        else e
        for e in events
    ]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stride", [1, 4])
def test_kvflow_hashes_alone_give_the_index_that_token_ids_give(stride: int) -> None:
    rng = random.Random(stride)
    shared = tokens(0, 40 * BLOCK)
    prompts = [shared[: rng.randint(1, 40) * BLOCK] + tokens(i + 1, 300) for i in range(12)]
    events = events_of(prompts, rng)

    def index_after(events: list[KvEvent]) -> PrefixIndex:
        # A small capacity, so the index evicts too.
        index = PrefixIndex(BLOCK, speculative_ttl_s=30.0, stride=stride)
        index.add_replica(capacity_blocks=120 // stride)
        index.add_replica(capacity_blocks=120 // stride)
        index.apply(0, [])  # precise from now on: a placement's entries are guesses
        index.record_placement(0, block_hashes(prompts[0], BLOCK), now=0.0)
        # Events confirm the guesses, then evict the prompt's tail: no guess may outlive it.
        index.apply(0, events[: len(events) // 2])
        index.apply(1, events)
        index.apply(0, events[len(events) // 2 :])
        return index

    hashed, taken = index_after(events), index_after(without_tokens(events))
    probes = [block_hashes(p, BLOCK) for p in prompts] + [block_hashes(shared, BLOCK)]
    assert any(hashed.match(p, now=1.0) for p in probes)
    for probe in probes:
        assert taken.match(probe, now=1.0) == hashed.match(probe, now=1.0)
    for replica in (0, 1):
        assert taken.blocks_held(replica) == hashed.blocks_held(replica)
    assert taken.unmatched_events == hashed.unmatched_events
    for index in (hashed, taken):
        index.apply(1, [AllBlocksCleared()])
    assert taken.match(probes[-1], now=1.0) == hashed.match(probes[-1], now=1.0)


@pytest.mark.timeout(30)
def test_hashes_of_larger_engine_blocks_are_not_taken_as_index_keys() -> None:
    index = PrefixIndex(BLOCK, speculative_ttl_s=30.0)
    index.add_replica(capacity_blocks=100)
    prompt = tokens(7, 4 * BLOCK)
    # Two engine blocks of 32 tokens: their hashes are not the index's 16-token ones.
    first = hash_block(ROOT_HASH, prompt[:32])
    second = hash_block(first, prompt[32:])
    index.apply(
        0,
        [
            BlockStored(
                block_hashes=(first, second),
                parent_block_hash=None,
                token_ids=tuple(prompt),
                block_size=32,
                kvflow_hashes=True,
            )
        ],
    )
    assert index.match(block_hashes(prompt, BLOCK), now=0.0) == {0: 4}


def conversations(count: int, turns: int) -> tuple[list[FleetRequest], dict[int, list[int]]]:
    """Agent-like calls: each conversation's prompt grows by its answer and a new message.

    Returns the calls in arrival order and each block's token ids by its hash.
    """
    block_tokens: dict[int, list[int]] = {}
    calls: list[FleetRequest] = []
    rng = random.Random(5)
    system = tokens(0, 64 * BLOCK)
    for number in range(count):
        prompt = system[: rng.randint(8, 64) * BLOCK] + tokens(100 + number, 200)
        for turn in range(turns):
            answer = tokens(10_000 + number * turns + turn, 48)
            chain = block_hashes(prompt + answer, BLOCK)
            for index, h in enumerate(chain):
                block_tokens[h] = (prompt + answer)[index * BLOCK : (index + 1) * BLOCK]
            name = f"c{number}-t{turn}"
            calls.append(
                FleetRequest(
                    arrival_time=number * 0.3 + turn * 2.0,
                    model=BIG,
                    prompt_tokens=len(prompt),
                    output_tokens=len(answer),
                    block_hashes=chain,
                    max_tokens=len(answer),
                    tenant="acme",
                    session=f"c{number}",
                    request_id=name,
                    context=TaskContext(
                        workflow_id=f"c{number}",
                        tenant="acme",
                        tier=1,
                        deadline_at=None,
                        started_at=0.0,
                        steps_remaining=turns - turn,
                        max_tokens=len(answer),
                    ),
                )
            )
            prompt = prompt + answer + tokens(20_000 + number * turns + turn, 100)
    calls.sort(key=lambda call: call.arrival_time)
    return calls, block_tokens


@pytest.mark.timeout(60)
def test_kvflow_in_the_simulated_fleet_places_the_same_with_or_without_token_ids() -> None:
    calls, block_tokens = conversations(count=24, turns=4)
    fleet = bench_fleet("agent", 2)
    # A cache of a few conversations per replica: blocks are evicted and stored again.
    config = EngineConfig(max_model_len=4096, num_gpu_blocks=300, enable_kv_events=True)
    evicted = [0]

    def run(token_ids: bool) -> list[tuple[str, int, int]]:
        replicas = [
            SimReplica(pool.gpu, [BUILTIN_MODELS[BIG]], config, name=name)
            for pool in fleet.pools
            for name in pool.replica_names()
        ]
        setup = PolicySetup(
            fleet=fleet,
            replica_names=[r.name for r in replicas],
            block_size=BLOCK,
            clock=lambda: sim.now,
            tokens_of=lambda parent, block: block_tokens[block],
            extra={"kv_event_token_ids": token_ids},
        )
        policy = KvflowPolicy(setup)

        def on_step(replica: int, step: StepResult) -> None:
            evicted[0] += sum(
                len(e.block_hashes)
                for e in step.kv_events
                if isinstance(e, sim_events.BlockRemoved)
            )
            policy.on_step(replica, step)

        sim = DiscreteEventFleet(
            replicas,
            policy,
            on_step=on_step,
            on_scrape=lambda now: policy.on_scrape(sim.view, now),
        )
        result = sim.run([dataclasses.replace(call) for call in calls])
        return sorted((r.request.request_id, r.replica, r.cached_tokens) for r in result.records)

    with_ids = run(True)
    assert evicted[0] > 500
    assert len(with_ids) == len(calls)
    assert len({replica for _, replica, _ in with_ids}) == 2
    assert sum(cached for *_, cached in with_ids) > 0
    assert run(False) == with_ids

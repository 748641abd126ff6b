"""The anchor routers of `kvflow bench policies` decide as their sources do, at their defaults.

Each anchor's documented defaults are asserted, and each is driven through a hand-made
fleet where the default values decide the choice: a router whose weight or threshold moved
picks another replica here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import pytest

from kvflow.scheduler.blocks import ROOT_HASH, hash_block
from kvflow.scheduler.fleet import Fleet
from kvflow.simulator.des import FleetRequest, FleetView
from kvflow.simulator.engine import SimReplica, SimRequest, StepResult
from kvflow.simulator.policies import (
    POLICIES,
    AttemptEnd,
    PolicySetup,
    TaskContext,
    aibrix,
    dynamo,
    llm_d,
    sglang,
)

pytestmark = pytest.mark.timeout(10)

MODEL = "m"
BLOCK = 16


class FakeEngine:
    """An engine that holds a fixed set of blocks (its KV events, as a router knows them)."""

    def __init__(self, cached: Sequence[int] = (), num_gpu_blocks: int = 100_000) -> None:
        self.cached = set(cached)
        self.num_gpu_blocks = num_gpu_blocks

    def cached_prefix_tokens(self, hashes: Sequence[int]) -> int:
        held = 0
        for h in hashes:
            if h not in self.cached:
                break
            held += 1
        return held * BLOCK


class FakeReplica:
    def __init__(self, engine: FakeEngine) -> None:
        self.engines = {MODEL: engine}


def fleet_of(*engines: FakeEngine) -> FleetView:
    return FleetView(cast(Sequence[SimReplica], [FakeReplica(e) for e in engines]))


def chain(blocks: int, start: int = 0) -> list[int]:
    hashes, parent = [], ROOT_HASH
    for b in range(blocks):
        first = start + b * BLOCK
        parent = hash_block(parent, range(first, first + BLOCK))
        hashes.append(parent)
    return hashes


_ids = iter(range(1_000_000))


def call(
    hashes: list[int],
    *,
    exclude: frozenset[int] = frozenset(),
    session: str = "task-0",
    max_tokens: int = 64,
) -> FleetRequest:
    return FleetRequest(
        arrival_time=0.0,
        model=MODEL,
        prompt_tokens=len(hashes) * BLOCK,
        output_tokens=32,
        block_hashes=hashes,
        request_id=f"r{next(_ids)}",
        exclude=exclude,
        context=TaskContext(
            workflow_id=session,
            tenant="acme",
            tier=1,
            deadline_at=None,
            started_at=0.0,
            steps_remaining=1,
            max_tokens=max_tokens,
        ),
    )


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def setup(replicas: int, *, seed: int = 0, hints: bool = False, clock: Clock | None = None):
    return PolicySetup(
        fleet=cast(Fleet, None),
        replica_names=[f"pool/{i}" for i in range(replicas)],
        block_size=BLOCK,
        clock=clock or Clock(),
        tokens_of=lambda parent, h: range(BLOCK),
        seed=seed,
        extra={"mechanisms": frozenset({"hints"})} if hints else {},
    )


@dataclass
class Output:
    """What a step result lists of a request that got tokens."""

    request_id: str
    num_output_tokens: int


def step_with(*outputs: Output) -> StepResult:
    return StepResult(start=0.0, duration=0.01, outputs=cast("list[SimRequest]", list(outputs)))


def ended(request: FleetRequest, replica: int) -> AttemptEnd:
    return AttemptEnd(request=request, replica=replica, ok=True)


def test_every_anchor_has_a_tuned_variant_registered_beside_it() -> None:
    for anchor in ("llm-d", "sglang", "dynamo", "aibrix"):
        assert f"{anchor}-tuned" in POLICIES
        assert POLICIES[f"{anchor}-tuned"](setup(2)).name == f"{anchor}-tuned"


# ---------------------------------------------------------------------------- llm-d


def test_llm_d_documented_defaults() -> None:
    default, precise = llm_d.LlmDPolicy, llm_d.LlmDPrecisePolicy
    # defaults.go: queue 2, kv-cache-utilization 2, prefix-cache 3.
    assert (default.queue_weight, default.kv_weight, default.prefix_weight) == (2, 2, 3)
    # epp-precise-prefix-cache-config.yaml: queue 1, kv 1, precise prefix 2, 64-token blocks.
    assert (precise.queue_weight, precise.kv_weight, precise.prefix_weight) == (1, 1, 2)
    assert llm_d.PRECISE_BLOCK_TOKENS == 64
    assert llm_d.MAX_PREFIX_BLOCKS == 256
    assert (llm_d.LOAD_AWARE_THRESHOLD, llm_d.SPECULATIVE_TTL_S) == (128, 2.0)
    assert llm_d.LlmDTunedPolicy.load_aware_weight == 1.0
    assert default.load_aware_weight == precise.load_aware_weight == 0.0


def test_llm_d_prefix_weight_3_outweighs_a_longer_queue_and_fuller_cache() -> None:
    # Pod 0 holds the prompt (prefix 1.0) but has 2 waiting and 60% KV usage; pod 1 is idle
    # at 20%: 2·0 + 2·0.4 + 3·1 = 3.8 against 2·1 + 2·0.8 + 3·0 = 3.6. With a prefix weight
    # of 2 or less, a queue weight of 3 or a kv weight of 3, pod 1 wins.
    fleet = fleet_of(FakeEngine(), FakeEngine())
    prompt = chain(8)
    for seed in range(5):
        policy = llm_d.LlmDPolicy(setup(2, seed=seed))
        assert policy.route(call(prompt, exclude=frozenset({1})), fleet, 0.0) == 0
        fleet.metrics[0].waiting, fleet.metrics[0].kv_cache_usage = 2, 0.6
        fleet.metrics[1].waiting, fleet.metrics[1].kv_cache_usage = 0, 0.2
        assert policy.route(call(prompt), fleet, 0.0) == 0
        # Half the prompt cached: 0.8 + 3·0.5 = 2.3 < 3.6.
        assert policy.route(call([*prompt[:4], *chain(4, start=9_000)]), fleet, 0.0) == 1


def test_llm_d_approximate_lru_holds_as_many_blocks_as_the_pods_gpu() -> None:
    # A pod with 4 GPU blocks keeps the last 4 blocks of a 6-block prompt: the prompt's first
    # block is gone, so the walk finds nothing (a fixed 31,250-block LRU would match all 6).
    fleet = fleet_of(FakeEngine(num_gpu_blocks=4), FakeEngine(num_gpu_blocks=4))
    policy = llm_d.LlmDPolicy(setup(2))
    prompt = chain(6)
    policy.route(call(prompt, exclude=frozenset({1})), fleet, 0.0)
    assert policy.prefix_scores(call(prompt), fleet, [0, 1], 0.0) == {}
    short = chain(3, start=5_000)
    policy.route(call(short, exclude=frozenset({1})), fleet, 0.0)
    assert policy.prefix_scores(call(short), fleet, [0, 1], 0.0) == {0: 1.0}


def test_llm_d_precise_scores_whole_64_token_blocks() -> None:
    # 8 blocks of 16 tokens = 2 blocks of 64. Pod 0 stored 48 tokens: no whole 64-token
    # block; pod 1 stored 80 tokens: one of two.
    prompt = chain(8)
    fleet = fleet_of(FakeEngine(prompt[:3]), FakeEngine(prompt[:5]))
    policy = llm_d.LlmDPrecisePolicy(setup(2))
    assert policy.prefix_scores(call(prompt), fleet, [0, 1], 0.0) == {0: 0.0, 1: 0.5}


def test_llm_d_tuned_counts_its_own_decision_for_two_seconds() -> None:
    clock = Clock()
    fleet = fleet_of(FakeEngine(), FakeEngine())
    policy = llm_d.LlmDTunedPolicy(setup(2, clock=clock))
    prompt = chain(8)
    policy.route(call(prompt, exclude=frozenset({1})), fleet, 0.0)
    assert policy.prefix_scores(call(prompt), fleet, [0, 1], 1.9) == {0: 1.0, 1: 0.0}
    assert policy.prefix_scores(call(prompt), fleet, [0, 1], 2.1) == {0: 0.0, 1: 0.0}
    # The precise profile without speculative indexing waits for the engine's events.
    precise = llm_d.LlmDPrecisePolicy(setup(2, clock=clock))
    precise.route(call(prompt, exclude=frozenset({1})), fleet, 0.0)
    assert precise.prefix_scores(call(prompt), fleet, [0, 1], 0.5) == {0: 0.0, 1: 0.0}


# ---------------------------------------------------------------------------- SGLang


def test_sglang_documented_defaults() -> None:
    # sgl_model_gateway.md: --cache-threshold 0.3, --balance-abs-threshold 64,
    # --balance-rel-threshold 1.5, --max-tree-size 2^26.
    assert sglang.CACHE_THRESHOLD == 0.3
    assert (sglang.BALANCE_ABS_THRESHOLD, sglang.BALANCE_REL_THRESHOLD) == (64, 1.5)
    assert sglang.MAX_TREE_SIZE_CHARS == 1 << 26
    policy = sglang.SglangCacheAwarePolicy(setup(2))
    assert (policy.cache_threshold, policy.balance_abs_threshold) == (0.3, 64)
    assert policy.balance_rel_threshold == 1.5


def test_sglang_follows_a_match_only_above_30_percent_of_the_prompt() -> None:
    fleet = fleet_of(FakeEngine(), FakeEngine())
    policy = sglang.SglangCacheAwarePolicy(setup(2))
    shared = chain(4)
    policy.route(call(shared, exclude=frozenset({1})), fleet, 0.0)  # worker 0: load 1
    # 4 of 10 blocks (40%) > 0.3: worker 0 despite its load.
    assert policy.route(call([*shared, *chain(6, start=7_000)]), fleet, 0.0) == 0
    # 3 of 10 blocks (30%), not above 0.3: the least loaded, worker 1.
    assert policy.route(call([*shared[:3], *chain(7, start=8_000)]), fleet, 0.0) == 1


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ((64, 0), 0),  # a difference of 64 is not above 64: balanced, follow the prefix
        ((66, 1), 1),  # 65 > 64 and 66 > 1.5: imbalanced, shortest queue
        ((300, 200), 0),  # 100 > 64 but 300 is not above 1.5 · 200: balanced
        ((301, 200), 1),  # 301 > 300: imbalanced
    ],
)
def test_sglang_balances_only_past_both_thresholds(loads: tuple[int, int], expected: int) -> None:
    fleet = fleet_of(FakeEngine(), FakeEngine())
    policy = sglang.SglangCacheAwarePolicy(setup(2))
    prompt = chain(8)
    policy.route(call(prompt, exclude=frozenset({1})), fleet, 0.0)
    policy.load.counts = {0: loads[0], 1: loads[1]}
    assert policy.route(call(prompt), fleet, 0.0) == expected


def test_sglang_gives_equal_matches_to_the_worker_that_created_the_node() -> None:
    fleet = fleet_of(FakeEngine(), FakeEngine())
    policy = sglang.SglangCacheAwarePolicy(setup(2))
    prompt = chain(8)
    # Worker 1 inserts the prompt first, then worker 0 is sent the same prompt: both hold
    # all of it, and the node's tenant stays worker 1 (tree.rs caches the creator).
    policy.route(call(prompt, exclude=frozenset({0})), fleet, 0.0)
    policy.route(call(prompt, exclude=frozenset({1})), fleet, 0.0)
    policy.load.counts = {0: 0, 1: 0}
    assert policy.prefix_match(prompt) == (8, 1)
    assert policy.route(call([*prompt, *chain(2, start=9_000)]), fleet, 0.0) == 1
    # A deeper node made by worker 0 is worker 0's.
    longer = [*prompt, *chain(4, start=10_000)]
    policy.route(call(longer, exclude=frozenset({1})), fleet, 0.0)
    assert policy.prefix_match([*longer, *chain(1, start=11_000)]) == (12, 0)


def test_sglang_load_is_the_gateways_in_flight_count() -> None:
    fleet = fleet_of(FakeEngine(), FakeEngine())
    policy = sglang.SglangCacheAwarePolicy(setup(2))
    first = call(chain(2))
    assert policy.route(first, fleet, 0.0) == 0
    assert policy.route(call(chain(2, start=3_000)), fleet, 0.0) == 1
    assert (policy.load[0], policy.load[1]) == (1, 1)
    policy.on_attempt_end(ended(first, 0))
    policy.on_attempt_end(ended(first, 0))  # a second report of the same request
    assert (policy.load[0], policy.load[1]) == (0, 1)


def test_sglang_tuned_keeps_a_session_on_its_worker_only_with_hints() -> None:
    fleet = fleet_of(FakeEngine(), FakeEngine())
    policy = sglang.SglangManualPolicy(setup(2, hints=True))
    policy.load.counts = {0: 3, 1: 0}
    assert policy.route(call(chain(2), session="a"), fleet, 0.0) == 1  # least loaded
    policy.load.counts = {0: 0, 1: 9}
    assert policy.route(call(chain(3), session="a"), fleet, 1.0) == 1  # sticky
    # Its worker excluded: a new least-loaded one, remembered; back once it serves again.
    assert policy.route(call(chain(3), session="a", exclude=frozenset({1})), fleet, 2.0) == 0
    assert policy.route(call(chain(4), session="a"), fleet, 3.0) == 1
    # Without hints there is no routing key: the gateway picks at random.
    plain = sglang.SglangManualPolicy(setup(2, seed=1))
    chosen = {plain.route(call(chain(2), session="a"), fleet, 0.0) for _ in range(30)}
    assert chosen == {0, 1}


# ---------------------------------------------------------------------------- Dynamo


def test_dynamo_documented_defaults() -> None:
    # config.rs KvRouterConfig::default.
    assert dynamo.OVERLAP_SCORE_CREDIT == 1.0
    assert dynamo.PREFILL_LOAD_SCALE == 1.0
    assert dynamo.ROUTER_TEMPERATURE == 0.0
    assert dynamo.DECODE_ACTIVE_REQUEST_WEIGHT == 0.0
    assert dynamo.ROUTER_TRACK_OUTPUT_BLOCKS is False
    assert dynamo.DynamoKvPolicy.track_output_blocks is False
    assert dynamo.DynamoAgentPolicy.track_output_blocks is True


def _busy_worker_0(policy: dynamo.DynamoKvPolicy, fleet: FleetView, blocks: int) -> None:
    """`blocks` distinct prompt blocks live on worker 0, past their prefill."""
    other = call(chain(blocks, start=50_000), exclude=frozenset({1}))
    assert policy.route(other, fleet, 0.0) == 0
    policy.on_step(0, step_with(Output(other.request_id, 1)))


@pytest.mark.parametrize(("decode_blocks", "expected"), [(6, 0), (10, 1)])
def test_dynamo_trades_cached_prefill_against_decode_load(
    decode_blocks: int, expected: int
) -> None:
    # An 8-block prompt, all cached on worker 0, none on worker 1 (idle):
    #   worker 0: 1.0 · max(8 − 1.0 · 8, 0) + decode + 8 new active blocks
    #   worker 1: 1.0 · 8 + 0 + 8 = 16
    # decode 6 → 14 < 16: worker 0; decode 10 → 18 > 16: worker 1. A prefill scale of 0.5
    # or 2, or an overlap credit of 0.5, flips one of the two.
    prompt = chain(8)
    fleet = fleet_of(FakeEngine(prompt), FakeEngine())
    for seed in range(3):
        policy = dynamo.DynamoKvPolicy(setup(2, seed=seed))
        _busy_worker_0(policy, fleet, decode_blocks)
        assert policy.load(0).prefill_tokens == 0
        assert policy.cost(call(prompt), 0, fleet) == decode_blocks + 8
        assert policy.route(call(prompt), fleet, 0.0) == expected


def test_dynamo_counts_each_live_prompt_block_once_and_no_output() -> None:
    fleet = fleet_of(FakeEngine(), FakeEngine())
    policy = dynamo.DynamoKvPolicy(setup(2))
    prompt = chain(6)
    first, second = call(prompt, exclude=frozenset({1})), call(prompt, exclude=frozenset({1}))
    policy.route(first, fleet, 0.0)
    policy.route(second, fleet, 0.0)
    assert policy.load(0).active_blocks() == 6
    policy.on_step(0, step_with(Output(first.request_id, 80), Output(second.request_id, 80)))
    assert policy.load(0).active_blocks() == 6  # 80 output tokens each: not tracked
    policy.on_attempt_end(ended(first, 0))
    assert policy.load(0).active_blocks() == 6
    policy.on_attempt_end(ended(second, 0))
    assert policy.load(0).active_blocks() == 0


def test_dynamo_charges_a_routed_request_its_uncached_prompt_until_its_first_token() -> None:
    prompt = chain(8)
    fleet = fleet_of(FakeEngine(prompt[:5]), FakeEngine())
    policy = dynamo.DynamoKvPolicy(setup(2))
    request = call(prompt, exclude=frozenset({1}))
    policy.route(request, fleet, 0.0)
    assert policy.load(0).prefill_tokens == (8 - 5) * BLOCK
    policy.on_step(0, step_with(Output(request.request_id, 1)))
    assert policy.load(0).prefill_tokens == 0


def test_dynamo_tuned_tracks_output_blocks_decaying_with_the_osl_hint() -> None:
    fleet = fleet_of(FakeEngine(), FakeEngine())
    tuned = dynamo.DynamoAgentPolicy(setup(2))
    request = call(chain(4), exclude=frozenset({1}), max_tokens=64)
    tuned.route(request, fleet, 0.0)
    tuned.on_step(0, step_with(Output(request.request_id, 32)))
    assert tuned.load(0).active_blocks() == 4 + 2  # no hints: each output block weighs 1
    hinted = dynamo.DynamoAgentPolicy(setup(2, hints=True))
    request = call(chain(4), exclude=frozenset({1}), max_tokens=64)
    hinted.route(request, fleet, 0.0)
    hinted.on_step(0, step_with(Output(request.request_id, 32)))
    # Half of osl 64 generated: its 4 exclusive prompt blocks and 2 output blocks weigh 0.5.
    assert hinted.load(0).active_blocks() == 3
    hinted.on_attempt_end(ended(request, 0))
    assert hinted.load(0).active_blocks() == 0


def test_dynamo_tuned_keeps_a_session_on_its_worker_only_with_hints() -> None:
    prompt = chain(8)
    fleet = fleet_of(FakeEngine(), FakeEngine(prompt))
    for hints, expected in ((True, 0), (False, 1)):
        policy = dynamo.DynamoAgentPolicy(setup(2, hints=hints))
        assert policy.route(call(chain(2), session="s", exclude=frozenset({1})), fleet, 0.0) == 0
        # Worker 1 holds the whole prompt; the session's worker is 0.
        assert policy.route(call(prompt, session="s"), fleet, 1.0) == expected
    policy = dynamo.DynamoAgentPolicy(setup(2, hints=True))
    policy.route(call(chain(2), session="s", exclude=frozenset({1})), fleet, 0.0)
    idle = dynamo.SESSION_AFFINITY_TTL_S + 1.0
    assert policy.route(call(prompt, session="s"), fleet, idle) == 1


# ---------------------------------------------------------------------------- AIBrix


def test_aibrix_documented_defaults() -> None:
    # prefix_cache.go and prefixcacheindexer/hash.go.
    assert aibrix.IMBALANCE_ABS_COUNT == 8
    assert aibrix.STANDARD_DEVIATION_FACTOR == 1
    assert aibrix.PREFIX_CACHE_BLOCK_NUMBER == 200_000
    assert aibrix.PREFIX_CACHE_BLOCK_CHARS == 4
    assert aibrix.EVICTION_DURATION_S == 20 * 60
    assert aibrix.AibrixPrefixCachePolicy(setup(2)).table.capacity_blocks == 200_000 // BLOCK


@pytest.mark.parametrize(("running", "expected"), [((8, 0), 0), ((9, 0), 1)])
def test_aibrix_leaves_the_prefix_only_past_8_requests_of_imbalance(
    running: tuple[int, int], expected: int
) -> None:
    # Pod 0 holds the prompt. 8 more requests than pod 1 is not imbalanced, and 8 is within
    # mean 4 + σ 5.66; 9 more is: only pod 1 is ready.
    fleet = fleet_of(FakeEngine(), FakeEngine())
    prompt = chain(8)
    for seed in range(3):
        policy = aibrix.AibrixPrefixCachePolicy(setup(2, seed=seed))
        policy.table.add(prompt, 0)
        policy.running = {0: running[0], 1: running[1]}
        assert policy.route(call(prompt), fleet, 0.0) == expected


def test_aibrix_counts_in_flight_requests_from_its_own_routing() -> None:
    fleet = fleet_of(FakeEngine(), FakeEngine())
    # The scrape says pod 1 is busy; AIBrix's gateway does not read it.
    fleet.metrics[1].running = 50
    policy = aibrix.AibrixPrefixCachePolicy(setup(2))
    first = call(chain(2))
    a = policy.route(first, fleet, 0.0)
    b = policy.route(call(chain(2, start=3_000)), fleet, 0.0)
    assert a is not None and b is not None and {a, b} == {0, 1}
    assert policy.running == {0: 1, 1: 1}
    policy.on_attempt_end(ended(first, a))
    assert policy.running[a] == 0 and policy.running[b] == 1


def test_aibrix_matches_prefixes_among_the_least_loaded_when_imbalanced() -> None:
    fleet = fleet_of(FakeEngine(), FakeEngine(), FakeEngine())
    prompt = chain(8)
    for seed in range(8):
        policy = aibrix.AibrixPrefixCachePolicy(setup(3, seed=seed))
        policy.table.add(prompt, 2)
        policy.running = {0: 9, 1: 0, 2: 0}
        assert policy.route(call(prompt), fleet, 0.0) == 2


def test_aibrix_shuffles_equal_matches_with_its_seed() -> None:
    fleet = fleet_of(FakeEngine(), FakeEngine())
    prompt = chain(8)

    def choice(seed: int) -> int | None:
        policy = aibrix.AibrixPrefixCachePolicy(setup(2, seed=seed))
        policy.table.add(prompt, 0)
        policy.table.add(prompt, 1)
        return policy.route(call(prompt), fleet, 0.0)

    assert {choice(seed) for seed in range(20)} == {0, 1}
    assert [choice(7) for _ in range(3)] == [choice(7)] * 3


def test_aibrix_forgets_a_prefix_written_more_than_20_minutes_ago() -> None:
    clock = Clock()
    policy = aibrix.AibrixPrefixCachePolicy(setup(2, clock=clock))
    prompt = chain(4)
    policy.table.add(prompt, 0)
    clock.now = 20 * 60 - 1
    assert policy.table.match(prompt, [0, 1]) == {0: 100}
    clock.now = 20 * 60 + 1
    assert policy.table.match(prompt, [0, 1]) == {}


def test_aibrix_tuned_matches_what_the_engines_stored() -> None:
    prompt = chain(8)
    fleet = fleet_of(FakeEngine(), FakeEngine(prompt[:6]))
    for seed in range(5):
        tuned = aibrix.AibrixKvSyncPolicy(setup(2, seed=seed))
        assert tuned.route(call(prompt), fleet, 0.0) == 1
    # Before its engine reports them, a routed prompt's blocks count for its pod.
    tuned = aibrix.AibrixKvSyncPolicy(setup(2))
    other = chain(8, start=20_000)
    first = call(other, exclude=frozenset({1}))
    tuned.route(first, fleet, 0.0)
    tuned.running = {0: 0, 1: 0}
    assert tuned.route(call(other), fleet, 0.0) == 0

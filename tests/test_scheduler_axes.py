"""Each axis does what its docstring says (property tests), and the rendezvous hash is stable."""

from __future__ import annotations

import math
from decimal import ROUND_HALF_UP, Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvflow.scheduler.axes import (
    GpuGenerationAxis,
    KvCacheAxis,
    LatencyBudget,
    MemoryHeadroom,
    PoolPrices,
    QueueLoad,
    Speed,
    TenantPriority,
    WarmWeights,
    WorkflowContext,
)
from kvflow.scheduler.config import (
    DEFAULT_AXES,
    AdmissionConfig,
    LatencyConfig,
    MemoryConfig,
    SchedulerConfig,
    SpeedConfig,
    WeightsConfig,
)
from kvflow.scheduler.fleet import ModelSpec, Pool, Tenant, TokenPrices, format_usd
from kvflow.scheduler.gpus import GpuGeneration
from kvflow.scheduler.rendezvous import (
    bounded_capacity,
    rendezvous_key,
    rendezvous_order,
    rendezvous_weights,
    replica_seed,
)

EIGHT_B = ModelSpec(
    name="llama-3.1-8b", parameters_b=8.0, layers=32, kv_heads=8, head_dim=128, context_length=8192
)
SEVENTY_B = ModelSpec(
    name="llama-3.1-70b",
    parameters_b=70.0,
    layers=80,
    kv_heads=8,
    head_dim=128,
    context_length=8192,
)
PRICES = TokenPrices(
    input_per_mtok_usd=Decimal("0.20"),
    cached_input_per_mtok_usd=Decimal("0.02"),
    output_per_mtok_usd=Decimal("0.60"),
)


def pool(gpu: GpuGeneration, gpus: int = 1) -> Pool:
    return Pool(
        name=gpu.value.lower(),
        gpu=gpu,
        replicas=1,
        gpus_per_replica=gpus,
        price_per_gpu_hour_usd=Decimal("1"),
        token_prices=PRICES,
        warm_models=[EIGHT_B.name],
    )


tokens = st.integers(0, 200_000)
fractions = st.floats(0.0, 1.0)


# ----------------------------------------------------------------------------- GPU generation


def test_faster_generations_have_faster_rooflines() -> None:
    axis = GpuGenerationAxis(SpeedConfig())
    order = [GpuGeneration.L4, GpuGeneration.A100, GpuGeneration.H100, GpuGeneration.H200]
    decode = [axis.roofline(pool(g), EIGHT_B).decode_s_per_token for g in order]
    assert decode == sorted(decode, reverse=True)
    # 16 GB of weights over 4.8 TB/s at 60 % efficiency: 5.6 ms per token on one H200.
    assert decode[-1] == pytest.approx(16e9 / (4.8e12 * 0.6))
    prefill = axis.roofline(pool(GpuGeneration.H100), EIGHT_B).prefill_s_per_token
    assert prefill == pytest.approx(2 * 8e9 / (989e12 * 0.4))
    two = axis.roofline(pool(GpuGeneration.H100, gpus=2), EIGHT_B)
    assert two.prefill_s_per_token == pytest.approx(prefill / 2)


@given(a=tokens, b=tokens, load=fractions)
def test_prefill_and_decode_grow_with_tokens(a: int, b: int, load: float) -> None:
    axis = GpuGenerationAxis(SpeedConfig())
    speed = axis.roofline(pool(GpuGeneration.H200), EIGHT_B)
    small, large = sorted((a, b))
    assert axis.prefill_s(speed, small) <= axis.prefill_s(speed, large)
    assert axis.prefill_s(speed, 0) == SpeedConfig().ttft_overhead_s
    assert axis.decode_s(speed, small, load) <= axis.decode_s(speed, large, load)
    assert axis.decode_s(speed, large, 0.0) <= axis.decode_s(speed, large, load)
    assert axis.decode_s(speed, large, load) <= large * speed.decode_s_per_token * 1.5 + 1e-12


@given(
    prefill=st.floats(0.001, 100.0),
    decode=st.floats(0.001, 100.0),
    uncached=st.integers(16, 100_000),
    output=st.integers(2, 10_000),
)
def test_observations_move_estimates_toward_what_was_measured(
    prefill: float, decode: float, uncached: int, output: int
) -> None:
    axis = GpuGenerationAxis(SpeedConfig(ttft_overhead_s=0.0, decode_batch_slowdown=0.0))
    h100 = pool(GpuGeneration.H100)
    before = axis.speed("h100/0", h100, EIGHT_B)
    axis.observe(
        "h100/0",
        h100,
        EIGHT_B,
        uncached_tokens=uncached,
        prefill_s=prefill,
        output_tokens=output,
        decode_s=decode,
        load_fraction=0.0,
    )
    after = axis.speed("h100/0", h100, EIGHT_B)
    roofline = axis.roofline(h100, EIGHT_B)
    measured = Speed(
        *(
            min(max(value, base / 1e4), base * 1e4)  # within the observation clamp
            for value, base in zip(
                (prefill / uncached, decode / (output - 1)), roofline, strict=True
            )
        )
    )
    for old, new, target in zip(before, after, measured, strict=True):
        assert min(old, target) - 1e-15 <= new <= max(old, target) + 1e-15
        assert new == pytest.approx(old + 0.2 * (target - old))
    # Another replica of the same generation learns from the generation's EWMA.
    assert axis.speed("h100/1", h100, EIGHT_B) == after


# ----------------------------------------------------------------------------- queue


@given(running=st.integers(0, 500), waiting=st.integers(0, 500), slots=st.integers(1, 256))
def test_queue_wait_is_zero_with_a_free_slot_and_grows_with_the_queue(
    running: int, waiting: int, slots: int
) -> None:
    queue = QueueLoad(WeightsConfig(), SpeedConfig(default_service_s=4.0))
    wait = queue.wait_s(running, waiting, slots, None)
    if waiting == 0 and running < slots:
        assert wait == 0.0
    assert wait == pytest.approx((waiting + max(0, running + 1 - slots)) * 4.0 / slots)
    assert queue.wait_s(running, waiting + 1, slots, None) > wait
    assert queue.wait_s(running, waiting, slots, 8.0) == pytest.approx(2 * wait)
    assert queue.penalty(running + waiting, slots) == pytest.approx(
        0.5 * (running + waiting) / slots
    )


# ----------------------------------------------------------------------------- memory


@given(
    prompt=tokens,
    output=st.integers(0, 50_000),
    cached=tokens,
    block=st.sampled_from([16, 32, 128]),
    total=st.integers(1, 1_000_000),
    usage=fractions,
)
def test_memory_headroom_admits_exactly_when_the_new_blocks_fit(
    prompt: int, output: int, cached: int, block: int, total: int, usage: float
) -> None:
    memory = MemoryHeadroom(MemoryConfig(reserve_fraction=0.05), WeightsConfig(kv_usage=0.5))
    cached = min(cached, prompt)
    need = memory.blocks_needed(prompt, output, cached, block)
    assert need == max(0, math.ceil((prompt + output) / block) - cached // block)
    free = memory.free_blocks(total, usage)
    assert free is not None
    assert free == pytest.approx(total * (1 - usage) - 0.05 * total)
    assert memory.admits(need, free) == (need <= free)
    assert memory.admits(need, None)  # unknown cache size: no basis to refuse
    # A request that would not fit even an empty cache (beyond the reserve) is too big there.
    assert memory.fits(need, memory.max_blocks(total)) == (need <= 0.95 * total)
    assert memory.fits(need, memory.max_blocks(None))
    assert memory.penalty(usage) == pytest.approx(0.5 * usage)
    less_free = memory.free_blocks(total, min(1.0, usage + 0.1))
    assert less_free is not None and less_free <= free


# ----------------------------------------------------------------------------- KV cache


@given(
    depth=st.integers(0, 10_000),
    prompt=tokens,
    engine=st.sampled_from([16, 32, 64, 128, 256]),
)
def test_expected_cached_tokens_are_whole_engine_blocks_short_of_the_last_token(
    depth: int, prompt: int, engine: int
) -> None:
    kv = KvCacheAxis()
    cached = kv.expected_cached_tokens(depth, prompt, 16, engine)
    assert cached % engine == 0
    assert 0 <= cached <= max(0, prompt - 1)
    assert cached <= depth * 16
    assert kv.expected_cached_tokens(depth + 1, prompt, 16, engine) >= cached


# ----------------------------------------------------------------------------- warm weights


def test_a_cold_load_reads_the_weights_and_starts_the_engine() -> None:
    warm = WarmWeights(SpeedConfig(load_bandwidth_gbps=2.0, load_overhead_s=20.0), MemoryConfig())
    assert warm.load_s(EIGHT_B) == pytest.approx(16e9 / 2e9 + 20.0)
    assert warm.can_load(pool(GpuGeneration.L4), EIGHT_B)  # 16 GB in 24 GB
    assert not warm.can_load(pool(GpuGeneration.L4), SEVENTY_B)  # 140 GB in 24 GB
    assert warm.can_load(pool(GpuGeneration.H200, gpus=2), SEVENTY_B)
    # 141 GB · 0.9 − 16 GB of weights, in blocks of 16 tokens of 128 KiB each.
    blocks = warm.kv_capacity_blocks(pool(GpuGeneration.H200), EIGHT_B, 16)
    assert blocks == int((141e9 * 0.9 - 16e9) / (EIGHT_B.kv_bytes_per_token() * 16))


def test_the_kv_usage_weight_is_the_caches_bytes_over_the_weights_bytes() -> None:
    warm = WarmWeights(SpeedConfig(), MemoryConfig())
    h100, h200, l4 = (pool(g) for g in (GpuGeneration.H100, GpuGeneration.H200, GpuGeneration.L4))
    # A full cache adds its bytes to every decode step's reads of the weights.
    assert warm.kv_read_ratio(h100, [EIGHT_B]) == pytest.approx((80e9 * 0.9 - 16e9) / 16e9)
    assert warm.kv_read_ratio(h200, [EIGHT_B]) == pytest.approx((141e9 * 0.9 - 16e9) / 16e9)
    assert warm.kv_read_ratio(l4, [EIGHT_B]) == pytest.approx((24e9 * 0.9 - 16e9) / 16e9)
    # A second model's weights take cache space; the step reads the larger one's weights.
    small = EIGHT_B.model_copy(update={"name": "small", "parameters_b": 1.0})
    assert warm.kv_read_ratio(h200, [EIGHT_B, small]) == pytest.approx((141e9 * 0.9 - 18e9) / 16e9)
    assert warm.kv_read_ratio(l4, [SEVENTY_B]) == 0.0  # weights beyond the memory: no cache
    derived = MemoryHeadroom(MemoryConfig(), WeightsConfig(), pool_weights=(3.5, 0.35))
    assert derived.penalty(0.4, 0) == pytest.approx(1.4)
    assert derived.penalty(0.4, 1) == pytest.approx(0.14)
    fixed = MemoryHeadroom(MemoryConfig(), WeightsConfig(kv_usage=0.5), pool_weights=(3.5, 0.35))
    assert fixed.penalty(0.4, 0) == fixed.penalty(0.4, 1) == pytest.approx(0.2)


# ----------------------------------------------------------------------------- tenant priority


@given(load=st.floats(0.0, 10.0), tier=st.integers(2, 5))
def test_a_higher_tier_is_admitted_whenever_a_lower_one_is(load: float, tier: int) -> None:
    priority = TenantPriority(AdmissionConfig())
    if priority.admits(tier, load):
        assert priority.admits(tier - 1, load)
    thresholds = AdmissionConfig().saturation_by_tier
    assert priority.admits(tier, load) == (load < thresholds[tier - 1])


def test_tenant_keys_and_daily_quota() -> None:
    priority = TenantPriority(AdmissionConfig())
    tenant = Tenant(name="acme", tier=2, fairness_weight=3.0, daily_budget_usd=Decimal("1.50"))
    assert priority.keys(tenant) == (2, "acme", 3.0)
    assert not priority.over_quota(tenant, 1_499_999)
    assert priority.over_quota(tenant, 1_500_000)
    assert not priority.over_quota(Tenant(name="free", tier=3), 10**12)


def test_tier_thresholds_must_let_high_tiers_wait_last() -> None:
    with pytest.raises(ValueError, match="non-increasing"):
        AdmissionConfig(saturation_by_tier=(1.0, 2.0, 1.0, 1.0, 1.0))


def test_a_configuration_without_the_warm_weights_axis_is_refused_by_name() -> None:
    without = tuple(a for a in DEFAULT_AXES if a != "warm_weights")
    with pytest.raises(ValueError, match="axes must include 'warm_weights'"):
        SchedulerConfig(axes=without)
    with pytest.raises(ValueError, match="unknown axes queue_lod"):
        SchedulerConfig(axes=("warm_weights", "queue_lod"))
    with pytest.raises(ValueError, match="more than once: kv_cache"):
        SchedulerConfig(axes=("warm_weights", "kv_cache", "kv_cache"))
    assert SchedulerConfig(axes=("warm_weights",)).axes == ("warm_weights",)


def test_the_output_estimate_is_the_observed_mean_once_enough_calls_finished() -> None:
    axis = GpuGenerationAxis(SpeedConfig(output_min_observations=5, ewma_alpha=0.2))
    model = EIGHT_B.name
    assert axis.expected_output(model, "acme", 512) == 512  # nothing seen: max_tokens
    for tokens in (100, 40, 40, 40):
        axis.observe_output(model, "acme", tokens)
    assert axis.expected_output(model, "acme", 512) == 512  # four calls are not enough
    axis.observe_output(model, "acme", 40)
    # EWMA: 100 → 88 → 78.4 → 70.72 → 64.576, rounded up.
    assert axis.expected_output(model, "acme", 512) == 65
    assert axis.expected_output(model, "globex", 512) == 65  # the model's mean for a newcomer
    assert axis.expected_output(model, "acme", 50) == 50  # never above max_tokens
    assert axis.expected_output(SEVENTY_B.name, "acme", 512) == 512


# ----------------------------------------------------------------------------- latency budget


@given(
    remaining=st.one_of(st.none(), st.floats(0.0, 1e5)),
    steps=st.integers(1, 100),
    estimate=st.floats(0.0, 1e5),
)
def test_a_step_gets_its_share_of_the_deadline_and_a_chance_of_meeting_it(
    remaining: float | None, steps: int, estimate: float
) -> None:
    latency = LatencyBudget(LatencyConfig(step_share_multiplier=1.5, deadline_shape=4.0))
    budget = latency.step_budget_s(remaining, steps)
    if remaining is None:
        assert budget is None
        assert latency.p_on_time(estimate, budget) == 1.0
        assert latency.admits(estimate, budget)
        return
    assert budget is not None
    assert budget == pytest.approx(min(remaining, 1.5 * remaining / steps))
    if steps == 1:
        assert budget == remaining
    p = latency.p_on_time(estimate, budget)
    assert 0.0 <= p <= 1.0
    assert latency.admits(estimate, budget) == (estimate <= budget)
    assert latency.p_on_time(estimate * 2 + 1, budget) <= p
    if budget > 0:
        assert latency.p_on_time(budget, budget) == pytest.approx(0.5)
    start = latency.schedule_to_start_s(1.0, estimate, budget)
    assert 1.0 <= start <= 300.0


# ----------------------------------------------------------------------------- workflow context


@given(
    cost=st.floats(0.0, 1e6),
    p=st.floats(0.01, 1.0),
    spent=st.floats(0.0, 1e7),
    more=st.floats(0.0, 1e7),
)
def test_more_sunk_cost_makes_an_unreliable_replica_costlier(
    cost: float, p: float, spent: float, more: float
) -> None:
    context = WorkflowContext(WeightsConfig(sunk_cost=0.5, sticky=0.1))
    j = context.objective(cost, p, spent)
    assert j == pytest.approx((cost + 0.5 * spent * (1 - p)) / p)
    assert context.objective(cost, p, spent + more) >= j - 1e-6 * max(1.0, j)
    assert context.objective(cost, 1.0, spent) == pytest.approx(cost)
    assert context.objective(cost, 0.0, spent) == math.inf
    assert context.sticky_factor(True) == pytest.approx(0.9)
    assert context.sticky_factor(False) == 1.0


@given(prompt=st.integers(0, 100_000), output=st.integers(0, 10_000), share=fractions)
def test_float_ranking_prices_agree_with_exact_micro_dollars(
    prompt: int, output: int, share: float
) -> None:
    cached = int(prompt * share)
    ranked = PoolPrices.of(PRICES).cost(prompt, cached, output)
    assert abs(ranked - PRICES.cost_micros(prompt, cached, output)) <= 0.5 + 1e-6 * ranked


prices_usd = st.decimals(min_value=0, max_value=1000, places=6, allow_nan=False).map(
    lambda d: d.normalize()
)


@given(
    inp=prices_usd,
    cached_in=prices_usd,
    out=prices_usd,
    prompt=st.integers(0, 1_000_000),
    output=st.integers(0, 100_000),
    share=fractions,
)
def test_exact_integer_prices_match_the_decimal_price_of_a_call(
    inp: Decimal,
    cached_in: Decimal,
    out: Decimal,
    prompt: int,
    output: int,
    share: float,
) -> None:
    prices = TokenPrices(
        input_per_mtok_usd=inp, cached_input_per_mtok_usd=cached_in, output_per_mtok_usd=out
    )
    cached = int(prompt * share)
    # The definition, in Decimal: what the integer arithmetic must reproduce to the µ$.
    total = (prompt - cached) * inp + cached * cached_in + output * out
    expected = int(total.quantize(Decimal(1), rounding=ROUND_HALF_UP))
    assert prices.cost_micros(prompt, cached, output) == expected
    assert PoolPrices.of(prices).exact.cost_micros(prompt, cached, output) == expected


@given(micros=st.integers(-(10**12), 10**12), places=st.integers(0, 6))
def test_dollar_amounts_round_half_up_like_decimal(micros: int, places: int) -> None:
    expected = (Decimal(micros) / 1_000_000).quantize(
        Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP
    )
    assert format_usd(micros, places) == str(expected)


def test_dollar_amounts_beyond_micro_dollars_pad_with_zeros() -> None:
    assert format_usd(4213, 8) == "0.00421300"
    assert format_usd(2_500_000, 0) == "3"
    assert format_usd(-15, 4) == "-0.0000"
    with pytest.raises(ValueError, match="places"):
        format_usd(1, -1)


# ----------------------------------------------------------------------------- rendezvous


def test_rendezvous_weights_are_stable_across_processes() -> None:
    # Fixed values: a change here would make old and new workers disagree on placements.
    assert replica_seed("h200/0") == 0x4936DE71405D38
    assert rendezvous_weights(0, [0, 1]) == [0, 0x5692161D100B05E5]
    assert rendezvous_weights(1, [0]) == [0x5692161D100B05E5]
    assert rendezvous_key([5, 6, 7, 8, 9], "wf", 4) == 8
    assert rendezvous_key([5, 6], "wf", 4) == 6
    assert rendezvous_key([], "wf", 4) == 0x9DD2CDBB9A02B059


@given(
    key=st.integers(0, 2**64 - 1),
    names=st.lists(
        st.from_regex(r"[a-z]{2,5}/[0-9]{1,3}", fullmatch=True),
        min_size=2,
        max_size=30,
        unique=True,
    ),
)
def test_removing_a_replica_moves_only_the_keys_it_owned(key: int, names: list[str]) -> None:
    seeds = [replica_seed(n) for n in names]
    owner = names[rendezvous_order(key, seeds)[0]]
    gone = names[-1]
    rest = [n for n in names if n != gone]
    new_owner = rest[rendezvous_order(key, [replica_seed(n) for n in rest])[0]]
    if owner != gone:
        assert new_owner == owner


@given(load=st.integers(0, 10_000), replicas=st.integers(1, 1024), factor=st.floats(1.0, 3.0))
def test_bounded_capacity_leaves_room_above_the_mean(
    load: int, replicas: int, factor: float
) -> None:
    capacity = bounded_capacity(load, replicas, factor)
    assert capacity >= 1
    assert capacity * replicas >= factor * (load + 1) - 1e-6

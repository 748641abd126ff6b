"""`kvflow bench policies`: every policy runs, the figures are computed right, the CLI behaves.

The goals' thresholds are the benchmark's to report; nothing here asserts them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from kvflow.scheduler.blocks import ROOT_HASH, hash_block
from kvflow.scheduler.config import DEFAULT_AXES, REQUIRED_AXIS
from kvflow.simulator.policies import ALL_POLICIES, POLICIES, PolicySetup
from kvflow.simulator.policy_bench import (
    Outcome,
    TaskRunner,
    bench_fleet,
    cost_per_success,
    figures,
    percentile,
    run_policy,
    run_workload,
    simulated_replicas,
    zero_miss_floor,
)
from kvflow.simulator.workloads import WORKLOADS, Call, Step, Task, Workload

KVFLOW = str(Path(sys.executable).with_name("kvflow"))


@pytest.mark.parametrize("name", list(ALL_POLICIES))
def test_every_policy_runs_every_task_of_a_tiny_agent_workload_to_an_end(name: str) -> None:
    spec = WORKLOADS["agent"]
    outcome = run_policy(
        name, spec=spec, fleet=bench_fleet("agent", 4), task_rate=2.0, tasks=12, seed=3
    )
    assert outcome.tasks == 12
    assert outcome.successes > 0
    assert sum(outcome.tasks_by_tier.values()) == 12
    assert outcome.spend_micros > 0
    assert 0 < outcome.cached_tokens < outcome.prompt_tokens


def test_warm_up_tasks_load_the_fleet_but_count_in_no_figure() -> None:
    spec = WORKLOADS["agent"]
    fleet = bench_fleet("agent", 4)
    whole = run_policy("round-robin", spec=spec, fleet=fleet, task_rate=2.0, tasks=12, seed=3)
    steady = run_policy(
        "round-robin", spec=spec, fleet=fleet, task_rate=2.0, tasks=12, seed=3, warmup_tasks=4
    )
    assert steady.tasks == sum(steady.tasks_by_tier.values()) == 8
    assert sum(steady.attempts_by_replica) < sum(whole.attempts_by_replica)
    assert 0 < steady.spend_micros < whole.spend_micros
    # Utilisation is measured from the first counted arrival to the last arrival.
    assert 0 < steady.span_s < whole.span_s
    assert 0 < steady.busy_s < whole.busy_s


@pytest.mark.parametrize("workload", ["hotspot", "heterogeneous", "faults"])
def test_kvflow_runs_the_other_workloads(workload: str) -> None:
    outcome = run_policy(
        "kvflow",
        spec=WORKLOADS[workload],
        fleet=bench_fleet(workload, 4),
        task_rate=2.0,
        tasks=12,
        seed=1,
    )
    assert outcome.tasks == 12
    if workload == "faults":
        # Replica 0 crashed a third of the way in: it took no attempt after it was found down.
        assert outcome.replicas == 4


def test_a_workload_is_the_same_whatever_the_arrival_rate() -> None:
    tenants = [("acme", 1), ("globex", 3), ("initech", 5)]
    slow = Workload(WORKLOADS["agent"], tenants, tasks=5, task_rate=0.5, seed=9)
    fast = Workload(WORKLOADS["agent"], tenants, tasks=5, task_rate=50.0, seed=9)
    for a, b in zip(slow, fast, strict=True):
        assert (a.tenant, [len(s.calls) for s in a.steps]) == (
            b.tenant,
            [len(s.calls) for s in b.steps],
        )
        assert a.steps[-1].calls[0].block_hashes == b.steps[-1].calls[0].block_hashes
        assert a.arrival > b.arrival


def test_tokens_of_turns_every_block_of_a_task_back_into_its_token_ids() -> None:
    workload = Workload(WORKLOADS["agent"], [("acme", 1)], tasks=3, task_rate=1.0, seed=2)
    for task in workload:
        for step in task.steps:
            for call in step.calls:
                parent = ROOT_HASH
                for h in call.block_hashes:
                    assert hash_block(parent, workload.tokens_of(parent, h)) == h
                    parent = h


def _chain(blocks: int, first_token: int = 0) -> list[int]:
    hashes, parent = [], ROOT_HASH
    for b in range(blocks):
        start = first_token + b * 16
        parent = hash_block(parent, range(start, start + 16))
        hashes.append(parent)
    return hashes


def test_cost_and_hit_rate_of_a_two_step_task_match_the_hand_computed_figures() -> None:
    # One H100 replica at 0.18 / 0.018 / 0.54 $ per million input / cached / output tokens,
    # i.e. micro-dollars per token. Step 1: 64 prompt tokens, 32 out. Step 2 repeats them and
    # adds 32 tokens: 128 prompt tokens, 32 out.
    fleet = bench_fleet("agent", 1)
    chain = _chain(10)
    task = Task(
        index=0,
        tenant="acme",
        tier=1,
        arrival=0.0,
        deadline_at=100.0,
        steps=[
            Step([Call(64, 32, chain[:6])], pause_after_s=1.0),
            Step([Call(128, 32, chain[:10])], pause_after_s=0.0),
        ],
    )
    policy = POLICIES["round-robin"](
        PolicySetup(
            fleet=fleet,
            replica_names=["h100/0"],
            block_size=16,
            clock=lambda: 0.0,
            tokens_of=lambda parent, h: range(16),
        )
    )
    runner = TaskRunner(fleet, simulated_replicas(fleet), policy, max_tokens=512)
    outcome = runner.run(iter([task]), lambda sim: None)

    # Step 1: nothing cached. 64·0.18 + 32·0.54 = 28.8 µ$, rounded half up: 29.
    # Step 2: step 1 computed its prompt and all but its last output token (95 tokens), so
    # 5 full blocks = 80 tokens are cached: 48·0.18 + 80·0.018 + 32·0.54 = 27.36 → 27.
    assert outcome.successes == 1
    assert outcome.spend_micros == 29 + 27
    assert outcome.cached_tokens == 80
    assert outcome.prompt_tokens == 64 + 128
    fig = figures(outcome, oracle_hit_rate=0.5)
    assert fig.cost_per_successful_task_usd == Decimal("0.000056")
    assert fig.prefix_hit_rate == pytest.approx(80 / 192)
    assert fig.wasted_spend_share == 0.0
    assert fig.slo_attainment == {"1": 1.0}


def test_zero_miss_floor_of_a_task_and_a_fan_out_matches_the_hand_computed_figures() -> None:
    # The two-step task of the test above, then a second task whose one step fans out into
    # two calls sharing 4 blocks (64 tokens) of its own and adding 16 tokens each.
    fleet = bench_fleet("agent", 1)
    chain = _chain(10)
    other = _chain(4, first_token=1000)
    first = Task(
        0,
        "acme",
        1,
        0.0,
        100.0,
        [Step([Call(64, 32, chain[:6])], 1.0), Step([Call(128, 32, chain[:10])], 0.0)],
    )
    fan_out = Task(
        1,
        "acme",
        1,
        1.0,
        100.0,
        [Step([Call(80, 16, [*other[:4], 11, 12]), Call(80, 16, [*other[:4], 21, 22])], 0.0)],
    )
    floor = zero_miss_floor([first, fan_out], fleet, block_size=16, warmup_tasks=0)
    # Task 0: 29 µ$ (nothing cached), then the 6 blocks step 1 sent are cached (96 tokens,
    # one block more than the engine could reuse: a floor is optimistic):
    # 32·0.18 + 96·0.018 + 32·0.54 = 24.768 → 25 µ$.
    # Task 1: the first call pays for all 80 tokens: 80·0.18 + 16·0.54 = 23.04 → 23 µ$; its
    # sibling finds the 4 shared blocks: 16·0.18 + 64·0.018 + 16·0.54 = 12.672 → 13 µ$.
    assert floor.cost_per_task_usd == Decimal(29 + 25 + 23 + 13) / 2 / 1_000_000
    assert floor.prefix_hit_rate == pytest.approx((96 + 64) / (64 + 128 + 80 + 80))
    # Warm-up tasks leave blocks behind for the counted ones but are not billed.
    counted = zero_miss_floor([first, fan_out], fleet, block_size=16, warmup_tasks=1)
    assert counted.cost_per_task_usd == Decimal(23 + 13) / 1_000_000


def test_no_policy_costs_less_than_the_zero_miss_floor() -> None:
    result = run_workload("agent", replicas=2, tasks=24, load=0.8)
    assert result.floor is not None and result.floor.cost_per_task_usd is not None
    for fig in [*result.policies.values(), result.oracle]:
        assert fig.cost_per_successful_task_usd is not None, fig.policy
        assert fig.cost_per_successful_task_usd >= result.floor.cost_per_task_usd, fig.policy
        assert fig.prefix_hit_rate <= result.floor.prefix_hit_rate, fig.policy


def test_ablation_runs_kvflow_once_without_each_axis_but_the_required_one() -> None:
    result = run_workload("agent", replicas=2, tasks=8, policies=["kvflow"], ablate=True)
    assert list(result.ablations) == [a for a in DEFAULT_AXES if a != REQUIRED_AXIS]
    for axis, fig in result.ablations.items():
        assert fig.tasks == 6, axis  # 8 tasks, the first 2 warm-up
        assert fig.success_rate > 0, axis


def test_a_run_measures_its_tasks_lifetimes_and_how_long_its_warm_up_filled_the_fleet() -> None:
    spec = WORKLOADS["agent"]
    fleet = bench_fleet("agent", 2)
    outcome = run_policy(
        "round-robin", spec=spec, fleet=fleet, task_rate=0.5, tasks=12, seed=0, warmup_tasks=4
    )
    tasks = list(
        Workload(spec, [(t.name, t.tier) for t in fleet.tenants], tasks=12, task_rate=0.5, seed=0)
    )
    assert outcome.warmup_s == pytest.approx(tasks[4].arrival - tasks[0].arrival)
    # A task that succeeds lives at least its tool pauses; none outlives its deadline by
    # more than the cancellation of its last call.
    counted = tasks[4:]
    pauses = sum(sum(s.pause_after_s for s in t.steps) for t in counted) / len(counted)
    deadlines = sum(t.deadline_at - t.arrival for t in counted) / len(counted)
    assert pauses < outcome.mean_task_s <= deadlines + 1.0


def test_figures_of_a_hand_made_outcome() -> None:
    outcome = Outcome(
        policy="p",
        replicas=2,
        tasks=4,
        successes=3,
        tasks_by_tier={1: 2, 5: 2},
        successes_by_tier={1: 1, 5: 2},
        spend_micros=1_000,
        wasted_micros=250,
        ttfts=[0.1, 0.2, 0.3, 0.4, 1.0],
        prompt_tokens=1_000,
        cached_tokens=600,
        span_s=10.0,
        busy_s=5.0,
        attempts_by_replica=[3, 1],
        failed_attempts=1,
        refusals=0,
        warmup_s=30.0,
        mean_task_s=120.0,
    )
    fig = figures(outcome, oracle_hit_rate=0.8)
    # 1,000 µ$ over 3 successful tasks = $0.000333333 (to the nano-dollar).
    assert fig.cost_per_successful_task_usd == Decimal("0.000333333")
    assert fig.success_rate == 0.75
    assert fig.slo_attainment == {"1": 0.5, "5": 1.0}
    assert fig.goodput_tasks_per_s == pytest.approx(0.3)
    assert (fig.ttft_p50_s, fig.ttft_p90_s, fig.ttft_p99_s) == (0.3, 1.0, 1.0)
    assert fig.prefix_hit_rate == pytest.approx(0.6)
    assert fig.oracle_prefix_hit_rate == 0.8
    assert fig.wasted_spend_share == 0.25
    assert fig.utilisation == pytest.approx(5.0 / 20.0)
    assert fig.max_replica_load_share == 0.75
    assert fig.max_replica_load_over_mean == 1.5
    # 30 s of warm-up arrivals for tasks that live 120 s: a quarter of a lifetime.
    assert fig.warmup_lifetimes == 0.25
    assert cost_per_success(1_000, 0) is None
    assert percentile([], 0.5) == 0.0


def _kvflow(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [KVFLOW, "bench", "policies", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={"COLUMNS": "200", "PATH": str(Path(sys.executable).parent)},
    )


def test_bench_policies_prints_the_table_and_writes_the_json_schema(tmp_path: Path) -> None:
    out = tmp_path / "policies.json"
    done = _kvflow(
        "--workload", "agent", "--replicas", "2", "--tasks", "6", "--no-sweep", "--json", str(out)
    )
    assert done.returncode == 0, done.stderr
    assert "goal:" in done.stdout
    data = json.loads(out.read_text())
    assert set(data["policies"]) == set(POLICIES)
    for fig in data["policies"].values():
        assert {
            "cost_per_successful_task_usd",
            "success_rate",
            "slo_attainment",
            "ttft_p50_s",
            "ttft_p99_s",
            "prefix_hit_rate",
            "oracle_prefix_hit_rate",
            "wasted_spend_share",
            "goodput_tasks_per_s",
            "max_replica_load_share",
        } <= set(fig)
        if fig["cost_per_successful_task_usd"] is not None:
            Decimal(fig["cost_per_successful_task_usd"])  # exact, never a float
    assert data["workload"] == {
        "name": "agent",
        "replicas": 2,
        "tasks": 6,
        "offered_load": 0.8,
        "seed": 0,
        "task_rate_per_s": data["workload"]["task_rate_per_s"],
        "warmup_tasks": 1,
        "oracle_utilisation": data["workload"]["oracle_utilisation"],
        "zero_miss_floor": {
            "cost_per_successful_task_usd": data["workload"]["zero_miss_floor"][
                "cost_per_successful_task_usd"
            ],
            "prefix_hit_rate": data["workload"]["zero_miss_floor"]["prefix_hit_rate"],
        },
    }
    Decimal(data["workload"]["zero_miss_floor"]["cost_per_successful_task_usd"])
    assert "zero-miss floor" in done.stdout
    assert data["ablations"] == {}


def test_plot_without_matplotlib_names_the_extra_to_install(tmp_path: Path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("matplotlib is installed: the message is for environments without it")
    done = _kvflow(
        "--workload", "agent", "--replicas", "2", "--tasks", "4", "--no-sweep",
        "--plot", str(tmp_path / "p.png"),
    )  # fmt: skip
    assert done.returncode == 2
    assert "pip install 'kvflow[bench]'" in done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workload", "nope"], "unknown workload 'nope'"),
        (["--load", "0"], "--load"),
        (["--load", "-0.5"], "--load"),
    ],
)
def test_bench_policies_refuses_bad_input_with_exit_code_2(args: list[str], message: str) -> None:
    done = _kvflow(*args)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr

"""kvflow's vLLM scheduler, step by step inside vLLM: a call at risk of its deadline pauses tier 3.

`tests/vllm_deadline_pause_steps.py` runs in vLLM's own interpreter (`make vllm-env`) with only
the `kvflow_vllm` package on its path, as a server would load it. There vLLM's real scheduler
(its KV cache manager, queues and output processing) runs under `DeadlinePauseScheduler`; the
model runner and the clock are scripted (a token per request a step; a step takes 4 ms plus 4 ms
a request it runs), so every scene gives the same steps on any machine, however busy. Each test
reads one scene's steps: which requests each step ran, when each request finished, whether any
was preempted or lost its KV blocks, and the scheduler's log.

The end-to-end form, a real server judged on its own pace, is `tests/test_vllm_deadline_pause_server.py`
(`make paced`). The asynchronous scheduler's composition is checked here too: no server on this
machine can run it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvflow.scheduler.placement import TIER_PRIORITY_SPAN
from tests.fixtures_vllm import in_vllm, vllm_scenes

pytestmark = pytest.mark.timeout(300)

STEPS_SCRIPT = Path(__file__).with_name("vllm_deadline_pause_steps.py")
LOW = {f"low-{i}" for i in range(4)}
"""The tier-3 calls every scene starts with (the script's `LOW_CALLS`)."""
PAUSE_LINE = f"pausing priority bands above 1 (span {TIER_PRIORITY_SPAN})"

Scene = dict[str, Any]


@pytest.fixture(scope="module")
def scenes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Scene]:
    """Every scene of the script, by name (one interpreter: vLLM takes seconds to import)."""
    return vllm_scenes(tmp_path_factory.mktemp("steps"), STEPS_SCRIPT)


def ran_alone(scene: Scene, request_id: str) -> int:
    """Steps that ran `request_id` and none of the tier-3 calls it arrived amid."""
    return sum(1 for step in scene["steps"] if step["ran"] == [request_id])


def duration(scene: Scene, request_id: str = "urgent") -> float:
    """From the tier-1 call's arrival to its last token (scripted seconds)."""
    return float(scene["finished_at"][request_id] - scene["arrived"])


def full_step_s(scene: Scene, requests: int) -> float:
    """How long the script's engine takes for a step of `requests`."""
    return float(scene["step_s"]["base"] + scene["step_s"]["per_request"] * requests)


def info_lines(scene: Scene) -> list[str]:
    return [line for line in scene["log"] if line.startswith("INFO ")]


def test_without_a_deadline_the_call_decodes_in_the_batch_and_would_miss_it(
    scenes: dict[str, Scene],
) -> None:
    unhurried, hurried = scenes["unhurried"], scenes["hurried"]
    # vLLM's own order: every running call gets a token on every step, the tier-1 call too...
    during = [s for s in unhurried["steps"] if unhurried["arrived"] <= s["at"]]
    assert all(set(s["ran"]) >= LOW for s in during), during[:5]
    assert ran_alone(unhurried, "urgent") == 0
    # ...so its 100 tokens take 100 steps of five: past the deadline the next scene sets.
    assert duration(unhurried) >= unhurried["tokens"] * full_step_s(unhurried, 5)
    assert duration(unhurried) > hurried["deadline_in_s"]
    assert info_lines(unhurried) == []


def test_a_call_at_risk_of_its_deadline_pauses_the_lower_tier_and_meets_it(
    scenes: dict[str, Scene],
) -> None:
    hurried, unhurried = scenes["hurried"], scenes["unhurried"]
    # Most of its steps leave the tier-3 calls out (the rest: the pace looks on time again
    # while they are out, and they run until it does not)...
    assert ran_alone(hurried, "urgent") >= 0.5 * hurried["tokens"]
    # ...and it finishes by its deadline, within the one step the pace lags by, where without
    # the deadline it took twice as long.
    assert duration(hurried) <= hurried["deadline_in_s"] + full_step_s(hurried, 5)
    assert duration(hurried) < 0.6 * duration(unhurried)
    # The paused calls were left out, not preempted: they kept their KV blocks and their place,
    # and every step after the tier-1 call's end runs all of them again.
    assert hurried["preempted"] == []
    assert all(hurried["blocks_kept"][r] for r in LOW), hurried["blocks_kept"]
    after = [s for s in hurried["steps"] if s["at"] >= hurried["finished_at"]["urgent"]]
    assert after and all(set(s["ran"]) == LOW for s in after), after[:5]
    # An operator reads why in the server's log, once for the call (the rest at debug).
    [line] = info_lines(hurried)
    assert "request urgent" in line and "would miss its deadline" in line, line
    assert line.endswith(PAUSE_LINE), line


def test_during_the_pause_the_same_band_runs_and_lower_bands_wait(
    scenes: dict[str, Scene],
) -> None:
    scene = scenes["arrivals"]
    paused = [s for s in scene["steps"] if "urgent" in s["ran"] and not LOW & set(s["ran"])]
    assert paused, "no step paused tier 3"
    # A tier-3 call arriving during the pause is not admitted while it lasts...
    assert not any("late-low" in s["ran"] for s in paused), paused
    # ...while a tier-1 call without a deadline of its own runs beside the urgent one.
    assert any("late-peer" in s["ran"] for s in paused), paused
    assert duration(scene) <= scene["deadline_in_s"] + full_step_s(scene, 6)
    assert scene["finished_at"]["late-low"] > scene["finished_at"]["urgent"]
    assert scene["preempted"] == []


def test_a_deadline_already_passed_pauses_no_one(scenes: dict[str, Scene]) -> None:
    scene = scenes["passed"]
    # Late either way: holding the others for it would only make them late too.
    assert ran_alone(scene, "urgent") == 0
    assert all(set(s["ran"]) >= LOW for s in scene["steps"]), scene["steps"][:5]
    assert scene["log"] == []


def test_an_unreadable_deadline_is_ignored_with_a_warning(scenes: dict[str, Scene]) -> None:
    scene = scenes["unreadable"]
    assert ran_alone(scene, "urgent") == 0
    [line] = scene["log"]
    assert line.startswith("WARNING request urgent: ignoring kvflow_deadline='tomorrow'"), line
    assert "needs a finite number of POSIX seconds" in line, line


def test_the_scheduler_refuses_a_server_without_the_priority_policy(
    scenes: dict[str, Scene],
) -> None:
    # Under fcfs vLLM ignores priorities: there would be no bands to pause.
    assert scenes["fcfs"]["error"] == (
        "DeadlinePauseScheduler needs --scheduling-policy priority (this server schedules by fcfs)"
    )


COMPOSITION_CHECK = """
import json
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from kvflow_vllm.scheduler import DeadlinePauseAsyncScheduler, DeadlinePauseScheduler

own = {n for n, v in vars(AsyncScheduler).items() if callable(v)}
print(json.dumps({
    "is_async": issubclass(DeadlinePauseAsyncScheduler, AsyncScheduler),
    "shadowed": sorted(own & set(vars(DeadlinePauseScheduler))),
    "schedule": DeadlinePauseAsyncScheduler.schedule.__qualname__,
    "async_methods": sorted(own),
}))
"""


def test_the_asynchronous_form_is_vllms_asynchronous_scheduler_with_the_pause(
    tmp_path: Path,
) -> None:
    """`DeadlinePauseAsyncScheduler`, as the real vLLM composes it.

    GPUs schedule asynchronously by default, and the CPU build turns that off, so no server
    here can run it. What can be checked is the composition a GPU server would load: the
    pause's `schedule()` over vLLM's asynchronous scheduler, none of whose own methods the
    pause replaces (its `__init__` calls on to it). A vLLM whose `AsyncScheduler` came to
    define `schedule()` itself would be shadowed by the pause, and this would say so.
    """
    out = in_vllm(tmp_path, "-c", COMPOSITION_CHECK)
    composed = json.loads(out.strip().splitlines()[-1])
    assert composed["is_async"], composed
    assert composed["schedule"] == "DeadlinePauseScheduler.schedule", composed
    assert composed["shadowed"] == ["__init__"], composed
    assert "_update_after_schedule" in composed["async_methods"], composed

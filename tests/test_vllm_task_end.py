"""kvflow's vLLM scheduler inside vLLM: an ended task's own KV blocks are reused first.

`tests/vllm_task_end_steps.py` runs in vLLM's own interpreter (`make vllm-env`) with only the
`kvflow_vllm` package on its path, as a server would load it: vLLM's real block pool, prefix
cache and LRU free queue under `TaskEndScheduler`, the model runner scripted. Two tasks share
a system prompt; A's call finishes before B's, so LRU would evict A's conversation first. B's
task ends, an unrelated call needs room, and A comes back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.fixtures_vllm import vllm_scenes

pytestmark = pytest.mark.timeout(300)

STEPS_SCRIPT = Path(__file__).with_name("vllm_task_end_steps.py")
BLOCK_SIZE = 16
PROMPT_A = 4 * BLOCK_SIZE
"""A's whole conversation: the shared system prompt's block and three of its own."""

Scene = dict[str, Any]


@pytest.fixture(scope="module")
def scenes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Scene]:
    """Every scene of the script, by name (one interpreter: vLLM takes seconds to import)."""
    return vllm_scenes(tmp_path_factory.mktemp("task-end"), STEPS_SCRIPT)


def test_under_lru_the_older_open_conversation_is_evicted(scenes: dict[str, Scene]) -> None:
    """Without a release, vLLM evicts A's blocks (older) and keeps B's, whose task is over."""
    lru = scenes["lru"]
    assert lru["b_found_system"] == BLOCK_SIZE, "B should find the shared system prompt"
    assert lru["a_found"] < PROMPT_A
    assert set(lru["filler_given"]) & set(lru["a_first"][1:])
    assert lru["released_blocks"] == 0


def test_an_ended_tasks_own_blocks_go_first(scenes: dict[str, Scene]) -> None:
    """After B's release the unrelated call takes B's own blocks; A finds its whole prompt."""
    release = scenes["release"]
    b_own = set(release["b_first"][1:])
    assert release["released_blocks"] == len(b_own) == 3
    assert b_own <= set(release["filler_given"])
    assert release["a_found"] == PROMPT_A


def test_a_shared_block_stays_for_the_tasks_still_open(scenes: dict[str, Scene]) -> None:
    """The system prompt's block, which A used too, is neither moved nor given away."""
    release = scenes["release"]
    system_block = release["b_first"][0]
    assert system_block == release["a_first"][0]
    assert system_block not in release["filler_given"]


def test_a_release_for_untagged_calls_changes_nothing(scenes: dict[str, Scene]) -> None:
    """Calls sent without `kvflow_task` leave nothing to release: vLLM's LRU as before."""
    untagged, lru = scenes["untagged"], scenes["lru"]
    assert untagged["released_blocks"] == 0
    assert untagged["filler_given"] == lru["filler_given"]
    assert untagged["a_found"] == lru["a_found"]


def test_a_system_prompt_released_by_its_first_user_stays_for_those_after(
    scenes: dict[str, Scene],
) -> None:
    """A's end releases the prompt with A's own blocks (no one else had used it); B computes it
    again, and B's end releases only B's own: C, the third task, finds the prompt cached."""
    second = scenes["second_user"]
    assert second["released"] == [4, 3, 3]
    assert second["found"] == [0, 0, BLOCK_SIZE]
    # Ended tasks' hashes are remembered up to twice the engine's blocks (11), no more.
    assert second["given_out"] == 2 * 11

"""The simulated vLLM server honours kvflow's task-end release as vLLM with kvflow's scheduler.

The same scene as on real vLLM (`tests/task_end_scene.py`), on a simulated engine with 12 KV
blocks of 16 tokens: without the release, LRU evicts the open task's conversation; with it,
the ended task's own blocks go first and the open task finds its whole prompt cached.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from kvflow.simulator import BUILTIN_MODELS, SimServer
from tests.fixtures_sim import SIM_BLOCK_SIZE, served
from tests.task_end_scene import BLOCKS, OWN_BLOCKS, returning_task_finds

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("release", [False, True], ids=["lru", "released"])
async def test_the_open_task_keeps_its_kv_when_the_ended_one_is_released(
    release: bool, sim_server_factory: Callable[..., SimServer]
) -> None:
    # The simulator, like vLLM, refuses a context longer than its cache holds.
    engine = {"num_gpu_blocks": BLOCKS, "max_model_len": (BLOCKS - 1) * SIM_BLOCK_SIZE}
    server = served(sim_server_factory(engine=engine))
    found = await returning_task_finds(server, release=release)
    assert found == ((1 + OWN_BLOCKS) * server.block_size if release else server.block_size)


async def test_a_release_naming_another_model_frees_the_tasks_blocks(
    sim_server_factory: Callable[..., SimServer],
) -> None:
    """On a replica warm for two models, the release (which names the pool's first model)
    still frees the blocks of a task that ran on the second."""
    engine = {"num_gpu_blocks": BLOCKS, "max_model_len": (BLOCKS - 1) * SIM_BLOCK_SIZE}
    models = [BUILTIN_MODELS["llama-3.2-1b"], BUILTIN_MODELS["llama-3.2-3b"]]
    server = sim_server_factory(engine=engine, models=models)
    second = dataclasses.replace(served(server), model="llama-3.2-3b")
    found = await returning_task_finds(second, release=True, release_model="llama-3.2-1b")
    assert found == (1 + OWN_BLOCKS) * SIM_BLOCK_SIZE

"""A real vLLM server under `TaskEndScheduler`: kvflow's release keeps the open task's KV.

vLLM's CPU build serves the tests' tiny model with 12 KV blocks of 128 tokens and kvflow's
engine scheduler (`VllmServer(task_end=True)`); the scene is `tests/task_end_scene.py`'s.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.fixtures_vllm import (
    VllmServedModel,
    early_vllm,
    served_model,
    tiny_server,
    vllm_servers,
)
from tests.task_end_scene import BLOCKS, OWN_BLOCKS, returning_task_finds

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

SERVERS = early_vllm(
    __name__,
    "vllm-task-end",
    lambda install, log_dir: {
        "server": tiny_server(
            install,
            log_dir,
            task_end=True,
            extra_args=["--num-gpu-blocks-override", str(BLOCKS)],
            extra_env={"VLLM_SERVER_DEV_MODE": "1"},  # for /reset_prefix_cache between scenes
        )
    },
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServedModel]:
    """A real vLLM server scheduling with `TaskEndScheduler`, 12 blocks of KV cache."""
    with vllm_servers(tmp_path_factory, SERVERS) as started:
        yield served_model(started["server"])


async def reset(server: VllmServedModel) -> None:
    """Empty the engine's prefix cache: otherwise the older scene's blocks go first."""
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(f"{server.base_url}/reset_prefix_cache")
        assert response.status_code == 200, response.text


async def test_the_open_task_keeps_its_kv_when_the_ended_one_is_released(
    server: VllmServedModel,
) -> None:
    whole = (1 + OWN_BLOCKS) * server.block_size
    # vLLM's LRU alone: A's own blocks were the oldest, and the unrelated call took them.
    await reset(server)
    assert await returning_task_finds(server, release=False) == server.block_size
    # B released: its own three blocks went first; A finds its whole conversation.
    await reset(server)
    assert await returning_task_finds(server, release=True) == whole

"""A real vLLM server under `TaskEndScheduler`: kvflow's release keeps the open task's KV.

vLLM's CPU build serves the tests' tiny model with 12 KV blocks of 128 tokens and kvflow's
engine scheduler (`VllmServer(task_end=True)`). Two tasks share a one-block system prompt and
have three blocks each of their own; A's call ends before B's, so vLLM's LRU would evict A's
conversation first. B's task ends, an unrelated call needs seven blocks (four are free, so
three cached blocks go) and A comes back with its whole conversation. The calls name their
task as kvflow's GPU worker does (`vllm_xargs.kvflow_task`, pinned by
tests/test_engine_hints.py), and the release is sent by kvflow's own `TaskEndRelease`. What A
found cached is the engine's own count (`usage.prompt_tokens_details.cached_tokens`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvflow.scheduler.task_end import ReleaseTarget, TaskEndRelease
from tests.fixtures_vllm import (
    BLOCK_SIZE,
    SERVED_MODEL_NAME,
    VllmServedModel,
    early_vllm,
    served_model,
    tiny_server,
    vllm_servers,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BLOCKS = 12
"""The engine's whole KV cache: one null block and eleven for requests."""
OWN_BLOCKS = 3
FILLER_BLOCKS = 7
"""The unrelated call: every free block (11 less the 7 cached) and three cached ones."""

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


def tokens(start: int, blocks: int) -> list[int]:
    """`blocks` blocks of distinct token ids from `start` (the tiny model has 2,048)."""
    return list(range(start, start + blocks * BLOCK_SIZE))


async def cached(
    http: httpx.AsyncClient, server: VllmServedModel, prompt: list[int], task: str | None
) -> int:
    """Send a one-token completion; the prompt tokens the engine found in its prefix cache."""
    body: dict[str, Any] = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 1}
    if task is not None:
        body["vllm_xargs"] = {"kvflow_task": task}
    response = await http.post(f"{server.base_url}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def returning_task_finds(server: VllmServedModel, *, release: bool, first: int) -> int:
    """Run the scene on fresh token ids from `first`; what A's second call found cached."""
    async with httpx.AsyncClient(timeout=120) as http:
        # Each scene starts from an empty cache: otherwise the older scene's blocks go first.
        reset = await http.post(f"{server.base_url}/reset_prefix_cache")
        assert reset.status_code == 200, reset.text
        system = tokens(first, 1)
        prompt_a = system + tokens(first + BLOCK_SIZE, OWN_BLOCKS)
        prompt_b = system + tokens(first + 4 * BLOCK_SIZE, OWN_BLOCKS)
        assert await cached(http, server, prompt_a, "task-a") == 0
        assert await cached(http, server, prompt_b, "task-b") == BLOCK_SIZE  # the system prompt
        if release:
            releases = TaskEndRelease(
                {"cpu/0": ReleaseTarget(server.base_url, SERVED_MODEL_NAME)}, client=http
            )
            assert releases.release("task-b", "cpu/0")
            await releases.drain()
            assert (releases.sent, releases.failed) == (1, 0)
        filler = tokens(first + 7 * BLOCK_SIZE, FILLER_BLOCKS)
        assert await cached(http, server, filler, None) == 0
        return await cached(http, server, [*prompt_a, 5, 6, 7], "task-a")


async def test_the_open_task_keeps_its_kv_when_the_ended_one_is_released(
    server: VllmServedModel,
) -> None:
    prompt_a = (1 + OWN_BLOCKS) * BLOCK_SIZE
    # vLLM's LRU alone: A's own blocks were the oldest, and the unrelated call took them.
    assert await returning_task_finds(server, release=False, first=0) == BLOCK_SIZE
    # B released: its own three blocks went first; A finds its whole conversation.
    assert await returning_task_finds(server, release=True, first=0) == prompt_a

"""The task-end scene, for real vLLM and for the simulator alike.

An engine with 12 KV blocks (one null block, eleven for requests). Two tasks share a one-block
system prompt and have three blocks each of their own; A's call ends before B's, so LRU would
evict A's conversation first. B's task ends (released by kvflow's own `TaskEndRelease`, or
not), an unrelated call needs seven blocks (four are free, so three cached blocks go) and A
comes back with its whole conversation. The calls name their task as kvflow's GPU worker does
(`vllm_xargs.kvflow_task`, pinned by tests/test_engine_hints.py). What A found cached is the
engine's own count (`usage.prompt_tokens_details.cached_tokens`).
"""

from __future__ import annotations

from typing import Any

import httpx

from kvflow.scheduler.task_end import ReleaseTarget, TaskEndRelease
from tests.servers import ServedModel

BLOCKS = 12
"""The engine's whole KV cache: one null block and eleven for requests."""
OWN_BLOCKS = 3
FILLER_BLOCKS = 7
"""The unrelated call: every free block (11 less the 7 cached) and three cached ones."""


def tokens(start: int, blocks: int, block_size: int) -> list[int]:
    """`blocks` blocks of distinct token ids from `start`."""
    return list(range(start, start + blocks * block_size))


async def cached(
    http: httpx.AsyncClient, server: ServedModel, prompt: list[int], task: str | None
) -> int:
    """Send a one-token completion; the prompt tokens the engine found in its prefix cache."""
    body: dict[str, Any] = {"model": server.model, "prompt": prompt, "max_tokens": 1}
    if task is not None:
        body["vllm_xargs"] = {"kvflow_task": task}
    response = await http.post(f"{server.base_url}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def returning_task_finds(
    server: ServedModel, *, release: bool, release_model: str | None = None
) -> int:
    """Run the scene on an engine whose cache holds nothing yet; what A's return found.

    The release names `release_model` (default: the served model), as the control plane
    names its pool's first model whichever model the task used.
    """
    size = server.block_size
    async with httpx.AsyncClient(timeout=120) as http:
        system = tokens(1, 1, size)
        prompt_a = system + tokens(1 + size, OWN_BLOCKS, size)
        prompt_b = system + tokens(1 + 4 * size, OWN_BLOCKS, size)
        assert await cached(http, server, prompt_a, "task-a") == 0
        assert await cached(http, server, prompt_b, "task-b") == size  # the system prompt
        if release:
            releases = TaskEndRelease(
                {"replica": ReleaseTarget(server.base_url, release_model or server.model)},
                client=http,
            )
            assert releases.release("task-b", "replica")
            await releases.drain()
            assert (releases.sent, releases.failed) == (1, 0)
        filler = tokens(1 + 7 * size, FILLER_BLOCKS, size)
        assert await cached(http, server, filler, None) == 0
        return await cached(http, server, [*prompt_a, 5, 6, 7], "task-a")

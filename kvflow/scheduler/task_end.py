"""Telling a vLLM engine that a task ended, so that it reuses the task's own KV blocks first.

vLLM evicts cached blocks least recently used first: a conversation whose task has ended, and
which will never be asked for again, outlives a paused conversation that is older. With
`Pool.task_end_release`, every call names its task (`vllm_xargs.kvflow_task`) and the engines
run kvflow's engine scheduler (`kvflow_vllm.scheduler.TaskEndScheduler`), which notes each
task's blocks. When the task ends, `TaskEndRelease` sends the engine that served its last call
a one-token completion carrying `vllm_xargs.kvflow_release`: vLLM has no request that evicts
chosen blocks, so the release rides on the smallest request there is, and the engine's
scheduler puts the task's own free blocks at the front of its free queue as the request
arrives.

A release is a hint. It is sent in the background, after the task has ended, once: a failure
is logged and changes nothing but the engine's eviction order. Only the last call's replica is
told; a task whose calls moved between replicas leaves its older copies to LRU there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import httpx

from kvflow.scheduler.engine_http import engine_limits

__all__ = ["RELEASE_XARG", "ReleaseTarget", "TaskEndRelease"]

log = logging.getLogger(__name__)

RELEASE_XARG = "kvflow_release"
"""`vllm_xargs` key of the release request (`kvflow_vllm.scheduler.RELEASE_KEY`)."""
RELEASE_TIMEOUT_S = 5.0
"""How long a release may take; a one-token request on a busy engine takes a step or two."""


@dataclass(frozen=True)
class ReleaseTarget:
    """Where one replica's engine takes releases: its base URL and a model it serves."""

    base_url: str
    model: str


class TaskEndRelease:
    """Sends release requests to the replicas in `targets` (replica name → target)."""

    def __init__(
        self,
        targets: Mapping[str, ReleaseTarget],
        *,
        client: httpx.AsyncClient | None = None,
        timeout_s: float = RELEASE_TIMEOUT_S,
    ) -> None:
        self.targets = dict(targets)
        self._client = client
        self._own_client = client is None
        self._timeout_s = timeout_s
        self._pending: set[asyncio.Task[None]] = set()
        self.sent = 0
        """Releases the engines answered with success."""
        self.failed = 0
        """Releases that failed (the engine down, slow or refusing)."""

    def release(self, workflow_id: str, replica: str) -> bool:
        """Start telling `replica`'s engine that the task ended; False if it takes no releases.

        Returns at once: the request runs in the background on the running event loop.
        """
        target = self.targets.get(replica)
        if target is None:
            return False
        task = asyncio.get_running_loop().create_task(self._send(workflow_id, replica, target))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return True

    async def _send(self, workflow_id: str, replica: str, target: ReleaseTarget) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout_s, limits=engine_limits())
        body = {
            "model": target.model,
            "prompt": [0],
            "max_tokens": 1,
            "vllm_xargs": {RELEASE_XARG: workflow_id},
        }
        try:
            response = await self._client.post(f"{target.base_url}/v1/completions", json=body)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            self.failed += 1
            # A lost release costs hit rate, never a task: the engine falls back on LRU.
            log.warning(
                "could not tell %s that task %s ended (%s: %s); its KV is left to LRU",
                replica,
                workflow_id,
                type(exc).__name__,
                exc,
            )
            return
        self.sent += 1

    async def drain(self) -> None:
        """Wait for the releases under way."""
        while self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

    async def aclose(self) -> None:
        """Finish the releases under way, log how many went, close the HTTP client it opened."""
        await self.drain()
        if self.targets:
            log.info("task-end releases: %d sent, %d failed", self.sent, self.failed)
        if self._own_client and self._client is not None:
            await self._client.aclose()
        self._client = None

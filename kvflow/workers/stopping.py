"""A Temporal worker whose stop ends: kvflow's workers never wait for ever to shut down.

`temporalio.worker.Worker.shutdown()` (and so the end of `async with worker`) waits with no
limit until the worker has run and stopped. Two ways it never returns:

- The worker never ran: a plugin's run context failed before it started (kvflow's checks the
  namespace's search attributes there). The failure ends `run()`, but nothing marks the
  worker stopped, and the exit of `async with` waits for that for ever.
- An activity does not end once cancelled (code that catches the cancellation and goes on,
  a completion that cannot be reported): the SDK waits for it for ever.

`BoundedWorker` stops waiting once `run()` has ended, whatever ended it, and gives the rest
`stop_timeout` (the graceful period, then `STOP_ALLOWANCE` for the cancelled activities to
clean up); past that it logs what was still running, cancels the run and moves on, and
`async with` raises `WorkerStopTimeout` naming it. Activities left behind are timed out by
Temporal (their heartbeat or start-to-close timeout) and run again elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from typing import Any

from temporalio.client import Client
from temporalio.worker import Worker

log = logging.getLogger(__name__)

STOP_ALLOWANCE = timedelta(seconds=60)
"""How long cancelled activities get to clean up after the graceful period, at most.

A cancelled model call writes its ledger row before it ends (retried with backoff for a few
seconds before it is spooled to disk), and each completion is one RPC that the client retries
for a few seconds when Temporal is slow; a minute covers both on a loaded machine, and is the
SDK's own default for plugins' cleanup after a stop (`plugin_shutdown_timeout`)."""


class WorkerStopTimeout(RuntimeError):
    """A worker's stop outlasted its `stop_timeout`; the message names what was still running."""


class BoundedWorker(Worker):
    """A `Worker` whose `shutdown()` returns within `stop_timeout` (module docstring).

    `stop_timeout` defaults to the worker's `graceful_shutdown_timeout` plus
    `STOP_ALLOWANCE`. Every other option is `Worker`'s.
    """

    def __init__(self, client: Client, *, stop_timeout: timedelta | None = None, **options: Any):
        super().__init__(client, **options)
        active = self.config(active_config=True)
        graceful: timedelta = active.get("graceful_shutdown_timeout") or timedelta()
        self.stop_timeout = stop_timeout if stop_timeout is not None else graceful + STOP_ALLOWANCE
        """How long `shutdown()` waits for the worker to stop."""
        self.left_running: list[str] | None = None
        """What was still running when the stop was abandoned (None: it was not)."""
        self._run_task: asyncio.Task[Any] | None = None
        self._run_ended = asyncio.Event()

    async def run(self) -> None:
        """`Worker.run`; returns (without raising) when `shutdown()` gave up waiting for it."""
        task = asyncio.current_task()
        self._run_task = task
        try:
            await super().run()
        except asyncio.CancelledError:
            if self.left_running is None or task is None:
                raise
            # The stop cancelled it after its bound (logged there); the run is over.
            task.uncancel()
        finally:
            self._run_ended.set()

    async def shutdown(self) -> None:
        """Stop polling and wait, at most `stop_timeout`, for the worker to stop (idempotent).

        Returns at once when the worker's run has ended already, or never began.
        """
        stop = asyncio.ensure_future(super().shutdown())
        started = self._run_task is not None or self._async_context_run_task is not None
        if not started:
            await asyncio.sleep(0)  # `Worker.shutdown` marks the worker stopping, then waits
            stop.cancel()
            return
        ended = asyncio.ensure_future(self._run_ended.wait())
        try:
            done, _ = await asyncio.wait(
                {stop, ended},
                timeout=self.stop_timeout.total_seconds(),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            stop.cancel()
            ended.cancel()
        if done:
            return
        self.left_running = self._still_running()
        log.error(
            "worker of %s did not stop within %.0f s; moving on without: %s",
            self.config()["task_queue"],
            self.stop_timeout.total_seconds(),
            ", ".join(self.left_running) or "the SDK's own tasks",
        )
        run = self._run_task or self._async_context_run_task
        if run is not None:
            run.cancel()

    async def __aexit__(self, exc_type: type[BaseException] | None, *args: Any) -> None:
        """`Worker.__aexit__`; raises `WorkerStopTimeout` if the stop was abandoned."""
        await super().__aexit__(exc_type, *args)
        if self.left_running is not None and exc_type is None:
            raise WorkerStopTimeout(
                f"the worker of {self.config()['task_queue']} did not stop within "
                f"{self.stop_timeout.total_seconds():.0f} s; still running: "
                + (", ".join(self.left_running) or "the SDK's own tasks")
            )

    def _still_running(self) -> list[str]:
        """The activities this worker still runs, e.g. `infer (workflow task-1, attempt 2)`."""
        # Read from the SDK's activity worker, where it keeps them (no public accessor).
        activities = getattr(getattr(self, "_activity_worker", None), "_running_activities", {})
        names: list[str] = []
        for running in list(activities.values()):
            info = getattr(running, "info", None)
            if info is None:
                names.append("an activity not yet started")
            else:
                names.append(
                    f"{info.activity_type} (workflow {info.workflow_id}, attempt {info.attempt})"
                )
        return names

"""The workflow worker: runs agent workflows next to the control plane they call.

`KvflowPlugin` does the registering; `workflow_worker` builds the worker for a control plane
that is already running (the embedded stack shares one among several workers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from temporalio.client import Client
from temporalio.worker import Worker

from kvflow.workers.control_plane import ControlPlane
from kvflow.workers.plugin import KvflowPlugin, role_worker

DEFAULT_WORKFLOW_QUEUE = "kvflow.workflows"
"""The task queue agent workflows run on unless told otherwise."""


async def workflow_worker(
    client: Client,
    control_plane: ControlPlane,
    *,
    workflows: Sequence[type],
    activities: Sequence[Any] = (),
    task_queue: str = DEFAULT_WORKFLOW_QUEUE,
    **worker_options: Any,
) -> Worker:
    """A Temporal worker (not yet started) for `workflows` on a running `control_plane`.

    When it runs, the plugin first makes sure kvflow's search attributes exist (registering
    missing ones), because a workflow that upserts an unknown attribute hangs instead of
    failing.
    """
    return role_worker(
        client,
        KvflowPlugin(control_plane=control_plane),
        task_queue=task_queue,
        workflows=list(workflows),
        activities=list(activities),
        **worker_options,
    )

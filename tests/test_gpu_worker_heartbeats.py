"""A GPU worker sends its calls' heartbeats often enough that a late send does not fail them.

Model calls run with a 2 s heartbeat timeout. Left to the SDK, a worker sends heartbeats every
0.8 x that (1.6 s), so a send 0.4 s late (a GC pause, a busy host) times the call out and its
attempt's spend is lost. kvflow's GPU worker sends them at least every second
(`GPU_HEARTBEAT_THROTTLE`), unless it was told otherwise.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from temporalio.client import Client

from kvflow.activities.inference import InferenceActivities, default_http_client
from kvflow.scheduler.fleet import task_queue_for
from kvflow.workers.gpu_worker import GpuWorker
from kvflow.workers.plugin import GPU_HEARTBEAT_THROTTLE, KvflowPlugin, role_worker
from kvflow.workflows.agent import HEARTBEAT_TIMEOUT
from tests.fleets import unshared_binding

pytestmark = pytest.mark.timeout(60)


async def test_a_gpu_worker_sends_heartbeats_with_a_second_of_slack(
    temporal_client: Client,
) -> None:
    worker = GpuWorker(temporal_client, unshared_binding(), spool_dir=None)
    throttle = worker.worker.config(active_config=True)["max_heartbeat_throttle_interval"]
    assert throttle == GPU_HEARTBEAT_THROTTLE
    # What a heartbeat may be late by before its call times out.
    assert HEARTBEAT_TIMEOUT - throttle >= timedelta(seconds=1)


async def test_a_gpu_worker_given_its_own_heartbeat_throttle_keeps_it(
    temporal_client: Client,
) -> None:
    binding = unshared_binding()
    activities = InferenceActivities(binding, default_http_client(), None)
    plugin = KvflowPlugin(inference=activities)
    worker = role_worker(
        temporal_client,
        plugin,
        task_queue=task_queue_for(binding.pool.name, binding.index),
        max_heartbeat_throttle_interval=timedelta(seconds=0.3),
    )
    assert worker.config(active_config=True)["max_heartbeat_throttle_interval"] == timedelta(
        seconds=0.3
    )

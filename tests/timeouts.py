"""A stuck async test is cut inside its event loop at its timeout, so that it unwinds.

pytest-timeout's signal stops a test wherever the main thread stands: between two turns of the
session's event loop. The test's coroutine is left pending there, its workers keep polling the
shared Temporal server, and later tests on the same task queues (the GPU workers'
`kvflow.gpu.<pool>.<i>`) hang behind them. Cancelled inside the loop instead, the test's
`async with` blocks stop what it started, and its failure shows the await it was stuck on.
The signal stays as the backstop, `UNWIND_S` later.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from pytest_timeout import get_env_settings

UNWIND_S = 30.0
"""How long a test cut at its timeout has to unwind its `async with` blocks (workers, servers)
before pytest-timeout's signal, the backstop, stops it wherever it stands."""


def _cut_at(limit_s: float, test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., Any]:
    @functools.wraps(test)
    async def bounded(*args: Any, **kwargs: Any) -> None:
        cut = asyncio.timeout(limit_s)
        try:
            async with cut:
                await test(*args, **kwargs)
        except TimeoutError:
            if not cut.expired():
                raise  # the test's own failure, not the cut
            # The chained traceback names the await that never returned.
            pytest.fail(f"the test did not finish within its timeout ({limit_s:g} s)")

    return bounded


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run every async test under `asyncio.timeout` at its own timeout (module docstring)."""
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

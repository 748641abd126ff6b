"""One way for a test to wait for something: `eventually`, which fails loudly when it gives up.

A poll that breaks out of its loop when time runs out lets the test go on and fail later with
a message about something else; `eventually` names what it waited for instead. Its timeout is
multiplied by `KVFLOW_TEST_SLOWDOWN` (default 1) on machines slower than the one it was set on.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from collections.abc import Awaitable, Callable

SLOWDOWN_ENV = "KVFLOW_TEST_SLOWDOWN"


def slowdown() -> float:
    """The factor the few wall-clock bounds of the suite are stretched by on a slow machine."""
    return float(os.environ.get(SLOWDOWN_ENV) or 1.0)


async def eventually(
    condition: Callable[[], object | Awaitable[object]],
    *,
    within: float,
    what: str,
    interval: float = 0.05,
) -> None:
    """Wait until `condition()` is truthy, checking every `interval` s; fail naming `what`.

    `within` is in seconds, before `slowdown()`.
    """
    deadline = time.monotonic() + within * slowdown()
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"gave up after {within * slowdown():g} s waiting until {what}")
        await asyncio.sleep(interval)

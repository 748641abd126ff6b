"""The compatibility suite runs every test against the simulator and against real vLLM.

`openai_server` is parametrized over both kinds. The real server comes from the `vllm_server`
fixture (tests/fixtures_vllm.py), resolved only when a test asks for it; where that fixture is
not available the vLLM half is skipped with a message, and under `CI=true` it fails instead.
"""

from __future__ import annotations

import os

import pytest

from tests.servers import ServedModel


@pytest.fixture(scope="session", params=["sim", "vllm"])
def openai_server(request: pytest.FixtureRequest) -> ServedModel:
    """A running vLLM-compatible server: the simulator, then real vLLM."""
    name = f"{request.param}_server"
    try:
        server: ServedModel = request.getfixturevalue(name)
    except pytest.FixtureLookupError:
        message = f"the fixture {name!r} is not available, so the {request.param} run is skipped"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return server

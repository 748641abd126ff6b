"""Simulated vLLM servers for the tests: one per session, and a factory for special ones.

`sim_server` mirrors the real-vLLM fixture's shape (`tests.servers.ServedModel`): a small
model, a 1,024-token context, prefix caching and cached-token details on; its KV block size is
16 tokens (a GPU's), where real vLLM on the CPU uses 128.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvflow.scheduler.gpus import GpuGeneration
from kvflow.simulator import BUILTIN_MODELS, EngineConfig, ServerSettings, SimServer
from tests.servers import ServedModel

SIM_MODEL = "llama-3.2-1b"
SIM_BLOCK_SIZE = 16
SIM_MAX_MODEL_LEN = 1024
SIM_TIME_SCALE = 20.0
"""Simulated seconds per real second: fast enough for tests, slow enough to stream."""


def sim_settings(**overrides: Any) -> ServerSettings:
    """Settings of a test server: `SIM_MODEL` on an H100, 1,024 tokens of context.

    Keyword arguments replace fields of `ServerSettings`; `engine=` may be a dict of
    `EngineConfig` fields to change.
    """
    engine = {"block_size": SIM_BLOCK_SIZE, "max_model_len": SIM_MAX_MODEL_LEN}
    engine.update(overrides.pop("engine", {}))
    values: dict[str, Any] = {
        "gpu": GpuGeneration.H100,
        "models": [BUILTIN_MODELS[SIM_MODEL]],
        "engine": EngineConfig(**engine),
        "time_scale": SIM_TIME_SCALE,
        "seed": 7,
    }
    values.update(overrides)
    return ServerSettings(**values)


def served(server: SimServer) -> ServedModel:
    """The `ServedModel` description of a running `SimServer`."""
    return ServedModel(
        kind="sim",
        base_url=server.base_url,
        model=server.model,
        block_size=server.block_size,
        max_model_len=server.max_model_len,
    )


@pytest.fixture(scope="session")
def sim_server() -> Iterator[ServedModel]:
    """A simulated vLLM server for the whole session (in this process, on a free port)."""
    with SimServer(sim_settings()) as server:
        yield served(server)


@pytest.fixture
def sim_server_factory() -> Iterator[Callable[..., SimServer]]:
    """Start extra simulated servers (`factory(**settings_overrides)`); all stop at the end."""
    servers: list[SimServer] = []

    def start(**overrides: Any) -> SimServer:
        server = SimServer(sim_settings(**overrides)).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()

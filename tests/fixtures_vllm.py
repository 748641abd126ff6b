"""Real vLLM for the tests: one CPU server on a tiny local Llama per test session.

`make vllm-env` (scripts/vllm_env.sh) builds vLLM's CPU build in its own virtual environment
and the tiny model, both under `KVFLOW_VLLM_HOME` (default `~/.cache/kvflow/vllm`). The
`vllm_server` fixture starts the server (with `kvflow.workers.vllm_server.VllmServer`) only when a
test asks for it, once per session, and stops it with its engine processes at the end. Without
the environment the tests that need it are skipped with a message saying how to build it;
under `CI=true` they fail instead. `served_vllm` builds such a server for a fixture of its
own, e.g. with another chat template or other engine arguments; `served_vllms` builds several
that load side by side.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvflow.workers.vllm_server import (
    CPU_BLOCK_SIZE,
    DEFAULT_KV_TOPIC,
    READY_TIMEOUT_S,
    STOP_TIMEOUT_S,
    VllmInstall,
    VllmServer,
    VllmServerError,
    stop_servers,
    vllm_install,
)
from tests.servers import ServedModel

SERVED_MODEL_NAME = "tiny-llama"
BLOCK_SIZE = CPU_BLOCK_SIZE
"""vLLM's KV block size on the CPU (GPUs usually use 16)."""
MAX_MODEL_LEN = 1024
KV_TOPIC = DEFAULT_KV_TOPIC

__all__ = [
    "BLOCK_SIZE",
    "KV_TOPIC",
    "MAX_MODEL_LEN",
    "READY_TIMEOUT_S",
    "SERVED_MODEL_NAME",
    "STOP_TIMEOUT_S",
    "VllmInstall",
    "VllmServedModel",
    "run_vllm_server",
    "run_vllm_servers",
    "served_vllm",
    "served_vllms",
    "skip_or_fail",
    "vllm_install",
]


@dataclass(frozen=True)
class VllmServedModel(ServedModel):
    """A running real vLLM server, with where it publishes its KV-cache events."""

    kv_events_endpoint: str
    """ZMQ PUB socket (`ipc://...`) of `[topic, sequence, msgpack batch]` messages."""
    kv_replay_endpoint: str
    """ZMQ ROUTER socket that replays buffered batches from a given sequence number."""
    kv_topic: str
    """Topic of the KV-event messages (subscribe to it)."""
    log_path: Path
    """The server's combined stdout and stderr."""
    pid: int
    """The API server's process, leader of a process group with the engine and worker."""
    model_dir: Path
    """The model folder it serves (its tokenizer and chat template)."""


def skip_or_fail(message: str) -> None:
    """Skip the test because a service is missing; under `CI=true` fail it instead."""
    # In CI a missing service is a failure: nothing is skipped silently there.
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that uses the real server `vllm`, so `-m "not vllm"` leaves them out."""
    for item in items:
        if "vllm_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.vllm)


def _with_chat_template(model_dir: Path, template: str, into: Path) -> Path:
    """`into`: the model of `model_dir` (linked, not copied) with `template` as its template."""
    into.mkdir(parents=True, exist_ok=True)
    for file in model_dir.iterdir():
        if file.name != "chat_template.jinja":
            (into / file.name).symlink_to(file)
    (into / "chat_template.jinja").write_text(template)
    return into


class _VllmServerWithArgs(VllmServer):
    """A `VllmServer` with more of vLLM's flags (`extra_args`) and environment (`extra_env`)."""

    def __init__(
        self,
        install: VllmInstall,
        *,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        **kwargs: object,
    ) -> None:
        super().__init__(install, **kwargs)  # type: ignore[arg-type]
        self.extra_args = list(extra_args)
        self.extra_env = dict(extra_env or {})

    def command(self) -> list[str]:
        """The server's command line, `extra_args` last."""
        return [*super().command(), *self.extra_args]

    def environment(self) -> dict[str, str]:
        """The server's environment, with `extra_env`."""
        return {**super().environment(), **self.extra_env}


def _test_server(
    install: VllmInstall,
    log_dir: Path,
    *,
    chat_template: str | None = None,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
) -> _VllmServerWithArgs:
    """A server of the tests' tiny model, logging to `log_dir/vllm-server.log` (not started)."""
    model_dir = install.model_dir
    if chat_template is not None:
        model_dir = _with_chat_template(model_dir, chat_template, log_dir / "model")
    return _VllmServerWithArgs(
        install,
        extra_args=extra_args,
        extra_env=extra_env,
        log_path=log_dir / "vllm-server.log",
        model_dir=model_dir,
        served_model_names=[SERVED_MODEL_NAME],
        max_model_len=MAX_MODEL_LEN,
        kv_events=True,
        kv_topic=KV_TOPIC,
        ready_timeout_s=READY_TIMEOUT_S,
        stop_timeout_s=STOP_TIMEOUT_S,
    )


def _served(server: VllmServer) -> VllmServedModel:
    """What the tests know of a started server."""
    assert server.pid is not None
    assert server.kv_events_endpoint is not None and server.kv_replay_endpoint is not None
    return VllmServedModel(
        kind="vllm",
        base_url=server.base_url,
        model=SERVED_MODEL_NAME,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        kv_events_endpoint=server.kv_events_endpoint,
        kv_replay_endpoint=server.kv_replay_endpoint,
        kv_topic=KV_TOPIC,
        log_path=server.log_path,
        pid=server.pid,
        model_dir=server.model_dir,
    )


@contextlib.contextmanager
def run_vllm_server(
    install: VllmInstall,
    log_dir: Path,
    *,
    chat_template: str | None = None,
    extra_args: Sequence[str] = (),
) -> Iterator[VllmServedModel]:
    """Start a real vLLM server on a free port, wait until it is healthy, stop it on exit.

    Its log goes to `log_dir/vllm-server.log`. With `chat_template`, it serves the tiny model
    with that template instead of the model's own (the model is linked into `log_dir/model`);
    `extra_args` are added to vLLM's command line (e.g. `--scheduling-policy priority`).
    Raises `VllmServerError` (a RuntimeError, with the log's tail) when it dies or is not
    healthy within READY_TIMEOUT_S. On exit the whole process group is stopped: SIGTERM, then
    SIGKILL after STOP_TIMEOUT_S. Tests that must kill a server (a stream cut mid-way) start
    their own with this rather than kill the session's.
    """
    server = _test_server(install, log_dir, chat_template=chat_template, extra_args=extra_args)
    with server:
        yield _served(server)


@contextlib.contextmanager
def run_vllm_servers(
    install: VllmInstall,
    log_dir: Path,
    extra_args: Mapping[str, Sequence[str]],
    *,
    extra_env: Mapping[str, str] | None = None,
) -> Iterator[dict[str, VllmServedModel]]:
    """Several real vLLM servers, by name, each with its `extra_args`; stopped on exit.

    They are all started before any is waited for, so they load side by side (two take about
    40 s on two cores where one after the other take about 55 s). Each logs to
    `log_dir/NAME/vllm-server.log`; `extra_env` is added to every server's environment. Raises
    `VllmServerError` as `run_vllm_server` does.
    """
    servers = {
        name: _test_server(install, log_dir / name, extra_args=args, extra_env=extra_env)
        for name, args in extra_args.items()
    }
    try:
        for server in servers.values():
            server.start()
        for server in servers.values():
            server.wait_ready()
        yield {name: _served(server) for name, server in servers.items()}
    finally:
        stop_servers([server for server in servers.values() if server.pid is not None])


def served_vllm(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    *,
    chat_template: str | None = None,
    extra_args: Sequence[str] = (),
) -> Iterator[VllmServedModel]:
    """The body of a real-vLLM fixture: skip (or fail under CI) without the environment."""
    install = vllm_install()
    missing = install.missing()
    if missing is not None:
        skip_or_fail(missing)
    try:
        server = run_vllm_server(
            install,
            tmp_path_factory.mktemp(name),
            chat_template=chat_template,
            extra_args=extra_args,
        )
        with server as served:
            yield served
    except VllmServerError as exc:
        pytest.fail(str(exc), pytrace=False)


def served_vllms(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    extra_args: Mapping[str, Sequence[str]],
    *,
    extra_env: Mapping[str, str] | None = None,
) -> Iterator[dict[str, VllmServedModel]]:
    """The body of a fixture of several real vLLM servers (`run_vllm_servers`), by name."""
    install = vllm_install()
    missing = install.missing()
    if missing is not None:
        skip_or_fail(missing)
    try:
        log_dir = tmp_path_factory.mktemp(name)
        with run_vllm_servers(install, log_dir, extra_args, extra_env=extra_env) as served:
            yield served
    except VllmServerError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServedModel]:
    """A real vLLM OpenAI-compatible server on the CPU serving `tiny-llama` (one per session).

    Prefix caching, prompt-token details (`cached_tokens` in usage) and KV-cache events over
    ZMQ are on; the KV block size is 128 tokens and the context 1024 tokens.
    """
    yield from served_vllm(tmp_path_factory, "vllm")


@pytest.fixture(scope="session")
def vllm_kv_events_endpoint(vllm_server: VllmServedModel) -> str:
    """The real server's KV-cache event publisher (`ipc://...`, topic `kv`)."""
    return vllm_server.kv_events_endpoint

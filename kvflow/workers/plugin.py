"""`KvflowPlugin`: the whole of kvflow's integration with a Temporal client and its workers.

One plugin class plays three roles, chosen by what it is given:

- **client** (`KvflowPlugin()`): on `Client.connect(plugins=[...])` it sets the pydantic data
  converter (kvflow's records are pydantic models; the default converter fails on `Decimal`)
  with a claim-check codec on the context store (payloads over `INLINE_LIMIT_BYTES` travel
  as references, see `kvflow.activities.claim_check`), and the OpenTelemetry tracing
  interceptor. A data converter given to `Client.connect` is kept: its own payload
  converter (other than the SDK's default), and its codec (encryption, compression) first,
  the claim check after it (`with_claim_check`). Every client and worker of a deployment
  must use the same context store.
- **workflow worker** (`KvflowPlugin(fleet)`): on a `Worker` it registers the control plane's
  activities (placement, observation, ledger task rows, the context store), runs the fleet's
  scheduler with its telemetry for as long as the worker runs, makes sure kvflow's search
  attributes exist before the first task, lets workflow code import `kvflow` inside the
  sandbox, holds every activity a task starts to the task's deadline
  (`kvflow.workflows.deadline`), and starts the next run of a task that continues as new
  with its own search attributes (`kvflow.workflows.continued_run`). The worker hosts any
  number of the user's workflows.
- **GPU worker** (`KvflowPlugin(fleet, replica="h100/0")`): on a `Worker` polling that replica's
  task queue (`kvflow.gpu.<pool>.<index>`, see `task_queue_for`) it registers the inference
  activity bound to the replica's vLLM server, checks that the server answers before the
  worker polls, and sends its calls' heartbeats at least every second
  (`GPU_HEARTBEAT_THROTTLE`).

A worker cannot change its client's data converter (Temporal's workers take it from the
client), so the client a worker runs on must be connected with `KvflowPlugin` too: a worker
role on a client without it logs a warning, since payloads other kvflow processes claim-check
(a dead GPU worker's last heartbeat, a large result) cannot be read there.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
from temporalio.client import Client, ClientConfig
from temporalio.contrib.opentelemetry import TracingInterceptor
from temporalio.plugin import SimplePlugin
from temporalio.worker import Worker, WorkerConfig, WorkflowRunner
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner

from kvflow.activities.claim_check import claim_check_of, with_claim_check
from kvflow.activities.context_store import (
    DEFAULT_CONTEXT_DIR,
    ContextStore,
    open_context_store,
)
from kvflow.activities.control_plane import LedgerSink
from kvflow.activities.inference import InferenceActivities, default_http_client
from kvflow.activities.wire import INLINE_LIMIT_BYTES
from kvflow.contrib import KVFLOW_PLUGIN_NAME
from kvflow.ledger.spool import DEFAULT_SPOOL_DIR, SpooledAttemptWriter, spooled_writer
from kvflow.ledger.store import AsyncLedger, default_ledger_url, open_ledger
from kvflow.scheduler.config import SchedulerConfig
from kvflow.scheduler.fleet import task_queue_for
from kvflow.workers.config import FleetConfig, load_fleet
from kvflow.workers.control_plane import ControlPlane
from kvflow.workers.dev_endpoints import EndpointsFileError, endpoints_file, read_endpoints_file
from kvflow.workers.failure_log import ExpectedFailureLog
from kvflow.workers.replica import check_endpoint, resolve_replica
from kvflow.workers.search_attributes import ensure_search_attributes
from kvflow.workers.stopping import BoundedWorker
from kvflow.workflows.continued_run import ContinuedRunInterceptor
from kvflow.workflows.deadline import TaskDeadlineInterceptor

log = logging.getLogger(__name__)

PLUGIN_NAME = KVFLOW_PLUGIN_NAME


def _sandbox_passes_kvflow(existing: WorkflowRunner | None) -> WorkflowRunner:
    """The sandbox, with `kvflow` passed through: workflow code may `from kvflow import ...`.

    kvflow's workflow-side modules are deterministic and import-safe; passing them through
    shares one copy with the worker instead of re-importing them for every workflow run.
    """
    runner = existing if isinstance(existing, SandboxedWorkflowRunner) else None
    if runner is None:
        return existing if existing is not None else SandboxedWorkflowRunner()
    return SandboxedWorkflowRunner(
        restrictions=runner.restrictions.with_passthrough_modules("kvflow"),
        runner_class=runner.runner_class,
    )


class KvflowPlugin(SimplePlugin):
    """kvflow's Temporal plugin; see the module docstring for its three roles.

    Args:
        fleet: the fleet (a `FleetConfig`, or the path of its TOML file). Without it the plugin
            only configures clients.
        replica: `POOL/INDEX`: makes this a GPU worker's plugin for that replica.
        endpoint: the GPU worker's vLLM base URL (default: the pool's `endpoints` entry).
        endpoints: for a workflow worker, the vLLM URL of each replica (`POOL/INDEX`) of a
            simulated pool, whose URLs the fleet cannot know. By default they are read from
            the file `kvflow dev` writes (`.kvflow/dev.toml` in the working directory, or
            `$KVFLOW_ENDPOINTS_FILE`; see `kvflow.workers.dev_endpoints`). With no URL for
            any simulated replica the worker refuses to start, saying how to give them; a
            replica left out of a partial list is down (a warning names it).
        ledger: where a worker writes attempt and task rows: a ledger URL (`sqlite:///...`,
            `postgresql://...`, created and migrated if needed) or an open ledger; by default
            `$KVFLOW_LEDGER_URL`, else `sqlite:///.kvflow/ledger.db` (what `kvflow report`
            reads).
        context_store: the content-addressed context store, shared by every worker and
            client: a store, a directory, or a store's URL (`postgresql://...`,
            `s3://bucket/prefix`; see `open_context_store`). Default `.kvflow/context`.
        context_dir: the older name of `context_store`; give one or the other.
        claim_check_bytes: payloads whose serialized size exceeds this many bytes are stored
            in the context store and travel as references (the client's data converter's
            codec); None turns the codec off.
        spool_dir: where a GPU worker keeps the attempt rows the ledger could not take, until
            it is back (`kvflow.ledger.spool`); None to write to the ledger only.
        scheduler_config: weights and thresholds of the scheduler (workflow worker).
        tracing: add the OpenTelemetry tracing interceptor.

    """

    def __init__(
        self,
        fleet: FleetConfig | Path | str | None = None,
        *,
        replica: str | None = None,
        endpoint: str | None = None,
        endpoints: Mapping[str, str] | None = None,
        ledger: str | LedgerSink | None = None,
        context_dir: Path | str | None = None,
        context_store: ContextStore | Path | str | None = None,
        claim_check_bytes: int | None = INLINE_LIMIT_BYTES,
        spool_dir: Path | str | None = DEFAULT_SPOOL_DIR,
        scheduler_config: SchedulerConfig | None = None,
        scrape_interval_s: float = 1.0,
        heartbeat_interval_s: float = 0.5,
        http: httpx.AsyncClient | None = None,
        tracing: bool = True,
        control_plane: ControlPlane | None = None,
        inference: InferenceActivities | None = None,
    ) -> None:
        if isinstance(fleet, str | Path):
            fleet = load_fleet(fleet)
        if replica is not None and fleet is None:
            raise ValueError(f"KvflowPlugin(replica={replica!r}) needs the fleet it belongs to")
        self.fleet = fleet
        self._owned_ledger: AsyncLedger | None = None
        if ledger is None and fleet is not None:
            ledger = default_ledger_url()
        if isinstance(ledger, str):
            self._owned_ledger = AsyncLedger(open_ledger(ledger, migrate=True))
            ledger = self._owned_ledger
        if context_store is not None and context_dir is not None:
            raise ValueError("KvflowPlugin takes context_store or context_dir, not both")
        spec = context_store if context_store is not None else context_dir
        store = (
            open_context_store(spec if spec is not None else DEFAULT_CONTEXT_DIR)
            if spec is None or isinstance(spec, Path | str)
            else spec
        )
        self.control_plane = control_plane
        self.inference = inference
        # What the plugin built it also starts and stops; what it was given (by `GpuWorker`,
        # the embedded stack) is started, checked and stopped by its owner.
        self._owns_control_plane = False
        self._owns_inference = False
        self._client: Client | None = None
        self._claim_check_bytes = claim_check_bytes
        self._endpoints_problem: str | None = None
        """Why this workflow worker's plugin cannot reach a simulated replica (raised at start)."""
        self._spooler: SpooledAttemptWriter | None = None
        if fleet is not None and replica is not None:
            binding = resolve_replica(fleet, replica, endpoint)
            if ledger is not None and spool_dir is not None:
                self._spooler = spooled_writer(ledger, Path(spool_dir), binding.name)
            self.inference = InferenceActivities(
                binding,
                http or default_http_client(),
                self._spooler or ledger,
                store=store,
                heartbeat_interval_s=heartbeat_interval_s,
            )
            self._owns_inference = True
        elif fleet is not None:
            endpoints = self._resolve_endpoints(fleet, endpoints)
            self.control_plane = ControlPlane(
                fleet,
                endpoints=endpoints,
                ledger=ledger,
                store=store,
                config=scheduler_config,
                scrape_interval_s=scrape_interval_s,
            )
            self._owns_control_plane = True
        activities: list[Callable[..., Any]] | None = None
        self.task_queue: str | None = None
        """The task queue a GPU worker with this plugin must poll."""
        if self.inference is not None:
            binding = self.inference.replica
            self.task_queue = task_queue_for(binding.pool.name, binding.index)
            activities = [self.inference.infer]
        elif self.control_plane is not None:
            activities = self.control_plane.activities.all()
        super().__init__(
            PLUGIN_NAME,
            # The client's own converter is kept, with kvflow's claim check after its codec.
            data_converter=with_claim_check(store, claim_check_bytes),
            interceptors=[
                *([TracingInterceptor()] if tracing else []),
                # Expected failures log one line; their tracebacks only at DEBUG.
                ExpectedFailureLog(),
                # Workflow workers: activities a task starts end by its deadline, and a task
                # that continues as new starts its next run as `running`.
                *(
                    [TaskDeadlineInterceptor(), ContinuedRunInterceptor()]
                    if self.control_plane is not None
                    else []
                ),
            ],
            activities=activities,
            workflow_runner=_sandbox_passes_kvflow if self.control_plane else None,
            run_context=self._running if activities else None,
        )

    def _resolve_endpoints(
        self, fleet: FleetConfig, given: Mapping[str, str] | None
    ) -> Mapping[str, str] | None:
        """The URLs of the simulated replicas: `given`, else the endpoints file of `kvflow dev`.

        A replica without one looks down to the scheduler; with none at all, every task would
        fail after its placement timeout: `_endpoints_problem` says so, and the worker refuses
        to start with it.
        """
        simulated = [
            name
            for pool in fleet.pools
            if isinstance(pool.endpoints, str)
            for name in pool.replica_names()
        ]
        if not simulated:
            return given
        source = "endpoints="
        if not given:
            path = endpoints_file()
            try:
                found = read_endpoints_file(path)
            except EndpointsFileError as exc:
                self._endpoints_problem = str(exc)
                return None
            if found is not None and not found.writer_runs():
                self._endpoints_problem = (
                    f"the endpoints file {path} was written by `kvflow dev` (pid {found.pid}), "
                    "which no longer runs: start `kvflow dev` again, or delete the file and "
                    "pass KvflowPlugin(fleet, endpoints={...})"
                )
                return None
            if found is not None:
                given, source = found.endpoints, f"the endpoints file {path}"
        missing = [name for name in simulated if name not in (given or {})]
        shown = ", ".join(missing[:4]) + (
            f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        )
        if missing and len(missing) < len(simulated):
            # A partial list is a choice (one simulator started by hand): the rest are down.
            log.warning(
                "no vLLM URL for the simulated replica(s) %s in %s: the scheduler sees them down",
                shown,
                source,
            )
        elif missing:
            where = (
                f"{source} names none of them"
                if given
                else f"no endpoints= was given and there is no {endpoints_file()}"
            )
            self._endpoints_problem = (
                f"KvflowPlugin(fleet) has no vLLM URL for the simulated replica(s) {shown} "
                f'(their pool says endpoints = "simulated"; {where}), so every task would '
                "wait for a replica that is down: run `kvflow dev` in this directory (it starts "
                "them and writes the file this plugin reads), or pass KvflowPlugin(fleet, "
                'endpoints={"POOL/INDEX": "http://HOST:PORT", ...}), or list the pool\'s vLLM '
                "URLs in the fleet file"
            )
        return given

    def configure_client(self, config: ClientConfig) -> ClientConfig:
        """Refuse a framework plugin kvflow replaces; then kvflow's converter and tracing."""
        _refuse_replaced_plugins(config.get("plugins") or ())
        return super().configure_client(config)

    def configure_worker(self, config: WorkerConfig) -> WorkerConfig:
        """Register this role's activities; a GPU worker must poll its replica's queue."""
        if self._endpoints_problem is not None and self._owns_control_plane:
            # At the worker's start, not as every task failing a minute later on "replica down".
            raise ValueError(self._endpoints_problem)
        self._client = config["client"]
        _refuse_replaced_plugins(config.get("plugins") or ())
        self._warn_if_client_cannot_read_claim_checks(self._client)
        if self.control_plane is not None:
            _require_framework_plugins(config)
        client_interceptors = self._client.config(active_config=True).get("interceptors", [])
        if self.interceptors is not None and any(
            isinstance(i, TracingInterceptor) for i in client_interceptors
        ):
            # The client traces already: one span per operation.
            kept = [i for i in self.interceptors if not isinstance(i, TracingInterceptor)]
            self.interceptors = kept or None
        if self.inference is not None:
            queue = config.get("task_queue")
            if queue != self.task_queue:
                raise ValueError(
                    f"the GPU worker for {self.inference.replica.name} must poll "
                    f"{self.task_queue!r}, not {queue!r}: Worker(client, "
                    f"task_queue=task_queue_for({self.inference.replica.pool.name!r}, "
                    f"{self.inference.replica.index}), ...)"
                )
            # `Worker` passes every option, unset ones as None: setdefault would keep the None.
            if config.get("max_concurrent_activities") is None:
                config["max_concurrent_activities"] = self.inference.replica.pool.max_concurrency
            if config.get("max_heartbeat_throttle_interval") in (None, _SDK_MAX_THROTTLE):
                config["max_heartbeat_throttle_interval"] = GPU_HEARTBEAT_THROTTLE
        return super().configure_worker(config)

    def _warn_if_client_cannot_read_claim_checks(self, client: Client) -> None:
        """Warn when this plugin claim-checks payloads but the worker's client cannot read them.

        A workflow that meets such a payload (the last heartbeat in a dead GPU worker's
        failure) fails its workflow task on every try, and the task hangs until the worker
        runs on a client that can.
        """
        if self._claim_check_bytes is None:
            return  # this plugin claim-checks nothing
        if claim_check_of(client.data_converter) is not None:
            return
        log.warning(
            "this worker's Temporal client was connected without KvflowPlugin: payloads over "
            "%d bytes that other kvflow processes claim-check cannot be read here, and a task "
            "that meets one stops until they can; connect it with "
            "Client.connect(..., plugins=[KvflowPlugin(context_dir=...)]) on the store every "
            "worker uses",
            self._claim_check_bytes,
        )

    async def run_worker(self, worker: Worker, next: Callable[[Worker], Awaitable[None]]) -> None:
        """Run `worker` inside this role's context; a context that fails stops it too.

        The context's checks (search attributes, the replica's endpoint) run before the worker
        polls. Should one fail, the SDK never marks the worker stopped (only its own run does):
        `Worker.shutdown()`, so the end of `async with worker`, would wait for ever, and the
        worker would stay registered for its task queue, refusing the next one built for it.
        """
        ran = False

        async def run(started: Worker) -> None:
            nonlocal ran
            ran = True
            await next(started)

        try:
            await super().run_worker(worker, run)
        except Exception:
            if not ran:
                await _stop_unstarted(worker, next)
            raise
        except BaseException:
            if not ran:
                # Cancelled before it ran: only marked stopped, as the SDK does itself when
                # its own check of the namespace fails at start.
                stopped = getattr(worker, "_shutdown_complete_event", None)
                if isinstance(stopped, asyncio.Event):
                    stopped.set()
            raise

    @asynccontextmanager
    async def _running(self) -> AsyncIterator[None]:
        """What runs around the worker: the control plane, or the GPU worker's checks."""
        try:
            if self.control_plane is not None:
                assert self._client is not None  # configure_worker ran first
                added = await ensure_search_attributes(self._client)
                if added:
                    log.info("registered search attributes %s", ", ".join(added))
                # Whether each replica's GPU worker polls is Temporal's to say, through a client.
                self.control_plane.watch(self._client)
                if self._owns_control_plane:
                    async with self.control_plane:
                        yield
                else:
                    yield
            elif self.inference is not None and self._owns_inference:
                await check_endpoint(self.inference.replica, self.inference.http)
                log.info("GPU worker for %s polls %s", self.inference.replica.name, self.task_queue)
                try:
                    if self._spooler is not None:
                        async with self._spooler:
                            yield
                    else:
                        yield
                finally:
                    await self.inference.http.aclose()
            else:
                yield
        finally:
            if self._owned_ledger is not None:
                await self._owned_ledger.close()


async def _stop_unstarted(worker: Worker, next: Callable[[Worker], Awaitable[None]]) -> None:
    """Take a worker that never ran through the SDK's own stop, without it taking any work.

    Its core worker is told to shut down first, so its pollers end at once instead of polling;
    then its run starts with the stop already asked for, and ends it as every stop ends: the
    worker marked stopped and no longer registered for its task queue.
    """
    bridge = getattr(worker, "_bridge_worker", None)
    if bridge is not None:
        bridge.initiate_shutdown()
    stopping = asyncio.ensure_future(worker.shutdown())
    await asyncio.sleep(0)  # `Worker.shutdown` marks the worker stopping, then waits
    try:
        await next(worker)
    except Exception as exc:
        log.debug("stopping a worker that never ran: %s", exc)  # the start's error is raised
    finally:
        stopping.cancel()


GPU_HEARTBEAT_THROTTLE = timedelta(seconds=1)
"""How often a GPU worker sends its calls' heartbeats to Temporal, at most.

The SDK sends a heartbeat at most every min(0.8 x the heartbeat timeout, this option). Model
calls run with a 2 s heartbeat timeout (`kvflow.workflows.agent.HEARTBEAT_TIMEOUT`), so by
default a send is due every 1.6 s and a worker 0.4 s late (a GC pause, a busy host) times its
call out: the call is re-placed and the attempt's spend is lost. At 1 s a send may be 1 s late.
The price is one heartbeat RPC a second per running call instead of one per 1.6 s. A worker
given its own `max_heartbeat_throttle_interval` keeps it."""

_SDK_MAX_THROTTLE = timedelta(seconds=60)
"""`Worker`'s default `max_heartbeat_throttle_interval`: the value that says "not set"."""


def role_worker(client: Client, plugin: KvflowPlugin, **options: Any) -> BoundedWorker:
    """A `Worker` on `client` with `plugin` in a worker role (GPU worker, control plane).

    A `BoundedWorker`: its stop ends, within `stop_timeout` (an option besides `Worker`'s).

    kvflow's own processes connect their client with `KvflowPlugin()` (the converter and the
    codec) and give the worker a second `KvflowPlugin` that carries its role. Temporal warns
    when a plugin type is on both ("may run twice"); for these two that is the design (the
    client's registers nothing on a worker), so the warning is not shown.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"The same plugin type .*KvflowPlugin", category=UserWarning
        )
        return BoundedWorker(client, plugins=[plugin], **options)


_AGENTS_PLUGIN = "KvflowAgentsPlugin() from kvflow.contrib.openai_agents"
_REPLACED_PLUGINS = {"OpenAIAgentsPlugin": _AGENTS_PLUGIN}
"""Framework plugins (by `name()`) whose model calls would go around kvflow, and kvflow's."""


def _refuse_replaced_plugins(plugins: Iterable[object]) -> None:
    """Refuse a framework's own Temporal plugin beside kvflow's, naming kvflow's in its place."""
    for plugin in plugins:
        name = _plugin_name(plugin)
        replacement = _REPLACED_PLUGINS.get(name)
        if replacement is not None:
            raise ValueError(
                f"{name} sends its agents' model calls around kvflow: put {replacement} in its "
                "place, after KvflowPlugin"
            )


def _require_framework_plugins(config: WorkerConfig) -> None:
    """Refuse workflows of the OpenAI Agents SDK on a worker without `KvflowAgentsPlugin`.

    The workflow sandbox would refuse the SDK's imports (only that plugin passes them through).
    """
    plugins = [*config["client"].config()["plugins"], *(config.get("plugins") or ())]
    if any(_plugin_name(p) == "kvflow.OpenAIAgentsPlugin" for p in plugins):
        return
    for workflow_class in config.get("workflows") or ():
        if _imports_agents_sdk(workflow_class):
            raise ValueError(
                f"workflow {workflow_class.__name__} runs OpenAI Agents SDK agents, which need "
                f"{_AGENTS_PLUGIN}: add it after KvflowPlugin in the client's plugins"
            )


def _plugin_name(plugin: object) -> str:
    name = getattr(plugin, "name", None)
    return str(name()) if callable(name) else ""


def _imports_agents_sdk(workflow_class: type) -> bool:
    """Whether the module of `workflow_class` holds the Agents SDK or anything of it."""
    module = sys.modules.get(workflow_class.__module__)
    if module is None:
        return False
    for value in vars(module).values():
        owner = (
            value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", "")
        )
        if isinstance(owner, str) and (owner == "agents" or owner.startswith("agents.")):
            return True
    return False

"""`kvflow bench overhead`: a kvflow step against the same call as a plain Temporal activity.

Both stacks run through the real Temporal dev server (`EmbeddedTemporal`, in memory, headless)
and a simulated replica whose model time is near zero (`TIME_SCALE`), so what is measured is
the orchestration around the call:

- bare: what a user writes without kvflow. A workflow on a plain worker calls an activity on
  another worker's task queue; the activity makes the same HTTP call (`POST
  /v1/chat/completions`, same messages, `max_tokens`, sampling) to a simulator.
- kvflow: `agent.infer` inside an `Agent`, on an `EmbeddedFleet` of one simulated replica
  (scheduler placement, GPU worker, ledger, context store, search attributes).

The stacks run one after the other, each alone (the bare one stops before the fleet starts),
so that CPU time can be charged to one stack: the CPU of this process (client, workers,
simulator, control plane) and of the Temporal server with its children, read from
`/proc/<pid>/stat`, over the concurrent run, divided by the steps it ran.

Serial latency is a step as the workflow sees it (wall clock around the call, in workflow
code). History bytes are the serialized events of the concurrent run's tasks per step.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel
from temporalio import activity, workflow
from temporalio.client import Client, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

with workflow.unsafe.imports_passed_through():
    from kvflow.activities.context_store import DirectoryContextStore
    from kvflow.activities.wire import ChatMessage, Sampling
    from kvflow.ledger.store import open_async_ledger
    from kvflow.ports import free_port
    from kvflow.scheduler.fleet import Fleet, Pool, Tenant, TokenPrices
    from kvflow.simulator import (
        BUILTIN_MODELS,
        EngineConfig,
        ServerSettings,
        SimServer,
        resolve_models,
    )
    from kvflow.workers.demo import connect_local
    from kvflow.workers.devserver import EmbeddedTemporal
    from kvflow.workers.embedded import EmbeddedFleet
    from kvflow.workflows.agent import Agent, TaskSpec

MODEL = "llama-3.2-1b"
TENANT = "bench"
TIME_SCALE = 1000.0
"""Simulated seconds per real second: a step's model time is tens of microseconds."""
MAX_TOKENS = 8
PROMPT = "Summarize the previous findings in one short sentence."
STEPS_PER_TASK = 5
HISTORY_SAMPLE = 20
"""Concurrent tasks whose histories are fetched and measured."""

BARE_ACTIVITY_QUEUE = "bench.overhead.bare-activities"
BARE_WORKFLOW_QUEUE = "bench.overhead.bare-workflows"
KVFLOW_WORKFLOW_QUEUE = "bench.overhead.kvflow-workflows"


def _clock() -> float:
    """Wall-clock seconds; read in workflow code only to report a step's duration."""
    with workflow.unsafe.sandbox_unrestricted():
        return time.perf_counter()


class OverheadTask(BaseModel):
    """The input of both benchmark workflows."""

    steps: int
    base_url: str = ""
    """The simulator the bare activity calls (kvflow's scheduler picks its own replica)."""
    max_tokens: int = MAX_TOKENS


class OverheadOutput(BaseModel):
    """Each step's wall time as the workflow saw it."""

    step_ms: list[float]


class BareCall(BaseModel):
    """One chat completion, as the plain activity sends it."""

    base_url: str
    model: str
    messages: list[dict[str, str]]
    max_tokens: int
    seed: int


class BareActivities:
    """The plain activity: one non-streaming chat completion over a shared HTTP client."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    @activity.defn(name="bench_overhead_bare_chat")
    async def chat(self, call: BareCall) -> str:
        """POST the call to the simulator and return the answer's text."""
        response = await self.http.post(
            f"{call.base_url}/v1/chat/completions",
            json={
                "model": call.model,
                "messages": call.messages,
                "max_tokens": call.max_tokens,
                "temperature": 0.0,
                "seed": call.seed,
                "ignore_eos": True,
            },
        )
        response.raise_for_status()
        text: str = response.json()["choices"][0]["message"]["content"]
        return text


@workflow.defn(name="BenchOverheadBare")
class BareTask:
    """`steps` calls of the plain activity, one after the other."""

    @workflow.run
    async def run(self, task: OverheadTask) -> OverheadOutput:
        """Run the steps; return their durations."""
        step_ms: list[float] = []
        for i in range(task.steps):
            started = _clock()
            await workflow.execute_activity(
                "bench_overhead_bare_chat",
                BareCall(
                    base_url=task.base_url,
                    model=MODEL,
                    messages=[{"role": "user", "content": PROMPT}],
                    max_tokens=task.max_tokens,
                    seed=i,
                ),
                task_queue=BARE_ACTIVITY_QUEUE,
                start_to_close_timeout=timedelta(seconds=60),
                result_type=str,
            )
            step_ms.append((_clock() - started) * 1000)
        return OverheadOutput(step_ms=step_ms)


@workflow.defn(name="BenchOverheadKvflow")
class KvflowTask:
    """`steps` kvflow steps (`agent.infer`), one after the other."""

    @workflow.run
    async def run(self, task: OverheadTask) -> OverheadOutput:
        """Run the steps; return their durations."""
        step_ms: list[float] = []
        agent = Agent(TaskSpec(tenant=TENANT, expected_steps=task.steps))
        async with agent:
            for i in range(task.steps):
                started = _clock()
                await agent.infer(
                    [ChatMessage(role="user", content=PROMPT)],
                    model=MODEL,
                    max_tokens=task.max_tokens,
                    step=f"step-{i + 1}",
                    sampling=Sampling(ignore_eos=True, seed=i),
                )
                step_ms.append((_clock() - started) * 1000)
        return OverheadOutput(step_ms=step_ms)


@dataclass(frozen=True)
class Goal:
    """One overhead goal, judged on the figures."""

    text: str
    met: bool
    detail: str


@dataclass
class StackFigures:
    """The figures of one stack (bare or kvflow)."""

    step_ms: list[float]
    history_bytes_per_step: float
    cpu_ms_per_step: float
    steps_per_s: float

    @property
    def p50(self) -> float:
        """Median serial step, ms."""
        return percentile(self.step_ms, 0.50)

    @property
    def p99(self) -> float:
        """99th percentile serial step, ms."""
        return percentile(self.step_ms, 0.99)


@dataclass
class OverheadResult:
    """Both stacks' figures and the goals."""

    serial_steps: int
    tasks: int
    steps_per_task: int
    bare: StackFigures
    kvflow: StackFigures
    goals: list[Goal] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        """The JSON of `kvflow bench overhead --json`."""
        return {
            "bare_activity_ms": {"p50": self.bare.p50, "p99": self.bare.p99},
            "kvflow_step_ms": {"p50": self.kvflow.p50, "p99": self.kvflow.p99},
            "history_bytes_per_step": {
                "bare": self.bare.history_bytes_per_step,
                "kvflow": self.kvflow.history_bytes_per_step,
            },
            "cpu_ms_per_step": {
                "bare": self.bare.cpu_ms_per_step,
                "kvflow": self.kvflow.cpu_ms_per_step,
            },
            "concurrent": {
                "tasks": self.tasks,
                "bare_steps_per_s": self.bare.steps_per_s,
                "kvflow_steps_per_s": self.kvflow.steps_per_s,
            },
            "serial_steps": self.serial_steps,
            "steps_per_task": self.steps_per_task,
            "goals": [{"goal": g.text, "met": g.met, "detail": g.detail} for g in self.goals],
        }


def percentile(values: Sequence[float], q: float) -> float:
    """The `q` quantile of `values` (linear interpolation between closest ranks)."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=1000, method="inclusive")[round(q * 1000) - 1]


def goals(bare: StackFigures, kv: StackFigures) -> list[Goal]:
    """The overhead goals, each judged on the measured figures."""
    median_gap = kv.p50 - bare.p50
    history = kv.history_bytes_per_step / bare.history_bytes_per_step
    cpu = kv.cpu_ms_per_step / bare.cpu_ms_per_step
    rate = kv.steps_per_s / bare.steps_per_s
    return [
        Goal(
            "a step's median within 10 ms of the bare activity",
            median_gap <= 10.0,
            f"{kv.p50:.1f} ms vs {bare.p50:.1f} ms: {median_gap:+.1f} ms",
        ),
        Goal(
            "history per step ≤ 2× bare",
            history <= 2.0,
            f"{kv.history_bytes_per_step:.0f} B vs {bare.history_bytes_per_step:.0f} B: "
            f"{history:.2f}×",
        ),
        Goal(
            "CPU per step ≤ 1.3× bare",
            cpu <= 1.3,
            f"{kv.cpu_ms_per_step:.1f} ms vs {bare.cpu_ms_per_step:.1f} ms: {cpu:.2f}×",
        ),
        Goal(
            "concurrent steps per second ≥ 0.8× bare",
            rate >= 0.8,
            f"{kv.steps_per_s:.1f}/s vs {bare.steps_per_s:.1f}/s: {rate:.2f}×",
        ),
    ]


def default_sizes(quick: bool) -> tuple[int, int]:
    """(serial steps, concurrent tasks) of a run."""
    return (20, 20) if quick else (200, 200)


# CPU time, from /proc


def _proc_stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of `pid`, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces.
    fields = text[text.rindex(")") + 2 :].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks


def cpu_seconds(roots: Sequence[int]) -> float:
    """User + system CPU seconds of `roots` and all their descendants (Linux `/proc`)."""
    if not Path("/proc/self/stat").exists():
        raise RuntimeError("CPU accounting reads /proc/<pid>/stat: Linux only")
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _proc_stat(int(entry))
            if stat is not None:
                stats[int(entry)] = stat
    wanted = set(roots)
    grew = True
    while grew:
        children = {pid for pid, (ppid, _) in stats.items() if ppid in wanted} - wanted
        grew = bool(children)
        wanted |= children
    return sum(stats[pid][1] for pid in wanted if pid in stats)


# The runs


def bench_fleet() -> Fleet:
    """One simulated H100 replica of `MODEL`, room for every concurrent call, one tenant."""
    return Fleet(
        models=[BUILTIN_MODELS[MODEL]],
        pools=[
            Pool(
                name="bench",
                gpu="H100",
                replicas=1,
                price_per_gpu_hour_usd=Decimal("2.00"),
                token_prices=TokenPrices(
                    input_per_mtok_usd=Decimal("0.10"),
                    cached_input_per_mtok_usd=Decimal("0.01"),
                    output_per_mtok_usd=Decimal("0.30"),
                ),
                warm_models=[MODEL],
                max_concurrency=1024,
            )
        ],
        tenants=[Tenant(name=TENANT, tier=2)],
    )


async def _history_bytes(handles: Sequence[WorkflowHandle[Any, Any]]) -> int:
    total = 0
    for handle in handles:
        history = await handle.fetch_history()
        total += sum(event.ByteSize() for event in history.events)
    return total


async def _measure_stack(
    client: Client,
    workflow_run: Callable[[Any, OverheadTask], Awaitable[OverheadOutput]],
    task_queue: str,
    *,
    base_url: str,
    serial_steps: int,
    tasks: int,
    cpu_roots: Sequence[int],
) -> StackFigures:
    async def run(steps: int) -> WorkflowHandle[Any, OverheadOutput]:
        return await client.start_workflow(
            workflow_run,
            OverheadTask(steps=steps, base_url=base_url),
            id=f"bench-overhead-{uuid.uuid4().hex[:12]}",
            task_queue=task_queue,
        )

    # Warm-up: connections, caches, the sandbox's first imports.
    warm = await run(2)
    await warm.result()
    serial = await run(serial_steps)
    step_ms = (await serial.result()).step_ms

    cpu_before = cpu_seconds(cpu_roots)
    started = time.perf_counter()
    handles = await asyncio.gather(*(run(STEPS_PER_TASK) for _ in range(tasks)))
    await asyncio.gather(*(h.result() for h in handles))
    elapsed = time.perf_counter() - started
    cpu_used = cpu_seconds(cpu_roots) - cpu_before
    steps = tasks * STEPS_PER_TASK
    sample = handles[:HISTORY_SAMPLE]
    history = await _history_bytes(sample)
    return StackFigures(
        step_ms=step_ms,
        history_bytes_per_step=history / (len(sample) * STEPS_PER_TASK),
        cpu_ms_per_step=cpu_used * 1000 / steps,
        steps_per_s=steps / elapsed,
    )


def _passthrough_sandbox() -> SandboxedWorkflowRunner:
    # The workflow file imports kvflow; the sandbox re-imports only the user's own modules.
    return SandboxedWorkflowRunner(
        restrictions=SandboxRestrictions.default.with_passthrough_modules("kvflow")
    )


async def _bare(
    address: str, fleet: Fleet, *, serial_steps: int, tasks: int, roots: Sequence[int]
) -> StackFigures:
    pool = fleet.pools[0]
    settings = ServerSettings(
        gpu=pool.gpu,
        models=resolve_models(pool.warm_models, fleet.models),
        engine=EngineConfig(block_size=16, tensor_parallel=pool.gpus_per_replica),
        time_scale=TIME_SCALE,
        seed=0,
        replica_name="bare/0",
    )
    client = await Client.connect(address, data_converter=pydantic_data_converter)
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    with SimServer(settings) as sim:
        async with httpx.AsyncClient(timeout=60.0, limits=limits) as http:
            activities = BareActivities(http)
            async with (
                Worker(client, task_queue=BARE_ACTIVITY_QUEUE, activities=[activities.chat]),
                Worker(
                    client,
                    task_queue=BARE_WORKFLOW_QUEUE,
                    workflows=[BareTask],
                    workflow_runner=_passthrough_sandbox(),
                ),
            ):
                return await _measure_stack(
                    client,
                    BareTask.run,
                    BARE_WORKFLOW_QUEUE,
                    base_url=sim.base_url,
                    serial_steps=serial_steps,
                    tasks=tasks,
                    cpu_roots=roots,
                )


async def _kvflow(
    address: str,
    fleet: Fleet,
    state: Path,
    *,
    serial_steps: int,
    tasks: int,
    roots: Sequence[int],
) -> StackFigures:
    client = await connect_local(address)
    ledger = await open_async_ledger(f"sqlite:///{state / 'ledger.db'}", migrate=True)
    try:
        async with EmbeddedFleet(
            client,
            fleet,
            ledger=ledger,
            store=DirectoryContextStore(state / "context"),
            time_scale=TIME_SCALE,
        ) as embedded:
            worker = await embedded.workflow_worker(
                workflows=[KvflowTask], task_queue=KVFLOW_WORKFLOW_QUEUE
            )
            async with worker:
                return await _measure_stack(
                    client,
                    KvflowTask.run,
                    KVFLOW_WORKFLOW_QUEUE,
                    base_url="",
                    serial_steps=serial_steps,
                    tasks=tasks,
                    cpu_roots=roots,
                )
    finally:
        await ledger.close()


def run_overhead(
    *,
    serial_steps: int,
    tasks: int,
    progress: Callable[[str], None] = lambda text: None,
) -> OverheadResult:
    """Start a dev server, measure the bare stack, then the kvflow stack, and judge the goals."""
    fleet = bench_fleet()
    with tempfile.TemporaryDirectory(prefix="kvflow-overhead-") as tmp:
        state = Path(tmp)
        progress("starting the Temporal dev server")
        with EmbeddedTemporal(
            port=free_port(), ui_port=None, state_dir=state, db_filename=None
        ) as temporal:
            assert temporal.pid is not None
            roots = [os.getpid(), temporal.pid]

            async def both() -> tuple[StackFigures, StackFigures]:
                progress(f"bare activities: {serial_steps} serial steps, {tasks} tasks")
                bare = await _bare(
                    temporal.address,
                    fleet,
                    serial_steps=serial_steps,
                    tasks=tasks,
                    roots=roots,
                )
                progress(f"kvflow steps: {serial_steps} serial steps, {tasks} tasks")
                kv = await _kvflow(
                    temporal.address,
                    fleet,
                    state,
                    serial_steps=serial_steps,
                    tasks=tasks,
                    roots=roots,
                )
                return bare, kv

            bare, kv = asyncio.run(both())
    return OverheadResult(
        serial_steps=serial_steps,
        tasks=tasks,
        steps_per_task=STEPS_PER_TASK,
        bare=bare,
        kvflow=kv,
        goals=goals(bare, kv),
    )

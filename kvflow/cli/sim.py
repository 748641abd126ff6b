"""`kvflow sim`: serve a simulated vLLM replica, or benchmark the discrete-event core.

kvflow sim serve --gpu H100 --model llama-3.1-8b --port 8000 --time-scale 10
kvflow sim serve --fleet fleet.toml --replica h100/0 --port 8101
kvflow sim bench --json sim-bench.json
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from kvflow.scheduler.fleet import ModelSpec
from kvflow.scheduler.gpus import GpuGeneration

if TYPE_CHECKING:
    from kvflow.simulator.engine import EngineConfig

# The engine, the server (FastAPI, uvicorn, ZMQ) and the benchmark are imported by the
# commands that use them, so that every other `kvflow` command starts quickly.
ROUTER_NAMES = ("prefix", "least-loaded", "round-robin")

sim_app = typer.Typer(
    help="The simulated vLLM engine: serve a replica over HTTP, benchmark the core.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)
_out = Console()
_err = Console(stderr=True)
logger = logging.getLogger(__name__)


def _fail(message: str, code: int = 2) -> NoReturn:
    _err.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def _validation_text(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc'])}: {e['msg'].removeprefix('Value error, ')}"
        for e in exc.errors()
    )


def _from_fleet(fleet_path: Path, replica: str | None) -> tuple[Any, Any]:
    # The fleet file is read by the one loader kvflow has (imported here, at the CLI edge).
    from kvflow.workers.config import FleetConfigError, load_fleet

    try:
        fleet = load_fleet(fleet_path)
    except FleetConfigError as exc:
        for problem in exc.problems:
            _err.print(f"[red]✗[/] {problem}", highlight=False, soft_wrap=True)
        _fail(f"{fleet_path}: fix the fleet file; nothing was started")
    if replica is None:
        return fleet, None
    pool_name, sep, index_text = replica.partition("/")
    try:
        pool = fleet.pool(pool_name)
    except KeyError:
        pools = ", ".join(p.name for p in fleet.pools)
        _fail(f"--replica {replica}: no pool {pool_name!r} in {fleet_path}; pools: {pools}")
    if not sep or not index_text.isdigit() or not 0 <= int(index_text) < pool.replicas:
        _fail(
            f"--replica {replica}: write POOL/INDEX with INDEX from 0 to {pool.replicas - 1} "
            f"(pool {pool.name} has {pool.replicas} replicas)"
        )
    return fleet, pool


def _cold_models_that_fit(
    gpu: GpuGeneration, warm: list[ModelSpec], candidates: list[ModelSpec], config: EngineConfig
) -> list[ModelSpec]:
    from kvflow.simulator.engine import SimReplica

    cold: list[ModelSpec] = []
    for model in candidates:
        try:
            SimReplica(gpu, warm, config, cold_models=[*cold, model])
        except ValueError as exc:
            logger.info("%s is not servable cold on this replica: %s", model.name, exc)
            continue
        cold.append(model)
    return cold


@sim_app.command("serve")
def serve(
    model: Annotated[
        list[str] | None,
        typer.Option("--model", help="a model to serve warm (repeat for several)"),
    ] = None,
    gpu: Annotated[
        GpuGeneration | None, typer.Option("--gpu", help="GPU generation (default H100)")
    ] = None,
    fleet: Annotated[
        Path | None, typer.Option("--fleet", help="fleet file: model shapes (and --replica)")
    ] = None,
    replica: Annotated[
        str | None,
        typer.Option("--replica", help="POOL/INDEX of --fleet: its GPU and warm models"),
    ] = None,
    cold_model: Annotated[
        list[str] | None,
        typer.Option("--cold-model", help="a model loaded on its first request (repeatable)"),
    ] = None,
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535)] = 8000,
    time_scale: Annotated[
        float, typer.Option("--time-scale", min=0.001, help="simulated seconds per real second")
    ] = 1.0,
    block_size: Annotated[int, typer.Option("--block-size", min=1, max=1024)] = 16,
    max_model_len: Annotated[int | None, typer.Option("--max-model-len", min=2)] = None,
    max_num_seqs: Annotated[int, typer.Option("--max-num-seqs", min=1)] = 256,
    max_num_batched_tokens: Annotated[int, typer.Option("--max-num-batched-tokens", min=1)] = 8192,
    gpu_memory_utilization: Annotated[
        float, typer.Option("--gpu-memory-utilization", min=0.01, max=1.0)
    ] = 0.9,
    num_gpu_blocks: Annotated[
        int | None,
        typer.Option(
            "--num-gpu-blocks", min=2, help="override the KV size (block 0 is the null block)"
        ),
    ] = None,
    tensor_parallel: Annotated[
        int | None, typer.Option("--tensor-parallel-size", min=1, max=64)
    ] = None,
    no_prefix_caching: Annotated[bool, typer.Option("--no-enable-prefix-caching")] = False,
    host_tier: Annotated[
        float,
        typer.Option(
            "--host-tier",
            min=0,
            max=1000,
            help=(
                "host memory for KV blocks as a multiple of the GPU KV cache, as vLLM's "
                "native offloading (`--kv-offloading-backend native --kv-offloading-size`) "
                "gives; 0: none"
            ),
        ),
    ] = 0.0,
    seed: Annotated[int, typer.Option("--seed", help="seeds sampling and error_rate")] = 0,
    kv_events_endpoint: Annotated[
        str | None, typer.Option("--kv-events-endpoint", help="ZMQ PUB endpoint, e.g. ipc://...")
    ] = None,
    kv_events_replay_endpoint: Annotated[
        str | None, typer.Option("--kv-events-replay-endpoint", help="ZMQ ROUTER endpoint")
    ] = None,
    kv_events_topic: Annotated[str, typer.Option("--kv-events-topic")] = "",
    kv_events_config: Annotated[
        str | None, typer.Option("--kv-events-config", help="vLLM's JSON form of the above")
    ] = None,
    fault_error_rate: Annotated[float, typer.Option("--fault-error-rate", min=0, max=1)] = 0.0,
    fault_error_code: Annotated[int, typer.Option("--fault-error-code")] = 503,
    fault_latency_ms: Annotated[float, typer.Option("--fault-latency-ms", min=0)] = 0.0,
    fault_stall_after: Annotated[int | None, typer.Option("--fault-stall-after", min=0)] = None,
    fault_stall_ms: Annotated[float | None, typer.Option("--fault-stall-ms", min=0)] = None,
    fault_disconnect_after: Annotated[
        int | None, typer.Option("--fault-disconnect-after", min=0)
    ] = None,
    fault_crash_after: Annotated[int | None, typer.Option("--fault-crash-after", min=0)] = None,
    fault_slowdown: Annotated[float, typer.Option("--fault-slowdown", min=1.0)] = 1.0,
) -> None:
    """Serve vLLM's OpenAI-compatible API from a simulated GPU replica until Ctrl-C."""
    import uvicorn

    from kvflow.simulator.engine import EngineConfig
    from kvflow.simulator.faults import FaultSpec
    from kvflow.simulator.models import resolve_models
    from kvflow.simulator.server import ServerSettings, SimulatedVllm, crash_process

    known: list[ModelSpec] = []
    warm_names = list(model or [])
    cold_names = list(cold_model or [])
    replica_name = "sim"
    gpus_per_replica = 1
    if replica is not None and fleet is None:
        _fail("--replica needs --fleet (the file that defines the pool)")
    if fleet is not None:
        config, pool = _from_fleet(fleet, replica)
        known = list(config.models)
        if pool is not None:
            replica_name = replica or replica_name
            gpu = gpu or pool.gpu
            gpus_per_replica = pool.gpus_per_replica
            warm_names = warm_names or list(pool.warm_models)
    if not warm_names:
        _fail("name a model to serve: --model NAME (or --fleet FILE --replica POOL/INDEX)")
    try:
        warm = resolve_models(warm_names, known)
        cold = resolve_models(cold_names, known)
    except ValueError as exc:
        _fail(str(exc))
    kv_endpoint, kv_replay, kv_topic = (
        kv_events_endpoint,
        kv_events_replay_endpoint,
        kv_events_topic,
    )
    if kv_events_config is not None:
        try:
            parsed = json.loads(kv_events_config)
        except json.JSONDecodeError as exc:
            _fail(f"--kv-events-config is not JSON: {exc}")
        if not isinstance(parsed, dict):
            _fail("--kv-events-config must be a JSON object")
        if parsed.get("enable_kv_cache_events", True):
            kv_endpoint = parsed.get("endpoint", kv_endpoint or "tcp://*:5557")
            kv_replay = parsed.get("replay_endpoint", kv_replay)
            kv_topic = parsed.get("topic", kv_topic)
    try:
        engine = EngineConfig(
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            num_gpu_blocks=num_gpu_blocks,
            enable_prefix_caching=not no_prefix_caching,
            host_tier=host_tier,
            tensor_parallel=tensor_parallel or gpus_per_replica,
        )
        faults = FaultSpec(
            error_rate=fault_error_rate,
            error_code=fault_error_code,
            latency_ms=fault_latency_ms,
            stall_after=fault_stall_after,
            stall_ms=fault_stall_ms,
            disconnect_after=fault_disconnect_after,
            crash_after=fault_crash_after,
            slowdown=fault_slowdown,
        )
        chosen_gpu = gpu or GpuGeneration.H100
        if fleet is not None and replica is not None and not cold_names:
            # Every other model of the fleet is servable cold where it fits.
            others = [m for m in known if m.name not in warm_names]
            cold = _cold_models_that_fit(chosen_gpu, warm, others, engine)
        settings = ServerSettings(
            gpu=chosen_gpu,
            models=warm,
            cold_models=cold,
            engine=engine,
            time_scale=time_scale,
            seed=seed,
            faults=faults,
            kv_events_endpoint=kv_endpoint,
            kv_events_replay_endpoint=kv_replay,
            kv_events_topic=kv_topic,
            replica_name=replica_name,
        )
        sim = SimulatedVllm(settings, crash=crash_process)
    except ValidationError as exc:
        _fail(_validation_text(exc))
    except ValueError as exc:
        _fail(str(exc))
    engines = sim.replica.engines
    _out.print(
        f"Simulated vLLM [bold]{replica_name}[/] on {chosen_gpu.value}×{engine.tensor_parallel} "
        f"at [bold]http://{host}:{port}[/] (time scale {time_scale:g}, block size {block_size})",
        highlight=False,
    )
    for name, core in engines.items():
        state = "warm" if core.loaded else f"cold, loads in {core.perf.load_seconds():.1f} s"
        _out.print(
            f"  {name}: {core.num_gpu_blocks:,} KV blocks"
            + (f" + {core.host.num_blocks:,} in host memory" if core.host is not None else "")
            + f", max_model_len {core.max_model_len:,} ({state})",
            highlight=False,
        )
    if kv_endpoint:
        _out.print(f"  KV events on {kv_endpoint} (topic {kv_topic!r})", highlight=False)
    server = uvicorn.Server(
        uvicorn.Config(
            sim.asgi,
            host=host,
            port=port,
            lifespan="on",
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=3,
        )
    )
    try:
        server.run()
    except KeyboardInterrupt:
        # uvicorn re-raises the Ctrl-C it handled; stopping that way is a normal end.
        _out.print("Simulated vLLM stopped.")
        return
    except (OSError, SystemExit) as exc:
        _fail(f"cannot serve on {host}:{port}: {exc}", code=1)
    if not server.started:
        _fail(f"cannot serve on {host}:{port} (is the port taken? choose another with --port)", 1)


@sim_app.command("bench")
def bench(
    replicas: Annotated[int, typer.Option("--replicas", min=1, max=1024)] = 16,
    tasks: Annotated[int, typer.Option("--tasks", min=1, help="agent tasks to simulate")] = 2000,
    task_rate: Annotated[
        float | None, typer.Option("--task-rate", min=0.001, help="tasks per simulated second")
    ] = None,
    router: Annotated[
        str, typer.Option("--router", help=f"one of {', '.join(ROUTER_NAMES)}")
    ] = "prefix",
    seed: Annotated[int, typer.Option("--seed")] = 0,
    json_path: Annotated[Path | None, typer.Option("--json", help="write the figures here")] = None,
) -> None:
    """Measure how many requests per wall-clock minute the discrete-event core simulates."""
    from kvflow.bench.simulator_speed import run_benchmark

    if router not in ROUTER_NAMES:
        _fail(f"--router {router!r}: choose one of {', '.join(ROUTER_NAMES)}")
    with _out.status(f"simulating {tasks:,} agent tasks on {replicas} replicas..."):
        result = run_benchmark(
            replicas=replicas, tasks=tasks, task_rate=task_rate, router=router, seed=seed
        )
    summary = result.summary
    table = Table(title=f"Discrete-event core: {replicas} replicas, router {router}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [
        ("requests simulated", f"{result.requests:,}"),
        ("wall seconds", f"{result.wall_seconds:.2f}"),
        ("requests per wall minute", f"[bold]{result.requests_per_minute:,.0f}[/]"),
        ("workload generation seconds (not counted)", f"{result.workload_seconds:.2f}"),
        ("engine steps", f"{result.steps:,}"),
        ("simulated seconds", f"{result.simulated_seconds:,.1f}"),
        ("simulated requests / s", f"{summary.get('requests_per_second', 0):,.1f}"),
        (
            "TTFT p50 / p95 (s)",
            f"{summary.get('ttft_p50', 0):.3f} / {summary.get('ttft_p95', 0):.3f}",
        ),
        ("e2e p50 / p95 (s)", f"{summary.get('e2e_p50', 0):.2f} / {summary.get('e2e_p95', 0):.2f}"),
        ("cached share of prompt tokens", f"{summary.get('cached_share', 0):.1%}"),
        ("preemptions", f"{summary.get('preemptions', 0):,.0f}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    _out.print(table)
    if json_path is not None:
        try:
            json_path.write_text(json.dumps(result.as_json(), indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            _fail(f"cannot write {json_path}: {exc.strerror}", code=1)
        _out.print(f"wrote {json_path}", highlight=False)


def main() -> NoReturn:
    """`python -m kvflow.cli.sim`: run the `sim` commands and exit with their status."""
    code = 0
    try:
        sim_app()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        code = 130
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()

"""The `kvflow` command line.

Exit codes: 0 success, 1 a runtime failure, 2 a usage or configuration error. Every exit goes
through `main`, which ends the process with `os._exit` once output is flushed: the Temporal
SDK's native runtime can crash while Python finalizes (sdk-python issue 300), and a command
that succeeded must not exit non-zero because of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.table import Table

from benchmarks.cli import bench_app
from ledger.cli import ledger_app, report_command
from simulator.cli import sim_app
from workers.console import fail, load_fleet_or_exit, out
from workers.devserver import DEFAULT_STATE_DIR, DevServerError, EmbeddedTemporal
from workers.vllm_server import Engine
from workers.worker_cli import worker_app

app = typer.Typer(
    name="kvflow",
    help="kvflow: KV-cache-aware placement of agent model calls on Temporal, and what they cost.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)
fleet_app = typer.Typer(help="Inspect and validate fleet.toml.", no_args_is_help=True)
app.add_typer(fleet_app, name="fleet")
app.add_typer(worker_app, name="worker")
app.add_typer(ledger_app, name="ledger")
app.add_typer(sim_app, name="sim")
app.add_typer(bench_app, name="bench")
app.command("report")(report_command)


@fleet_app.command("check")
def fleet_check(
    file: Annotated[Path, typer.Argument(help="the fleet file to validate, e.g. fleet.toml")],
) -> None:
    """Validate FILE and print the fleet; exit 2 listing every problem if it is invalid."""
    fleet = load_fleet_or_exit(file)
    t = fleet.temporal
    out.print(
        f"[bold]{file}[/]: Temporal at {t.address}, namespace {t.namespace!r}, "
        f"TLS {'on' if t.tls and not t.tls.disabled else 'off'}, "
        f"API key from ${t.api_key_env}",
        highlight=False,
    )

    pools = Table(title="GPU pools")
    for column in (
        "pool",
        "GPU",
        "replicas",
        "endpoints",
        "$/GPU-h",
        "$/Mtok in / cached / out",
        "warm models",
        "max calls",
    ):
        pools.add_column(column)
    for pool in fleet.pools:
        prices = pool.token_prices
        endpoints = (
            pool.endpoints
            if isinstance(pool.endpoints, str)
            else "\n".join(str(u) for u in pool.endpoints)
        )
        pools.add_row(
            pool.name,
            f"{pool.gpu.value}×{pool.gpus_per_replica}",
            str(pool.replicas),
            endpoints,
            f"{pool.price_per_gpu_hour_usd}",
            f"{prices.input_per_mtok_usd} / {prices.cached_input_per_mtok_usd}"
            f" / {prices.output_per_mtok_usd}",
            "\n".join(pool.warm_models),
            str(pool.max_concurrency),
        )
    out.print(pools)

    models = Table(title="Models")
    for column in ("model", "params", "context", "KV/token", "fallback"):
        models.add_column(column)
    for model in fleet.models:
        models.add_row(
            model.name,
            f"{model.parameters_b:g}B",
            f"{model.context_length:,}",
            f"{model.kv_bytes_per_token() / 1024:g} KiB",
            model.fallback or "-",
        )
    out.print(models)

    tenants = Table(title="Tenants")
    for column in ("tenant", "tier", "fairness weight", "daily budget"):
        tenants.add_column(column)
    for tenant in fleet.tenants:
        budget = tenant.daily_budget_usd
        tenants.add_row(
            tenant.name,
            str(tenant.tier),
            f"{tenant.fairness_weight:g}",
            f"${budget}" if budget is not None else "none",
        )
    out.print(tenants)
    replicas = sum(p.replicas for p in fleet.pools)
    out.print(
        f"[green]✓[/] {file} is valid: {len(fleet.pools)} pools, {replicas} replicas, "
        f"{len(fleet.models)} models, {len(fleet.tenants)} tenants",
        highlight=False,
    )


PortOption = Annotated[int, typer.Option("--port", help="gRPC port of the Temporal frontend")]
UiPortOption = Annotated[int, typer.Option("--ui-port", help="port of the Temporal Web UI")]
StateDirOption = Annotated[
    Path, typer.Option("--state-dir", help="folder for the SQLite file and logs")
]


def _wait_for_stop_signal(server: EmbeddedTemporal) -> None:
    """Block until Ctrl-C / SIGTERM, or until the server dies on its own."""
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    while not stop.wait(0.5):
        if server.pid is not None and not _alive(server):
            fail(f"the Temporal dev server stopped unexpectedly; see {server.log_path}", code=1)


def _alive(server: EmbeddedTemporal) -> bool:
    process = server._process
    return process is not None and process.poll() is None


@app.command()
def server(
    port: PortOption = 7233,
    ui_port: UiPortOption = 8233,
    state_dir: StateDirOption = DEFAULT_STATE_DIR,
    in_memory: Annotated[
        bool, typer.Option("--in-memory", help="keep no SQLite file; state is lost at exit")
    ] = False,
) -> None:
    """Run the embedded Temporal dev server (with the Web UI) until Ctrl-C."""
    temporal = EmbeddedTemporal(
        port=port,
        ui_port=ui_port,
        state_dir=state_dir,
        db_filename=None if in_memory else "temporal.db",
    )
    try:
        temporal.start()
    except DevServerError as exc:
        fail(str(exc))
    try:
        out.print(
            f"Temporal dev server at [bold]{temporal.address}[/] "
            f"(namespace 'default', state {temporal.db_path or 'in memory'})",
            highlight=False,
        )
        out.print(f"Web UI: [bold]{temporal.ui_url}[/]   Ctrl-C stops it.", highlight=False)
        _wait_for_stop_signal(temporal)
    finally:
        temporal.stop()
    out.print("Temporal dev server stopped.")


@app.command()
def demo(
    fleet: Annotated[Path, typer.Option("--fleet", help="fleet file")] = Path("fleet.toml"),
    tasks: Annotated[int, typer.Option("--tasks", min=1, max=10_000, help="tasks to run")] = 60,
    seed: Annotated[
        int, typer.Option("--seed", help="seed of the workload and the simulators")
    ] = 7,
    keep_running: Annotated[
        bool, typer.Option("--keep-running", help="leave the stack up after the report")
    ] = False,
    engine: Annotated[
        Engine,
        typer.Option(
            "--engine",
            help="sim: a simulated replica per replica of the fleet; vllm: start real vLLM "
            "servers on --model (from `make vllm-env`)",
        ),
    ] = Engine.SIM,
    model: Annotated[
        Path | None,
        typer.Option("--model", help="model folder the vLLM servers serve (--engine vllm)"),
    ] = None,
    replicas: Annotated[
        int | None,
        typer.Option(
            "--replicas", min=1, max=16, help="vLLM servers to start (--engine vllm; default 2)"
        ),
    ] = None,
    endpoints: Annotated[
        str | None,
        typer.Option(
            "--endpoints",
            help="URL[,URL...]: vLLM servers that already run, one replica each",
        ),
    ] = None,
    port: PortOption = 7233,
    ui_port: UiPortOption = 8233,
    state_dir: StateDirOption = DEFAULT_STATE_DIR,
) -> None:
    """Run agent tasks of three tenants on a simulated fleet, then show what they cost.

    With --endpoints or --engine vllm they run on real vLLM servers (one pool, `vllm`).
    """
    from workers.demo import (
        DemoOptions,
        EndpointError,
        check_endpoints,
        connect_local,
        fleet_on_endpoints,
        local_vllm_servers,
        log_to_file,
        parse_endpoints,
        run_demo,
        sample_models,
    )
    from workers.vllm_server import VllmServerError, model_max_positions, vllm_install

    if engine is Engine.VLLM and endpoints is not None:
        fail(
            "--endpoints uses vLLM servers that already run, --engine vllm starts its own: "
            "give one of them"
        )
    if engine is Engine.VLLM and model is None:
        fail(
            "--engine vllm needs --model DIR, the model folder the vLLM servers serve "
            f"(after `make vllm-env`: --model {vllm_install().model_dir})"
        )
    if engine is Engine.SIM and (model is not None or replicas is not None):
        fail(
            "--model and --replicas are for --engine vllm; the simulated fleet's replicas "
            "come from --fleet"
        )
    config = load_fleet_or_exit(fleet)
    urls: list[str] = []
    if endpoints is not None:
        try:
            urls = parse_endpoints(endpoints)
            names = [m.name for m in config.models]
            served = check_endpoints(urls, sample_models(), names_to_serve=names)
            config = fleet_on_endpoints(config, served)
        except EndpointError as exc:
            fail(str(exc))
    install = vllm_install()
    if engine is Engine.VLLM:
        assert model is not None
        missing = install.missing()
        if missing is not None:
            fail(missing)
        if model_max_positions(model) is None:
            fail(
                f"--model {model}: no Hugging Face model there (its config.json is missing "
                "or unreadable); give the folder that holds config.json and the weights"
            )
    log_file = log_to_file(state_dir / "demo.log")
    temporal = EmbeddedTemporal(port=port, ui_port=ui_port, state_dir=state_dir)
    if engine is Engine.SIM and not urls:
        where = (
            f"fleet {fleet}: {len(config.pools)} pools, "
            f"{sum(p.replicas for p in config.pools)} replicas"
        )
    else:
        where = f"{len(urls) or replicas or 2} vLLM server(s), prices of fleet {fleet}"
    # SIGTERM stops the stack as Ctrl-C does (as a SIGINT, which asyncio.run turns into a
    # clean cancellation), so no vLLM or Temporal process is left behind.
    signal.signal(signal.SIGTERM, lambda signum, frame: os.kill(os.getpid(), signal.SIGINT))

    async def run() -> None:
        client = await connect_local(temporal.address)
        await run_demo(
            client,
            config,
            state_dir=state_dir,
            options=DemoOptions(tasks=tasks, seed=seed),
            console=out,
            ui_url=temporal.ui_url,
            keep_running=keep_running,
            # Simulators in processes of their own (their file is the fleet's own file).
            fleet_file=fleet if engine is Engine.SIM and not urls else None,
        )

    with contextlib.ExitStack() as stack:
        try:
            if engine is Engine.VLLM:
                assert model is not None
                names = [m.name for m in config.models]
                started = time.monotonic()
                servers = stack.enter_context(
                    local_vllm_servers(
                        install,
                        model,
                        served_model_names=names,
                        replicas=replicas or 2,
                        log_dir=state_dir,
                    )
                )
                out.print(
                    f"Starting {len(servers)} vLLM server(s) on {model} serving "
                    f"{', '.join(names)} (logs: {state_dir}/vllm-*.log)",
                    highlight=False,
                    soft_wrap=True,
                )
            stack.callback(temporal.stop)
            temporal.start()
            if engine is Engine.VLLM:
                for server in servers:
                    server.wait_ready()
                urls = [server.base_url for server in servers]
                config = fleet_on_endpoints(config, check_endpoints(urls, sample_models()))
                out.print(
                    f"vLLM servers ready at {', '.join(urls)} after "
                    f"{time.monotonic() - started:.0f} s",
                    highlight=False,
                )
                if model is not None and model.resolve() == install.model_dir.resolve():
                    out.print(
                        "Note: the tiny test model writes random text, so steps that ask "
                        "for JSON (plans, triage, critiques) often fail validation, and their "
                        "tasks with them.",
                        highlight=False,
                    )
            out.print(
                f"Temporal dev server at {temporal.address}, UI {temporal.ui_url}; {where}, "
                f"{len(config.tenants)} tenants; {tasks} tasks. Logs: {log_file}",
                highlight=False,
                soft_wrap=True,
            )
            asyncio.run(run())
        except KeyboardInterrupt:
            out.print("Interrupted.")
        except DevServerError as exc:
            fail(str(exc))
        except (VllmServerError, EndpointError) as exc:
            fail(str(exc), code=1)
    out.print("Embedded stack stopped.")


def main() -> NoReturn:
    """Console-script entry point: run the CLI, flush, and exit without finalizer crashes."""
    code = 0
    try:
        app()
    except SystemExit as exc:
        if isinstance(exc.code, int):
            code = exc.code
        elif exc.code is not None:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = 130
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()

"""The `kvflow` command line.

Exit codes: 0 success, 1 a runtime failure, 2 a usage or configuration error. Every exit goes
through `main`, which ends the process with `os._exit` once output is flushed: the Temporal
SDK's native runtime can crash while Python finalizes (sdk-python issue 300), and a command
that succeeded must not exit non-zero because of it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.table import Table

from kvflow.cli.bench import bench_app
from kvflow.cli.codec import codec_app_cli
from kvflow.cli.context import context_app
from kvflow.cli.demo import demo
from kvflow.cli.dev import dev
from kvflow.cli.init import init
from kvflow.cli.ledger import ledger_app, report_command
from kvflow.cli.sim import sim_app
from kvflow.cli.worker import worker_app
from kvflow.scheduler.redact import redact_url
from kvflow.workers.codec_server import local_codec_server
from kvflow.workers.console import (
    PortOption,
    StateDirOption,
    UiPortOption,
    fail,
    load_fleet_or_exit,
    out,
)
from kvflow.workers.devserver import DEFAULT_STATE_DIR, DevServerError, EmbeddedTemporal

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
app.command()(demo)
app.command()(dev)
app.command()(init)
app.add_typer(ledger_app, name="ledger")
app.add_typer(context_app, name="context")
app.add_typer(sim_app, name="sim")
app.add_typer(bench_app, name="bench")
app.add_typer(codec_app_cli, name="codec")
app.command("report")(report_command)


@fleet_app.command("check")
def fleet_check(
    file: Annotated[
        Path | None,
        typer.Argument(help="the fleet file to validate (default: fleet.toml here)"),
    ] = None,
) -> None:
    """Validate FILE and print the fleet; exit 2 listing every problem if it is invalid."""
    if file is None:
        file = Path("fleet.toml")
        if not file.is_file():
            fail(
                f"no fleet file given, and there is no {file.resolve()}: run `kvflow init` to "
                "write a commented one here, or name the file: kvflow fleet check PATH"
            )
    elif not file.exists():
        fail(f"{file}: no such file; `kvflow init` writes a commented fleet.toml to start from")
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
            else "\n".join(redact_url(str(u)) for u in pool.endpoints)
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


def _stop_on_signal() -> threading.Event:
    """An event that Ctrl-C / SIGTERM sets, from now on, instead of interrupting."""
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return stop


def _wait_for_stop_signal(server: EmbeddedTemporal, stop: threading.Event) -> None:
    """Block until `stop` is set, or until the server dies on its own."""
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
    """Run the embedded Temporal dev server (with the Web UI) until Ctrl-C.

    Temporal only: `kvflow dev` also runs the fleet's simulated replicas and GPU workers.
    """
    # The UI decodes claim-checked payloads (prompts, answers) through it: text, not references.
    codec = local_codec_server(state_dir / "context", ui_port)
    temporal = EmbeddedTemporal(
        port=port,
        ui_port=ui_port,
        state_dir=state_dir,
        db_filename=None if in_memory else "temporal.db",
        codec_endpoint=codec.url,
    )
    try:
        temporal.start()
    except DevServerError as exc:
        codec.stop()
        fail(str(exc))
    try:
        # Before the banner: a Ctrl-C right after "Ctrl-C stops it." must stop it in order.
        stop = _stop_on_signal()
        out.print(
            f"Temporal dev server at [bold]{temporal.address}[/] "
            f"(namespace 'default', state {temporal.db_path or 'in memory'})",
            highlight=False,
        )
        out.print(f"Web UI: [bold]{temporal.ui_url}[/]   Ctrl-C stops it.", highlight=False)
        out.print(f"Codec server (the UI decodes payloads with it): {codec.url}", highlight=False)
        _wait_for_stop_signal(temporal, stop)
    finally:
        temporal.stop()
        codec.stop()
    out.print("Temporal dev server stopped.")


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

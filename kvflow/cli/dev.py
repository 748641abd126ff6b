"""`kvflow dev`: the whole local stack in one command, for a user's own program to run against.

It starts what `kvflow demo` starts, without the demo's workload: the Temporal dev server with
its Web UI, the codec server the UI decodes payloads with, one simulated vLLM replica per
replica of the fleet's simulated pools (each in a process of its own) and a GPU worker for
every replica. The user's program brings the workflow worker: `KvflowPlugin(fleet)` on it runs
the scheduler and the control plane next to the user's workflows.

What that program needs to find the stack is where it looks by default:

- Temporal at the fleet file's `[temporal] address` (`127.0.0.1:7233`), or `TEMPORAL_ADDRESS`,
  which `kvflow dev` prints when it serves another port;
- the simulated replicas' URLs in the endpoints file, `.kvflow/dev.toml` in the directory
  `kvflow dev` runs in (`kvflow.workers.dev_endpoints`), which `KvflowPlugin(fleet)` reads
  when it is given no `endpoints=`; `KVFLOW_ENDPOINTS_FILE` names another one;
- the ledger (`.kvflow/ledger.db`, what `kvflow report` reads) and the context store
  (`.kvflow/context`), `KvflowPlugin`'s defaults.

So run the program from the same directory. Ctrl-C (or SIGTERM) stops everything it started,
in order, removes the endpoints file and exits 0; killed outright, its children get the
parent-death signal (`kvflow.workers.devserver.stop_with_parent`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Annotated

import typer

from kvflow.cli.demo import StopOnSigterm
from kvflow.ledger.store import LEDGER_URL_ENV, default_ledger_url
from kvflow.scheduler.fleet import task_queue_for
from kvflow.scheduler.redact import redact_url
from kvflow.workers.codec_server import local_codec_server
from kvflow.workers.config import EXAMPLE_FLEET, FleetConfig
from kvflow.workers.console import (
    PortOption,
    StateDirOption,
    UiPortOption,
    fail,
    load_fleet_or_exit,
    out,
)
from kvflow.workers.dev_endpoints import (
    DEV_FILE,
    ENDPOINTS_FILE_ENV,
    EndpointsFileError,
    read_endpoints_file,
    write_endpoints_file,
)
from kvflow.workers.devserver import DEFAULT_STATE_DIR, DevServerError, EmbeddedTemporal

DEV_READY = "Ctrl-C stops everything kvflow dev started."
"""The last line of the banner: once it is printed, the stack serves."""


def _fleet_file(given: Path | None) -> Path:
    """The fleet file to simulate: `--fleet`, else `./fleet.toml`, else kvflow's example."""
    if given is not None:
        return given
    local = Path("fleet.toml")
    return local if local.is_file() else EXAMPLE_FLEET


def _refuse_a_running_dev(path: Path) -> None:
    """Exit 2 when another `kvflow dev` serves this directory (its endpoints file is live)."""
    try:
        found = read_endpoints_file(path)
    except EndpointsFileError:
        return  # a broken file is replaced
    if found is not None and found.pid != os.getpid() and found.writer_runs():
        fail(
            f"another `kvflow dev` (pid {found.pid}) serves this directory ({path}): "
            "use that one, or stop it with Ctrl-C first"
        )


def dev(
    fleet: Annotated[
        Path | None,
        typer.Option(
            "--fleet",
            help="fleet file to simulate (default: ./fleet.toml, else kvflow's example fleet)",
        ),
    ] = None,
    port: PortOption = 7233,
    ui_port: UiPortOption = 8233,
    state_dir: StateDirOption = DEFAULT_STATE_DIR,
    time_scale: Annotated[
        float,
        typer.Option(
            "--time-scale", min=0.1, help="how many times faster than a real GPU the replicas run"
        ),
    ] = 10.0,
) -> None:
    """Run Temporal, its UI, and the fleet's simulated replicas with their GPU workers.

    Your own program (a workflow worker with KvflowPlugin(fleet)) then runs against it
    unchanged, from this directory: the replicas' URLs are in .kvflow/dev.toml, which the
    plugin reads. Ctrl-C stops everything.
    """
    from kvflow.activities.context_store import DirectoryContextStore
    from kvflow.ledger.store import open_async_ledger
    from kvflow.workers.demo import connect_local, log_to_file
    from kvflow.workers.embedded import EmbeddedFleet

    fleet_file = _fleet_file(fleet)
    config = load_fleet_or_exit(fleet_file)
    default_dir = state_dir.resolve() == DEFAULT_STATE_DIR.resolve()
    endpoints_path = DEV_FILE if default_dir else state_dir / DEV_FILE.name
    _refuse_a_running_dev(endpoints_path)
    context_dir = state_dir / "context"
    ledger_url = (
        default_ledger_url()
        if default_dir
        else os.environ.get(LEDGER_URL_ENV) or f"sqlite:///{state_dir / 'ledger.db'}"
    )
    log_file = log_to_file(state_dir / "dev.log")
    # The UI decodes claim-checked payloads (prompts, answers) through it: text, not references.
    codec = local_codec_server(context_dir, ui_port)
    temporal = EmbeddedTemporal(
        port=port, ui_port=ui_port, state_dir=state_dir, codec_endpoint=codec.url
    )
    sigterm = StopOnSigterm()
    signal.signal(signal.SIGTERM, sigterm)

    async def serve() -> None:
        client = await connect_local(temporal.address, context_dir)
        ledger = await open_async_ledger(ledger_url, migrate=True)
        simulated = any(isinstance(p.endpoints, str) for p in config.pools)
        try:
            async with EmbeddedFleet(
                client,
                config,
                ledger=ledger,
                store=DirectoryContextStore(context_dir),
                time_scale=time_scale,
                # Each simulator in a process of its own, as a real vLLM server would be.
                fleet_file=fleet_file.resolve() if simulated else None,
                # Placement is the user's workflow worker's; this one only reports liveness.
                scrape_interval_s=5.0,
            ) as embedded:
                endpoints = {name: sim.base_url for name, sim in embedded.sims.items()}
                write_endpoints_file(
                    endpoints_path,
                    endpoints,
                    temporal_address=temporal.address,
                    ui_url=temporal.ui_url,
                )
                try:
                    _banner(
                        config,
                        fleet_file,
                        temporal,
                        codec.url,
                        endpoints,
                        endpoints_path=endpoints_path,
                        default_dir=default_dir,
                        context_dir=context_dir,
                        ledger_url=ledger_url,
                        log_file=log_file,
                    )
                    await asyncio.Event().wait()
                finally:
                    endpoints_path.unlink(missing_ok=True)
        finally:
            await ledger.close()

    with contextlib.ExitStack() as stack:
        try:
            stack.callback(codec.stop)
            stack.callback(temporal.stop)
            temporal.start()
            sigterm.run(serve())
        except KeyboardInterrupt:
            out.print("Stopping…" if not sigterm.received else "Stopping on SIGTERM…")
        except DevServerError as exc:
            fail(str(exc))
    out.print("kvflow dev stopped: Temporal, the codec server, the replicas and their workers.")


def _banner(
    config: FleetConfig,
    fleet_file: Path,
    temporal: EmbeddedTemporal,
    codec_url: str,
    endpoints: dict[str, str],
    *,
    endpoints_path: Path,
    default_dir: bool,
    context_dir: Path,
    ledger_url: str,
    log_file: Path,
) -> None:
    """What runs where, and what to paste into another terminal."""
    replicas = sum(p.replicas for p in config.pools)
    say = out.print
    say(
        f"[bold]kvflow dev[/]: fleet {fleet_file} ({len(config.pools)} pools, "
        f"{replicas} replicas); logs {log_file}",
        highlight=False,
        soft_wrap=True,
    )
    say(f"  Temporal       {temporal.address} (namespace 'default')", highlight=False)
    say(f"  Web UI         {temporal.ui_url}", highlight=False)
    say(f"  Codec server   {codec_url} (the UI decodes payloads with it)", highlight=False)
    for pool in config.pools:
        for index, name in enumerate(pool.replica_names()):
            url = endpoints.get(name) or (
                redact_url(str(pool.endpoints[index])) if isinstance(pool.endpoints, list) else "-"
            )
            say(
                f"  replica {name:<8} {url}  GPU worker on {task_queue_for(pool.name, index)}",
                highlight=False,
            )
    say(f"  Endpoints file {endpoints_path} (KvflowPlugin(fleet) reads it)", highlight=False)
    say(f"  Ledger         {redact_url(ledger_url)} (`kvflow report`)", highlight=False)
    say("In another terminal, in this directory:", highlight=False)
    say(f"  export TEMPORAL_ADDRESS={temporal.address}", highlight=False)
    if not default_dir:
        say(f"  export {ENDPOINTS_FILE_ENV}={endpoints_path.resolve()}", highlight=False)
        say(f"  export {LEDGER_URL_ENV}={redact_url(ledger_url)}", highlight=False)
        say(
            f"  and give KvflowPlugin(fleet, context_store={str(context_dir.resolve())!r})",
            highlight=False,
        )
    say("  python starter.py    (written by `kvflow init`; or your own program)", highlight=False)
    say(DEV_READY, highlight=False)

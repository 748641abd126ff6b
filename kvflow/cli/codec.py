"""`kvflow codec serve`: the remote codec server the Temporal Web UI and CLI decode with."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
import uvicorn
from temporalio.client import Client

from kvflow.cli.context import DEFAULT_CONTEXT_STORE, ContextStoreOption, open_store_or_exit
from kvflow.ports import port_is_free
from kvflow.workers.codec_server import (
    DEFAULT_CODEC_PORT,
    DEFAULT_UI_ORIGINS,
    ENCODE_QUOTA_BYTES,
    ENCODE_QUOTA_WINDOW_S,
    CodecAccess,
    CodecConfigError,
    EncodeQuota,
    PayloadOpener,
    WorkflowTenants,
    check_exposure,
    codec_app,
    load_codec,
    load_tokens,
)
from kvflow.workers.console import fail, load_fleet_or_exit, out

codec_app_cli = typer.Typer(
    help="Serve Temporal's remote codec protocol for kvflow's claim-checked payloads.",
    no_args_is_help=True,
)


@codec_app_cli.command("serve")
def serve_command(
    port: Annotated[
        int, typer.Option("--port", min=1, max=65535, help="port to listen on")
    ] = DEFAULT_CODEC_PORT,
    host: Annotated[
        str,
        typer.Option("--host", help="address to listen on; other than loopback needs --tokens"),
    ] = "127.0.0.1",
    context_store: ContextStoreOption = DEFAULT_CONTEXT_STORE,
    tokens: Annotated[
        Path | None,
        typer.Option(
            "--tokens",
            help="TOML file of bearer tokens and the tenants each may read "
            '(\\[tokens.NAME] token = "..." tenants = \\["acme"] or \\["*"])',
        ),
    ] = None,
    ui_origin: Annotated[
        list[str] | None,
        typer.Option(
            "--ui-origin",
            help="origin of the Web UI that calls this server (repeatable; default "
            "http://localhost:8233 and http://127.0.0.1:8233)",
        ),
    ] = None,
    fleet: Annotated[
        Path | None,
        typer.Option(
            "--fleet",
            help="fleet file whose \\[temporal] section says how to reach Temporal, to learn "
            "each workflow's tenant (with --tokens; default 127.0.0.1:7233)",
        ),
    ] = None,
    codec: Annotated[
        str | None,
        typer.Option(
            "--codec",
            help="MODULE:NAME of your clients' own PayloadCodec (encryption, compression), or "
            "of a callable that makes one: decoded after the claim check",
        ),
    ] = None,
    encode_quota_mib: Annotated[
        float,
        typer.Option(
            "--encode-quota-mib",
            min=0,
            help="MiB of payloads each caller may send to /encode (which stores them) per "
            "minute; 0: none",
        ),
    ] = ENCODE_QUOTA_BYTES / 2**20,
) -> None:
    """Decode claim-checked payloads for the Temporal Web UI and `temporal --codec-endpoint`."""
    try:
        access = load_tokens(tokens) if tokens is not None else CodecAccess()
        check_exposure(host, access)
        own = load_codec(codec) if codec is not None else None
    except CodecConfigError as exc:
        fail(str(exc))
    store = open_store_or_exit(context_store, "--context-store", existing=True)
    if not port_is_free(port, host if host != "localhost" else "127.0.0.1"):
        fail(f"port {port} on {host} is already in use; choose another with --port")
    origins = tuple(o.rstrip("/") for o in ui_origin) if ui_origin else DEFAULT_UI_ORIGINS
    if any(not o.startswith(("http://", "https://")) for o in origins):
        fail(f"--ui-origin must be an http(s) origin such as http://localhost:8233, not {origins}")
    connect_config = (
        load_fleet_or_exit(fleet).temporal.connect_config()
        if fleet is not None
        else {"target_host": "127.0.0.1:7233"}
    )

    async def connect() -> Client:
        return await Client.connect(**connect_config)

    opener = PayloadOpener(store, tenant_of=WorkflowTenants(connect), codec=own)
    quota = EncodeQuota(int(encode_quota_mib * 2**20), ENCODE_QUOTA_WINDOW_S)
    app = codec_app(opener, access, ui_origins=origins, encode_quota=quota)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if access.open:
        out.print(
            "No --tokens: every caller reads every tenant's payloads, so this server listens "
            f"on {host} (this machine) only.",
            highlight=False,
        )
    else:
        out.print(
            f"{len(access.tokens)} tokens from {tokens}; tenants are looked up in Temporal.",
            highlight=False,
        )
    out.print(
        f"Codec server for {store.location} at [bold]http://{host}:{port}[/] "
        f"(UI origins {', '.join(origins)}). Ctrl-C stops it.",
        highlight=False,
    )
    uvicorn.run(app, host=host, port=port, log_level="warning", lifespan="off")

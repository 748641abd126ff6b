"""`kvflow context`: the content-addressed context store's retention; how commands open a store.

Every command that reads or writes the context store takes `--context-store` (`--store` here):
a directory, or the URL of a store many machines share (`postgresql://...`, `s3://...`; see
`kvflow.activities.context_store.open_context_store`). The older spelling, `--context-dir`
(`--dir` here), is the same option and takes the same values.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

import typer

from kvflow.activities.context_store import (
    DEFAULT_CONTEXT_DIR,
    ContextStore,
    ContextStoreUnavailable,
    ContextStoreUrlError,
    DirectoryContextStore,
    open_context_store,
)
from kvflow.cli.url_options import fail_without_secrets, url_option
from kvflow.workers.console import fail, out

context_app = typer.Typer(help="Manage the context store.", no_args_is_help=True)

STORE_HELP = (
    "the context store every worker shares: a directory, postgresql://user@host:5432/db"
    "?schema=NAME or s3://bucket/prefix?endpoint_url=URL"
)
DEFAULT_CONTEXT_STORE = str(DEFAULT_CONTEXT_DIR)
ContextStoreOption = Annotated[
    str,
    typer.Option("--context-store", "--context-dir", callback=url_option, help=STORE_HELP),
]
"""The store every worker, the codec server and reconcile share (`--context-dir`: its older
name)."""


def open_store_or_exit(spec: str, option: str, *, existing: bool = False) -> ContextStore:
    """The store `spec` names; else exit 2 with what is wrong and how to fix it, no password.

    `existing`: a directory store must already exist (a command that only reads it).
    """
    try:
        store = open_context_store(spec)
    except (ContextStoreUrlError, ContextStoreUnavailable) as exc:
        fail_without_secrets(f"{option}: {exc}", spec)
    if existing and isinstance(store, DirectoryContextStore) and not store.root.is_dir():
        fail(f"no context store at {store.root.absolute()}; point {option} at the workers' one")
    return store


@context_app.command("prune")
def prune_command(
    older_than_days: Annotated[
        float,
        typer.Option(
            "--older-than-days",
            min=0,
            help="delete contents not stored or read for this many days; choose more than "
            "the longest task lasts, or its references stop resolving",
        ),
    ],
    context_store: Annotated[
        str, typer.Option("--store", "--dir", callback=url_option, help=STORE_HELP)
    ] = DEFAULT_CONTEXT_STORE,
) -> None:
    """Delete contents of the context store (every tenant's) that were not used lately."""
    store = open_store_or_exit(context_store, "--store", existing=True)
    try:
        removed = store.prune(timedelta(days=older_than_days))
    except ContextStoreUnavailable as exc:
        fail_without_secrets(str(exc), context_store, code=1)
    finally:
        store.close()
    out.print(
        f"removed {removed} contents older than {older_than_days:g} days from {store.location}",
        highlight=False,
    )

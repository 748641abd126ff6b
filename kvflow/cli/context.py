"""`kvflow context`: the content-addressed context store's retention."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Annotated

import typer

from kvflow.activities.context_store import DEFAULT_CONTEXT_DIR, DirectoryContextStore
from kvflow.workers.console import fail, out

context_app = typer.Typer(help="Manage the context store.", no_args_is_help=True)


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
    context_dir: Annotated[
        Path, typer.Option("--dir", help="the context store directory every worker shares")
    ] = DEFAULT_CONTEXT_DIR,
) -> None:
    """Delete contents of the context store (every tenant's) that were not used lately."""
    if not context_dir.is_dir():
        fail(f"no context store at {context_dir.absolute()}; point --dir at the workers' one")
    removed = DirectoryContextStore(context_dir).prune(timedelta(days=older_than_days))
    out.print(f"removed {removed} contents older than {older_than_days:g} days from {context_dir}")

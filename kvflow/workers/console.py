"""The CLI's consoles and its one way to report a user error.

Every `kvflow` subcommand, wherever it lives, prints through `out` and `err` and reports bad
input with `fail`, so errors look the same and exit codes mean the same everywhere.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from kvflow.workers.config import FleetConfig, FleetConfigError, load_fleet

# Piped output (CI logs, `| less`) gets 120 columns instead of rich's default 80 so the fleet
# tables stay readable; a terminal keeps its own width.
_PIPE_WIDTH = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 120
out = Console(width=_PIPE_WIDTH)
err = Console(stderr=True, width=_PIPE_WIDTH)


def fail(message: str, code: int = 2) -> NoReturn:
    """Print a user-facing error (no traceback) and exit with `code`.

    `message` is plain text: a path or a value with brackets in it prints as written.
    """
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def load_fleet_or_exit(path: Path) -> FleetConfig:
    """Load `path`, or print every problem in it and exit 2."""
    try:
        return load_fleet(path)
    except FleetConfigError as exc:
        for problem in exc.problems:
            err.print(f"[red]✗[/] {escape(str(problem))}", highlight=False, soft_wrap=True)
        count = len(exc.problems)
        fail(f"{path}: {count} problem{'s' if count != 1 else ''}; fix them and run again")


PortOption = Annotated[int, typer.Option("--port", help="gRPC port of the Temporal frontend")]
UiPortOption = Annotated[int, typer.Option("--ui-port", help="port of the Temporal Web UI")]
StateDirOption = Annotated[
    Path, typer.Option("--state-dir", help="folder for the SQLite file and logs")
]

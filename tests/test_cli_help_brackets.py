"""Every `kvflow ... --help` shows the square brackets its help text holds.

Typer renders help text as rich markup, where `[temporal]` is a style tag: unescaped, it
vanishes and leaves "the fleet file's  table". Help texts escape their brackets (`\\[`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from kvflow.cli.main import app

runner = CliRunner()

_BRACKETED = re.compile(r"\\?\[[^\[\]]*\]")
"""A bracketed term of a help text as written, escaped or not."""


def _commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield path, command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from _commands(sub, (*path, name))


COMMANDS = dict(_commands(typer.main.get_command(app)))


def _written_terms(command: Any) -> list[str]:
    """The bracketed terms of the command's help and its options' help, as they should show."""
    texts = [command.help or "", *(getattr(p, "help", None) or "" for p in command.params)]
    return [term.removeprefix("\\") for text in texts for term in _BRACKETED.findall(text)]


def _rendered_help(path: tuple[str, ...]) -> str:
    result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "240"})
    assert result.exit_code == 0, result.output
    # Undo rich's layout: box edges and line breaks.
    return " ".join(result.output.replace("│", " ").split())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", list(COMMANDS), ids=lambda p: " ".join(p) or "kvflow")
def test_help_shows_every_bracketed_term_it_was_written_with(path: tuple[str, ...]) -> None:
    shown = _rendered_help(path)
    missing = [term for term in _written_terms(COMMANDS[path]) if term not in shown]
    assert missing == [], f"kvflow {' '.join(path)} --help lost {missing}:\n{shown}"


@pytest.mark.timeout(30)
def test_reconcile_help_names_the_fleet_files_temporal_table() -> None:
    assert "the fleet file's [temporal] table" in _rendered_help(("ledger", "reconcile"))
    demo = _rendered_help(("demo",))
    assert "URL[,URL...]" in demo and "NAME[,NAME...]" in demo

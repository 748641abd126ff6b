"""`kvflow report` and `kvflow ledger migrate|reconcile`.

Exit codes follow the `kvflow` CLI: 0 success, 1 a runtime failure (Temporal unreachable),
2 bad input (unknown group-by field, bad, empty or out-of-range dates, an empty tenant, a
ledger that does not exist, is unreachable or has an old schema), always with a message and
never a traceback. Messages quote what the user typed, so they are printed as plain text:
a `[/x]` in a URL or a date is not a markup tag.
"""

from __future__ import annotations

import asyncio
import io
import sys
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from temporalio.client import Client
from temporalio.service import RPCError

from kvflow.cli.context import DEFAULT_CONTEXT_STORE, ContextStoreOption, open_store_or_exit
from kvflow.cli.url_options import fail_without_secrets, url_option
from kvflow.ledger.errors import LedgerError
from kvflow.ledger.export import (
    report_csv,
    report_html,
    report_json,
    report_notes,
)
from kvflow.ledger.focus import focus_csv, ledger_focus_export
from kvflow.ledger.migrations import LATEST_VERSION
from kvflow.ledger.report import Report, ReportQuery
from kvflow.ledger.store import (
    DEFAULT_LEDGER_URL,
    LEDGER_URL_ENV,
    AsyncLedger,
    connect_ledger,
    open_ledger,
)
from kvflow.ledger.table import print_whole, report_table
from kvflow.scheduler.fleet import format_usd
from kvflow.workers.config import TemporalConnection
from kvflow.workers.console import err, fail, load_fleet_or_exit, out
from kvflow.workers.plugin import KvflowPlugin
from kvflow.workers.reconcile import ReconcileResult, reconcile

ledger_app = typer.Typer(
    help="The spend ledger: create or upgrade its schema, fill task rows from Temporal.",
    no_args_is_help=True,
)


class ReportFormat(StrEnum):
    """Output formats of `kvflow report`."""

    TABLE = "table"
    CSV = "csv"
    JSON = "json"
    HTML = "html"
    FOCUS = "focus"
    """FOCUS 1.2 cost and usage rows (CSV) for FinOps tools (`kvflow.ledger.focus`)."""


DbOption = Annotated[
    str,
    typer.Option(
        "--db",
        envvar=LEDGER_URL_ENV,
        callback=url_option,
        help="ledger URL: sqlite:///path/to/ledger.db or postgresql://user@host:5432/db",
    ),
]


def report_command(
    db: DbOption = DEFAULT_LEDGER_URL,
    group_by: Annotated[
        str,
        typer.Option(
            "--group-by",
            help="comma-separated: tenant, workflow_type, model, pool, day (empty: one row)",
        ),
    ] = "tenant,workflow_type",
    since: Annotated[
        str | None,
        typer.Option("--since", help="first UTC day (YYYY-MM-DD, inclusive) or ISO date-time"),
    ] = None,
    until: Annotated[
        str | None,
        typer.Option("--until", help="last UTC day (YYYY-MM-DD, inclusive) or ISO date-time"),
    ] = None,
    tenant: Annotated[str | None, typer.Option("--tenant", help="only this tenant")] = None,
    output_format: Annotated[
        ReportFormat,
        typer.Option(
            "--format",
            help="table, csv, json, html, or focus (FOCUS 1.2 CSV for FinOps tools; usage by "
            "day, tenant, workflow type, outcome, pool, model and token type, with the bills' "
            "rounding to the micro-dollar as adjustments, whatever --group-by says)",
        ),
    ] = ReportFormat.TABLE,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="write to this file instead of stdout")
    ] = None,
) -> None:
    r"""Cost per successful task, with every failed attempt and retry counted.

    Tasks are selected by when they closed. Money is in US dollars; JSON is {"rows": \[...]}.
    """
    query = _report_query(group_by, since, until, tenant)
    focus_text, focus_rows = "", 0
    try:
        with open_ledger(db) as ledger:
            if output_format is ReportFormat.FOCUS:
                report, focus = ledger_focus_export(ledger, query)
                focus_text, focus_rows = focus_csv(focus), len(focus.charges)
            else:
                report = ledger.report(query)
    except LedgerError as exc:
        fail_without_secrets(str(exc), db)

    if output_format is ReportFormat.TABLE:
        if output is None:
            print_whole(out, report_table(report))
            for note in report_notes(report):
                out.print(note, style="dim", highlight=False)
            return
        text = _render_table_text(report)
    elif output_format is ReportFormat.CSV:
        text = report_csv(report)
    elif output_format is ReportFormat.JSON:
        text = report_json(report)
    elif output_format is ReportFormat.HTML:
        text = report_html(report)
    else:
        text = focus_text
        # A FOCUS file has no room for them: what it leaves out is said on stderr.
        for note in report_notes(report):
            err.print(note, style="dim", highlight=False)

    if output is None:
        sys.stdout.write(text)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        fail(f"cannot write {output}: {exc.strerror or exc}")
    rows = focus_rows if output_format is ReportFormat.FOCUS else len(report.rows)
    err.print(
        f"wrote {output} ({rows} row{'s' if rows != 1 else ''}, {output_format.value})",
        highlight=False,
    )


def _report_query(
    group_by: str, since: str | None, until: str | None, tenant: str | None
) -> ReportQuery:
    """The report's query from its options, or exit 2 naming the option that is wrong.

    An empty `--since`, `--until` or `--tenant` (an unset shell variable) is refused rather
    than read as "no bound": `--tenant ""` would otherwise report every tenant. Any other
    tenant is data (the ledger may hold names the fleet would refuse), matched verbatim.
    """
    for option, value in (("--since", since), ("--until", until), ("--tenant", tenant)):
        if value is not None and not value.strip():
            fail(f"{option} is empty; give a value, or leave {option} out")
    try:
        return ReportQuery.parse(group_by, since, until, tenant)
    except LedgerError as exc:
        fail(str(exc))
    except OverflowError:
        # A date near 0001-01-01 or 9999-12-31 leaves the calendar once it is made UTC (or,
        # for --until, once its whole day is added).
        if _overflows(since=since):
            fail(f"--since {since!r} falls outside the years 1 to 9999 once in UTC")
        fail(
            f"--until {until!r} reaches past 9999-12-31 in UTC (a date counts its whole "
            "day, so the last date --until takes is 9999-12-30)"
        )


def _overflows(since: str | None = None, until: str | None = None) -> bool:
    """Whether this bound, read alone, leaves the calendar."""
    try:
        ReportQuery.parse("", since=since, until=until)
    except OverflowError:
        return True
    except LedgerError:
        return False
    return False


def _render_table_text(report: Report) -> str:
    buffer = io.StringIO()
    # A file gets plain text (no colour codes) at a width that fits every column.
    console = Console(file=buffer, width=100)
    print_whole(console, report_table(report))
    for note in report_notes(report):
        console.print(note, highlight=False)
    return buffer.getvalue()


@ledger_app.command("migrate")
def migrate_command(db: DbOption = DEFAULT_LEDGER_URL) -> None:
    """Create the ledger (a SQLite file, a PostgreSQL schema) or upgrade it to this kvflow."""
    try:
        with connect_ledger(db, create=True) as ledger:
            applied = ledger.migrate()
    except LedgerError as exc:
        fail_without_secrets(str(exc), db)
    if applied:
        versions = ", ".join(str(v) for v in applied)
        out.print(
            f"[green]✓[/] {ledger.url}: applied migration(s) {versions}; "
            f"schema version {LATEST_VERSION}",
            highlight=False,
        )
    else:
        out.print(
            f"[green]✓[/] {ledger.url}: already at schema version {LATEST_VERSION}",
            highlight=False,
        )


def _print_reconcile(result: ReconcileResult) -> None:
    if result.written:
        table = Table(title="Task rows written")
        for column in ("workflow id", "run id", "type", "tenant", "outcome", "attempts", "spend"):
            table.add_column(column)
        for task in result.written:
            table.add_row(
                task.workflow_id,
                task.run_id,
                task.workflow_type,
                task.tenant,
                task.outcome.value,
                str(task.attempts),
                f"${format_usd(task.spend_micros)}",
            )
        out.print(table)
    if result.moved:
        moved = Table(title="Tasks whose ledger spend moved after they closed")
        for column in ("workflow id", "run id", "tenant", "at close", "ledger", "moved"):
            moved.add_column(column)
        for task in result.moved:
            sign = "+" if task.moved_micros >= 0 else "-"
            moved.add_row(
                task.workflow_id,
                task.run_id,
                task.tenant,
                f"${format_usd(task.spend_at_close_micros)}",
                f"${format_usd(task.spend_micros)}",
                f"{sign}${format_usd(abs(task.moved_micros))}",
            )
        out.print(moved)
        out.print(
            "Rows reached the ledger after these tasks closed (a spool replayed, an estimate "
            "replaced): the ledger's figure is the one the report uses.",
            highlight=False,
        )
    out.print(
        f"{result.examined} closed run(s) examined: {len(result.written)} task row(s) written, "
        f"{result.already_recorded} already recorded, {result.skipped} skipped "
        "(not kvflow tasks)",
        highlight=False,
    )


@ledger_app.command("reconcile")
def reconcile_command(
    db: DbOption = DEFAULT_LEDGER_URL,
    fleet: Annotated[
        Path | None,
        typer.Option("--fleet", help="take the Temporal connection from this fleet file"),
    ] = None,
    address: Annotated[
        str | None, typer.Option("--address", help="Temporal frontend HOST:PORT")
    ] = None,
    namespace: Annotated[str | None, typer.Option("--namespace", help="Temporal namespace")] = None,
    query: Annotated[
        str | None,
        typer.Option("--query", help="extra visibility filter, e.g. \"WorkflowType = 'X'\""),
    ] = None,
    since: Annotated[
        datetime | None,
        typer.Option("--since", help="only runs closed at or after this (ISO date or date-time)"),
    ] = None,
    context_store: ContextStoreOption = DEFAULT_CONTEXT_STORE,
) -> None:
    r"""Write task rows for closed workflows that have none (terminated, timed out).

    The Temporal connection is the fleet file's \[temporal] table (or 127.0.0.1:7233, namespace
    default), then TEMPORAL_ADDRESS / TEMPORAL_NAMESPACE, then --address / --namespace. Its
    client decodes payloads as the workers' do: those over 2 KB from --context-store.
    """
    connection = load_fleet_or_exit(fleet).temporal if fleet is not None else TemporalConnection()
    config = connection.connect_config()
    if address:
        config["target_host"] = address
    if namespace:
        config["namespace"] = namespace
    try:
        ledger = open_ledger(db)
    except LedgerError as exc:
        fail_without_secrets(str(exc), db)
    store = open_store_or_exit(context_store, "--context-store")

    async def run() -> ReconcileResult:
        try:
            # The workers' converter and codec: a payload over 2 KB is a reference into the store.
            plugins = [KvflowPlugin(context_store=store)]
            client = await Client.connect(**config, plugins=plugins)
        except RuntimeError as exc:
            fail(f"cannot reach Temporal at {config.get('target_host')}: {exc}", code=1)
        try:
            return await reconcile(AsyncLedger(ledger), client, query=query, closed_since=since)
        except RPCError as exc:
            fail(f"Temporal refused the visibility query: {exc}")

    try:
        result = asyncio.run(run())
    except LedgerError as exc:
        fail_without_secrets(str(exc), db, code=1)
    finally:
        ledger.close()
        store.close()
    _print_reconcile(result)

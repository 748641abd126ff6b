"""The finance report as a terminal table, for the CLI and the demo."""

from __future__ import annotations

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from kvflow.ledger.export import HEADINGS, row_values
from kvflow.ledger.report import METRIC_COLUMNS, RATIO_COLUMNS, Report

_TABLE_HEADINGS: dict[str, str] = {
    **HEADINGS,
    "succeeded": "ok",
    "success_rate": "success",
    "total_spend_usd": "spend",
    "wasted_spend_usd": "wasted",
    "cost_per_successful_task_usd": "per success",
    "p50_cost_per_succeeded_task_usd": "p50",
    "p95_cost_per_succeeded_task_usd": "p95",
    "cached_token_share": "cached",
    "tokens_saved_by_resume": "saved by resume",
}
"""Short headings for the terminal, where width is scarce (the caption explains them)."""


def _percent(value: object) -> str:
    return "–" if value is None else f"{float(str(value)) * 100:.1f}%"


def print_whole(console: Console, table: Table) -> None:
    """Print `table` at its natural width, even if wider than the terminal.

    Rich would cut figures short to fit; a wrapped line is better than a wrong-looking number.
    """
    # Measure against an unbounded width: a measurement never exceeds the width it is given.
    needed = Measurement.get(console, console.options.update_width(10_000), table).maximum
    if needed <= console.width:
        console.print(table)
        return
    width = console.width
    console.width = needed
    try:
        console.print(table)
    finally:
        console.width = width


def report_table(report: Report) -> Table:
    """The report as a rich table with a totals row; money cells are never cut."""
    table = Table(
        title="Cost per successful task",
        caption="Money in US dollars. ok: succeeded tasks; per success: spend / ok; "
        "p50, p95: cost of a succeeded task; cached: cached share of prompt tokens.",
    )
    keys = [f.value for f in report.query.group_by]
    for column in (*keys, *METRIC_COLUMNS):
        table.add_column(
            _TABLE_HEADINGS[column],
            justify="left" if column in keys else "right",
            # Figures and group names must be read whole; headings may wrap instead.
            no_wrap=True,
        )

    def cells(values: dict[str, object]) -> list[str]:
        shown: list[str] = []
        for column in (*keys, *METRIC_COLUMNS):
            value = values.get(column)
            if column in RATIO_COLUMNS:
                shown.append(_percent(value))
            elif value is None:
                shown.append("–")
            elif isinstance(value, int):
                shown.append(f"{value:,}")
            else:
                shown.append(str(value))
        return shown

    for row in report.rows:
        table.add_row(*cells(dict(row_values(row))))
    if keys:  # without group keys the one row is the total
        table.add_section()
        total = cells({**dict.fromkeys(keys, ""), **report.totals.metrics()})
        total[0] = "total"
        table.add_row(*total, style="bold")
    return table

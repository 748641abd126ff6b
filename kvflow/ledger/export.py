"""The report as JSON, CSV and a self-contained HTML page.

JSON is `{"rows": [...]}`: one object per group with the group keys by name, counts as
integers, ratios as numbers (four places), and money as dollar decimal strings
(`"0.004213"`) or null. CSV has the same columns in the same order (null is an empty cell).
The HTML page needs no network and no script: a table with the same values and an inline SVG
chart of the cost per successful task per day, one line per tenant.
"""

from __future__ import annotations

import csv
import io
import json
from collections import defaultdict
from datetime import date
from decimal import Decimal
from html import escape

from kvflow.ledger.report import (
    METRIC_COLUMNS,
    Report,
    ReportRow,
)
from kvflow.scheduler.fleet import format_usd, micros_to_usd

CellValue = str | int | float | None


def row_values(row: ReportRow) -> dict[str, str | int | Decimal | None]:
    """One row's group keys and metrics, keyed by column name, in `Report.columns` order."""
    return {**row.keys, **row.metrics()}


def _json_value(value: str | int | Decimal | None) -> CellValue:
    # Ratios are not money: a JSON number reads best in other tools.
    return float(value) if isinstance(value, Decimal) else value


def report_json(report: Report) -> str:
    """The report as `{"rows": [...], "moved_tasks": [...]}` (value types: module docstring).

    `moved_tasks` lists the tasks whose ledger spend moved after they closed
    (`Report.moved`), with both figures.
    """
    rows = [
        {name: _json_value(value) for name, value in row_values(row).items()} for row in report.rows
    ]
    moved = [
        {
            "workflow_id": task.workflow_id,
            "run_id": task.run_id,
            "tenant": task.tenant,
            "spend_at_close_usd": format_usd(task.spend_at_close_micros),
            "ledger_spend_usd": format_usd(task.spend_micros),
        }
        for task in report.moved
    ]
    return json.dumps({"rows": rows, "moved_tasks": moved}, indent=2) + "\n"


def cell_text(value: str | int | Decimal | None) -> str:
    """A value as CSV and HTML show it: the same text as its JSON form, empty for null."""
    json_value = _json_value(value)
    return "" if json_value is None else str(json_value)


def report_csv(report: Report) -> str:
    """The report as CSV with a header row of `report.columns`."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(report.columns)
    for row in report.rows:
        values = row_values(row)
        writer.writerow([cell_text(values[column]) for column in report.columns])
    return buffer.getvalue()


HEADINGS: dict[str, str] = {
    "tenant": "tenant",
    "workflow_type": "workflow type",
    "model": "model",
    "pool": "pool",
    "day": "day (UTC)",
    "tasks": "tasks",
    "succeeded": "succeeded",
    "success_rate": "success rate",
    "attempts": "attempts",
    "total_spend_usd": "total spend (USD)",
    "wasted_spend_usd": "wasted spend (USD)",
    "cost_per_successful_task_usd": "cost per successful task (USD)",
    "p50_cost_per_succeeded_task_usd": "p50 per succeeded task (USD)",
    "p95_cost_per_succeeded_task_usd": "p95 per succeeded task (USD)",
    "cached_token_share": "cached token share",
    "tokens_saved_by_resume": "tokens saved by resume",
}
"""Human column headings for the table and the HTML page."""

_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
_WIDTH, _HEIGHT = 860, 340
_LEFT, _RIGHT, _TOP, _BOTTOM = 90, 170, 20, 50

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem; color: #222; }
h1 { font-size: 1.5rem; } h2 { font-size: 1.15rem; margin-top: 2rem; }
.meta, .note { color: #555; font-size: 0.9rem; }
table { border-collapse: collapse; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.3rem 0.6rem; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tfoot td, tfoot th { font-weight: bold; background: #f4f4f4; }
svg text { font-size: 12px; fill: #333; }
"""


def _nice_step(maximum: int) -> int:
    """The smallest 1-2-5 × 10^k step (micro-dollars) that covers `maximum` in 5 ticks."""
    target = max(1, -(-maximum // 5))
    magnitude = 1
    while True:
        for factor in (1, 2, 5):
            if factor * magnitude >= target:
                return factor * magnitude
        magnitude *= 10


def _usd_label(micros: int) -> str:
    return "$" + format(micros_to_usd(micros).normalize(), "f")


def chart_svg(report: Report) -> str:
    """An SVG line chart of cost per successful task per UTC day, one line per tenant.

    Each point is a `<circle>` with `data-tenant`, `data-day` and `data-cost-usd` attributes
    and a `<title>` tooltip; days on which a tenant had no success leave a gap in its line.
    """
    series: dict[str, dict[date, int]] = defaultdict(dict)
    for row in report.daily_by_tenant:
        cost = row.cost_per_successful_task_micros
        tenant, day_text = row.keys.get("tenant"), row.keys.get("day")
        if cost is not None and tenant is not None and day_text is not None:
            series[tenant][date.fromisoformat(day_text)] = cost
    if not series:
        return '<p class="note">No task succeeded in this range: there is nothing to chart.</p>'
    days = sorted({day for points in series.values() for day in points})
    first, span = days[0], max(1, (days[-1] - days[0]).days)
    step = _nice_step(max(cost for points in series.values() for cost in points.values()))
    ticks = -(-max(cost for points in series.values() for cost in points.values()) // step)
    top_value = max(1, ticks) * step
    plot_w, plot_h = _WIDTH - _LEFT - _RIGHT, _HEIGHT - _TOP - _BOTTOM

    def x(day: date) -> int:
        if len(days) == 1:
            return _LEFT + plot_w // 2
        return _LEFT + (day - first).days * plot_w // span

    def y(micros: int) -> int:
        return _TOP + plot_h - micros * plot_h // top_value

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{_HEIGHT}" '
        f'viewBox="0 0 {_WIDTH} {_HEIGHT}" role="img" '
        'aria-label="Cost per successful task per day, by tenant">'
    ]
    for tick in range(max(1, ticks) + 1):
        value = tick * step
        parts.append(
            f'<line x1="{_LEFT}" y1="{y(value)}" x2="{_LEFT + plot_w}" y2="{y(value)}" '
            'stroke="#e3e3e3"/>'
            f'<text x="{_LEFT - 8}" y="{y(value) + 4}" text-anchor="end">'
            f"{escape(_usd_label(value))}</text>"
        )
    # Label at most ~8 days so that long ranges stay readable.
    label_every = max(1, -(-len(days) // 8))
    labelled = set(range(0, len(days), label_every))
    if (len(days) - 1) - max(labelled) >= label_every:
        labelled.add(len(days) - 1)
    for index, day in enumerate(days):
        if index in labelled:
            parts.append(
                f'<text x="{x(day)}" y="{_TOP + plot_h + 20}" text-anchor="middle">'
                f"{day.isoformat()}</text>"
            )
    parts.append(
        f'<line x1="{_LEFT}" y1="{_TOP + plot_h}" x2="{_LEFT + plot_w}" y2="{_TOP + plot_h}" '
        'stroke="#888"/>'
    )
    for index, tenant in enumerate(sorted(series)):
        color = _COLORS[index % len(_COLORS)]
        points = series[tenant]
        # Consecutive days with a success form one segment; a day without one breaks the line.
        segment: list[str] = []
        segments: list[list[str]] = [segment]
        for day in days:
            if day in points:
                segment.append(f"{x(day)},{y(points[day])}")
            elif segment:
                segment = []
                segments.append(segment)
        for run in segments:
            if len(run) > 1:
                parts.append(
                    f'<polyline fill="none" stroke="{color}" stroke-width="2" '
                    f'points="{" ".join(run)}"/>'
                )
        for day, cost in sorted(points.items()):
            usd = format_usd(cost)
            parts.append(
                f'<circle cx="{x(day)}" cy="{y(cost)}" r="3.5" fill="{color}" '
                f'data-tenant="{escape(tenant)}" data-day="{day.isoformat()}" '
                f'data-cost-usd="{usd}"><title>{escape(tenant)} {day.isoformat()}: '
                f"${usd} per successful task</title></circle>"
            )
        legend_y = _TOP + 10 + index * 18
        parts.append(
            f'<rect x="{_WIDTH - _RIGHT + 16}" y="{legend_y - 9}" width="12" height="12" '
            f'fill="{color}"/><text x="{_WIDTH - _RIGHT + 34}" y="{legend_y + 1}">'
            f"{escape(tenant)}</text>"
        )
    parts.append("</svg>")
    return "\n".join(parts)


def report_notes(report: Report) -> list[str]:
    """Sentences that qualify the figures: attempt-level grouping, attempts left out."""
    notes = []
    if report.totals.tasks == 0:
        notes.append("No task closed in this range (and for this tenant).")
    if report.query.attempt_level:
        notes.append(
            "Grouped by model or pool: a task counts in every group it used, with its spend "
            "there, so task counts can add up to more than the total."
        )
    if report.unclosed_attempts:
        notes.append(
            f"{report.unclosed_attempts} attempt(s) costing "
            f"${format_usd(report.unclosed_spend_micros)} belong to tasks with no task row "
            "(still running, or closed without one: run `kvflow ledger reconcile`); they are "
            "not in this report."
        )
    if report.moved:
        moved = sum(task.moved_micros for task in report.moved)
        sign = "+" if moved >= 0 else "-"
        notes.append(
            f"{len(report.moved)} task(s) had rows arrive or change after they closed (a "
            f"spool replayed, an estimate replaced): their ledger spend differs from what "
            f"they showed at the close by {sign}${format_usd(abs(moved))} in all. The figures "
            "above are the ledger's; `kvflow ledger reconcile` lists the tasks."
        )
    return notes


def _cell(column: str, value: str | int | Decimal | None) -> str:
    numeric = column in METRIC_COLUMNS
    css = ' class="num"' if numeric else ""
    text = cell_text(value)
    shown = "–" if value is None else escape(text)
    return f'<td data-column="{column}" data-value="{escape(text)}"{css}>{shown}</td>'


def report_html(report: Report, *, title: str = "kvflow: cost per successful task") -> str:
    """A self-contained HTML page: the report table (with totals) and the per-tenant chart.

    Every cell carries `data-column` and `data-value` (the CSV value) so that other tools can
    read the page as well as people.
    """
    query = report.query
    group_names = [HEADINGS[f.value] for f in query.group_by] or ["all tasks"]
    since = query.since.isoformat() if query.since else None
    until = query.until.isoformat() if query.until else None
    if since and until:
        scope = f"Tasks closed from {since} until (not including) {until}"
    elif since:
        scope = f"Tasks closed from {since}"
    elif until:
        scope = f"Tasks closed before {until}"
    else:
        scope = "All closed tasks"
    scope += f", tenant {query.tenant}" if query.tenant else ", all tenants"
    head = "".join(
        f'<th scope="col" data-column="{c}">{escape(HEADINGS[c])}</th>' for c in report.columns
    )
    body = "\n".join(
        "<tr>" + "".join(_cell(c, v) for c, v in row_values(row).items()) + "</tr>"
        for row in report.rows
    )
    totals = report.totals.metrics()
    key_count = len(query.group_by)
    foot = (f'<th scope="row" colspan="{key_count}">total</th>' if key_count else "") + "".join(
        _cell(c, totals[c]) for c in METRIC_COLUMNS
    )
    notes = report_notes(report)
    note_html = "".join(f'<p class="note">{escape(n)}</p>' for n in notes)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{escape(title)}</title>
<style>{_STYLE}</style>
</head>
<body>
<h1>{escape(title)}</h1>
<p class="meta">{escape(scope)}; grouped by {escape(", ".join(group_names))}.
Money in US dollars; success rate and cached token share are fractions of 1.</p>
<h2>Cost per successful task per day, by tenant</h2>
{chart_svg(report)}
<h2>Report</h2>
<table id="report">
<thead><tr>{head}</tr></thead>
<tbody>
{body}
</tbody>
<tfoot><tr>{foot}</tr></tfoot>
</table>
{note_html}
</body>
</html>
"""

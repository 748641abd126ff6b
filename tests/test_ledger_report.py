"""The cost-per-successful-task report, checked against figures computed by hand.

Prices (tests.fixtures_ledger.PRICES): 2 µ$ per input token, 0.5 per cached token, 10 per
output token. The ledger holds:

acme / ResearchAgent
- A, closed 2025-03-03, succeeded on a retry:
  plan try 1 on h100 failed  1000 in, 0 cached, 100 out    = 2000 + 0 + 1000    = 3000 (waste)
  plan try 2 on a100 ok      1000 in, 800 cached, 300 out  = 400 + 400 + 3000   = 3800
  answer on a100 ok          2000 in, 1000 cached, 500 out = 2000 + 500 + 5000  = 7500
  spend 14300, wasted 3000
- B, closed 2025-03-03, failed after two paid steps:
  plan on h100 ok            1000 in, 0 cached, 200 out    = 2000 + 2000        = 4000
  draft on h100 ok           1500 in, 1000 cached, 400 out = 1000 + 500 + 4000  = 5500
  critique on h100 failed    2000 in, 1500 cached, 0 out   = 1000 + 750         = 1750
  spend 11250, all wasted
- C, closed 2025-03-04, succeeded after a cut stream resumed elsewhere (llama-8b on l4):
  answer try 1 resumed_elsewhere 500 in, 0 cached, 50 out  = 1000 + 500         = 1500
  answer try 2 ok, 50 reused     500 in, 0 cached, 50 out  = 1000 + 500         = 1500
  spend 3000, no waste (the cut attempt's output was carried on), 50 tokens saved
globex / Support (llama-8b on l4), closed 2025-03-04
- D terminated: one cancelled attempt 800 in, 0 cached, 20 out = 1600 + 200     = 1800
- E succeeded: one attempt 1000 in, 500 cached, 100 out  = 1000 + 250 + 1000    = 2250
A running task F has one attempt (1000 in, 0 out = 2000) and no task row yet.
"""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvflow.cli.main import app
from kvflow.ledger import (
    AttemptOutcome,
    Ledger,
    ReportQuery,
    ReportQueryError,
    TaskOutcome,
    connect_ledger,
)
from kvflow.ledger.export import report_csv, report_html, report_json
from tests.fixtures_ledger import attempt_record, task_record

DAY1 = datetime(2025, 3, 3, 12, 0, tzinfo=UTC)
DAY2 = datetime(2025, 3, 4, 12, 0, tzinfo=UTC)
OK, FAILED = AttemptOutcome.OK, AttemptOutcome.FAILED

runner = CliRunner()


def _fill(ledger: Ledger) -> None:
    acme: dict[str, Any] = {"tenant": "acme", "workflow_type": "ResearchAgent"}
    big: dict[str, Any] = {"model": "llama-70b"}
    small: dict[str, Any] = {"model": "llama-8b", "pool": "l4"}
    globex: dict[str, Any] = {"tenant": "globex", "workflow_type": "Support", **small}
    attempts = [
        # A: succeeded on a retry
        attempt_record("A", **acme, **big, activity_id="1", attempt=1, step="plan", pool="h100",
                       outcome=FAILED, prompt_tokens=1000, completion_tokens=100),
        attempt_record("A", **acme, **big, activity_id="1", attempt=2, step="plan", pool="a100",
                       prompt_tokens=1000, cached_tokens=800, completion_tokens=300),
        attempt_record("A", **acme, **big, activity_id="2", step="answer", pool="a100",
                       prompt_tokens=2000, cached_tokens=1000, completion_tokens=500),
        # B: failed after two paid steps
        attempt_record("B", **acme, **big, activity_id="1", step="plan", pool="h100",
                       prompt_tokens=1000, completion_tokens=200),
        attempt_record("B", **acme, **big, activity_id="2", step="draft", pool="h100",
                       prompt_tokens=1500, cached_tokens=1000, completion_tokens=400),
        attempt_record("B", **acme, **big, activity_id="3", step="critique", pool="h100",
                       outcome=FAILED, prompt_tokens=2000, cached_tokens=1500,
                       completion_tokens=0),
        # C: cut mid-stream, resumed elsewhere
        attempt_record("C", **acme, **small, activity_id="1", step="answer",
                       outcome=AttemptOutcome.RESUMED_ELSEWHERE, prompt_tokens=500,
                       completion_tokens=50),
        attempt_record("C", **acme, **small, activity_id="1", attempt=2, step="answer",
                       prompt_tokens=500, completion_tokens=50, reused_tokens=50),
        # D and E: globex
        attempt_record("D", **globex, activity_id="1", outcome=AttemptOutcome.CANCELLED,
                       prompt_tokens=800, completion_tokens=20),
        attempt_record("E", **globex, activity_id="1", prompt_tokens=1000, cached_tokens=500,
                       completion_tokens=100),
        # F: still running
        attempt_record("F", **acme, **big, activity_id="1", pool="h100", prompt_tokens=1000,
                       completion_tokens=0, started_at=DAY2),
    ]  # fmt: skip
    for record in attempts:
        assert ledger.record_attempt(record)
    tasks = [
        task_record("A", **acme, outcome=TaskOutcome.SUCCEEDED, closed_at=DAY1,
                    steps=2, attempts=3, spend_micros=14300),
        task_record("B", **acme, outcome=TaskOutcome.FAILED, closed_at=DAY1 + timedelta(hours=1),
                    steps=2, attempts=3, spend_micros=11250),
        task_record("C", **acme, outcome=TaskOutcome.SUCCEEDED, closed_at=DAY2,
                    steps=1, attempts=2, spend_micros=3000),
        task_record("D", tenant="globex", workflow_type="Support",
                    outcome=TaskOutcome.TERMINATED, closed_at=DAY2, steps=0, attempts=1,
                    spend_micros=1800),
        task_record("E", tenant="globex", workflow_type="Support",
                    outcome=TaskOutcome.SUCCEEDED, closed_at=DAY2 + timedelta(hours=11),
                    steps=1, attempts=1, spend_micros=2250),
    ]  # fmt: skip
    for task in tasks:
        assert ledger.record_task(task)


@pytest.fixture
def filled(ledger: Ledger) -> Ledger:
    _fill(ledger)
    return ledger


ACME = {
    "tenant": "acme",
    "workflow_type": "ResearchAgent",
    "tasks": 3,
    "succeeded": 2,
    "success_rate": 0.6667,
    "attempts": 8,
    "total_spend_usd": "0.028550",
    "wasted_spend_usd": "0.014250",
    "cost_per_successful_task_usd": "0.014275",
    "p50_cost_per_succeeded_task_usd": "0.003000",
    "p95_cost_per_succeeded_task_usd": "0.014300",
    "cached_token_share": 0.4526,  # 4300 cached of 9500 prompt tokens
    "tokens_saved_by_resume": 50,
}
GLOBEX = {
    "tenant": "globex",
    "workflow_type": "Support",
    "tasks": 2,
    "succeeded": 1,
    "success_rate": 0.5,
    "attempts": 2,
    "total_spend_usd": "0.004050",
    "wasted_spend_usd": "0.001800",
    "cost_per_successful_task_usd": "0.004050",
    "p50_cost_per_succeeded_task_usd": "0.002250",
    "p95_cost_per_succeeded_task_usd": "0.002250",
    "cached_token_share": 0.2778,  # 500 cached of 1800 prompt tokens
    "tokens_saved_by_resume": 0,
}


def _json_rows(report) -> list[dict[str, object]]:
    document = json.loads(report_json(report))
    assert list(document) == ["rows", "moved_tasks"]
    rows: list[dict[str, object]] = document["rows"]
    return rows


def test_cost_per_successful_task_counts_failures_and_retries(filled: Ledger) -> None:
    report = filled.report(ReportQuery())

    assert _json_rows(report) == [ACME, GLOBEX]
    totals = report.totals
    assert (totals.tasks, totals.succeeded) == (5, 3)
    # 32600 µ$ over 3 successes, rounded half up.
    assert totals.spend_micros == 32600
    assert totals.cost_per_successful_task_micros == 10867
    assert totals.wasted_micros == 14250 + 1800


def test_report_totals_equal_the_attempt_rows_to_the_micro_dollar(filled: Ledger) -> None:
    report = filled.report(ReportQuery(group_by=()))
    every_attempt = sum(a.cost_micros for wf in "ABCDEF" for a in filled.attempts_for(wf, "run-1"))

    assert report.totals.spend_micros + report.unclosed_spend_micros == every_attempt == 34600
    assert (report.unclosed_attempts, report.unclosed_spend_micros) == (1, 2000)
    assert report.rows[0].spend_micros == report.totals.spend_micros


def test_grouping_by_pool_counts_a_task_in_each_pool_it_used(filled: Ledger) -> None:
    report = filled.report(ReportQuery.parse("pool", tenant="acme"))
    rows = {row["pool"]: row for row in _json_rows(report)}

    assert list(rows) == ["a100", "h100", "l4"]
    # A touched a100 (3800 + 7500) and h100 (its failed try, 3000); B ran only on h100.
    assert (rows["a100"]["tasks"], rows["a100"]["succeeded"]) == (1, 1)
    assert rows["a100"]["total_spend_usd"] == "0.011300"
    assert rows["a100"]["wasted_spend_usd"] == "0.000000"
    assert (rows["h100"]["tasks"], rows["h100"]["succeeded"]) == (2, 1)
    assert rows["h100"]["total_spend_usd"] == "0.014250"
    assert rows["h100"]["wasted_spend_usd"] == "0.014250"
    assert rows["h100"]["cost_per_successful_task_usd"] == "0.014250"
    assert rows["l4"]["total_spend_usd"] == "0.003000"
    spends = sum(Decimal(str(r["total_spend_usd"])) for r in rows.values())
    assert spends == Decimal("0.028550")


def test_a_task_that_used_two_models_on_one_pool_is_one_task_of_that_pool(
    ledger: Ledger,
) -> None:
    # The fallback model on the same pool as the model asked for: one task, two models.
    on_h100: dict[str, Any] = {"tenant": "acme", "workflow_type": "Support", "pool": "h100"}
    for record in [
        attempt_record("G", **on_h100, model="llama-70b", activity_id="1", step="plan",
                       prompt_tokens=1000, completion_tokens=100),
        attempt_record("G", **on_h100, model="llama-8b", activity_id="2", step="answer",
                       prompt_tokens=1000, completion_tokens=100),
    ]:  # fmt: skip
        assert ledger.record_attempt(record)
    assert ledger.record_task(
        task_record("G", tenant="acme", workflow_type="Support", outcome=TaskOutcome.SUCCEEDED,
                    closed_at=DAY1, steps=2, attempts=2, spend_micros=0)
    )  # fmt: skip
    (pool,) = _json_rows(ledger.report(ReportQuery.parse("pool")))
    assert (pool["pool"], pool["tasks"], pool["succeeded"]) == ("h100", 1, 1)
    # Grouped by model too, the task is in each model's row, as it is in each pool it used.
    by_model = _json_rows(ledger.report(ReportQuery.parse("model,pool")))
    assert [(r["model"], r["tasks"]) for r in by_model] == [("llama-70b", 1), ("llama-8b", 1)]
    assert sum(Decimal(str(r["total_spend_usd"])) for r in by_model) == Decimal(
        str(pool["total_spend_usd"])
    )


def test_day_range_and_tenant_filter_select_tasks_by_close_day(filled: Ledger) -> None:
    report = filled.report(ReportQuery.parse("tenant,day", since="2025-03-04", until="2025-03-04"))
    rows = _json_rows(report)

    assert [(r["tenant"], r["day"], r["tasks"]) for r in rows] == [
        ("acme", "2025-03-04", 1),
        ("globex", "2025-03-04", 2),
    ]
    nothing_succeeded = filled.report(ReportQuery.parse("", until="2025-03-03", tenant="globex"))
    assert _json_rows(nothing_succeeded) == []
    only_b = filled.report(
        ReportQuery.parse("tenant", since="2025-03-03T12:30:00", until="2025-03-04T00:00:00Z")
    )
    (row,) = _json_rows(only_b)
    assert (row["tasks"], row["succeeded"], row["cost_per_successful_task_usd"]) == (1, 0, None)
    assert row["p50_cost_per_succeeded_task_usd"] is None


def test_bad_group_by_and_empty_range_name_the_problem() -> None:
    with pytest.raises(ReportQueryError, match=r"unknown group-by field 'colour'.*tenant"):
        ReportQuery.parse("tenant,colour")
    with pytest.raises(ReportQueryError, match="empty range"):
        ReportQuery.parse(since="2025-03-05", until="2025-03-04")
    with pytest.raises(ReportQueryError, match="not an ISO date"):
        ReportQuery.parse(since="last tuesday")
    with pytest.raises(ReportQueryError, match="more than once"):
        ReportQuery.parse("day,day")


def test_csv_and_json_carry_the_same_figures(filled: Ledger) -> None:
    report = filled.report(ReportQuery.parse("tenant,workflow_type,day"))
    rows_json = _json_rows(report)
    rows_csv = list(csv.DictReader(io.StringIO(report_csv(report))))

    assert list(rows_csv[0]) == list(report.columns) == list(rows_json[0])
    assert len(rows_csv) == len(rows_json) == 3
    for from_csv, from_json in zip(rows_csv, rows_json, strict=True):
        assert from_csv == {k: "" if v is None else str(v) for k, v in from_json.items()}
    # Dollars parse back to the exact micro-dollar totals.
    total = sum(Decimal(r["total_spend_usd"]) for r in rows_csv)
    assert total * 1_000_000 == report.totals.spend_micros == 32600
    acme_day1 = rows_json[0]
    assert (acme_day1["day"], acme_day1["cost_per_successful_task_usd"]) == (
        "2025-03-03",
        "0.025550",
    )


class _PageReader(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.section = ""
        self.rows: dict[str, list[dict[str, str]]] = {"tbody": [], "tfoot": []}
        self.points: list[dict[str, str]] = []
        self.tags: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {k: v or "" for k, v in attrs}
        self.tags.add(tag)
        if tag in {"tbody", "tfoot"}:
            self.section = tag
        elif tag == "tr" and self.section:
            self.rows[self.section].append({})
        elif tag == "td" and self.section:
            self.rows[self.section][-1][values["data-column"]] = values["data-value"]
        elif tag == "circle":
            self.points.append(values)
        if tag in {"script", "link", "img"} or "http" in values.get("src", ""):
            raise AssertionError(f"the page loads something: <{tag} {values}>")

    def handle_endtag(self, tag: str) -> None:
        if tag in {"tbody", "tfoot"}:
            self.section = ""


def test_html_page_shows_the_table_and_the_chart_offline(filled: Ledger) -> None:
    report = filled.report(ReportQuery())
    page = _PageReader()
    page.feed(report_html(report))

    assert "svg" in page.tags
    assert page.rows["tbody"] == [
        {k: "" if v is None else str(v) for k, v in row.items()} for row in [ACME, GLOBEX]
    ]
    (totals,) = page.rows["tfoot"]
    assert totals["total_spend_usd"] == "0.032600"
    assert totals["cost_per_successful_task_usd"] == "0.010867"
    points = sorted((p["data-tenant"], p["data-day"], p["data-cost-usd"]) for p in page.points)
    assert points == [
        ("acme", "2025-03-03", "0.025550"),  # A and B closed that day; only A succeeded
        ("acme", "2025-03-04", "0.003000"),
        ("globex", "2025-03-04", "0.004050"),
    ]
    # Later days sit further right; the dearer day sits higher (smaller y).
    by_key = {(p["data-tenant"], p["data-day"]): p for p in page.points}
    early, late = by_key[("acme", "2025-03-03")], by_key[("acme", "2025-03-04")]
    assert int(early["cx"]) < int(late["cx"])
    assert int(early["cy"]) < int(late["cy"])


def test_report_cli_prints_json_and_writes_files(filled: Ledger, tmp_path: Path) -> None:
    url = filled.url
    result = runner.invoke(app, ["report", "--db", url, "--format", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["rows"] == [ACME, GLOBEX]

    target = tmp_path / "report.html"
    result = runner.invoke(
        app, ["report", "--db", url, "--format", "html", "--output", str(target)]
    )
    assert result.exit_code == 0, result.output
    assert "0.014275" in target.read_text(encoding="utf-8")

    table = runner.invoke(app, ["report", "--db", url, "--group-by", "tenant,pool"])
    assert table.exit_code == 0, table.output
    assert "acme" in table.stdout and "0.014250" in table.stdout
    assert "a task counts in every group it used" in table.stdout
    assert "1 attempt(s) costing $0.002000" in table.stdout


def test_report_cli_exits_2_on_bad_input(ledger_url: str, ledger: Ledger) -> None:
    cases = {
        ("--group-by", "tenant,colour"): "unknown group-by field 'colour'",
        ("--since", "2025-03-05", "--until", "2025-03-04"): "empty range",
        ("--until", "yesterday"): "not an ISO date",
    }
    for arguments, message in cases.items():
        result = runner.invoke(app, ["report", "--db", ledger_url, *arguments])
        assert result.exit_code == 2, result.output
        assert message in result.stderr
        assert "Traceback" not in result.output


def test_report_cli_refuses_an_old_schema_until_migrated(ledger_url: str) -> None:
    with connect_ledger(ledger_url, create=True) as old:
        old.migrate(to_version=1)

    refused = runner.invoke(app, ["report", "--db", ledger_url])
    assert refused.exit_code == 2
    assert "schema version 1" in refused.stderr
    assert "kvflow ledger migrate --db" in refused.stderr

    migrated = runner.invoke(app, ["ledger", "migrate", "--db", ledger_url])
    assert migrated.exit_code == 0, migrated.output
    assert "applied migration(s) 2" in migrated.stdout
    assert runner.invoke(app, ["report", "--db", ledger_url]).exit_code == 0


def test_kvflow_report_process_exits_2_for_a_missing_database(tmp_path: Path) -> None:
    kvflow = Path(sys.executable).parent / "kvflow"
    missing = tmp_path / "nowhere" / "ledger.db"

    result = subprocess.run(
        [str(kvflow), "report", "--db", f"sqlite:///{missing}", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert result.returncode == 2, result
    assert "no ledger database at" in result.stderr
    assert "kvflow ledger migrate" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    assert not missing.exists()

"""`kvflow report --format focus`: FOCUS 1.2 rows that reconcile with the ledger, exactly.

Prices: `P1` is 0.15 / 0.075 / 0.60 µ$ per input / cached / output token, so most attempts
round to the micro-dollar; `P2` (0.20 / 0.02 / 0.80) is a later price of pool l4. The ledger
holds three tenants, four pools, two days across a month's end and five task outcomes:

2025-02-28, acme / ResearchAgent on llama-70b:
- R1 succeeded: h100 failed (1001 in, 37 out) = 150.15 + 22.2 = 172.35 → 172 µ$ (waste);
  a100 ok (1001 in, 768 cached, 233 out); a100 ok (2003 in, 1024 cached, 411 out).
- R2 compensated: h100 ok (999 in, 120 out); h100 ok (1500 in, 512 cached, 77 out).
2025-03-01:
- acme / Support S1 succeeded: l4 llama-8b (513 in, 65 out) at P1.
- globex / Support on l4 llama-8b: G1 terminated (a cancelled attempt, 800 in, 21 out, P2);
  G2 succeeded (1000 in, 500 cached, 100 out, P2); G3 succeeded (700 in, 50 out, P1).
- initech / Triage: I1 failed (a100 llama-70b failed, 300 in, 0 out); I2 cancelled
  (h200 llama-70b ok, 100 in, 10 out).
- acme: F is still running (an attempt on h100, no task row): in no row.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvflow.cli.main import app
from kvflow.ledger import AttemptOutcome, AttemptRecord, Ledger, ReportQuery, TaskOutcome
from kvflow.ledger.focus import COLUMNS, COST_COLUMNS, ledger_focus_export
from kvflow.ledger.report import GroupField, Report
from kvflow.ledger.store import Row, open_ledger
from kvflow.scheduler.fleet import TokenPrices, micros_to_usd
from tests.fixtures_ledger import attempt_record, task_record

pytestmark = pytest.mark.timeout(120)

P1 = TokenPrices.per_mtok("0.15", "0.075", "0.60")
P2 = TokenPrices.per_mtok("0.20", "0.02", "0.80")
DAY1 = datetime(2025, 2, 28, 15, 0, tzinfo=UTC)
DAY2 = datetime(2025, 3, 1, 9, 0, tzinfo=UTC)
FAILED, CANCELLED = AttemptOutcome.FAILED, AttemptOutcome.CANCELLED

runner = CliRunner()


def _attempts() -> list[AttemptRecord]:
    acme: dict[str, Any] = {"tenant": "acme", "workflow_type": "ResearchAgent", "prices": P1}
    support: dict[str, Any] = {"workflow_type": "Support", "model": "llama-8b", "pool": "l4"}
    triage: dict[str, Any] = {"tenant": "initech", "workflow_type": "Triage", "prices": P1}
    return [
        attempt_record("R1", **acme, activity_id="1", pool="h100", outcome=FAILED,
                       prompt_tokens=1001, completion_tokens=37, started_at=DAY1),
        attempt_record("R1", **acme, activity_id="1", attempt=2, pool="a100",
                       prompt_tokens=1001, cached_tokens=768, completion_tokens=233,
                       started_at=DAY1),
        attempt_record("R1", **acme, activity_id="2", pool="a100", prompt_tokens=2003,
                       cached_tokens=1024, completion_tokens=411, started_at=DAY1),
        attempt_record("R2", **acme, activity_id="1", pool="h100", prompt_tokens=999,
                       completion_tokens=120, started_at=DAY1),
        attempt_record("R2", **acme, activity_id="2", step="undo", pool="h100",
                       prompt_tokens=1500, cached_tokens=512, completion_tokens=77,
                       started_at=DAY1),
        attempt_record("S1", tenant="acme", **support, prices=P1, prompt_tokens=513,
                       completion_tokens=65, started_at=DAY2),
        attempt_record("G1", tenant="globex", **support, prices=P2, outcome=CANCELLED,
                       prompt_tokens=800, completion_tokens=21, started_at=DAY2),
        attempt_record("G2", tenant="globex", **support, prices=P2, prompt_tokens=1000,
                       cached_tokens=500, completion_tokens=100, started_at=DAY2),
        attempt_record("G3", tenant="globex", **support, prices=P1, prompt_tokens=700,
                       completion_tokens=50, started_at=DAY2),
        attempt_record("I1", **triage, pool="a100", outcome=FAILED, prompt_tokens=300,
                       completion_tokens=0, started_at=DAY2),
        attempt_record("I2", **triage, pool="h200", prompt_tokens=100, completion_tokens=10,
                       started_at=DAY2),
        attempt_record("F", **acme, pool="h100", prompt_tokens=4000, completion_tokens=0,
                       started_at=DAY2),
    ]  # fmt: skip


TASKS = {
    "R1": ("acme", "ResearchAgent", TaskOutcome.SUCCEEDED, DAY1),
    "R2": ("acme", "ResearchAgent", TaskOutcome.COMPENSATED, DAY1 + timedelta(hours=1)),
    "S1": ("acme", "Support", TaskOutcome.SUCCEEDED, DAY2),
    "G1": ("globex", "Support", TaskOutcome.TERMINATED, DAY2),
    "G2": ("globex", "Support", TaskOutcome.SUCCEEDED, DAY2 + timedelta(hours=2)),
    "G3": ("globex", "Support", TaskOutcome.SUCCEEDED, DAY2 + timedelta(hours=3)),
    "I1": ("initech", "Triage", TaskOutcome.FAILED, DAY2),
    "I2": ("initech", "Triage", TaskOutcome.CANCELLED, DAY2),
}


@pytest.fixture
def filled(ledger: Ledger) -> Ledger:
    attempts = _attempts()
    for record in attempts:
        assert ledger.record_attempt(record)
    for workflow_id, (tenant, workflow_type, outcome, closed_at) in TASKS.items():
        spend = sum(a.cost_micros for a in attempts if a.workflow_id == workflow_id)
        ledger.record_task(
            task_record(workflow_id, tenant=tenant, workflow_type=workflow_type,
                        outcome=outcome, closed_at=closed_at, spend_micros=spend)
        )  # fmt: skip
    return ledger


def _export(ledger: Ledger, *options: str) -> tuple[list[dict[str, str]], str]:
    """`kvflow report --format focus` on `ledger`: its rows, and what it said on stderr."""
    result = runner.invoke(app, ["report", "--db", ledger.url, "--format", "focus", *options])
    assert result.exit_code == 0, result.output
    return list(csv.DictReader(io.StringIO(result.stdout))), result.stderr


def _sum(rows: list[dict[str, str]], column: str) -> Decimal:
    return sum((Decimal(row[column]) for row in rows if row[column]), Decimal(0))


FIXED_POINT = re.compile(r"-?\d+\.\d+")
MONEY_AND_QUANTITIES = (
    *COST_COLUMNS,
    "ListUnitPrice",
    "ContractedUnitPrice",
    "ConsumedQuantity",
    "PricingQuantity",
    "x_WastedCost",
)


def test_every_cost_column_adds_up_to_the_ledgers_spend_to_the_micro_dollar(
    filled: Ledger,
) -> None:
    rows, stderr = _export(filled)
    closed = [a for a in _attempts() if a.workflow_id in TASKS]
    spend = micros_to_usd(sum(a.cost_micros for a in closed))
    report = filled.report(ReportQuery(group_by=()))
    assert spend == micros_to_usd(report.totals.spend_micros) == Decimal("0.002013")
    for column in COST_COLUMNS:
        assert _sum(rows, column) == spend, column
    assert _sum(rows, "x_WastedCost") == micros_to_usd(report.totals.wasted_micros)
    # Each (day, tenant) adds up to the report's row for it.
    by_day = filled.report(ReportQuery.parse("tenant,day"))
    expected = {
        (row.keys["day"], row.keys["tenant"]): micros_to_usd(row.spend_micros)
        for row in by_day.rows
    }
    got: dict[tuple[str, str], Decimal] = defaultdict(Decimal)
    for row in rows:
        got[(row["ChargePeriodStart"][:10], row["SubAccountId"])] += Decimal(row["BilledCost"])
    assert got == expected
    # The running task's attempt is in no row, and the command says so.
    assert "1 attempt(s) costing $0.000600" in stderr
    for row in rows:
        # No discount exists: the four costs are one figure on every row.
        assert len({Decimal(row[column]) for column in COST_COLUMNS}) == 1, row
        # Exact decimals in fixed point, never a float's exponent.
        for column in MONEY_AND_QUANTITIES:
            assert row[column] == "" or FIXED_POINT.fullmatch(row[column]), (column, row[column])


def test_an_attempts_rounding_is_an_adjustment_row_not_a_discount(filled: Ledger) -> None:
    rows, _ = _export(filled)
    r1 = json.dumps({"kvflow:outcome": "succeeded", "kvflow:workflow_type": "ResearchAgent"})
    h100 = {
        (r["ChargeCategory"], r["x_TokenType"]): r
        for r in rows
        if r["Tags"] == r1 and r["ResourceId"] == "h100"
    }
    # R1's failed attempt on h100: 1001 in × 0.15 = 150.15 µ$, 37 out × 0.60 = 22.2 µ$,
    # billed 172 µ$; the usage is priced exactly and the -0.35 µ$ is the rounding.
    assert set(h100) == {("Usage", "input"), ("Usage", "output"), ("Adjustment", "")}
    usage_in, usage_out = h100[("Usage", "input")], h100[("Usage", "output")]
    assert (usage_in["ListCost"], usage_in["BilledCost"]) == ("0.00015015", "0.00015015")
    assert (usage_out["ListCost"], usage_out["BilledCost"]) == ("0.0000222", "0.0000222")
    rounding = h100[("Adjustment", "")]
    assert rounding["BilledCost"] == rounding["ListCost"] == "-0.00000035"
    assert rounding["x_WastedCost"] == "-0.00000035"  # a failed attempt's: waste
    assert rounding["x_Model"] == "llama-70b" and rounding["SubAccountId"] == "acme"
    for column in ("SkuId", "SkuPriceId", "ListUnitPrice", "PricingQuantity", "ConsumedQuantity"):
        assert rounding[column] == "", column
    total = sum((Decimal(r["BilledCost"]) for r in h100.values()), Decimal(0))
    assert total == micros_to_usd(172)


# FOCUS 1.2, as its columns' requirements read (specification/columns/*.md at tag v1.2).
MANDATORY_1_2 = [
    "BilledCost",
    "BillingAccountId",
    "BillingAccountName",
    "BillingCurrency",
    "BillingPeriodEnd",
    "BillingPeriodStart",
    "ChargeCategory",
    "ChargeClass",
    "ChargeDescription",
    "ChargePeriodEnd",
    "ChargePeriodStart",
    "ContractedCost",
    "EffectiveCost",
    "InvoiceIssuerName",
    "ListCost",
    "PricingQuantity",
    "PricingUnit",
    "ProviderName",
    "PublisherName",
    "ServiceCategory",
    "ServiceName",
]
# Conditional ones whose condition kvflow meets (it measures usage, publishes unit prices,
# bills resources and sub accounts) and the recommended ones.
APPLICABLE_1_2 = [
    "ConsumedQuantity",
    "ConsumedUnit",
    "ContractedUnitPrice",
    "ListUnitPrice",
    "PricingCategory",
    "ResourceId",
    "ResourceName",
    "ResourceType",
    "SkuId",
    "SkuMeter",
    "SkuPriceDetails",
    "SkuPriceId",
    "SubAccountId",
    "SubAccountName",
    "Tags",
    "ChargeFrequency",
    "InvoiceId",
    "ServiceSubcategory",
]
NOT_NULL_1_2 = [
    "BilledCost",
    "BillingAccountId",
    "BillingCurrency",
    "BillingPeriodEnd",
    "BillingPeriodStart",
    "ChargeCategory",
    "ChargeFrequency",
    "ChargePeriodEnd",
    "ChargePeriodStart",
    "ContractedCost",
    "EffectiveCost",
    "InvoiceIssuerName",
    "ListCost",
    "ProviderName",
    "PublisherName",
    "ServiceCategory",
    "ServiceName",
    "ServiceSubcategory",
]
NOT_NULL_ON_USAGE_1_2 = [
    "ConsumedQuantity",
    "ConsumedUnit",
    "ContractedUnitPrice",
    "ListUnitPrice",
    "PricingCategory",
    "PricingQuantity",
    "PricingUnit",
    "SkuId",
    "SkuPriceId",
]
CHARGE_CATEGORIES = {"Usage", "Purchase", "Tax", "Credit", "Adjustment"}
MOMENT = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


def focus_1_2_problems(rows: list[dict[str, str]]) -> list[str]:
    """What in `rows` breaks a FOCUS 1.2 requirement that applies to kvflow's charges."""
    header = list(rows[0])
    problems = [f"{c} missing" for c in (*MANDATORY_1_2, *APPLICABLE_1_2) if c not in header]
    unknown = set(header) - set(COLUMNS) - {c for c in header if c.startswith("x_")}
    problems += [f"custom column {c} lacks the x_ prefix" for c in sorted(unknown)]
    if problems:
        return problems
    for number, row in enumerate(rows, start=1):

        def fail(what: str, row_number: int = number) -> None:
            problems.append(f"row {row_number}: {what}")

        category = row["ChargeCategory"]
        if category not in CHARGE_CATEGORIES:
            fail(f"ChargeCategory {category!r}")
        for column in NOT_NULL_1_2:
            if not row[column]:
                fail(f"{column} is null")
        for column in ("ChargePeriodStart", "ChargePeriodEnd", "BillingPeriodStart"):
            if not MOMENT.fullmatch(row[column]):
                fail(f"{column} {row[column]!r} is not an ISO 8601 UTC moment")
        if row["ChargeClass"]:
            fail("ChargeClass set on a row that corrects nothing")
        if (row["ServiceCategory"], row["ServiceSubcategory"]) != (
            "AI and Machine Learning",
            "Generative AI",
        ):
            fail("service category and subcategory")
        usage = category == "Usage"
        for column in NOT_NULL_ON_USAGE_1_2:
            if usage and not row[column]:
                fail(f"{column} is null on usage")
        if not usage and (row["ConsumedQuantity"] or row["ConsumedUnit"]):
            fail("ConsumedQuantity on a row that is not usage")
        if row["PricingQuantity"] and row["PricingUnit"] != "1000000 Tokens":
            fail(f"PricingUnit {row['PricingUnit']!r}")
        # Unit price × quantity is the cost, and a cost with no unit price is the billed cost.
        for price, cost in (
            ("ListUnitPrice", "ListCost"),
            ("ContractedUnitPrice", "ContractedCost"),
        ):
            if row[price] and row["PricingQuantity"]:
                if Decimal(row[price]) * Decimal(row["PricingQuantity"]) != Decimal(row[cost]):
                    fail(f"{price} × PricingQuantity ≠ {cost}")
            elif Decimal(row[cost]) != Decimal(row["BilledCost"]):
                fail(f"{cost} ≠ BilledCost without a unit price")
        for column in ("Tags", "SkuPriceDetails"):
            if row[column] and not isinstance(json.loads(row[column]), dict):
                fail(f"{column} is not a JSON object")
        if row["SkuPriceDetails"] and any(
            not key.startswith("x_") for key in json.loads(row["SkuPriceDetails"])
        ):
            fail("SkuPriceDetails has a custom property without the x_ prefix")
    return problems


def test_the_export_meets_focus_1_2s_requirements(filled: Ledger) -> None:
    rows, _ = _export(filled)
    assert list(rows[0]) == list(COLUMNS)
    assert focus_1_2_problems(rows) == []
    assert {r["ChargeCategory"] for r in rows} == {"Usage", "Adjustment"}
    # The check checks: a discount that does not exist, or a missing column, is caught.
    rows[0]["ListCost"] = str(Decimal(rows[0]["ListCost"]) * 2)
    assert focus_1_2_problems(rows) == ["row 1: ListUnitPrice × PricingQuantity ≠ ListCost"]
    without = [{k: v for k, v in row.items() if k != "ServiceSubcategory"} for row in rows]
    assert focus_1_2_problems(without) == ["ServiceSubcategory missing"]


def test_rows_name_tenant_pool_model_and_carry_outcome_and_workflow_type(filled: Ledger) -> None:
    rows, _ = _export(filled)
    by_key = {
        (r["ChargePeriodStart"][:10], r["SubAccountId"], r["ResourceId"], r["SkuPriceId"],
         r["Tags"], r["ChargeCategory"]): r
        for r in rows
    }  # fmt: skip
    assert len(by_key) == len(rows)
    r1 = json.dumps({"kvflow:outcome": "succeeded", "kvflow:workflow_type": "ResearchAgent"})
    failed_input = by_key[("2025-02-28", "acme", "h100", "h100/llama-70b/input/0.15", r1, "Usage")]
    expected_values = {
        "BillingCurrency": "USD",
        "PricingCurrency": "USD",
        "BillingPeriodStart": "2025-02-01T00:00:00Z",
        "BillingPeriodEnd": "2025-03-01T00:00:00Z",
        "ChargePeriodStart": "2025-02-28T00:00:00Z",
        "ChargePeriodEnd": "2025-03-01T00:00:00Z",
        "ChargeClass": "",
        "InvoiceId": "",
        "ServiceCategory": "AI and Machine Learning",
        "ServiceSubcategory": "Generative AI",
        "ConsumedQuantity": "1001.0",
        "ConsumedUnit": "Tokens",
        "PricingQuantity": "0.001001",
        "PricingUnit": "1000000 Tokens",
        "ListUnitPrice": "0.15",
        "ListCost": "0.00015015",
        "BilledCost": "0.00015015",
        "PricingCurrencyEffectiveCost": "0.00015015",
        "x_WastedCost": "0.00015015",  # a failed attempt of a task that succeeded
        "SkuId": "llama-70b/input",
        "SkuMeter": "Input Tokens",
        "x_Model": "llama-70b",
        "x_TokenType": "input",
        "SubAccountName": "acme",
        "SubAccountType": "Tenant",
        "ResourceName": "h100",
        "ResourceType": "GPU pool",
        "InvoiceIssuerName": "kvflow",
        "ProviderName": "kvflow",
        "PublisherName": "kvflow",
    }
    assert {column: failed_input[column] for column in expected_values} == expected_values
    assert json.loads(failed_input["SkuPriceDetails"]) == {
        "x_Model": "llama-70b",
        "x_Pool": "h100",
        "x_TokenType": "input",
    }
    r2 = json.dumps({"kvflow:outcome": "compensated", "kvflow:workflow_type": "ResearchAgent"})
    compensated = [r for r in rows if r["Tags"] == r2]
    assert compensated and all(r["x_WastedCost"] == r["BilledCost"] for r in compensated)
    # A price change is a new SkuPriceId of the same SKU.
    globex = {r["SkuPriceId"] for r in rows if r["SubAccountId"] == "globex"}
    assert {"l4/llama-8b/output/0.6", "l4/llama-8b/output/0.8"} <= globex


def test_tenant_and_range_options_select_what_the_report_selects(filled: Ledger) -> None:
    rows, _ = _export(filled, "--tenant", "globex", "--since", "2025-03-01")
    assert {r["SubAccountId"] for r in rows} == {"globex"}
    report = filled.report(ReportQuery.parse("", tenant="globex", since="2025-03-01"))
    assert _sum(rows, "BilledCost") == micros_to_usd(report.totals.spend_micros) > 0
    rows, _ = _export(filled, "--until", "2025-02-28")
    assert {r["ChargePeriodStart"] for r in rows} == {"2025-02-28T00:00:00Z"}


# ---- what a FinOps query engine reads from the file ---------------------------------------------

# DuckDB's CSV reader infers DOUBLE for decimals: exact sums name the money columns' type.
DUCKDB_DECIMALS = {column: "DECIMAL(38, 18)" for column in (*COST_COLUMNS, "x_WastedCost")}
FINANCE_QUESTIONS = {
    GroupField.TENANT: "SubAccountId",
    GroupField.MODEL: "x_Model",
    GroupField.POOL: "ResourceId",
    GroupField.DAY: "strftime(ChargePeriodStart, '%Y-%m-%d')",
    GroupField.WORKFLOW_TYPE: """json_extract_string(Tags, '$."kvflow:workflow_type"')""",
}


@pytest.fixture
def duckdb_module() -> Any:
    if importlib.util.find_spec("duckdb") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("duckdb is not installed; it is in the dev extra")
        pytest.skip("duckdb is not installed (pip install -e '.[dev]')")
    import duckdb

    return duckdb


def _spend_by(report: Report, field: GroupField) -> dict[str, tuple[Decimal, Decimal]]:
    return {
        str(row.keys[field.value]): (
            micros_to_usd(row.spend_micros),
            micros_to_usd(row.wasted_micros),
        )
        for row in report.rows
    }


def test_duckdb_answers_cost_by_tenant_model_pool_day_and_workflow_type_as_the_report(
    duckdb_module: Any, filled: Ledger, tmp_path: Path
) -> None:
    path = tmp_path / "focus.csv"
    result = runner.invoke(
        app, ["report", "--db", filled.url, "--format", "focus", "--output", str(path)]
    )
    assert result.exit_code == 0, result.output
    db = duckdb_module.connect()
    db.execute("SET TimeZone = 'UTC'")
    types = ", ".join(f"'{column}': '{kind}'" for column, kind in DUCKDB_DECIMALS.items())
    db.execute(f"CREATE VIEW focus AS SELECT * FROM read_csv('{path}', types = {{{types}}})")
    for field, expression in FINANCE_QUESTIONS.items():
        answers = db.execute(
            f"SELECT {expression}, SUM(BilledCost), SUM(EffectiveCost), SUM(ListCost), "
            f"SUM(ContractedCost), SUM(x_WastedCost) FROM focus GROUP BY 1"
        ).fetchall()
        got: dict[str, tuple[Decimal, Decimal]] = {}
        for key, billed, effective, listed, contracted, wasted in answers:
            assert billed == effective == listed == contracted, (field, key)
            got[str(key)] = (billed, wasted)
        report = filled.report(ReportQuery(group_by=(field,)))
        assert got == _spend_by(report, field), field
    assert set(got) == {"ResearchAgent", "Support", "Triage"}


# ---- one snapshot, a fixed number of statements -------------------------------------------------


def _count_statements(ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every statement `ledger` runs from now on, in order."""
    statements: list[str] = []
    execute = ledger._execute

    def counting(sql: str, params: Sequence[object] = ()) -> tuple[int, list[Row]]:
        statements.append(sql)
        return execute(sql, params)

    monkeypatch.setattr(ledger, "_execute", counting)
    return statements


def _tasks(ledger: Ledger, count: int, *, start: int = 0) -> None:
    for number in range(start, start + count):
        workflow_id = f"T{number}"
        attempt = attempt_record(workflow_id, prices=P1, completion_tokens=number)
        ledger.record_attempt(attempt)
        ledger.record_task(
            task_record(workflow_id, closed_at=DAY1, spend_micros=attempt.cost_micros)
        )


def test_the_export_reads_the_same_number_of_statements_for_any_number_of_tasks(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts: list[int] = []
    for more in (3, 30):
        _tasks(ledger, more, start=len(counts) * 100)
        statements = _count_statements(ledger, monkeypatch)
        report, export = ledger_focus_export(ledger, ReportQuery(group_by=()))
        assert export.billed_micros == report.totals.spend_micros > 0
        counts.append(len(statements))
        monkeypatch.undo()
    assert counts[0] == counts[1], counts


def test_rows_written_during_the_export_change_neither_the_file_nor_its_report(
    filled: Ledger, ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another GPU worker's row for S1 lands after the report's reads and before the rest.
    late = attempt_record("S1", activity_id="9", tenant="acme", workflow_type="Support",
                          model="llama-8b", pool="l4", prices=P1, started_at=DAY2)  # fmt: skip
    statements = _count_statements(filled, monkeypatch)
    execute = filled._execute

    def writing_after_the_report(sql: str, params: Sequence[object] = ()) -> tuple[int, list[Row]]:
        result = execute(sql, params)
        if "LEFT JOIN tasks" in sql:  # the report's last read
            with open_ledger(ledger_url) as other:
                assert other.record_attempt(late)
        return result

    monkeypatch.setattr(filled, "_execute", writing_after_the_report)
    report, export = ledger_focus_export(filled, ReportQuery(group_by=()))
    assert statements  # the export read through the ledger watched here
    before = sum(a.cost_micros for a in _attempts() if a.workflow_id in TASKS)
    assert report.totals.spend_micros == export.billed_micros == before
    monkeypatch.undo()
    assert filled.report(ReportQuery(group_by=())).totals.spend_micros == before + late.cost_micros


# ---- the FinOps Foundation's validator ------------------------------------------------------------

# focus-validator 1.0.0 (the newest for Python 3.11; 2.x needs 3.12) checks FOCUS 1.0 only, and
# under four column names of the 1.0 preview that 1.0 renamed; its SkuPriceId rule reads the
# preview's ChargeType, a column 1.0 dropped. A FOCUS file fails it for those five checks alone.
PREVIEW_NAMES = {
    "ResourceId": "ResourceID",
    "InvoiceIssuerName": "InvoiceIssuer",
    "ProviderName": "Provider",
    "PublisherName": "Publisher",
    "ChargeCategory": "ChargeType",
}
VALIDATOR_MISREADS = {
    "InvoiceIssuer_Required",
    "Provider_Required",
    "Publisher_Required",
    "ResourceID_Required",
    "SkuPriceId_Nullable",
}


def _write(rows: list[dict[str, str]], path: Path, *, preview_names: bool = False) -> Path:
    """`rows` as CSV at `path`; `preview_names` adds a copy of five columns under the names the
    validator looks for."""
    with path.open("w", newline="", encoding="utf-8") as file:
        extra = PREVIEW_NAMES if preview_names else {}
        writer = csv.writer(file)
        writer.writerow([*rows[0], *extra.values()])
        for row in rows:
            writer.writerow([*row.values(), *(row[column] for column in extra)])
    return path


def _validate(path: Path) -> tuple[str, set[str]]:
    """Run the FinOps Foundation's validator on `path`: its output and the checks it failed."""
    spec = importlib.util.find_spec("focus_validator")
    assert spec is not None and spec.origin is not None
    result = subprocess.run(
        [sys.executable, "-m", "focus_validator.main", "--data-file", str(path),
         "--validate-version", "1.0"],
        # It reads its currency codes from a path relative to its own package's parent.
        cwd=Path(spec.origin).parent.parent,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )  # fmt: skip
    output = result.stdout + result.stderr
    return output, set(re.findall(r"^(\w+) failed:", result.stdout, re.MULTILINE))


@pytest.fixture
def validator() -> None:
    if importlib.util.find_spec("focus_validator") is not None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail("focus-validator is not installed; it is in the dev extra")
    pytest.skip("focus-validator is not installed (pip install -e '.[dev]')")


def test_the_foundations_validator_fails_the_export_only_on_the_names_it_misreads(
    validator: None, filled: Ledger, tmp_path: Path
) -> None:
    rows, _ = _export(filled)
    output, failed = _validate(_write(rows, tmp_path / "focus.csv"))
    assert "Validation failed!" in output and failed == VALIDATOR_MISREADS, output
    assert 'KeyError("ChargeType")' in output
    # With those columns copied under the preview's names, it accepts the file.
    output, failed = _validate(_write(rows, tmp_path / "renamed.csv", preview_names=True))
    assert "Validation succeeded." in output and not failed, output


def test_the_foundations_validator_checks_values_but_not_arithmetic(
    validator: None, filled: Ledger, tmp_path: Path
) -> None:
    rows, _ = _export(filled)
    broken = [dict(row) for row in rows]
    broken[3]["ServiceCategory"] = "GPUs"
    output, failed = _validate(_write(broken, tmp_path / "enum.csv", preview_names=True))
    assert failed == {"ServiceCategory_Enum"}, output
    # A ListCost that is not the price times the quantity, a discount that does not exist:
    # FOCUS forbids it, the validator reads costs as floats and never multiplies.
    wrong = [dict(row) for row in rows]
    wrong[0]["ListCost"] = str(Decimal(wrong[0]["ListCost"]) * 2)
    output, failed = _validate(_write(wrong, tmp_path / "cost.csv", preview_names=True))
    assert "Validation succeeded." in output and not failed, output
    assert focus_1_2_problems(wrong) == ["row 1: ListUnitPrice × PricingQuantity ≠ ListCost"]


# ---- tasks that continued as new ----------------------------------------------------------------


def test_a_run_that_continued_as_new_is_its_tasks_spend_not_a_task_nor_waste(
    ledger: Ledger,
) -> None:
    # Task C's first run continued as new after a failed attempt and its retry; the second
    # run succeeded.
    attempts = [
        attempt_record("C", run_id="run-1", outcome=FAILED, prices=P1,
                       prompt_tokens=1000, completion_tokens=10, started_at=DAY1),
        attempt_record("C", run_id="run-1", attempt=2, prices=P1,
                       prompt_tokens=1000, completion_tokens=100, started_at=DAY1),
        attempt_record("C", run_id="run-2", activity_id="2", prices=P1,
                       prompt_tokens=2000, completion_tokens=100, started_at=DAY1),
    ]  # fmt: skip
    for record in attempts:
        assert ledger.record_attempt(record)
    for run, outcome in (("run-1", TaskOutcome.CONTINUED_AS_NEW), ("run-2", TaskOutcome.SUCCEEDED)):
        spend = sum(a.cost_micros for a in attempts if a.run_id == run)
        chain = "run-1" if run == "run-2" else None
        ledger.record_task(
            task_record("C", run_id=run, outcome=outcome, closed_at=DAY1, spend_micros=spend,
                        chain_run_id=chain)
        )  # fmt: skip
    total, failed = sum(a.cost_micros for a in attempts), attempts[0].cost_micros
    report = ledger.report(ReportQuery(group_by=()))
    # One task, which succeeded and cost what both runs spent; waste is the failed attempt.
    assert (report.totals.tasks, report.totals.succeeded) == (1, 1)
    assert report.totals.spend_micros == total and report.totals.wasted_micros == failed > 0
    assert report.unclosed_attempts == 0
    rows, _ = _export(ledger)
    assert _sum(rows, "BilledCost") == micros_to_usd(total)
    assert _sum(rows, "x_WastedCost") == micros_to_usd(failed)
    outcomes = {json.loads(row["Tags"])["kvflow:outcome"] for row in rows}
    assert outcomes == {"continued_as_new", "succeeded"}


def _two_run_task(
    ledger: Ledger, workflow_id: str, last: TaskOutcome | None, *, chained: bool = True
) -> tuple[int, int, int]:
    """A task whose first run (closed DAY1: a failed attempt, its retry) continued as new and
    whose second run (closed DAY2, one attempt) ended as `last` (None: it runs still, no row).
    The runs' spends and the failed attempt's cost; `chained=False` writes the second row as
    rows from before the chain key were written."""
    attempts = [
        attempt_record(workflow_id, run_id="run-1", outcome=FAILED, prices=P1,
                       prompt_tokens=1000, completion_tokens=10, started_at=DAY1),
        attempt_record(workflow_id, run_id="run-1", attempt=2, prices=P1,
                       prompt_tokens=1000, completion_tokens=100, started_at=DAY1),
        attempt_record(workflow_id, run_id="run-2", activity_id="2", prices=P1,
                       prompt_tokens=2000, completion_tokens=100, started_at=DAY2),
    ]  # fmt: skip
    for record in attempts:
        assert ledger.record_attempt(record)
    spends = [sum(a.cost_micros for a in attempts if a.run_id == run) for run in ("run-1", "run-2")]
    ledger.record_task(
        task_record(workflow_id, run_id="run-1", outcome=TaskOutcome.CONTINUED_AS_NEW,
                    closed_at=DAY1, spend_micros=spends[0])
    )  # fmt: skip
    if last is not None:
        ledger.record_task(
            task_record(workflow_id, run_id="run-2", outcome=last, closed_at=DAY2,
                        spend_micros=spends[1], chain_run_id="run-1" if chained else None)
        )  # fmt: skip
    return spends[0], spends[1], attempts[0].cost_micros


def test_a_task_that_fails_after_continuing_as_new_wastes_what_every_run_spent(
    ledger: Ledger,
) -> None:
    first, second, failed = _two_run_task(ledger, "F", TaskOutcome.FAILED)
    by_day = ledger.report(ReportQuery(group_by=(GroupField.DAY,)))
    day1, day2 = by_day.rows
    # Each run's spend stays on the day it closed; all of it is waste, as the task failed.
    assert (day1.tasks, day1.spend_micros, day1.wasted_micros) == (0, first, first)
    assert (day2.tasks, day2.succeeded, day2.wasted_micros) == (1, 0, second)
    assert by_day.totals.wasted_micros == first + second > first > failed
    # Read for the first day alone, after the task failed on the second: the same waste.
    day_one = ledger.report(ReportQuery(group_by=(), until=DAY1 + timedelta(hours=1)))
    assert (day_one.totals.tasks, day_one.totals.wasted_micros) == (0, first)
    rows, _ = _export(ledger)
    assert _sum(rows, "x_WastedCost") == micros_to_usd(first + second)


def test_a_continued_run_wastes_only_its_failed_attempts_while_its_task_goes_on(
    ledger: Ledger,
) -> None:
    _, _, failed = _two_run_task(ledger, "R", None)
    report = ledger.report(ReportQuery(group_by=()))
    assert (report.totals.tasks, report.totals.wasted_micros) == (0, failed)
    assert report.unclosed_attempts == 1


def test_rows_from_before_the_chain_key_keep_a_continued_runs_waste_to_its_failed_attempts(
    ledger: Ledger,
) -> None:
    _, second, failed = _two_run_task(ledger, "O", TaskOutcome.FAILED, chained=False)
    report = ledger.report(ReportQuery(group_by=()))
    assert report.totals.wasted_micros == failed + second


def test_a_task_that_continued_as_new_costs_all_its_runs_in_the_percentiles(
    ledger: Ledger,
) -> None:
    first, second, _ = _two_run_task(ledger, "C", TaskOutcome.SUCCEEDED)
    # Only the last run closed in range: the task still costs what both runs spent.
    report = ledger.report(ReportQuery(group_by=(), since=DAY2 - timedelta(hours=1)))
    totals = report.totals
    assert (totals.tasks, totals.succeeded, totals.spend_micros) == (1, 1, second)
    assert totals.p50_micros == totals.p95_micros == first + second
    by_pool = ledger.report(ReportQuery(group_by=(GroupField.POOL,)))
    [h100] = by_pool.rows
    assert h100.p50_micros == first + second

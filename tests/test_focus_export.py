"""`kvflow report --format focus`: FOCUS 1.0 rows that reconcile with the ledger and validate.

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
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvflow.cli.main import app
from kvflow.ledger import AttemptOutcome, AttemptRecord, Ledger, ReportQuery, TaskOutcome
from kvflow.ledger.focus import COLUMNS, FOCUS_COLUMNS, attempt_parts
from kvflow.ledger.report import GroupField
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
    "BilledCost",
    "EffectiveCost",
    "ListCost",
    "ContractedCost",
    "ListUnitPrice",
    "ContractedUnitPrice",
    "ConsumedQuantity",
    "PricingQuantity",
    "x_WastedCost",
)


def test_billed_cost_adds_up_to_the_ledgers_spend_to_the_micro_dollar(filled: Ledger) -> None:
    rows, stderr = _export(filled)
    closed = [a for a in _attempts() if a.workflow_id in TASKS]
    spend = micros_to_usd(sum(a.cost_micros for a in closed))
    report = filled.report(ReportQuery(group_by=()))
    assert spend == micros_to_usd(report.totals.spend_micros) == Decimal("0.002013")
    assert _sum(rows, "BilledCost") == spend
    assert _sum(rows, "EffectiveCost") == spend
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
        # List and contracted costs are the quantity times the price, exactly.
        listed = Decimal(row["PricingQuantity"]) * Decimal(row["ListUnitPrice"])
        assert Decimal(row["ListCost"]) == listed == Decimal(row["ContractedCost"])
        assert Decimal(row["PricingQuantity"]) * 1_000_000 == Decimal(row["ConsumedQuantity"])
        # Exact decimals in fixed point, never a float's exponent.
        for column in MONEY_AND_QUANTITIES:
            assert FIXED_POINT.fullmatch(row[column]), (column, row[column])


def test_an_attempts_rounding_goes_to_its_largest_part() -> None:
    failed = _attempts()[0]  # 1001 in = 150.15 µ$, 37 out = 22.2 µ$, billed 172 µ$
    parts = {part.token_type.value: part for part in attempt_parts(failed)}
    assert failed.cost_micros == 172
    assert set(parts) == {"input", "output"}  # no cached tokens: no cached part
    assert parts["input"].billed == Decimal("0.0001498")
    assert parts["output"].billed == Decimal("0.0000222")


def test_rows_name_tenant_pool_model_and_carry_outcome_and_workflow_type(filled: Ledger) -> None:
    rows, _ = _export(filled)
    assert list(rows[0]) == list(COLUMNS)
    by_key = {
        (r["ChargePeriodStart"][:10], r["SubAccountId"], r["ResourceId"], r["SkuPriceId"],
         r["Tags"]): r
        for r in rows
    }  # fmt: skip
    assert len(by_key) == len(rows)
    r1 = json.dumps({"kvflow:outcome": "succeeded", "kvflow:workflow_type": "ResearchAgent"})
    failed_input = by_key[("2025-02-28", "acme", "h100", "h100/llama-70b/input/0.15", r1)]
    expected_values = {
        "BillingCurrency": "USD",
        "BillingPeriodStart": "2025-02-01T00:00:00Z",
        "BillingPeriodEnd": "2025-03-01T00:00:00Z",
        "ChargePeriodStart": "2025-02-28T00:00:00Z",
        "ChargePeriodEnd": "2025-03-01T00:00:00Z",
        "ChargeCategory": "Usage",
        "ChargeClass": "",
        "ServiceCategory": "AI and Machine Learning",
        "ConsumedQuantity": "1001.0",
        "ConsumedUnit": "Tokens",
        "PricingQuantity": "0.001001",
        "PricingUnit": "1000000 Tokens",
        "ListUnitPrice": "0.15",
        "ListCost": "0.00015015",
        "BilledCost": "0.0001498",
        "x_WastedCost": "0.0001498",  # a failed attempt of a task that succeeded
        "SkuId": "llama-70b/input",
        "x_Model": "llama-70b",
        "x_TokenType": "input",
        "SubAccountName": "acme",
        "ResourceName": "h100",
    }
    assert {column: failed_input[column] for column in expected_values} == expected_values
    # Cost per successful task: the report's, for that day, tenant, workflow type, pool and
    # model, failed and compensated tasks included; empty where nothing succeeded.
    report = filled.report(ReportQuery.parse("tenant,workflow_type,pool,model,day"))
    per_success = {
        (r.keys["day"], r.keys["tenant"], r.keys["pool"], r.keys["model"]): r.metrics()[
            "cost_per_successful_task_usd"
        ]
        for r in report.rows
    }
    for row in rows:
        expected = per_success[
            (row["ChargePeriodStart"][:10], row["SubAccountId"], row["ResourceId"], row["x_Model"])
        ]
        got = row["x_CostPerSuccessfulTask"]
        assert (Decimal(got) if got else None) == (Decimal(expected) if expected else None)
    r2 = json.dumps({"kvflow:outcome": "compensated", "kvflow:workflow_type": "ResearchAgent"})
    compensated = [r for r in rows if r["Tags"] == r2]
    assert compensated and all(r["x_WastedCost"] == r["BilledCost"] for r in compensated)
    # (172 + 222 + 233) µ$ on h100 that day, over its one success (R1)
    assert {r["x_CostPerSuccessfulTask"] for r in compensated} == {"0.000627"}
    initech = [r for r in rows if r["SubAccountId"] == "initech"]
    assert {r["x_CostPerSuccessfulTask"] for r in initech} == {""}
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


# focus-validator 1.0.0 (the FinOps Foundation's, on PyPI) checks FOCUS 1.0 under four
# column names of the 1.0 preview, and its SkuPriceId rule reads the preview's ChargeType
# (1.0's ChargeCategory): the file it reads carries those names, with the same values.
VALIDATOR_NAMES = {
    "ResourceId": "ResourceID",
    "InvoiceIssuerName": "InvoiceIssuer",
    "ProviderName": "Provider",
    "PublisherName": "Publisher",
}


def _validate(rows: list[dict[str, str]], path: Path) -> subprocess.CompletedProcess[str]:
    """Run the FinOps Foundation's validator (FOCUS 1.0) on `rows`."""
    with path.open("w", newline="", encoding="utf-8") as file:
        header = [VALIDATOR_NAMES.get(c, c) for c in rows[0]] + ["ChargeType"]
        writer = csv.writer(file)
        writer.writerow(header)
        for row in rows:
            writer.writerow([*row.values(), row["ChargeCategory"]])
    spec = importlib.util.find_spec("focus_validator")
    assert spec is not None and spec.origin is not None
    return subprocess.run(
        [sys.executable, "-m", "focus_validator.main", "--data-file", str(path),
         "--validate-version", "1.0"],
        # It reads its currency codes from a path relative to its own package's parent.
        cwd=Path(spec.origin).parent.parent,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )  # fmt: skip


@pytest.fixture
def validator() -> None:
    if importlib.util.find_spec("focus_validator") is not None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail("focus-validator is not installed; it is in the dev extra")
    pytest.skip("focus-validator is not installed (pip install -e '.[dev]')")


def test_the_finops_foundations_validator_accepts_the_export(
    validator: None, filled: Ledger, tmp_path: Path
) -> None:
    rows, _ = _export(filled)
    assert len(rows) >= 20
    assert set(FOCUS_COLUMNS) <= set(rows[0])
    result = _validate(rows, tmp_path / "focus.csv")
    assert "Validation succeeded." in result.stdout, result.stdout + result.stderr
    # The run checks something: a value outside the specification fails it.
    rows[3]["ServiceCategory"] = "GPUs"
    result = _validate(rows, tmp_path / "broken.csv")
    assert "ServiceCategory_Enum failed" in result.stdout, result.stdout + result.stderr


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

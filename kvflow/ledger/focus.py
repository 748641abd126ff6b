"""The ledger's spend as FOCUS 1.0 rows: the cost and usage format FinOps tools ingest.

FOCUS is the FinOps Foundation's Open Cost and Usage Specification; cloud bills come in it, so
a FOCUS file of kvflow's spend sits beside them in the tools finance already uses. This
module writes FOCUS 1.0 (the version the Foundation's `focus-validator` checks) as CSV.

The rows
--------
One row per UTC day, tenant, workflow type, task outcome, pool, model and token type (input,
cached input, output), for the tasks that closed in the report's range. The day is the one
the task closed on, the report's `day`: a task's charges land on one day, so each day's rows
add up to `kvflow report --group-by day`, and the whole file to the report's total spend.

- Who: `SubAccountId`/`SubAccountName` is the tenant; `BillingAccountId`, `ProviderName`,
  `PublisherName` and `InvoiceIssuerName` name the fleet's operator (`FocusAccount`).
- What: `ServiceName` "kvflow inference", `ServiceCategory` "AI and Machine Learning",
  `ResourceId`/`ResourceName` the pool (`ResourceType` "GPU pool"); `SkuId` is
  `<model>/<token type>` and `SkuPriceId` adds the pool and the price, so a new price is a
  new `SkuPriceId`. `ChargeCategory` is "Usage", `ChargeFrequency` "Usage-Based",
  `PricingCategory` "Standard"; the commitment-discount, region and `ChargeClass` columns
  are empty (nothing of the kind exists here, and no row is a correction).
- How much: `ConsumedQuantity` tokens (`ConsumedUnit` "Tokens"); `PricingQuantity` the same
  in millions (`PricingUnit` "1000000 Tokens"), priced at the pool's `ListUnitPrice` per
  million, the price stored with each attempt. `ListCost` = `PricingQuantity` × `ListUnitPrice`
  exactly, and `ContractedCost` and `ContractedUnitPrice` equal them (kvflow's prices are
  the prices: no negotiated discount).
- Billed: `BilledCost` = `EffectiveCost` = what the ledger billed (its attempts' integer
  micro-dollars). An attempt's cost is rounded once, to the micro-dollar, so it is split by
  token type at its stored prices and the rounding goes to its largest part: every row is
  exact, and the sum of `BilledCost` is the ledger's spend to the micro-dollar.
- `Tags` (a JSON object): `kvflow:workflow_type` and `kvflow:outcome` (the task's outcome).
- kvflow's own columns (FOCUS's `x_` prefix): `x_Model`, `x_TokenType`, `x_WastedCost` (the
  row's part of the report's wasted spend: every cost of a task that did not succeed, the
  runs it continued as new from included, and the failed and cancelled attempts of one that
  did or still runs), and
  `x_CostPerSuccessfulTask`: the report's cost per successful task for the row's day,
  tenant, workflow type, pool and model, all outcomes together (the same on each of that
  group's rows; empty where none succeeded).

Money and quantities are Decimals written in fixed point, never floats, and always with a
decimal point (`12.0`): tools that infer a CSV's column types (pandas, DuckDB, Spark) then
read every Decimal column as a decimal, not as an integer in one file and a decimal in the
next. Attempts of tasks with no task row yet are not in the file, as they are not in the
report (`report_notes` says how many).
"""

from __future__ import annotations

import csv
import io
import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from enum import StrEnum

from kvflow.ledger.records import AttemptOutcome, AttemptRecord, TaskOutcome
from kvflow.ledger.report import (
    AttemptTotals,
    GroupField,
    Report,
    ReportQuery,
    TaskFacts,
    build_report,
)
from kvflow.ledger.store import Ledger
from kvflow.scheduler.fleet import micros_to_usd

FOCUS_VERSION = "1.0"
"""The FOCUS version of the columns written."""

FOCUS_COLUMNS: tuple[str, ...] = (
    "BilledCost",
    "BillingAccountId",
    "BillingAccountName",
    "BillingCurrency",
    "BillingPeriodEnd",
    "BillingPeriodStart",
    "ChargeCategory",
    "ChargeClass",
    "ChargeDescription",
    "ChargeFrequency",
    "ChargePeriodEnd",
    "ChargePeriodStart",
    "CommitmentDiscountCategory",
    "CommitmentDiscountId",
    "CommitmentDiscountName",
    "CommitmentDiscountStatus",
    "CommitmentDiscountType",
    "ConsumedQuantity",
    "ConsumedUnit",
    "ContractedCost",
    "ContractedUnitPrice",
    "EffectiveCost",
    "InvoiceIssuerName",
    "ListCost",
    "ListUnitPrice",
    "PricingCategory",
    "PricingQuantity",
    "PricingUnit",
    "ProviderName",
    "PublisherName",
    "RegionId",
    "RegionName",
    "ResourceId",
    "ResourceName",
    "ResourceType",
    "ServiceCategory",
    "ServiceName",
    "SkuId",
    "SkuPriceId",
    "SubAccountId",
    "SubAccountName",
    "Tags",
)
"""The FOCUS 1.0 columns written, in the specification's (alphabetical) order."""

KVFLOW_COLUMNS: tuple[str, ...] = (
    "x_Model",
    "x_TokenType",
    "x_WastedCost",
    "x_CostPerSuccessfulTask",
)
"""kvflow's own columns, after the FOCUS ones (module docstring)."""

COLUMNS = FOCUS_COLUMNS + KVFLOW_COLUMNS

_PER_MILLION = 6
"""Prices are per million tokens: a quantity in millions is tokens scaled by 10^-6."""
_WASTED_ATTEMPTS = frozenset({AttemptOutcome.FAILED, AttemptOutcome.CANCELLED})


class TokenType(StrEnum):
    """The three things a pool prices separately (`TokenPrices`)."""

    INPUT = "input"
    """Prompt tokens the engine computed (not served from its KV cache)."""
    CACHED_INPUT = "cached-input"
    OUTPUT = "output"


# Where an attempt's rounding goes when two parts are equally large: the first listed.
_TOKEN_TYPES = (TokenType.OUTPUT, TokenType.INPUT, TokenType.CACHED_INPUT)


@dataclass(frozen=True)
class FocusAccount:
    """The FOCUS columns the ledger has no value for: who operates the fleet and bills."""

    billing_account_id: str = "kvflow"
    billing_account_name: str = "kvflow"
    provider_name: str = "kvflow"
    """`ProviderName`, `PublisherName` and `InvoiceIssuerName`: the fleet's operator."""
    service_name: str = "kvflow inference"


@dataclass(frozen=True, slots=True)
class AttemptPart:
    """The part of one attempt's bill that is one token type."""

    token_type: TokenType
    tokens: int
    price_per_mtok: Decimal
    billed: Decimal
    """Dollars billed for it (exact; the attempt's parts add up to its micro-dollars)."""


def attempt_parts(attempt: AttemptRecord) -> list[AttemptPart]:
    """Split an attempt's billed micro-dollars by token type at the prices stored with it.

    Each part is its tokens × price; the attempt's rounding to the micro-dollar (at most half
    of one, unless the row's cost was estimated) goes to its largest part. Parts without
    tokens or money are left out.
    """
    prices = attempt.prices
    tokens = {
        TokenType.INPUT: attempt.prompt_tokens - attempt.cached_tokens,
        TokenType.CACHED_INPUT: attempt.cached_tokens,
        TokenType.OUTPUT: attempt.completion_tokens,
    }
    price = {
        TokenType.INPUT: prices.input_per_mtok_usd,
        TokenType.CACHED_INPUT: prices.cached_input_per_mtok_usd,
        TokenType.OUTPUT: prices.output_per_mtok_usd,
    }
    listed = {kind: (tokens[kind] * price[kind]).scaleb(-_PER_MILLION) for kind in _TOKEN_TYPES}
    billed = dict(listed)
    largest = max(_TOKEN_TYPES, key=lambda kind: (listed[kind], -_TOKEN_TYPES.index(kind)))
    billed[largest] += micros_to_usd(attempt.cost_micros) - sum(listed.values(), Decimal(0))
    return [
        AttemptPart(
            token_type=kind,
            tokens=tokens[kind],
            price_per_mtok=price[kind],
            billed=billed[kind],
        )
        for kind in _TOKEN_TYPES
        if tokens[kind] or billed[kind]
    ]


@dataclass(frozen=True, slots=True)
class ChargeKey:
    """What one FOCUS row is the charge of."""

    day: date
    tenant: str
    workflow_type: str
    outcome: TaskOutcome
    pool: str
    model: str
    token_type: TokenType
    price_per_mtok: Decimal


@dataclass(slots=True)
class Charge:
    """The sums of one FOCUS row."""

    tokens: int = 0
    billed: Decimal = Decimal(0)
    wasted: Decimal = Decimal(0)


@dataclass(frozen=True)
class FocusExport:
    """The charges of the tasks in a report's range, ready to be written as FOCUS rows."""

    charges: dict[ChargeKey, Charge]
    cost_per_successful_task_micros: dict[tuple[str | None, ...], int | None]
    """By (tenant, workflow type, pool, model, day), as the report computes it."""
    account: FocusAccount = FocusAccount()

    @property
    def billed_micros(self) -> int:
        """The sum of `BilledCost`, in micro-dollars (always whole: see `attempt_parts`)."""
        total = sum((charge.billed for charge in self.charges.values()), Decimal(0))
        return int(total.scaleb(6))


_SUCCESS_GROUPS = (
    GroupField.TENANT,
    GroupField.WORKFLOW_TYPE,
    GroupField.POOL,
    GroupField.MODEL,
    GroupField.DAY,
)


def focus_export(
    tasks: Sequence[TaskFacts],
    attempts: Iterable[AttemptRecord],
    account: FocusAccount | None = None,
) -> FocusExport:
    """The FOCUS charges of `tasks` from their attempt rows (those of other tasks are ignored)."""
    by_key = {task.key: task for task in tasks}
    charges: dict[ChargeKey, Charge] = defaultdict(Charge)
    totals: dict[tuple[str, str, str, str], AttemptTotals] = {}
    for attempt in attempts:
        task = by_key.get((attempt.workflow_id, attempt.run_id))
        if task is None:
            continue
        # As in the report: all of a task's spend is waste once it ended unsucceeded (a run
        # it continued as new from too); else its failed and cancelled attempts.
        wasted = task.all_wasted or attempt.outcome in _WASTED_ATTEMPTS
        for part in attempt_parts(attempt):
            key = ChargeKey(
                day=task.closed_at.astimezone(UTC).date(),
                tenant=task.tenant,
                workflow_type=task.workflow_type,
                outcome=task.outcome,
                pool=attempt.pool,
                model=attempt.model,
                token_type=part.token_type,
                price_per_mtok=part.price_per_mtok,
            )
            charge = charges[key]
            charge.tokens += part.tokens
            charge.billed += part.billed
            if wasted:
                charge.wasted += part.billed
        _add_to_totals(totals, attempt)
    success = build_report(ReportQuery(group_by=_SUCCESS_GROUPS), tasks, totals.values())
    return FocusExport(
        charges=dict(charges),
        cost_per_successful_task_micros={
            tuple(row.keys[f.value] for f in _SUCCESS_GROUPS): row.cost_per_successful_task_micros
            for row in success.rows
        },
        account=account or FocusAccount(),
    )


def _add_to_totals(
    totals: dict[tuple[str, str, str, str], AttemptTotals], attempt: AttemptRecord
) -> None:
    """Sum an attempt into its task's totals on its model and pool, as the ledger's SQL does."""
    key = (attempt.workflow_id, attempt.run_id, attempt.model, attempt.pool)
    part = totals.get(key)
    wasted = attempt.cost_micros if attempt.outcome in _WASTED_ATTEMPTS else 0
    totals[key] = AttemptTotals(
        workflow_id=attempt.workflow_id,
        run_id=attempt.run_id,
        model=attempt.model,
        pool=attempt.pool,
        attempts=(part.attempts if part else 0) + 1,
        spend_micros=(part.spend_micros if part else 0) + attempt.cost_micros,
        wasted_micros=(part.wasted_micros if part else 0) + wasted,
        prompt_tokens=(part.prompt_tokens if part else 0) + attempt.prompt_tokens,
        cached_tokens=(part.cached_tokens if part else 0) + attempt.cached_tokens,
        reused_tokens=(part.reused_tokens if part else 0) + attempt.reused_tokens,
    )


def ledger_focus_export(
    ledger: Ledger, query: ReportQuery, account: FocusAccount | None = None
) -> tuple[Report, FocusExport]:
    """The report of `query`'s range and tenant (ungrouped), and its FOCUS charges.

    The tasks come from the report; their attempt rows are read task by task.
    """
    report = ledger.report(
        ReportQuery(group_by=(), since=query.since, until=query.until, tenant=query.tenant)
    )
    attempts = (
        attempt
        for task in report.tasks
        for attempt in ledger.attempts_for(task.workflow_id, task.run_id)
    )
    return report, focus_export(report.tasks, attempts, account)


def decimal_text(value: Decimal) -> str:
    """A Decimal in fixed point with a decimal point: `12.0`, `0.0000024`, never `2.4E-6`."""
    text = format(value.normalize(), "f")
    return text if "." in text else text + ".0"


def _moment(day: date) -> str:
    return datetime.combine(day, time(), tzinfo=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _month_after(day: date) -> date:
    return (day.replace(day=28) + timedelta(days=4)).replace(day=1)


def focus_rows(export: FocusExport) -> list[dict[str, str]]:
    """The FOCUS rows, each a dict by column name (empty string for null), sorted by key."""
    account = export.account
    rows = []
    for key in sorted(export.charges, key=_sort_key):
        charge = export.charges[key]
        listed = (charge.tokens * key.price_per_mtok).scaleb(-_PER_MILLION)
        billed = decimal_text(charge.billed)
        per_success = export.cost_per_successful_task_micros.get(
            (key.tenant, key.workflow_type, key.pool, key.model, key.day.isoformat())
        )
        kind = key.token_type.value.replace("-", " ")
        values = {
            "BilledCost": billed,
            "BillingAccountId": account.billing_account_id,
            "BillingAccountName": account.billing_account_name,
            "BillingCurrency": "USD",
            "BillingPeriodEnd": _moment(_month_after(key.day)),
            "BillingPeriodStart": _moment(key.day.replace(day=1)),
            "ChargeCategory": "Usage",
            "ChargeDescription": f"{key.model} {kind} tokens on pool {key.pool}",
            "ChargeFrequency": "Usage-Based",
            "ChargePeriodEnd": _moment(key.day + timedelta(days=1)),
            "ChargePeriodStart": _moment(key.day),
            "ConsumedQuantity": decimal_text(Decimal(charge.tokens)),
            "ConsumedUnit": "Tokens",
            "ContractedCost": decimal_text(listed),
            "ContractedUnitPrice": decimal_text(key.price_per_mtok),
            "EffectiveCost": billed,
            "InvoiceIssuerName": account.provider_name,
            "ListCost": decimal_text(listed),
            "ListUnitPrice": decimal_text(key.price_per_mtok),
            "PricingCategory": "Standard",
            "PricingQuantity": decimal_text(Decimal(charge.tokens).scaleb(-_PER_MILLION)),
            "PricingUnit": "1000000 Tokens",
            "ProviderName": account.provider_name,
            "PublisherName": account.provider_name,
            "ResourceId": key.pool,
            "ResourceName": key.pool,
            "ResourceType": "GPU pool",
            "ServiceCategory": "AI and Machine Learning",
            "ServiceName": account.service_name,
            "SkuId": f"{key.model}/{key.token_type.value}",
            "SkuPriceId": (
                f"{key.pool}/{key.model}/{key.token_type.value}/{decimal_text(key.price_per_mtok)}"
            ),
            "SubAccountId": key.tenant,
            "SubAccountName": key.tenant,
            "Tags": json.dumps(
                {"kvflow:outcome": key.outcome.value, "kvflow:workflow_type": key.workflow_type},
                sort_keys=True,
            ),
            "x_Model": key.model,
            "x_TokenType": key.token_type.value,
            "x_WastedCost": decimal_text(charge.wasted),
            "x_CostPerSuccessfulTask": (
                "" if per_success is None else decimal_text(micros_to_usd(per_success))
            ),
        }
        rows.append({column: values.get(column, "") for column in COLUMNS})
    return rows


def _sort_key(key: ChargeKey) -> tuple[object, ...]:
    return (
        key.day,
        key.tenant,
        key.workflow_type,
        key.outcome.value,
        key.pool,
        key.model,
        _TOKEN_TYPES.index(key.token_type),
        key.price_per_mtok,
    )


def focus_csv(export: FocusExport) -> str:
    """The FOCUS rows as CSV, with a header row of `COLUMNS`."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(focus_rows(export))
    return buffer.getvalue()

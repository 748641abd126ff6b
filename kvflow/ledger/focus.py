"""The ledger's spend as FOCUS 1.2 rows: the cost and usage format FinOps tools ingest.

FOCUS is the FinOps Foundation's Open Cost and Usage Specification; cloud bills come in it, so
a FOCUS file of kvflow's spend sits beside them in the tools finance already uses. This
module writes FOCUS 1.2 (the current release, the first with token-priced SaaS examples,
`PricingCurrency` and invoice columns) as CSV, every column the specification defines, in its
(alphabetical) order, then kvflow's own `x_` columns.

The rows
--------
The tasks are those that closed in the report's range, and their attempts are read with the
report in one snapshot (`Ledger.report_and_attempt_sums`), so the file and the report cannot
disagree.
The day of every row is the UTC day the task closed on, the report's `day`. Rows are of two
kinds:

- **Usage**: one per day, tenant, workflow type, task outcome, pool, model, token type (input,
  cached input, output) and price. `ConsumedQuantity` is tokens (`ConsumedUnit` "Tokens"),
  `PricingQuantity` the same in millions (`PricingUnit` "1000000 Tokens"), `ListUnitPrice`
  the pool's price per million stored with the attempts, and `ListCost` =
  `PricingQuantity` × `ListUnitPrice` exactly. kvflow's prices are the prices: no discount
  exists, so `ContractedUnitPrice` = `ListUnitPrice` and `BilledCost` = `EffectiveCost` =
  `ContractedCost` = `ListCost` on every row.
- **Adjustment** (`ChargeCategory` "Adjustment"): the GPU worker bills each attempt in whole
  micro-dollars, so an attempt's bill differs from its tokens × prices by its rounding (at
  most half a micro-dollar, unless the row is an estimate). One row per day, tenant, workflow
  type, outcome, pool and model carries the sum of that group's roundings, all four cost
  columns equal, no quantity, SKU or price (the specification's rule for a charge that is not
  usage). A rounding is no discount: a FinOps tool comparing `ListCost` with `BilledCost`
  finds none, and the file still sums to the ledger's micro-dollars.

So every cost column sums, exactly, to the ledger's spend of the tasks in range: the report's
total spend, to the micro-dollar, and each day, tenant, workflow type, pool or model to the
report's row for it (the report groups a task's attempts by model and pool as the file does).

Columns
-------
- Who: `SubAccountId`/`SubAccountName` is the tenant (`SubAccountType` "Tenant");
  `BillingAccountId`/`Name`/`Type`, `ProviderName`, `PublisherName` and `InvoiceIssuerName`
  name the fleet's operator (`FocusAccount`). `InvoiceId` is empty: kvflow issues no invoice.
- What: `ServiceName` "kvflow inference", `ServiceCategory` "AI and Machine Learning",
  `ServiceSubcategory` "Generative AI"; `ResourceId`/`ResourceName` the pool (`ResourceType`
  "GPU pool"). `SkuId` is `<model>/<token type>` (`SkuMeter` says which tokens), and
  `SkuPriceId` adds the pool and the price, so a new price is a new `SkuPriceId` of the same
  SKU; `SkuPriceDetails` names the model, pool and token type. `ChargeFrequency`
  "Usage-Based", `PricingCategory` "Standard" on usage. Billing and pricing are in USD
  (`PricingCurrency` and its three columns repeat the billed figures).
- Empty: commitment discounts, capacity reservations, regions and zones (nothing of the
  kind), and `ChargeClass` (no row corrects an invoiced period).
- `Tags` (a JSON object): `kvflow:workflow_type` and `kvflow:outcome` (the task's outcome).
- kvflow's own: `x_Model`, `x_TokenType` (empty on adjustments), and `x_WastedCost`, the
  row's part of the report's wasted spend (every cost of a task that did not succeed, the
  runs it continued as new from included, and the failed and cancelled attempts of one that
  did or still runs), so it sums to the report's wasted spend for any grouping.

There is no cost-per-successful-task column: it is a ratio over tasks (spend / succeeded
tasks), and a row is a charge, not a task. Put on rows it is either one group's figure
repeated (which a FinOps tool sums or averages into nonsense, and which disagrees with every
other grouping's figure) or not there. `kvflow report` gives it for any grouping over the
same range; the file's `BilledCost` adds up to that report's total spend.

Money and quantities are Decimals written in fixed point, never floats, and always with a
decimal point (`12.0`): tools that infer a CSV's column types then read every such column as a
number of one kind, not an integer in one file and a decimal in the next (DuckDB and pandas
infer DOUBLE, a binary float: read the cost columns as DECIMAL to sum them exactly, as the
README shows). Attempts of tasks with no task row yet are not in the file, as they are not in
the report (`report_notes` says how many).
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
from typing import NamedTuple

from kvflow.ledger.records import AttemptOutcome, AttemptRecord, TaskOutcome
from kvflow.ledger.report import Report, ReportQuery, TaskFacts
from kvflow.ledger.store import AttemptSums, Ledger
from kvflow.scheduler.fleet import micros_to_usd

FOCUS_VERSION = "1.2"
"""The FOCUS version of the columns written."""

FOCUS_COLUMNS: tuple[str, ...] = (
    "AvailabilityZone",
    "BilledCost",
    "BillingAccountId",
    "BillingAccountName",
    "BillingAccountType",
    "BillingCurrency",
    "BillingPeriodEnd",
    "BillingPeriodStart",
    "CapacityReservationId",
    "CapacityReservationStatus",
    "ChargeCategory",
    "ChargeClass",
    "ChargeDescription",
    "ChargeFrequency",
    "ChargePeriodEnd",
    "ChargePeriodStart",
    "CommitmentDiscountCategory",
    "CommitmentDiscountId",
    "CommitmentDiscountName",
    "CommitmentDiscountQuantity",
    "CommitmentDiscountStatus",
    "CommitmentDiscountType",
    "CommitmentDiscountUnit",
    "ConsumedQuantity",
    "ConsumedUnit",
    "ContractedCost",
    "ContractedUnitPrice",
    "EffectiveCost",
    "InvoiceId",
    "InvoiceIssuerName",
    "ListCost",
    "ListUnitPrice",
    "PricingCategory",
    "PricingCurrency",
    "PricingCurrencyContractedUnitPrice",
    "PricingCurrencyEffectiveCost",
    "PricingCurrencyListUnitPrice",
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
    "ServiceSubcategory",
    "SkuId",
    "SkuMeter",
    "SkuPriceDetails",
    "SkuPriceId",
    "SubAccountId",
    "SubAccountName",
    "SubAccountType",
    "Tags",
)
"""Every column FOCUS 1.2 defines, in the specification's (alphabetical) order."""

KVFLOW_COLUMNS: tuple[str, ...] = ("x_Model", "x_TokenType", "x_WastedCost")
"""kvflow's own columns, after the FOCUS ones (module docstring)."""

COLUMNS = FOCUS_COLUMNS + KVFLOW_COLUMNS

COST_COLUMNS: tuple[str, ...] = ("BilledCost", "ContractedCost", "EffectiveCost", "ListCost")
"""The four cost columns: equal on every row (no discount exists), each summing to the spend."""

_PER_MILLION = 6
"""Prices are per million tokens: a quantity in millions is tokens scaled by 10^-6."""
_WASTED_ATTEMPTS = frozenset({AttemptOutcome.FAILED, AttemptOutcome.CANCELLED})


class TokenType(StrEnum):
    """The three things a pool prices separately (`TokenPrices`)."""

    INPUT = "input"
    """Prompt tokens the engine computed (not served from its KV cache)."""
    CACHED_INPUT = "cached-input"
    OUTPUT = "output"


_TOKEN_TYPES = (TokenType.OUTPUT, TokenType.INPUT, TokenType.CACHED_INPUT)
_METERS = {
    TokenType.INPUT: "Input Tokens",
    TokenType.CACHED_INPUT: "Cached Input Tokens",
    TokenType.OUTPUT: "Output Tokens",
}


@dataclass(frozen=True)
class FocusAccount:
    """The FOCUS columns the ledger has no value for: who operates the fleet and bills."""

    billing_account_id: str = "kvflow"
    billing_account_name: str = "kvflow"
    billing_account_type: str = "Billing Account"
    provider_name: str = "kvflow"
    """`ProviderName`, `PublisherName` and `InvoiceIssuerName`: the fleet's operator."""
    service_name: str = "kvflow inference"


@dataclass(frozen=True, slots=True)
class AttemptPart:
    """The part of one attempt's tokens that is one token type, at its stored price."""

    token_type: TokenType
    tokens: int
    price_per_mtok: Decimal
    cost: Decimal
    """Dollars: tokens × price, exactly."""


def attempt_sums(attempt: AttemptRecord) -> AttemptSums:
    """One attempt row as the export reads attempts (`Ledger.report_and_attempt_sums`)."""
    return AttemptSums(
        workflow_id=attempt.workflow_id,
        run_id=attempt.run_id,
        pool=attempt.pool,
        model=attempt.model,
        outcome=attempt.outcome,
        prices=attempt.prices,
        input_tokens=attempt.prompt_tokens - attempt.cached_tokens,
        cached_tokens=attempt.cached_tokens,
        completion_tokens=attempt.completion_tokens,
        cost_micros=attempt.cost_micros,
    )


def attempt_parts(attempt: AttemptSums) -> list[AttemptPart]:
    """Attempts' tokens by type, each at the price stored with them.

    Types without tokens are left out. The parts add up to the attempts' bill less its
    rounding (`attempt_rounding`).
    """
    prices = attempt.prices
    tokens = {
        TokenType.INPUT: attempt.input_tokens,
        TokenType.CACHED_INPUT: attempt.cached_tokens,
        TokenType.OUTPUT: attempt.completion_tokens,
    }
    price = {
        TokenType.INPUT: prices.input_per_mtok_usd,
        TokenType.CACHED_INPUT: prices.cached_input_per_mtok_usd,
        TokenType.OUTPUT: prices.output_per_mtok_usd,
    }
    return [
        AttemptPart(
            token_type=kind,
            tokens=tokens[kind],
            price_per_mtok=price[kind],
            cost=(tokens[kind] * price[kind]).scaleb(-_PER_MILLION),
        )
        for kind in _TOKEN_TYPES
        if tokens[kind]
    ]


def attempt_rounding(attempt: AttemptSums, parts: Sequence[AttemptPart]) -> Decimal:
    """The attempts' bill (whole micro-dollars each) less their tokens × prices, in dollars."""
    return micros_to_usd(attempt.cost_micros) - sum((part.cost for part in parts), Decimal(0))


class ChargeKey(NamedTuple):
    """What one FOCUS row is the charge of (a tuple: hashed once per attempt part).

    Usage of one token type at one price; with `token_type` None, the group's rounding.
    """

    day: date
    tenant: str
    workflow_type: str
    outcome: TaskOutcome
    pool: str
    model: str
    token_type: TokenType | None = None
    price_per_mtok: Decimal | None = None

    @property
    def usage(self) -> bool:
        """Whether the row is usage (else the rounding adjustment)."""
        return self.token_type is not None


@dataclass(slots=True)
class Charge:
    """The sums of one FOCUS row."""

    tokens: int = 0
    cost: Decimal = Decimal(0)
    """Dollars, exact: tokens × price on usage, the roundings on an adjustment."""
    wasted: Decimal = Decimal(0)


@dataclass(frozen=True)
class FocusExport:
    """The charges of the tasks in a report's range, ready to be written as FOCUS rows."""

    charges: dict[ChargeKey, Charge]
    account: FocusAccount = FocusAccount()

    @property
    def billed_micros(self) -> int:
        """The sum of `BilledCost`, in micro-dollars (always whole: the ledger's spend)."""
        total = sum((charge.cost for charge in self.charges.values()), Decimal(0))
        return int(total.scaleb(6))


def focus_export(
    tasks: Sequence[TaskFacts],
    attempts: Iterable[AttemptSums],
    account: FocusAccount | None = None,
) -> FocusExport:
    """The FOCUS charges of `tasks` from their attempts (those of other tasks are ignored).

    `attempts` may be rows (`attempt_sums`) or their sums by run, pool, model, outcome and
    prices, as `Ledger.report_and_attempt_sums` reads them: the charges are the same.
    """
    by_key = {task.key: task for task in tasks}
    charges: dict[ChargeKey, Charge] = defaultdict(Charge)
    for attempt in attempts:
        task = by_key.get((attempt.workflow_id, attempt.run_id))
        if task is None:
            continue
        # As in the report: all of a task's spend is waste once it ended unsucceeded (a run
        # it continued as new from too); else its failed and cancelled attempts.
        wasted = task.all_wasted or attempt.outcome in _WASTED_ATTEMPTS
        group = ChargeKey(
            day=task.closed_at.astimezone(UTC).date(),
            tenant=task.tenant,
            workflow_type=task.workflow_type,
            outcome=task.outcome,
            pool=attempt.pool,
            model=attempt.model,
        )
        parts = attempt_parts(attempt)
        for part in parts:
            charge = charges[
                group._replace(token_type=part.token_type, price_per_mtok=part.price_per_mtok)
            ]
            charge.tokens += part.tokens
            charge.cost += part.cost
            if wasted:
                charge.wasted += part.cost
        rounding = attempt_rounding(attempt, parts)
        if rounding:
            adjustment = charges[group]
            adjustment.cost += rounding
            if wasted:
                adjustment.wasted += rounding
    # Roundings of a group can cancel out: a row is kept while it carries any money.
    kept = {
        key: charge for key, charge in charges.items() if key.usage or charge.cost or charge.wasted
    }
    return FocusExport(charges=kept, account=account or FocusAccount())


def ledger_focus_export(
    ledger: Ledger, query: ReportQuery, account: FocusAccount | None = None
) -> tuple[Report, FocusExport]:
    """The report of `query`'s range and tenant (ungrouped), and its FOCUS charges.

    Both come from one snapshot of the ledger, in a number of statements that does not grow
    with the number of tasks.
    """
    report, attempts = ledger.report_and_attempt_sums(
        ReportQuery(group_by=(), since=query.since, until=query.until, tenant=query.tenant)
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
        cost = decimal_text(charge.cost)
        values = {
            "BilledCost": cost,
            "BillingAccountId": account.billing_account_id,
            "BillingAccountName": account.billing_account_name,
            "BillingAccountType": account.billing_account_type,
            "BillingCurrency": "USD",
            "BillingPeriodEnd": _moment(_month_after(key.day)),
            "BillingPeriodStart": _moment(key.day.replace(day=1)),
            "ChargeFrequency": "Usage-Based",
            "ChargePeriodEnd": _moment(key.day + timedelta(days=1)),
            "ChargePeriodStart": _moment(key.day),
            "ContractedCost": cost,
            "EffectiveCost": cost,
            "InvoiceIssuerName": account.provider_name,
            "ListCost": cost,
            "PricingCurrency": "USD",
            "PricingCurrencyEffectiveCost": cost,
            "ProviderName": account.provider_name,
            "PublisherName": account.provider_name,
            "ResourceId": key.pool,
            "ResourceName": key.pool,
            "ResourceType": "GPU pool",
            "ServiceCategory": "AI and Machine Learning",
            "ServiceName": account.service_name,
            "ServiceSubcategory": "Generative AI",
            "SubAccountId": key.tenant,
            "SubAccountName": key.tenant,
            "SubAccountType": "Tenant",
            "Tags": json.dumps(
                {"kvflow:outcome": key.outcome.value, "kvflow:workflow_type": key.workflow_type},
                sort_keys=True,
            ),
            "x_Model": key.model,
            "x_WastedCost": decimal_text(charge.wasted),
        }
        if key.token_type is None or key.price_per_mtok is None:
            values["ChargeCategory"] = "Adjustment"
            values["ChargeDescription"] = (
                f"{key.model} on pool {key.pool}: each attempt's bill rounded to the micro-dollar"
            )
        else:
            values.update(_usage_values(key, key.token_type, key.price_per_mtok, charge))
        rows.append({column: values.get(column, "") for column in COLUMNS})
    return rows


def _usage_values(
    key: ChargeKey, token_type: TokenType, price: Decimal, charge: Charge
) -> dict[str, str]:
    """The columns only a usage row has: quantities, prices and the SKU."""
    unit_price = decimal_text(price)
    sku = f"{key.model}/{token_type.value}"
    details = {"x_Model": key.model, "x_Pool": key.pool, "x_TokenType": token_type.value}
    return {
        "ChargeCategory": "Usage",
        "ChargeDescription": (
            f"{key.model} {token_type.value.replace('-', ' ')} tokens on pool {key.pool}"
        ),
        "ConsumedQuantity": decimal_text(Decimal(charge.tokens)),
        "ConsumedUnit": "Tokens",
        "ContractedUnitPrice": unit_price,
        "ListUnitPrice": unit_price,
        "PricingCategory": "Standard",
        "PricingCurrencyContractedUnitPrice": unit_price,
        "PricingCurrencyListUnitPrice": unit_price,
        "PricingQuantity": decimal_text(Decimal(charge.tokens).scaleb(-_PER_MILLION)),
        "PricingUnit": "1000000 Tokens",
        "SkuId": sku,
        "SkuMeter": _METERS[token_type],
        "SkuPriceDetails": json.dumps(details, sort_keys=True),
        "SkuPriceId": f"{key.pool}/{sku}/{unit_price}",
        "x_TokenType": token_type.value,
    }


def _sort_key(key: ChargeKey) -> tuple[object, ...]:
    return (
        key.day,
        key.tenant,
        key.workflow_type,
        key.outcome.value,
        key.pool,
        key.model,
        # Usage by token type, then the group's adjustment.
        len(_TOKEN_TYPES) if key.token_type is None else _TOKEN_TYPES.index(key.token_type),
        key.price_per_mtok or Decimal(0),
    )


def focus_csv(export: FocusExport) -> str:
    """The FOCUS rows as CSV, with a header row of `COLUMNS`."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(focus_rows(export))
    return buffer.getvalue()

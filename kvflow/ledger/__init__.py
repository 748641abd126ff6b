"""The spend ledger: attempt and task rows, and the cost-per-successful-task report.

Write rows with `open_ledger(url).record_attempt(...)` / `.record_task(...)` (or through
`AsyncLedger` from async code); read `Ledger.report(ReportQuery(...))`, or run `kvflow report`.
Money is integer micro-dollars; the report's definitions are in `kvflow.ledger.report`.
"""

from kvflow.ledger.errors import (
    LedgerError,
    LedgerNotFound,
    LedgerSchemaError,
    LedgerUnavailable,
    LedgerUrlError,
    ReportQueryError,
)
from kvflow.ledger.records import AttemptOutcome, AttemptRecord, TaskOutcome, TaskRecord, TaskSource
from kvflow.ledger.report import GroupField, Report, ReportQuery, ReportRow
from kvflow.ledger.store import (
    DEFAULT_LEDGER_URL,
    LEDGER_URL_ENV,
    AsyncLedger,
    Ledger,
    connect_ledger,
    default_ledger_url,
    open_async_ledger,
    open_ledger,
)

__all__ = [
    "DEFAULT_LEDGER_URL",
    "LEDGER_URL_ENV",
    "AsyncLedger",
    "AttemptOutcome",
    "AttemptRecord",
    "GroupField",
    "Ledger",
    "LedgerError",
    "LedgerNotFound",
    "LedgerSchemaError",
    "LedgerUnavailable",
    "LedgerUrlError",
    "Report",
    "ReportQuery",
    "ReportQueryError",
    "ReportRow",
    "TaskOutcome",
    "TaskRecord",
    "TaskSource",
    "connect_ledger",
    "default_ledger_url",
    "open_async_ledger",
    "open_ledger",
]

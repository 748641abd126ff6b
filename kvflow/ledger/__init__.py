"""The spend ledger: attempt and task rows, and the cost-per-successful-task report.

Write rows with `open_ledger(url).record_attempt(...)` / `.record_task(...)` (or through
`AsyncLedger` from async code); read `Ledger.report(ReportQuery(...))`, or run `kvflow report`.
Money is integer micro-dollars; the report's definitions are in `kvflow.ledger.report`.

Every attempt is billed exactly once
------------------------------------
An attempt is one run of one inference activity, keyed `(workflow_id, run_id, activity_id,
attempt)`: the key Temporal gives it, which the GPU worker and the workflow both know. The
ledger holds one row per key. The GPU worker writes the exact row when the attempt ends (retried,
spooled to its disk, replayed: `kvflow.ledger.spool`). When the workflow loses track of an
attempt (heartbeat timeout: the worker died, before or after its write, or its completion was
lost on the way to Temporal) it writes a *provisional* row from the last heartbeat. The exact
row wins whichever comes first: it replaces a provisional row, a provisional row never replaces
it.

The ledger is the book of record
--------------------------------
A task's spend, attempt count and wasted spend are the sum of its attempt rows as they stand
when they are read (`Ledger.task` returns a `TaskBook`; the report sums the same rows). No row
is ever patched into a total, so a row counts the same whichever order it arrives in: before or
after the task row, straight away or replayed from a spool, an exact row replacing an estimate,
an attempt of a timed-out run that ends after `kvflow ledger reconcile` wrote its row. A resumed
mark (`mark_resumed`) is a fact of its own, kept in `resumed_attempts`: a `failed` or `cancelled`
row of a marked attempt (its output was carried on) is stored as `resumed_elsewhere` whenever it
arrives, and no later row undoes it.

The task row keeps what its writer saw at the close (`spend_at_close_micros`,
`attempts_at_close`): the workflow's spend meter, which is also its `kvflow_spend` query and its
`KvflowSpendMicros` search attribute, or the rows reconcile found. Where the ledger moved after
that (a row that was still in a spool when the task closed), `Ledger.tasks_moved` lists the
task, `kvflow report` flags it with the difference and `kvflow ledger reconcile` lists it. The
ledger's figure is the one finance bills.
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

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

The task row's spend is the sum of the task's attempt rows. The workflow writes it from its
spend meter, in which every attempt is billed at its row's figures: an answer and a failure
carry the cost the worker computed for its row, and a lost attempt is billed at its row as read
back from the ledger when the workflow bills it and again just before it closes. The meter,
rather than a sum the task-row write would take from the ledger, is what the row records: an
answer whose row is still in a GPU worker's spool when the task closes (the ledger was down) is
counted all the same, and the books add up once the spool is replayed. The `kvflow_spend` query
and the `KvflowSpendMicros` search attribute show the same figures.

Rows that arrive after the task row keep it the sum, in the transaction that writes them: an
exact row that replaces an estimate moves the task's spend by the difference, and a new row is
added to a row `kvflow ledger reconcile` summed without it. What stays apart is only a lost
attempt whose provisional row could not be written for the whole retry window and whose worker
row arrives later (the workflow logs the failed write), and a row written in the moment between
`reconcile` reading a task's attempts and writing its task row.
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

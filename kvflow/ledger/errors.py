"""Every error the ledger raises, in one hierarchy.

Driver errors (sqlite3, psycopg) are mapped to these at the ledger's boundary, so callers and
the CLI handle one set of types. `LedgerUnavailable` is the one a caller may retry.
"""

from __future__ import annotations


class LedgerError(Exception):
    """Base class of every ledger error."""


class LedgerUrlError(LedgerError):
    """The ledger URL is malformed or names a backend kvflow does not support."""


class LedgerNotFound(LedgerError):
    """The ledger database does not exist (and was not asked to be created)."""


class LedgerUnavailable(LedgerError):
    """The database server could not be reached or refused the connection (retryable)."""


class LedgerSchemaError(LedgerError):
    """The database has no ledger schema, an older one (migrate it) or a newer one."""


class ReportQueryError(LedgerError):
    """A report was asked for with an unknown group-by field, a bad date or an empty range."""

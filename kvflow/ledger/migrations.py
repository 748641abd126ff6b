"""The ledger's schema, as numbered migrations applied in order.

`schema_version` holds one row per applied migration. A ledger opened for writing or reporting
checks that its latest version is `LATEST_VERSION`; an older database is refused with a message
that says to run `kvflow ledger migrate`. Migrations are append-only: never edit one that has
shipped, add the next number.

The SQL is the same for SQLite and PostgreSQL except for two column types: `{timestamp}`
(`TIMESTAMPTZ` in PostgreSQL; ISO-8601 UTC text in SQLite, which sorts in time order) and
`{decimal}` (`NUMERIC` in PostgreSQL; the exact decimal as text in SQLite).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Migration:
    """One schema change: its number, what it does, and its statements."""

    version: int
    description: str
    statements: tuple[str, ...]


SCHEMA_VERSION_TABLE = """
CREATE TABLE IF NOT EXISTS schema_version (
    version INTEGER PRIMARY KEY,
    description TEXT NOT NULL,
    applied_at {timestamp} NOT NULL
)
"""

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "attempt and task tables",
        (
            """
            CREATE TABLE attempts (
                workflow_id TEXT NOT NULL,
                run_id TEXT NOT NULL,
                activity_id TEXT NOT NULL,
                attempt INTEGER NOT NULL,
                step TEXT NOT NULL,
                tenant TEXT NOT NULL,
                workflow_type TEXT NOT NULL,
                model TEXT NOT NULL,
                pool TEXT NOT NULL,
                replica TEXT NOT NULL,
                gpu TEXT NOT NULL,
                started_at {timestamp} NOT NULL,
                ended_at {timestamp} NOT NULL,
                outcome TEXT NOT NULL,
                prompt_tokens BIGINT NOT NULL,
                cached_tokens BIGINT NOT NULL,
                completion_tokens BIGINT NOT NULL,
                reused_tokens BIGINT NOT NULL,
                input_per_mtok_usd {decimal} NOT NULL,
                cached_input_per_mtok_usd {decimal} NOT NULL,
                output_per_mtok_usd {decimal} NOT NULL,
                cost_micros BIGINT NOT NULL,
                error_type TEXT,
                recorded_at {timestamp} NOT NULL,
                PRIMARY KEY (workflow_id, run_id, activity_id, attempt)
            )
            """,
            """
            CREATE TABLE tasks (
                workflow_id TEXT NOT NULL,
                run_id TEXT NOT NULL,
                tenant TEXT NOT NULL,
                workflow_type TEXT NOT NULL,
                started_at {timestamp} NOT NULL,
                closed_at {timestamp} NOT NULL,
                outcome TEXT NOT NULL,
                steps INTEGER NOT NULL,
                attempts INTEGER NOT NULL,
                spend_micros BIGINT NOT NULL,
                compensation_micros BIGINT NOT NULL,
                source TEXT NOT NULL,
                recorded_at {timestamp} NOT NULL,
                PRIMARY KEY (workflow_id, run_id)
            )
            """,
        ),
    ),
    Migration(
        2,
        "indexes for reports by close time and for attempts without a task row",
        (
            "CREATE INDEX tasks_by_closed_at ON tasks (closed_at, tenant)",
            "CREATE INDEX attempts_by_started_at ON attempts (started_at, tenant)",
        ),
    ),
    Migration(
        3,
        "provisional attempt rows, superseded by the GPU worker's exact row",
        (
            # Rows written before this migration all came from GPU workers or were final.
            "ALTER TABLE attempts ADD COLUMN provisional BOOLEAN NOT NULL DEFAULT FALSE",
        ),
    ),
    Migration(
        4,
        "a task's spend is the sum of its attempt rows; resumed marks are facts of their own",
        (
            # What the task row held is the writer's figure when the task closed; the ledger's
            # figures are summed from the attempt rows on every read (`Ledger.task`).
            "ALTER TABLE tasks RENAME COLUMN spend_micros TO spend_at_close_micros",
            "ALTER TABLE tasks RENAME COLUMN attempts TO attempts_at_close",
            """
            CREATE TABLE resumed_attempts (
                workflow_id TEXT NOT NULL,
                run_id TEXT NOT NULL,
                activity_id TEXT NOT NULL,
                recorded_at {timestamp} NOT NULL,
                PRIMARY KEY (workflow_id, run_id, activity_id)
            )
            """,
            """
            INSERT INTO resumed_attempts (workflow_id, run_id, activity_id, recorded_at)
            SELECT workflow_id, run_id, activity_id, MIN(recorded_at) FROM attempts
            WHERE outcome = 'resumed_elsewhere' GROUP BY workflow_id, run_id, activity_id
            """,
        ),
    ),
    Migration(
        5,
        "the chain of runs a task continued as new through",
        (
            # The first run of the task's chain (`workflow.info().first_execution_run_id`).
            # Rows from before did not say: each is taken as a chain of its own run.
            "ALTER TABLE tasks ADD COLUMN chain_run_id TEXT",
            "UPDATE tasks SET chain_run_id = run_id",
            "CREATE INDEX tasks_by_chain ON tasks (chain_run_id)",
        ),
    ),
)

LATEST_VERSION = MIGRATIONS[-1].version
"""The schema version this kvflow writes and reads."""

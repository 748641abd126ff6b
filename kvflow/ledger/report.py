"""Cost per successful task: the report's definitions and its computation.

The report is computed in Python from two small inputs that every backend fetches with the
same SQL: the closed tasks in range (`TaskFacts`) and, per task, its attempts summed by model
and pool (`AttemptTotals`). Every money figure is integer micro-dollars until it is formatted.

Definitions (per group of the report):

- **tasks**: closed tasks (task rows) whose `closed_at` lies in `[since, until)`. A run that
  continued as new (outcome `continued_as_new`) is no task of its own: its task goes on in
  the next run, and the runs of one task form a chain (`chain_run_id`, the chain's first
  run; a cron run or a workflow retry starts a chain of its own). In a chain of rows from
  before, which cron runs and retries share, each final row ends the continued runs closed
  since the one before it (`ChainEnds`). A continued run's spend, attempts and tokens count
  in its own groups (its tenant, workflow type and day of close) as every spend does; it is
  not a task there.
- **succeeded**: those whose outcome is `succeeded`. **success_rate** = succeeded / tasks.
- **a task's spend** = the sum of `cost_micros` over its attempt rows (not the task row's own
  total), so the report's totals equal the sum of attempt rows to the micro-dollar.
- **total_spend** = the sum of the tasks' spend and of the runs that continued as new.
- **wasted_spend** = the spend of tasks that did not succeed (failed, compensated, cancelled,
  terminated, timed out; their compensations are attempts of theirs, so they are included)
  + the cost of `failed` and `cancelled` attempts within succeeded tasks. An attempt that was
  `resumed_elsewhere` is not waste: its partial output was carried into the next attempt.
  A continued run is judged by its chain's end as the ledger knows it when the report is
  read: all its spend is waste once a later run of its task ended without success, and only
  its failed and cancelled attempts while the task succeeded or still runs. So a report of a
  past period grows the waste of a task that failed since, as it grows for a row that arrived
  late.
- **cost_per_successful_task** = total_spend / succeeded, rounded half up to the micro-dollar;
  null when nothing succeeded. This is the figure finance asks for: every failure and retry on
  the way is in the numerator, only successes are in the denominator.
- **p50 / p95 cost per succeeded task**: nearest-rank percentiles of the spend of the succeeded
  tasks (the value at rank `ceil(p/100 × n)` of the sorted spends), so each is the real cost of
  one task; null when nothing succeeded. A task that continued as new costs what all its runs
  spent, whenever they closed (grouped by model or pool: what they spent on that model or
  pool, in the groups its last run touched).
- **cached_token_share** = cached prompt tokens / prompt tokens over the group's attempts.
- **tokens_saved_by_resume** = the sum of the attempts' `reused_tokens`: output tokens that a
  resumed attempt did not have to decode again.
- **day** is the UTC day of the task's `closed_at`.
- **moved tasks**: tasks whose ledger spend (the sum of their attempt rows, what every figure
  above uses) differs from the spend their task row's writer saw at the close: a row spooled
  and replayed after it, an exact row that replaced an estimate. They are listed, with the
  difference, so a figure read at the close can be told from a mistake.

Grouping by `model` or `pool` is attempt-level: a task counts in every model/pool group it
touched, with its spend in that group being its attempts' spend there (so the task counts of
such a report can add up to more than the number of tasks, while the spends still add up to
the total). A task with no attempts counts in the group whose model and pool are null.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from decimal import ROUND_HALF_UP, Decimal
from enum import StrEnum

from kvflow.ledger.errors import ReportQueryError
from kvflow.ledger.records import TaskOutcome
from kvflow.scheduler.fleet import format_usd


class GroupField(StrEnum):
    """A field the report can group by."""

    TENANT = "tenant"
    WORKFLOW_TYPE = "workflow_type"
    MODEL = "model"
    POOL = "pool"
    DAY = "day"


ATTEMPT_LEVEL_FIELDS = frozenset({GroupField.MODEL, GroupField.POOL})
"""Fields that split a task's attempts between groups (see the module docstring)."""

DEFAULT_GROUP_BY: tuple[GroupField, ...] = (GroupField.TENANT, GroupField.WORKFLOW_TYPE)

METRIC_COLUMNS: tuple[str, ...] = (
    "tasks",
    "succeeded",
    "success_rate",
    "attempts",
    "total_spend_usd",
    "wasted_spend_usd",
    "cost_per_successful_task_usd",
    "p50_cost_per_succeeded_task_usd",
    "p95_cost_per_succeeded_task_usd",
    "cached_token_share",
    "tokens_saved_by_resume",
)
"""The metric columns of every row, in order, after the group keys (JSON and CSV names)."""

RATIO_COLUMNS = frozenset({"success_rate", "cached_token_share"})
"""Metric columns that are fractions of 1 (the others are counts or dollar strings)."""


def _ratio(numerator: int, denominator: int) -> Decimal | None:
    if denominator == 0:
        return None
    return (Decimal(numerator) / Decimal(denominator)).quantize(
        Decimal("0.0001"), rounding=ROUND_HALF_UP
    )


def nearest_rank(sorted_values: Sequence[int], percent: int) -> int | None:
    """The nearest-rank percentile: the value at rank `ceil(percent/100 × n)` (1-based)."""
    n = len(sorted_values)
    if n == 0:
        return None
    rank = max(1, (percent * n + 99) // 100)
    return sorted_values[rank - 1]


def _parse_moment(name: str, text: str, *, end: bool) -> datetime:
    """An ISO date (whole UTC day; `end` makes it inclusive) or an ISO date-time (UTC if naive)."""
    text = text.strip()
    try:
        day = date.fromisoformat(text)
    except ValueError:
        pass
    else:
        if len(text) == 10:  # YYYY-MM-DD: a whole day; other ISO forms are date-times below
            start = datetime.combine(day, time(), tzinfo=UTC)
            return start + timedelta(days=1) if end else start
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ReportQueryError(
            f"{name} {text!r} is not an ISO date (YYYY-MM-DD) or date-time "
            "(YYYY-MM-DDTHH:MM[:SS][+HH:MM])"
        ) from None
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


@dataclass(frozen=True)
class ReportQuery:
    """What to report: grouping, the close-time range `[since, until)` and a tenant filter."""

    group_by: tuple[GroupField, ...] = DEFAULT_GROUP_BY
    since: datetime | None = None
    """Tasks closed at or after this moment (aware)."""
    until: datetime | None = None
    """Tasks closed before this moment (aware; exclusive)."""
    tenant: str | None = None

    def __post_init__(self) -> None:
        duplicates = {f for f in self.group_by if self.group_by.count(f) > 1}
        if duplicates:
            names = ", ".join(sorted(duplicates))
            raise ReportQueryError(f"group-by lists {names} more than once; name each once")
        for name, moment in (("since", self.since), ("until", self.until)):
            if moment is not None and moment.tzinfo is None:
                raise ReportQueryError(f"{name} has no time zone; give an aware datetime")
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise ReportQueryError(
                f"empty range: since {self.since.isoformat()} is not before until "
                f"{self.until.isoformat()}; give a since that is before until "
                "(dates are whole UTC days, both inclusive)"
            )

    @classmethod
    def parse(
        cls,
        group_by: str = ",".join(DEFAULT_GROUP_BY),
        since: str | None = None,
        until: str | None = None,
        tenant: str | None = None,
    ) -> ReportQuery:
        """Build a query from command-line text.

        `group_by` is a comma-separated list of field names (empty for one overall row).
        `since` and `until` are ISO dates, both inclusive whole UTC days, or ISO date-times
        (`until` exclusive; naive means UTC). Raises `ReportQueryError` naming what is wrong.
        """
        fields: list[GroupField] = []
        known = ", ".join(f.value for f in GroupField)
        for part in group_by.split(","):
            name = part.strip().lower().replace("-", "_")
            if not name:
                continue
            try:
                fields.append(GroupField(name))
            except ValueError:
                raise ReportQueryError(
                    f"unknown group-by field {part.strip()!r}; choose from {known} "
                    "(comma-separated, e.g. tenant,day)"
                ) from None
        return cls(
            group_by=tuple(fields),
            since=_parse_moment("since", since, end=False) if since else None,
            until=_parse_moment("until", until, end=True) if until else None,
            tenant=tenant or None,
        )

    @property
    def attempt_level(self) -> bool:
        """Whether a task's attempts are split between groups (grouping by model or pool)."""
        return any(f in ATTEMPT_LEVEL_FIELDS for f in self.group_by)


@dataclass(frozen=True, slots=True)
class TaskFacts:
    """The part of a task row the report needs."""

    workflow_id: str
    run_id: str
    tenant: str
    workflow_type: str
    closed_at: datetime
    outcome: TaskOutcome
    spend_at_close_micros: int = 0
    """What the task row's writer saw the task spend when it closed."""
    chain_outcome: TaskOutcome | None = None
    """For a run that continued as new: how its task ended in a later run (None: not yet)."""
    earlier_spend: tuple[SpendSlice, ...] = ()
    """For the last run of a task that continued as new: what its earlier runs spent."""

    @property
    def key(self) -> tuple[str, str]:
        """`(workflow_id, run_id)`."""
        return (self.workflow_id, self.run_id)

    @property
    def all_wasted(self) -> bool:
        """Whether all this run's spend is waste: its task ended, here or later, unsucceeded."""
        ended = self.outcome if self.outcome.final else self.chain_outcome
        return ended is not None and ended is not TaskOutcome.SUCCEEDED


class ChainEnds:
    """The final rows of chains of runs, in close order: where each continued run's task ended.

    The runs of a chain close one after another. A continued run's task ends at the first
    final row of its chain that closed at or after it (the continued run first on a tie,
    then by run id), so the order is defined whatever order the rows were written or read
    in. A chain written since the chain travels with the continue-as-new holds one task. One
    written before names `first_execution_run_id`, which the cron runs and workflow retries of
    a workflow share with its continued runs, so it may hold several tasks: each final row
    ends the continued runs that closed since the final row before it.
    """

    def __init__(self, rows: Iterable[tuple[str, str, datetime, TaskOutcome]]) -> None:
        """`rows`: the final rows of the chains, as (chain, run id, closed at, outcome)."""
        ends: dict[str, list[tuple[datetime, str, TaskOutcome]]] = defaultdict(list)
        for chain, run_id, closed_at, outcome in rows:
            ends[chain].append((closed_at, run_id, outcome))
        for chain_ends in ends.values():
            chain_ends.sort()
        self._ends = dict(ends)
        self._closes = {chain: [end[0] for end in e] for chain, e in self._ends.items()}

    def end_of(self, chain: str, closed_at: datetime) -> tuple[str, TaskOutcome] | None:
        """Where a continued run of `chain`, closed at `closed_at`, had its task end.

        (run id, outcome) of that final row; None while the task has not ended.
        """
        closes = self._closes.get(chain)
        if not closes:
            return None
        at = bisect_left(closes, closed_at)
        if at == len(closes):
            return None
        _, run_id, outcome = self._ends[chain][at]
        return run_id, outcome


@dataclass(frozen=True, slots=True)
class SpendSlice:
    """What some runs spent on one model and pool."""

    model: str | None
    pool: str | None
    spend_micros: int


@dataclass(frozen=True, slots=True)
class MovedTask:
    """A task whose ledger spend moved after it closed: rows came or changed since."""

    workflow_id: str
    run_id: str
    tenant: str
    spend_at_close_micros: int
    spend_micros: int
    """The ledger's spend now: the sum of the task's attempt rows."""

    @property
    def moved_micros(self) -> int:
        """Ledger spend minus spend at the close."""
        return self.spend_micros - self.spend_at_close_micros


@dataclass(frozen=True, slots=True)
class AttemptTotals:
    """One task's attempts on one model and pool, summed."""

    workflow_id: str
    run_id: str
    model: str | None
    pool: str | None
    attempts: int
    spend_micros: int
    wasted_micros: int
    """Cost of its `failed` and `cancelled` attempts."""
    prompt_tokens: int
    cached_tokens: int
    reused_tokens: int


@dataclass
class ReportRow:
    """The figures of one group (see the module docstring for every definition)."""

    keys: dict[str, str | None]
    tasks: int = 0
    succeeded: int = 0
    attempts: int = 0
    spend_micros: int = 0
    wasted_micros: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    reused_tokens: int = 0
    succeeded_spends: list[int] = field(default_factory=list)
    """Spend of each succeeded task in this group, sorted."""

    @property
    def success_rate(self) -> Decimal | None:
        """The fraction succeeded / tasks, to four places; None without tasks."""
        return _ratio(self.succeeded, self.tasks)

    @property
    def cost_per_successful_task_micros(self) -> int | None:
        """Total spend / succeeded, rounded half up; None when nothing succeeded."""
        if self.succeeded == 0:
            return None
        return (2 * self.spend_micros + self.succeeded) // (2 * self.succeeded)

    @property
    def p50_micros(self) -> int | None:
        """Median spend of a succeeded task (nearest rank)."""
        return nearest_rank(self.succeeded_spends, 50)

    @property
    def p95_micros(self) -> int | None:
        """95th-percentile spend of a succeeded task (nearest rank)."""
        return nearest_rank(self.succeeded_spends, 95)

    @property
    def cached_token_share(self) -> Decimal | None:
        """The fraction cached / prompt tokens, to four places; None without prompt tokens."""
        return _ratio(self.cached_tokens, self.prompt_tokens)

    def metrics(self) -> dict[str, str | int | Decimal | None]:
        """The metric columns: money as dollar strings, ratios as `Decimal`, counts as int."""

        def usd(micros: int | None) -> str | None:
            return None if micros is None else format_usd(micros)

        return {
            "tasks": self.tasks,
            "succeeded": self.succeeded,
            "success_rate": self.success_rate,
            "attempts": self.attempts,
            "total_spend_usd": format_usd(self.spend_micros),
            "wasted_spend_usd": format_usd(self.wasted_micros),
            "cost_per_successful_task_usd": usd(self.cost_per_successful_task_micros),
            "p50_cost_per_succeeded_task_usd": usd(self.p50_micros),
            "p95_cost_per_succeeded_task_usd": usd(self.p95_micros),
            "cached_token_share": self.cached_token_share,
            "tokens_saved_by_resume": self.reused_tokens,
        }


@dataclass(frozen=True)
class Report:
    """A computed report: its rows, a totals row, and the series the HTML chart draws."""

    query: ReportQuery
    rows: tuple[ReportRow, ...]
    totals: ReportRow
    """All tasks in range as one task-level group."""
    daily_by_tenant: tuple[ReportRow, ...]
    """Grouped by tenant and day, whatever `query.group_by` is (the HTML chart's data)."""
    unclosed_attempts: int = 0
    """Attempts started in range whose task has no task row (running, or to reconcile)."""
    unclosed_spend_micros: int = 0
    moved: tuple[MovedTask, ...] = ()
    """Tasks in range whose ledger spend differs from what their writer saw at the close.

    The report's figures are the ledger's (the sum of attempt rows); these are flagged so
    that a figure read earlier (the workflow's `KvflowSpendMicros`, an earlier report) can be
    told apart from a mistake.
    """
    tasks: tuple[TaskFacts, ...] = ()
    """The closed tasks in range the figures are computed from (the FOCUS export reads them)."""

    @property
    def columns(self) -> tuple[str, ...]:
        """Group keys then metric columns: the CSV header and the JSON keys, in order."""
        return (*(f.value for f in self.query.group_by), *METRIC_COLUMNS)


def _group(
    tasks: Iterable[TaskFacts],
    attempts_by_task: dict[tuple[str, str], list[AttemptTotals]],
    group_by: tuple[GroupField, ...],
) -> list[ReportRow]:
    by_model = GroupField.MODEL in group_by
    by_pool = GroupField.POOL in group_by
    rows: dict[tuple[str | None, ...], ReportRow] = {}
    for task in tasks:
        parts = attempts_by_task.get(task.key, [])
        # One slice per value of the attempt-level fields grouped by (model, pool or both)
        # that the task touched, else one: grouped by pool alone, a task that used two models
        # on one pool is one task of that pool, not two.
        slices: dict[tuple[str | None, str | None], list[AttemptTotals]] = defaultdict(list)
        if not parts:
            slices[(None, None)] = []
        for part in parts:
            touched = (part.model if by_model else None, part.pool if by_pool else None)
            slices[touched].append(part)
        succeeded = task.outcome is TaskOutcome.SUCCEEDED
        for (model, pool), members in slices.items():
            values: dict[GroupField, str | None] = {
                GroupField.TENANT: task.tenant,
                GroupField.WORKFLOW_TYPE: task.workflow_type,
                GroupField.MODEL: model,
                GroupField.POOL: pool,
                GroupField.DAY: task.closed_at.astimezone(UTC).date().isoformat(),
            }
            key = tuple(values[f] for f in group_by)
            row = rows.get(key)
            if row is None:
                row = rows[key] = ReportRow(keys={f.value: values[f] for f in group_by})
            spend = sum(m.spend_micros for m in members)
            row.attempts += sum(m.attempts for m in members)
            row.spend_micros += spend
            row.prompt_tokens += sum(m.prompt_tokens for m in members)
            row.cached_tokens += sum(m.cached_tokens for m in members)
            row.reused_tokens += sum(m.reused_tokens for m in members)
            if task.all_wasted:
                row.wasted_micros += spend
            else:
                row.wasted_micros += sum(m.wasted_micros for m in members)
            if not task.outcome.final:
                continue  # its task goes on in the next run: no task here
            row.tasks += 1
            if succeeded:
                row.succeeded += 1
                earlier = sum(
                    e.spend_micros
                    for e in task.earlier_spend
                    if (e.model if by_model else None, e.pool if by_pool else None) == (model, pool)
                )
                row.succeeded_spends.append(spend + earlier)
    for row in rows.values():
        row.succeeded_spends.sort()
    # Nulls (tasks without attempts, grouped by model or pool) sort last.
    return [rows[k] for k in sorted(rows, key=lambda k: tuple((v is None, v or "") for v in k))]


def build_report(
    query: ReportQuery,
    tasks: Sequence[TaskFacts],
    attempts: Iterable[AttemptTotals],
    *,
    unclosed_attempts: int = 0,
    unclosed_spend_micros: int = 0,
) -> Report:
    """Compute the report for `query` from the tasks in range and their attempt totals."""
    by_task: dict[tuple[str, str], list[AttemptTotals]] = defaultdict(list)
    for part in attempts:
        by_task[(part.workflow_id, part.run_id)].append(part)
    totals = _group(tasks, by_task, ())
    moved = []
    for task in tasks:
        spend = sum(part.spend_micros for part in by_task.get(task.key, []))
        if spend != task.spend_at_close_micros:
            moved.append(
                MovedTask(
                    workflow_id=task.workflow_id,
                    run_id=task.run_id,
                    tenant=task.tenant,
                    spend_at_close_micros=task.spend_at_close_micros,
                    spend_micros=spend,
                )
            )
    return Report(
        query=query,
        rows=tuple(_group(tasks, by_task, query.group_by)),
        totals=totals[0] if totals else ReportRow(keys={}),
        daily_by_tenant=tuple(_group(tasks, by_task, (GroupField.TENANT, GroupField.DAY))),
        unclosed_attempts=unclosed_attempts,
        unclosed_spend_micros=unclosed_spend_micros,
        moved=tuple(moved),
        tasks=tuple(tasks),
    )

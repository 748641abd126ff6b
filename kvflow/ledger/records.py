"""The two rows of the ledger: one per attempt of a model call, one per task.

An `AttemptRecord` is written by the GPU worker when an attempt ends, whatever its outcome:
a failed attempt is billed too, because the input was processed. A `TaskRecord` is written by
the workflow when it closes, or by `kvflow ledger reconcile` for a workflow that closed without
running its own code (terminated, timed out).

Both are idempotent by their natural key: writing the same record twice changes nothing. The
one exception is a *provisional* attempt row (the workflow's estimate, from the last heartbeat,
of an attempt whose GPU worker it lost): the worker's exact row for the same key replaces it,
never the reverse.
Money is integer micro-dollars; prices are the `Decimal` dollar prices the cost was computed
with, stored with the attempt so that a later price change does not rewrite history.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal, Self

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from kvflow.scheduler.fleet import TokenPrices


class AttemptOutcome(StrEnum):
    """How one attempt of a model call ended."""

    OK = "ok"
    """It returned its answer."""
    FAILED = "failed"
    """It raised (server error, timeout, bad output); the call may be re-placed."""
    CANCELLED = "cancelled"
    """The workflow cancelled it (deadline, task cancelled)."""
    RESUMED_ELSEWHERE = "resumed_elsewhere"
    """It was cut mid-stream and its partial output continued on another replica."""


class TaskOutcome(StrEnum):
    """How a task (one workflow run) ended."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    COMPENSATED = "compensated"
    """It failed and its saga's compensations ran."""
    CANCELLED = "cancelled"
    TERMINATED = "terminated"
    """An operator or a parent terminated it; its own code did not run to the end."""
    TIMED_OUT = "timed_out"
    """Its workflow execution or run timeout expired."""
    CONTINUED_AS_NEW = "continued_as_new"
    """The run continued as new: its task goes on in the next run, under the same workflow
    id. Its spend counts in the cost per successful task; the run is not a task of its own,
    neither a success nor a failure (`kvflow.ledger.report`)."""

    @property
    def final(self) -> bool:
        """Whether the task ended here (every outcome but `continued_as_new`)."""
        return self is not TaskOutcome.CONTINUED_AS_NEW


TaskSource = Literal["workflow", "reconcile"]
"""Who wrote a task row: the workflow itself, or `kvflow ledger reconcile`."""


class _Record(BaseModel):
    """A ledger row as it crosses a task queue (`kvflow.record_task`) and the spool file.

    Workers of two releases share a task queue while a rollout runs, so each side must read
    the other's rows: fields a newer writer adds are ignored, and an optional field with
    nothing to say (None) is left out of the row, so an older reader that does not know it
    still takes the row (`_without_empty_optionals`).
    """

    # Ignore, not forbid: a worker of the previous release refused every row of this one.
    model_config = ConfigDict(extra="ignore", frozen=True)

    @model_serializer(mode="wrap")
    def _without_empty_optionals(self, handler: SerializerFunctionWrapHandler) -> Any:
        # A reader that predates a None-default field fills in the same None when it is absent.
        data = handler(self)
        if isinstance(data, dict):
            for name, field in type(self).model_fields.items():
                if field.default is None and data.get(name, False) is None:
                    del data[name]
        return data

    @field_validator("*", mode="before")
    @classmethod
    def _no_nul(cls, value: object) -> object:
        # PostgreSQL's text cannot hold NUL, and a row the ledger refuses for good would be
        # a bill lost: a NUL in a name (a step called "a\x00b") is kept visible instead.
        if isinstance(value, str) and "\x00" in value:
            return value.replace("\x00", "\ufffd")
        return value


class AttemptRecord(_Record):
    """One attempt of one model call, as billed.

    Key: `(workflow_id, run_id, activity_id, attempt)`. `cost_micros` is computed once, on the
    GPU worker, usually as `prices.cost_micros(prompt_tokens, cached_tokens,
    completion_tokens)`; the ledger stores it as given.
    """

    workflow_id: str = Field(min_length=1)
    run_id: str = Field(min_length=1)
    activity_id: str = Field(min_length=1)
    attempt: int = Field(ge=1, description="1 for the first attempt of this activity id")
    step: str = Field(min_length=1, description="the step name in the workflow, e.g. `plan`")
    tenant: str = Field(min_length=1)
    workflow_type: str = Field(min_length=1)
    model: str = Field(min_length=1)
    pool: str = Field(min_length=1)
    replica: str = Field(min_length=1, description="`pool/index`")
    gpu: str = Field(min_length=1, description="GPU generation, e.g. `H100`")
    started_at: AwareDatetime
    ended_at: AwareDatetime
    outcome: AttemptOutcome
    prompt_tokens: int = Field(ge=0)
    cached_tokens: int = Field(ge=0, description="part of prompt_tokens served from KV cache")
    completion_tokens: int = Field(ge=0)
    reused_tokens: int = Field(
        default=0, ge=0, description="output tokens carried over from an earlier cut attempt"
    )
    prices: TokenPrices
    cost_micros: int = Field(ge=0)
    error_type: str | None = Field(default=None, description="the error's type when not ok")
    provisional: bool = Field(
        default=False,
        description="an estimate written by the workflow for an attempt it lost track of; "
        "the GPU worker's exact row for the same key replaces it",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError(
                f"cached_tokens ({self.cached_tokens}) cannot exceed prompt_tokens "
                f"({self.prompt_tokens}): cached tokens are part of the prompt"
            )
        if self.ended_at < self.started_at:
            raise ValueError("ended_at is before started_at")
        return self

    @property
    def key(self) -> tuple[str, str, str, int]:
        """The idempotency key `(workflow_id, run_id, activity_id, attempt)`."""
        return (self.workflow_id, self.run_id, self.activity_id, self.attempt)


class TaskRecord(_Record):
    """One task (one workflow run) once it has closed, as its writer saw it.

    Key: `(workflow_id, run_id)`. `spend_micros` and `attempts` are the writer's figures at the
    close: the workflow's spend meter, or the attempt rows `kvflow ledger reconcile` found.
    The ledger keeps them as `spend_at_close_micros` and `attempts_at_close`; the task's
    spend itself is always the sum of its attempt rows (`TaskBook`, from `Ledger.task`), so a
    row that arrives after the close counts without any special case. `compensation_micros`
    is the part of the spend made by saga compensations (informational).
    """

    workflow_id: str = Field(min_length=1)
    run_id: str = Field(min_length=1)
    tenant: str = Field(min_length=1)
    workflow_type: str = Field(min_length=1)
    started_at: AwareDatetime
    closed_at: AwareDatetime
    outcome: TaskOutcome
    steps: int = Field(
        ge=0, description="model and tool calls that completed (compensations not included)"
    )
    attempts: int = Field(ge=0, description="model call attempts, failed ones included")
    spend_micros: int = Field(ge=0)
    compensation_micros: int = Field(default=0, ge=0)
    source: TaskSource = "workflow"
    chain_run_id: str | None = Field(
        default=None,
        min_length=1,
        description="the first run of the task's chain of runs, when it is not this run "
        "(every run of a task that continues as new names the same one, carried with the "
        "continue-as-new: `kvflow.workflows.carry`; a cron run or a workflow retry starts a "
        "chain of its own); None: this run is the first (or it is not known, in rows from "
        "before). Rows written before the carry name `first_execution_run_id`, which cron runs "
        "and retries share: the report splits such a chain at its final rows",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.closed_at < self.started_at:
            raise ValueError("closed_at is before started_at")
        if self.compensation_micros > self.spend_micros:
            raise ValueError("compensation_micros cannot exceed spend_micros (it is part of it)")
        return self

    @property
    def key(self) -> tuple[str, str]:
        """The idempotency key `(workflow_id, run_id)`."""
        return (self.workflow_id, self.run_id)

    @property
    def chain(self) -> str:
        """The first run of the task's chain of runs (its own when not known)."""
        return self.chain_run_id or self.run_id


class TaskBook(TaskRecord):
    """A task as the ledger books it: its row, with spend and attempts summed from its attempts.

    `spend_micros` and `attempts` are the sum and count of the task's attempt rows as they
    stand now, whatever order they arrived in (late, spooled and replayed, an exact row that
    replaced an estimate). `spend_at_close_micros` and `attempts_at_close` are what the
    writer of the task row saw; `moved_micros` is how far the ledger moved since.
    """

    spend_at_close_micros: int = Field(ge=0, description="the writer's spend at the close")
    attempts_at_close: int = Field(ge=0, description="the writer's attempt count at the close")
    wasted_micros: int = Field(
        ge=0,
        description="cost of the task's failed and cancelled attempt rows; a resumed one is "
        "not waste (the report counts all of a failed task's spend as wasted)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        # Overrides TaskRecord's: the compensation figure is the writer's, of its own spend at
        # the close, which the ledger's sum may not have reached yet.
        if self.closed_at < self.started_at:
            raise ValueError("closed_at is before started_at")
        return self

    @property
    def moved_micros(self) -> int:
        """Ledger spend minus the spend at the close: rows that came or changed after it."""
        return self.spend_micros - self.spend_at_close_micros

    def as_written(self) -> TaskRecord:
        """The task row as its writer wrote it, with its figures at the close."""
        values = self.model_dump(
            exclude={"spend_at_close_micros", "attempts_at_close", "wasted_micros"}
        )
        values.update(spend_micros=self.spend_at_close_micros, attempts=self.attempts_at_close)
        return TaskRecord.model_validate(values)


def chain_run_id(run_id: str, first_run_id: str | None) -> str | None:
    """`TaskRecord.chain_run_id` of a run: its chain's first run, None when that is this run."""
    return first_run_id if first_run_id and first_run_id != run_id else None


def utc(moment: datetime) -> datetime:
    """`moment` in UTC; naive datetimes are refused because their zone is unknown."""
    if moment.tzinfo is None:
        raise ValueError(f"{moment.isoformat()} has no time zone; give an aware datetime")
    return moment.astimezone(UTC)

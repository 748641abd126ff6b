"""The step API: `Agent`, what an agent workflow calls for every model call and tool call.

    @workflow.defn
    class Research:
        @workflow.run
        async def run(self, task: ResearchTask) -> str:
            agent = Agent(task.spec)
            async with agent:
                plan = await agent.infer(
                    [ChatMessage(role="user", content=task.question)],
                    model="llama-3.1-8b", max_tokens=300, output=Plan, step="plan",
                )
                ...
                return answer

One `infer` call does what the control plane needs, durably:

1. **place**: a local activity asks the scheduler; the placement is a marker in history;
2. **dispatch**: the inference activity runs on the placement's task queue with Temporal
   priority and fairness from the tenant, a schedule-to-start limit from the placement, a
   start-to-close limit from the remaining latency budget, a heartbeat timeout, a summary for
   the UI, and no Temporal retries;
3. **re-place** on a retryable failure or a schedule-to-start timeout: the scheduler hears of
   it, one unit of the task's retry budget is spent, the failed replica is excluded, and the
   call resumes from the partial output the failure carried; once every replica that could
   serve the call has failed it, the exclusions lapse and it is placed among them again;
4. **fail** with one `ApplicationError` type per cause (see `kvflow.workflows.errors`) when the
   failure is permanent, the retry budget is empty or the deadline cannot be met;
5. **return** the parsed pydantic model when `output` is given, re-asking a bounded number of
   times when the answer does not match the schema.

`async with agent:` brackets the task: on success it records the task as succeeded; on failure
or cancellation it runs the saga's compensations in reverse and records the outcome. An
exception that does not end the workflow (a bug in workflow code: Temporal fails the workflow
task and retries it) records nothing and undoes nothing. A model or tool call outside the
block has no task to book it, and fails the workflow (`OutsideTask`). A task that continues
as new inside the block goes on in the next run with its caps, spend and deadline
(`kvflow.workflows.carry`). The money path (`TaskSpend`) lives in
`kvflow.workflows.spend`. Every
attempt's cost is summed (failed ones included); after each step the search attributes and the
workflow's current details show spend, steps and retries, and the `kvflow_spend` query returns
the whole breakdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Sequence
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, TypeVar, cast, overload

from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError
from temporalio import workflow
from temporalio.common import Priority, RetryPolicy, SearchAttributeUpdate
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    FailureError,
    RetryState,
    TimeoutError,
    TimeoutType,
)
from temporalio.workflow import ActivityCancellationType

from kvflow.workflows import errors
from kvflow.workflows import search_attributes as attrs
from kvflow.workflows.calls import (
    LOCAL_RETRY,
    LOCAL_SCHEDULE_TO_CLOSE,
    bounded_local,
    uncancellable,
)
from kvflow.workflows.calls import is_cancellation as _is_cancellation
from kvflow.workflows.carry import TASK_CARRY_PATCH, TaskCarry, carried_into
from kvflow.workflows.spend import (
    AttemptSpend,
    SpendBreakdown,
    StepSpend,
    TaskSpend,
)

with workflow.unsafe.imports_passed_through():
    from kvflow.activities.control_plane import (
        CONTEXT_GET_ACTIVITY,
        CONTEXT_PUT_ACTIVITY,
        END_TASK_ACTIVITY,
        OBSERVE_ACTIVITY,
        PLACE_ACTIVITY,
    )
    from kvflow.activities.errors import RETRYABLE_TYPES
    from kvflow.activities.inference import INFER_ACTIVITY
    from kvflow.activities.wire import (
        CONVERSATION,
        AttemptProgress,
        ChatMessage,
        Checkpoint,
        ContextGet,
        ContextPut,
        ContextRef,
        InferenceRequest,
        InferenceResult,
        PlaceAnswer,
        PlaceInput,
        Sampling,
        ToolChoice,
        ToolSpec,
        call_input_problem,
        digest_of,
        first_error,
        needs_store,
    )
    from kvflow.ledger.records import TaskOutcome
    from kvflow.scheduler.decision import Filter
    from kvflow.scheduler.fleet import format_usd
    from kvflow.scheduler.placement import (
        Observation,
        ObservationVerdict,
        Placement,
        PlacementRequest,
        Refusal,
        RefusalReason,
    )

T = TypeVar("T", bound=BaseModel)
R = TypeVar("R")

HEARTBEAT_TIMEOUT = timedelta(seconds=2)
"""How long a silent GPU worker is trusted: a crashed replica is noticed after this, and a
cancellation reaches a running call within 0.8 x this (the SDK's heartbeat interval)."""
SEARCH_ATTRIBUTE_INTERVAL = timedelta(seconds=2)
"""A running task upserts its spend, steps and re-placements at most this often."""
DEFAULT_CALL_TIMEOUT = timedelta(minutes=10)
"""The start-to-close limit of a call when the task has no latency budget."""
TOOL_START_TO_CLOSE = timedelta(seconds=60)
"""The start-to-close limit of one attempt of a tool call (`Agent.tool`)."""
TOOL_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=3,
)
"""How a tool call is retried unless `Agent.tool` is given a policy: three attempts in about
3 s, enough for a blip; a tool that keeps failing fails its task instead of holding it."""
EXCLUSIONS_LAPSE_PATCH = "kvflow-exclusions-lapse"
"""`workflow.patched` id of the rule that a call every candidate replica has failed is placed
again among them (histories from before it failed the task there)."""
WAIT_FOR_UNDOABLE_TOOLS_PATCH = "kvflow-wait-for-undoable-tools"
"""`workflow.patched` id of the rule that a cancelled task waits for a running tool that has a
compensation, and undoes it if it did its work (histories from before left it running)."""
STOP_WHEN_CANCELLED_PATCH = "kvflow-stop-when-cancelled"
"""`workflow.patched` id of the rule that a task cancelled while a call runs ends there, even
when the call's answer completed first (histories from before it went on to their next
steps)."""
ADMISSION_WAITS_TO_DEADLINE_PATCH = "kvflow-admission-waits-to-deadline"
"""`workflow.patched` id of the rule that a step with a deadline waits for admission until the
deadline, its waits stretched past `MAX_ADMISSION_WAITS` (histories from before it failed the
task at that many waits)."""
END_TASK_PATCH = "kvflow-end-task-where-placed"
"""`workflow.patched` id of the rule that a closing task tells its own worker's scheduler it
ended, by a local activity (histories from before told it through the ledger's task row, which
any workflow worker may write)."""
CONTINUED_RUN_BOOKED_PATCH = "kvflow-continued-run-booked"
"""`workflow.patched` id of the rule that a run continuing as new writes its row, outcome
`continued_as_new` (histories from before wrote none: their spend stayed off every task)."""
CONTINUED_RUN_OUTCOME_PATCH = "kvflow-continued-run-outcome"
"""`workflow.patched` id of the rule that a run continuing as new publishes `KvflowOutcome =
'continued_as_new'` and its exact spend, and its next run starts as `running`
(`kvflow.workflows.continued_run`; histories from before left the closed run `running`)."""
MAX_ADMISSION_WAITS = 60
"""How many times one step waits for admission before it fails, without a deadline. With one,
the step waits while the wait ends before the deadline, each wait past this many at least
`ADMISSION_WAIT_STRETCH` times the step's wait so far."""
ADMISSION_WAIT_STRETCH = 0.1
"""Past `MAX_ADMISSION_WAITS`, a step with a deadline waits at least this share of its wait so
far before asking again: a task held through an hour-long overload adds a few dozen timers to
its history rather than hundreds, and asks again within a tenth of the time it has waited."""
MAX_OUTAGE_REPLACEMENTS = 10
"""How many times an outage of Temporal may cut one call and have it re-placed free of the
task's and the tenant's retry budgets; beyond that its re-placements are retries."""
KEEP_INLINE_MESSAGES = 2
"""The newest messages of a conversation sent inline; earlier ones travel as one reference."""
SPEND_QUERY = "kvflow_spend"
"""The query that returns the task's `SpendBreakdown`."""


MAX_LATENCY_BUDGET_S = 30 * 86_400
"""The longest latency budget a `TaskSpec` takes: 30 days."""
MAX_RETRY_BUDGET = 100
"""The most re-placements a `TaskSpec` may allow."""
MAX_EXPECTED_STEPS = 10_000
"""The most model calls a `TaskSpec` may expect."""
MAX_SCHEMA_REPAIRS = 10
"""The most re-asks for schema-invalid output a `TaskSpec` may allow."""
MAX_BUDGET_MICROS = 1_000_000 * 1_000_000
"""The largest spend cap a `TaskSpec` takes: $1,000,000, in micro-dollars."""


class TaskSpec(BaseModel):
    """The budgets of one agent task; put it in the workflow's input.

    Out-of-range budgets are refused where the spec is built, before the task starts: a
    negative one, and one too large to be meant (30 days, 100 re-placements, 10,000 steps,
    10 repairs, $1,000,000), which is usually a unit mistake. The refusal names the field, its
    unit and its range, and shows the value in human units, e.g. "latency_budget_s must be
    more than 0 s and at most 30 days (2,592,000 s); got 3,456,000 s (40 days)". The tenant is
    checked against the fleet at the first model call (`InvalidTask`).
    """

    tenant: str = Field(min_length=1, description="a tenant of the fleet file's [[tenants]]")
    latency_budget_s: float | None = Field(
        default=None,
        description="seconds from the task's start (its first run's, when it continues as "
        "new) to its deadline; None: no deadline",
    )
    retry_budget: int = Field(
        default=3,
        description="re-placements the task may use over all its runs",
    )
    expected_steps: int = Field(default=1, description="model calls the task will make")
    step_slo_s: float | None = Field(
        default=None,
        description=(
            "seconds each model call should end within (an objective, not a timeout): a call "
            "past it is reported late, and a late tier-1 call makes lower tiers wait where "
            "`AdmissionConfig.headroom_by_tier` is set; with task admission on, a new task "
            "whose first call the fleet's load would make late is refused (`Overloaded`). "
            "None: no per-step objective"
        ),
    )
    expected_tool_s: float = Field(
        default=0.0,
        description=(
            "seconds the task expects to spend in its tools in all; at the first model call "
            "the scheduler adds it to the model time of `expected_steps` calls to judge "
            "whether the fleet's load would make the task miss its deadline (`Overloaded`)"
        ),
    )
    schema_repairs: int = Field(default=2, description="re-asks for schema-invalid output")
    budget_micros: int | None = Field(
        default=None,
        description="the most the task may spend over all its runs, in micro-dollars; None: no cap",
    )

    @field_validator("latency_budget_s", "step_slo_s")
    @classmethod
    def _positive_seconds(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None:
            # Each None means something else: say which, so the fix is clear.
            none = (
                "None for no deadline"
                if info.field_name == "latency_budget_s"
                else ("None for no per-step objective")
            )
            _check_seconds(info.field_name, value, low_exclusive=True, none=none)
        return value

    @field_validator("expected_tool_s")
    @classmethod
    def _tool_seconds(cls, value: float, info: ValidationInfo) -> float:
        _check_seconds(info.field_name, value, low_exclusive=False, none=None)
        return value

    @field_validator("retry_budget", "expected_steps", "schema_repairs")
    @classmethod
    def _count(cls, value: int, info: ValidationInfo) -> int:
        name = info.field_name or ""
        low, high, unit = _COUNT_RANGES[name]
        if not low <= value <= high:
            raise _budget_error(
                f"{name} must be between {low:,} and {high:,} {unit}; got {value:,}"
            )
        return value

    @field_validator("budget_micros")
    @classmethod
    def _micros(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= MAX_BUDGET_MICROS:
            raise _budget_error(
                "budget_micros must be between $0 and "
                f"${MAX_BUDGET_MICROS // 1_000_000:,} ({MAX_BUDGET_MICROS:,} micro-dollars: "
                f"$2.50 is 2,500,000), or None for no cap; got {value:,} micro-dollars "
                f"({_usd_grouped(value)})"
            )
        return value


_COUNT_RANGES: dict[str, tuple[int, int, str]] = {
    "retry_budget": (0, MAX_RETRY_BUDGET, "re-placements"),
    "expected_steps": (1, MAX_EXPECTED_STEPS, "model calls"),
    "schema_repairs": (0, MAX_SCHEMA_REPAIRS, "re-asks"),
}
"""Each count field of `TaskSpec`: its lowest and highest value, and what it counts."""


def _budget_error(message: str) -> PydanticCustomError:
    # A custom error keeps pydantic's generic "Value error, " prefix off the message.
    return PydanticCustomError("task_budget", message)


def _check_seconds(
    name: str | None, value: float, *, low_exclusive: bool, none: str | None
) -> None:
    """Refuse a `TaskSpec` duration outside (0 or [0) .. 30 days], naming unit and range."""
    low = "more than 0 s" if low_exclusive else "at least 0 s"
    ok = math.isfinite(value) and (value > 0 if low_exclusive else value >= 0)
    if ok and value <= MAX_LATENCY_BUDGET_S:
        return
    got = _seconds_and_duration(value) if math.isfinite(value) else f"{value}"
    alternative = f", or {none}" if none else ""
    raise _budget_error(
        f"{name} must be {low} and at most 30 days ({MAX_LATENCY_BUDGET_S:,} s), in seconds "
        f"(2 minutes is 120){alternative}; got {got}"
    )


def _seconds_and_duration(seconds: float) -> str:
    """`seconds`, and in days, hours or minutes where that reads better: "3,456,000 s (40 days)"."""
    shown = f"{int(seconds):,} s" if seconds == int(seconds) else f"{seconds:,.6g} s"
    for unit, size in (("days", 86_400), ("hours", 3_600), ("minutes", 60)):
        if abs(seconds) >= 2 * size:
            return f"{shown} ({seconds / size:,.4g} {unit})"
    return shown


def _usd_grouped(micros: int) -> str:
    """Micro-dollars as dollars with thousands grouped and no float: "$12,345.5", "-$0.000001"."""
    whole, fraction = divmod(abs(micros), 1_000_000)
    cents = f".{fraction:06d}".rstrip("0").rstrip(".")
    return f"{'-' if micros < 0 else ''}${whole:,}{cents}"


@dataclass
class _Call:
    """One model call while it is placed, dispatched and re-placed."""

    record: StepSpend
    model: str
    chat: list[ChatMessage] | None
    prompt: str | ContextRef | None
    max_tokens: int
    schema: dict[str, Any] | None
    sampling: Sampling
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    exclude: list[str] = field(default_factory=list)
    """Replicas that failed this call."""
    checkpoint: Checkpoint | None = None
    """Partial output to continue from."""
    carried: list[str] = field(default_factory=list)
    """Activity ids of the cut attempts whose output `checkpoint` holds."""
    attempt: int = 1
    outage_replacements: int = 0
    """Re-placements after an outage of Temporal cut the call (no retries)."""
    after_outage: bool = False
    """The next placement follows an outage of Temporal: it spends no retry budget."""


class _Failure(BaseModel):
    """A failed attempt, reduced to what the step API decides on."""

    error_type: str
    message: str
    retryable: bool
    checkpoint: Checkpoint | None = None
    attempt: AttemptSpend


_CURRENT: ContextVar[Agent | None] = ContextVar("kvflow_current_agent", default=None)
"""The `Agent` whose `async with` block the running workflow code is in."""


class Agent:
    """The step API of one agent task. Create it inside `@workflow.run`."""

    def __init__(self, spec: TaskSpec) -> None:
        self.spec = spec
        self._run_started_at = _task_started_at(workflow.info())
        """When this run started (its ledger row's `started_at`)."""
        self._started_at = self._run_started_at
        """When the task started: its first run's start, where it continued as new."""
        self._deadline = self._deadline_from(self._started_at)
        self._carried: TaskCarry | None = None
        """What the earlier runs of the task left this one (`TaskCarry`); None: it is the first."""
        self.spend = TaskSpend(spec.tenant)
        """The task's spend meter and the ledger rows the workflow writes."""
        self.steps: list[StepSpend] = self.spend.steps
        self.retries = 0
        self.outcome = "running"
        self._compensations: list[tuple[str, Callable[..., Any] | str, Any]] = []
        self._refs: dict[str, ContextRef] = {}
        self._last_replica: str | None = None
        workflow.set_query_handler(SPEND_QUERY, self.breakdown)
        workflow.upsert_search_attributes(
            [attrs.TENANT.value_set(spec.tenant), attrs.OUTCOME.value_set("running")]
        )
        self._published: dict[str, str | int] = {attrs.OUTCOME.name: "running"}
        """The search attributes' values as last upserted (`_publish`)."""
        self._published_at: datetime | None = None
        self._entered: Token[Agent | None] | None = None
        """Undoes `Agent.current()` when the `async with` block ends."""
        self._compensating = False
        self._take_carry()

    def _deadline_from(self, started_at: datetime) -> datetime | None:
        budget = self.spec.latency_budget_s
        return started_at + timedelta(seconds=budget) if budget else None

    def _take_carry(self) -> None:
        """Take the task over from the run this one continued as new from, once.

        Its caps are the task's: the spend, re-placements and start (so the deadline) of its
        earlier runs count here (`kvflow.workflows.carry`). Tried again on entering the block,
        for an agent made before the workflow's run started (in `@workflow.init`).
        """
        if self._carried is not None:
            return
        carry = carried_into(workflow.info().continued_run_id)
        if carry is None or not workflow.patched(TASK_CARRY_PATCH):
            return
        self._carried = carry
        self._started_at = carry.started_at
        self._deadline = self._deadline_from(carry.started_at)

    def carry(self) -> TaskCarry:
        """The task as its next run takes it over when it continues as new (`TaskCarry`)."""
        info = workflow.info()
        before = self._carried
        return TaskCarry(
            from_run_id=info.run_id,
            chain_run_id=before.chain_run_id if before else info.run_id,
            started_at=self._started_at,
            spend_micros=self.task_spend_micros,
            retries=self._task_retries,
            steps_done=self._steps_done,
        )

    @property
    def task_spend_micros(self) -> int:
        """What the task has spent across its runs: `spend_micros` and its earlier runs'."""
        return self.spend_micros + (self._carried.spend_micros if self._carried else 0)

    @property
    def _task_retries(self) -> int:
        """Re-placements the task has used across its runs."""
        return self.retries + (self._carried.retries if self._carried else 0)

    @property
    def _steps_done(self) -> int:
        """Model calls the task has completed across its runs."""
        done = sum(1 for s in self.steps if s.kind == "infer" and s.outcome == "ok")
        return done + (self._carried.steps_done if self._carried else 0)

    # ---- the task's bracket ------------------------------------------------------------------

    @staticmethod
    def current() -> Agent | None:
        """The task whose `async with agent:` block is running, or None outside any.

        How framework adapters (`kvflow.contrib`) find the task that places and bills the
        model calls of an agent run inside the block.
        """
        return _CURRENT.get()

    def activity_deadline(self) -> datetime | None:
        """When activities the task starts must end (`TaskDeadlineInterceptor`); None: never.

        The task's deadline, except while compensations run: they undo what the task did and
        must finish even when the task ran out of time.
        """
        return None if self._compensating else self._deadline

    async def __aenter__(self) -> Agent:
        self._take_carry()
        self._entered = _CURRENT.set(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        entered, self._entered = self._entered, None
        if entered is not None:
            # When the workflow is being evicted its coroutine is closed from another context,
            # and the one the token belongs to is going away with it.
            with contextlib.suppress(ValueError):
                _CURRENT.reset(entered)
        if exc is None:
            await self._close(TaskOutcome.SUCCEEDED)
            return
        if isinstance(exc, workflow.ContinueAsNewError):
            # The task goes on in the next run, under the same workflow id: this run's row
            # books its spend (the report counts it in the task's cost), and the task stays
            # open in the scheduler. Histories from before wrote no row for such a run.
            if workflow.patched(CONTINUED_RUN_BOOKED_PATCH):
                await self._book(TaskOutcome.CONTINUED_AS_NEW)
            if workflow.patched(CONTINUED_RUN_OUTCOME_PATCH):
                # The closed run says why it closed; the next run gets its own attributes
                # (`ContinuedRunInterceptor`), so this does not reach the live task.
                self.outcome = TaskOutcome.CONTINUED_AS_NEW.value
                self._publish()
            return
        cancelled = _is_cancellation(exc)
        if not cancelled and not workflow.is_failure_exception(exc):
            # Not the task's end: a bug (a KeyError), a version mismatch between workers
            # (`UnreadableDetails`), a non-determinism error: the workflow task fails and
            # Temporal retries it, so nothing may be undone or recorded here. The run that
            # gets past it (fixed code) closes the task; only the end of a workflow does.
            return
        compensated = await self.compensate()
        if cancelled:
            outcome = TaskOutcome.CANCELLED
        elif compensated:
            outcome = TaskOutcome.COMPENSATED
        else:
            outcome = TaskOutcome.FAILED
        await self._close(outcome)
        if cancelled and not isinstance(exc, asyncio.CancelledError):
            # End the workflow as cancelled, not failed: the cancellation reached us wrapped
            # in the activity's error.
            raise asyncio.CancelledError from exc

    def _refuse_outside_block(self, method: str, step: str) -> None:
        """Fail the workflow at a call made outside `async with agent:`.

        Only the block opens and closes the task: a call outside it would spend with no task
        row, no outcome and no compensation, and the task would show `running` for good.
        Non-retryable, so the workflow fails at once instead of its workflow task retrying.
        """
        if self._entered is not None:
            return
        raise errors.task_error(
            errors.TaskErrorType.OUTSIDE_TASK,
            f"agent.{method}({step!r}) was called outside the task's block; write the calls "
            f"inside it:\n\n    async with agent:\n        ... = await agent.{method}(...)\n\n"
            "(the block opens the task, books its spend and closes it with its outcome)",
            step=step,
        )

    # ---- model calls -------------------------------------------------------------------------

    @overload
    async def infer(
        self,
        messages: Sequence[ChatMessage] | None = None,
        *,
        model: str,
        max_tokens: int,
        output: type[T],
        step: str = ...,
        prompt: str | None = None,
        sampling: Sampling | None = None,
        tools: Sequence[ToolSpec] | None = None,
        tool_choice: ToolChoice | None = None,
        json_schema: dict[str, Any] | None = None,
    ) -> T: ...

    @overload
    async def infer(
        self,
        messages: Sequence[ChatMessage] | None = None,
        *,
        model: str,
        max_tokens: int,
        output: None = None,
        step: str = ...,
        prompt: str | None = None,
        sampling: Sampling | None = None,
        tools: Sequence[ToolSpec] | None = None,
        tool_choice: ToolChoice | None = None,
        json_schema: dict[str, Any] | None = None,
    ) -> InferenceResult: ...

    async def infer(
        self,
        messages: Sequence[ChatMessage] | None = None,
        *,
        model: str,
        max_tokens: int,
        output: type[T] | None = None,
        step: str = "infer",
        prompt: str | None = None,
        sampling: Sampling | None = None,
        tools: Sequence[ToolSpec] | None = None,
        tool_choice: ToolChoice | None = None,
        json_schema: dict[str, Any] | None = None,
    ) -> T | InferenceResult:
        """Run one model call on the best replica; see the module docstring for the steps.

        Give `messages` (chat) or `prompt` (completion). With `output`, the answer is asked for
        as JSON matching that model's schema and returned parsed; with `json_schema` (a raw
        schema, for callers that hold no pydantic model) it is asked for the same way and
        returned unparsed. With `tools`, the model may answer with `InferenceResult.tool_calls`
        instead of text; `tool_choice` is "auto" (the default when tools are given),
        "required", "none" or the name of the one tool it must call. Running the tools is the
        caller's: their results go back as `ChatMessage(role="tool", tool_call_id=...)`.
        """
        self._refuse_outside_block("infer", step)
        record = StepSpend(index=len(self.steps) + 1, name=step, kind="infer", model=model)
        self.steps.append(record)
        problem = call_input_problem(
            model, messages, prompt, max_tokens, tools=tools, tool_choice=tool_choice
        )
        if problem is None and output is not None and json_schema is not None:
            problem = "give `output` (a pydantic model) or `json_schema`, not both"
        if problem is not None:
            # Refused here: the same rule raised while building the request would fail the
            # workflow task, which Temporal retries forever.
            record.outcome = errors.TaskErrorType.INVALID_TASK
            raise self._error(errors.TaskErrorType.INVALID_TASK, record, problem)
        chat = await self._externalize(list(messages)) if messages is not None else None
        text_prompt: str | ContextRef | None = None
        if prompt is not None:
            text_prompt = await self._store_if_large(prompt)
        schema = output.model_json_schema() if output is not None else json_schema
        repairs_left = self.spec.schema_repairs
        while True:
            call = _Call(
                record,
                model,
                chat,
                text_prompt,
                max_tokens,
                schema,
                sampling or Sampling(),
                tools=list(tools) if tools else None,
                tool_choice=tool_choice,
            )
            result = await self._call(call)
            if output is None:
                return self._step_done(record, result)
            try:
                parsed = output.model_validate_json(await self.text_of(result))
            except ValidationError as invalid:
                if repairs_left == 0 or chat is None:
                    record.outcome = errors.TaskErrorType.SCHEMA_INVALID_OUTPUT
                    raise self._error(
                        errors.TaskErrorType.SCHEMA_INVALID_OUTPUT,
                        record,
                        f"the answer did not match {output.__name__} after "
                        f"{self.spec.schema_repairs} repairs: {first_error(invalid)}",
                    ) from None
                repairs_left -= 1
                # Show the model its answer and what was wrong with it, and ask again.
                chat = [
                    *chat,
                    # The whole answer: its reference when it was offloaded (the GPU worker
                    # resolves it), never a preview.
                    ChatMessage(role="assistant", content=result.text_ref or result.text),
                    ChatMessage(
                        role="user",
                        content=f"That answer is not valid JSON for the schema: "
                        f"{first_error(invalid)}. Answer again with JSON only.",
                    ),
                ]
                continue
            self._step_done(record, result)
            return parsed

    async def _call(self, call: _Call) -> InferenceResult:
        record = call.record
        while True:
            remaining = self._remaining_s()
            if remaining is not None and remaining <= 0:
                raise self._error(
                    errors.TaskErrorType.DEADLINE_EXCEEDED,
                    record,
                    f"the task's {self.spec.latency_budget_s:g} s latency budget is spent",
                )
            asked_at = workflow.now()
            placement = await self._place(call)
            remaining = self._remaining_s()
            record.reason = placement.reason
            record.model = placement.model
            try:
                messages = await self._compact(call.chat)
            except BaseException:
                # The call never left: the replica's in-flight count, raised by the
                # placement, must drop before the task fails.
                await self._not_dispatched(placement)
                raise
            request = InferenceRequest(
                model=placement.model,
                **messages,
                prompt=call.prompt,
                max_tokens=call.max_tokens,
                sampling=call.sampling,
                json_schema=call.schema,
                tools=call.tools,
                tool_choice=call.tool_choice,
                tenant=self.spec.tenant,
                step=record.name,
                deadline=self._deadline,
                checkpoint=call.checkpoint,
                priority=placement.engine_priority,
                # The step's objective from when the call was asked, as its placement saw it.
                step_deadline=None
                if self.spec.step_slo_s is None
                else asked_at + timedelta(seconds=self.spec.step_slo_s),
            )
            dispatched_at = workflow.now()
            cancelled_before = workflow.cancellation_reason() is not None
            try:
                result: InferenceResult = await workflow.execute_activity(
                    INFER_ACTIVITY,
                    request,
                    result_type=InferenceResult,
                    task_queue=placement.task_queue,
                    schedule_to_start_timeout=timedelta(seconds=placement.schedule_to_start_s),
                    start_to_close_timeout=_call_timeout(remaining),
                    heartbeat_timeout=HEARTBEAT_TIMEOUT,
                    retry_policy=RetryPolicy(maximum_attempts=1),
                    # A cancelled call returns once the GPU worker stopped and billed it, so
                    # the workflow can count what it cost (a cancellation carries no details).
                    cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
                    priority=Priority(
                        priority_key=placement.priority_key,
                        fairness_key=placement.fairness_key,
                        fairness_weight=placement.fairness_weight,
                    ),
                    summary=self._summary(record, placement),
                )
            except ActivityError as err:
                failure = _failure_of(err, placement)
                failure.attempt.model = placement.model
                failure.attempt.activity_id = err.activity_id or ""
                record.attempts.append(failure.attempt)
                if _is_cancellation(err) or (
                    workflow.cancellation_reason() is not None and _worker_went_silent(err)
                ):
                    # The task was cancelled: not a failure to classify or re-place, but an
                    # attempt to bill and a replica whose in-flight count must drop.
                    record.outcome = "cancelled"
                    await self._cancelled(err, call, placement, failure, dispatched_at)
                    raise asyncio.CancelledError("the task was cancelled") from err
                if _worker_went_silent(err):
                    await self.spend.bill_lost_attempt(
                        failure.attempt,
                        step=record.name,
                        error_type=failure.error_type,
                        dispatched_at=dispatched_at,
                    )
                verdict = await self._observe(placement, failure, dispatched_at=dispatched_at)
                self._publish()
                # Cancelled as the call failed: the task ends cancelled, neither failed nor
                # re-placed.
                self._stop_if_cancelled(record, cancelled_before=cancelled_before)
                if not failure.retryable:
                    record.outcome = failure.error_type
                    raise self._error(
                        errors.TaskErrorType.STEP_FAILED,
                        record,
                        f"{failure.error_type} on {placement.replica}: {failure.message}",
                        cause=failure.error_type,
                    ) from None
                # An outage of Temporal cut the call, not the replica: its re-placement is no
                # retry, and the replica stays a candidate.
                free = (
                    verdict.control_plane_fault
                    and call.outage_replacements < MAX_OUTAGE_REPLACEMENTS
                )
                if not free and self._task_retries >= self.spec.retry_budget:
                    record.outcome = errors.TaskErrorType.RETRY_BUDGET_EXHAUSTED
                    raise self._error(
                        errors.TaskErrorType.RETRY_BUDGET_EXHAUSTED,
                        record,
                        f"{failure.error_type} on {placement.replica} and the task's "
                        f"{self.spec.retry_budget} re-placements are used up",
                        last_error=failure.error_type,
                    ) from None
                call.attempt += 1
                call.after_outage = free
                if free:
                    call.outage_replacements += 1
                else:
                    self.retries += 1
                    call.exclude.append(placement.replica)
                if failure.checkpoint is not None and call.schema is None:
                    before = call.checkpoint.completion_tokens if call.checkpoint else 0
                    if failure.checkpoint.completion_tokens > before and err.activity_id:
                        call.carried.append(err.activity_id)
                    call.checkpoint = failure.checkpoint
                continue
            record.attempts.append(
                AttemptSpend(
                    replica=result.replica,
                    model=result.model,
                    outcome="ok",
                    cost_micros=result.cost_micros,
                    prompt_tokens=result.usage.prompt_tokens,
                    cached_tokens=result.usage.cached_tokens,
                    completion_tokens=result.usage.completion_tokens,
                    reused_tokens=result.reused_tokens,
                )
            )
            await self._observe(placement, None, result, dispatched_at=dispatched_at)
            if result.reused_tokens and call.carried:
                await self.spend.mark_resumed(call.carried)
            self._last_replica = result.replica
            # The answer may have completed after the task's cancellation asked the GPU worker
            # to stop: the SDK then returns it, and the cancellation is spent.
            self._stop_if_cancelled(record, cancelled_before=cancelled_before)
            return result

    def _stop_if_cancelled(
        self, record: StepSpend, *, cancelled_before: bool, outcome: str = "cancelled"
    ) -> None:
        """End the task as cancelled if its cancellation arrived while the step's call ran.

        Called when a call has ended other than cancelled. Temporal delivers a workflow's
        cancellation once. A call cancelled while its answer completes (the GPU worker hears
        of it only with its next heartbeat) returns that answer; one that fails then would be
        re-placed or fail the task. The task would go on to spend on calls its owner asked it
        not to make, or end failed though it was cancelled first. The answer already paid for
        stays billed (its attempt is "ok"); the task ends CANCELED and its saga's
        compensations run. The step's outcome becomes `outcome`.

        `cancelled_before` says whether the cancellation had already been requested when the
        call was dispatched: such a call is the caller's cleanup after catching it, and this
        does nothing for it.
        """
        if cancelled_before or workflow.cancellation_reason() is None:
            return
        if not workflow.patched(STOP_WHEN_CANCELLED_PATCH):
            return
        record.outcome = outcome
        self._publish()
        raise asyncio.CancelledError(f"the task was cancelled at step {record.name!r}")

    async def _place(self, call: _Call) -> Placement:
        """Ask the scheduler; wait out admission refusals (saturated fleet, circuits open)."""
        record, checkpoint = call.record, call.checkpoint
        done = self._steps_done
        waiting_since: datetime | None = None
        asked_at = workflow.now()
        step_slo = self.spec.step_slo_s
        while True:
            remaining = self._remaining_s()
            step_remaining = (
                None if step_slo is None else step_slo - (workflow.now() - asked_at).total_seconds()
            )
            queued_s = (
                0.0 if waiting_since is None else (workflow.now() - waiting_since).total_seconds()
            )
            request = PlacementRequest(
                model=call.model,
                block_hashes=[],
                prompt_tokens=0,
                max_output_tokens=call.max_tokens
                - (checkpoint.completion_tokens if checkpoint else 0),
                tenant=self.spec.tenant,
                deadline_s_remaining=remaining,
                step_deadline_s_remaining=step_remaining,
                steps_remaining=max(1, self.spec.expected_steps - done),
                previous_replica=self._last_replica,
                spent_micros=self.task_spend_micros,
                budget_micros=self.spec.budget_micros,
                exclude=call.exclude,
                workflow_id=workflow.info().workflow_id,
                task_started_at=self._started_at.timestamp(),
                queued_s=max(0.0, queued_s),
                steps_done=done,
                expected_tool_s=self.spec.expected_tool_s if done == 0 else 0.0,
                attempt=call.attempt,
                # Re-placements made before this request: this one is already counted.
                task_retries=self._task_retries
                - (1 if call.attempt > 1 and not call.after_outage else 0),
                after_control_plane_fault=call.after_outage,
            )
            answer = await self._local(
                PLACE_ACTIVITY,
                PlaceInput(
                    request=request,
                    messages=call.chat,
                    prompt=call.prompt,
                    checkpoint_text=checkpoint.text if checkpoint else "",
                    tools=call.tools,
                ),
                PlaceAnswer,
                record,
            )
            if answer.placement is not None:
                return answer.placement
            assert answer.refusal is not None
            refusal: Refusal = answer.refusal
            wait = self._admission_wait(refusal, remaining, record.admission_waits, waiting_since)
            if wait is not None:
                # Admission: under saturation low tiers wait before high tiers do. A durable
                # timer, so a worker restart does not lose the place in line.
                record.admission_waits += 1
                if waiting_since is None:
                    waiting_since = workflow.now()
                record.outcome = f"waiting: {refusal.reason.value}"
                self._publish()
                await workflow.sleep(wait)
                continue
            if (
                refusal.reason is RefusalReason.NO_REPLICA
                and call.exclude
                and Filter.EXCLUDED.value in refusal.rejections
                and workflow.patched(EXCLUSIONS_LAPSE_PATCH)
            ):
                # Every replica that could serve the call has failed it once. Exclusion keeps
                # a re-placement off a replica that just failed while another can serve it; it
                # is no reason to fail a task whose retry budget holds (a single replica, a
                # heartbeat lost on a busy host). The re-placement was charged when the
                # replica was excluded, and open circuits still keep dead replicas out.
                call.exclude.clear()
                continue
            record.outcome = f"refused: {refusal.reason.value}"
            error_type = {
                RefusalReason.DEADLINE: errors.TaskErrorType.DEADLINE_EXCEEDED,
                RefusalReason.RETRY_BUDGET_EXHAUSTED: errors.TaskErrorType.RETRY_BUDGET_EXHAUSTED,
                RefusalReason.OVERLOADED: errors.TaskErrorType.OVERLOADED,
            }.get(refusal.reason, errors.TaskErrorType.PLACEMENT_REFUSED)
            raise self._error(
                error_type, record, refusal.message, refusal=refusal.model_dump(mode="json")
            )

    def _admission_wait(
        self,
        refusal: Refusal,
        remaining: float | None,
        waits: int,
        waiting_since: datetime | None,
    ) -> float | None:
        """How long a refused step waits before it asks again; None: it fails now.

        It waits out a retryable refusal's `retry_after_s` while the wait ends before the
        task's deadline (`remaining` s away). Without a deadline it waits at most
        `MAX_ADMISSION_WAITS` times; with one, past that count each wait is at least
        `ADMISSION_WAIT_STRETCH` times the step's wait so far (since `waiting_since`), so a
        long hold adds few timers to the history.
        """
        wait = refusal.retry_after_s
        if not refusal.retryable or wait is None:
            return None
        if waits >= MAX_ADMISSION_WAITS:
            if remaining is None or not workflow.patched(ADMISSION_WAITS_TO_DEADLINE_PATCH):
                return None
            # A deadline bounds the wait, not a count: a task held by admission through a
            # long overload starts when there is room, while it still can finish.
            waited = (
                0.0 if waiting_since is None else (workflow.now() - waiting_since).total_seconds()
            )
            if ADMISSION_WAIT_STRETCH * waited < remaining:
                wait = max(wait, ADMISSION_WAIT_STRETCH * waited)
        if remaining is not None and wait >= remaining:
            return None
        return wait

    async def _cancelled(
        self,
        err: ActivityError,
        call: _Call,
        placement: Placement,
        failure: _Failure,
        dispatched_at: datetime,
    ) -> None:
        """Bill a call the task's cancellation stopped, and give its replica's slot back."""
        failure.attempt.outcome = "cancelled"
        if _worker_went_silent(err):
            # The worker died while the cancellation was on its way: bill its last heartbeat.
            await self.spend.bill_lost_attempt(
                failure.attempt,
                step=call.record.name,
                error_type=failure.error_type,
                dispatched_at=dispatched_at,
            )
        else:
            await self.spend.bill_cancelled(failure.attempt)
        await self._observe(placement, failure, dispatched_at=dispatched_at)
        self._publish()

    async def _local(
        self, activity: str, arg: Any, result_type: type[R], record: StepSpend | None
    ) -> R:
        """Run a control-plane local activity, bounded, and fail the task if it fails for good.

        A permanent error (`PERMANENT_ERRORS`) runs once; a transient one is retried within
        `LOCAL_RETRY` and `LOCAL_SCHEDULE_TO_CLOSE`. Either way the task then fails with one
        typed, non-retryable error (and its saga's compensations run) instead of retrying the
        workflow task forever.
        """
        try:
            result: R = await bounded_local(activity, arg, result_type)
        except FailureError as err:
            # A local activity's failure arrives as its cause, not wrapped in an ActivityError.
            if _is_cancellation(err):
                raise
            cause = err.cause if isinstance(err, ActivityError) else err
            raise self._control_plane_error(activity, cause or err, record) from None
        return result

    def _control_plane_error(
        self, activity: str, cause: BaseException, record: StepSpend | None
    ) -> ApplicationError:
        kind = cause.type if isinstance(cause, ApplicationError) else None
        message = cause.message if isinstance(cause, ApplicationError) else str(cause)
        error_type, fix = _CONTROL_PLANE_FIXES.get(
            kind or "",
            (
                errors.TaskErrorType.CONTROL_PLANE_FAILED,
                f"it failed {LOCAL_RETRY.maximum_attempts} times or for "
                f"{LOCAL_SCHEDULE_TO_CLOSE.total_seconds():g} s; see the workflow worker's log",
            ),
        )
        what = f"{activity}: {message}; {fix}" if fix else f"{activity}: {message}"
        if record is not None:
            record.outcome = error_type
            return self._error(error_type, record, what, cause=kind)
        return errors.task_error(error_type, what, cause=kind, spend_micros=self.spend_micros)

    async def _not_dispatched(self, placement: Placement) -> None:
        """Tell the scheduler a placed call was never sent (the replica is not at fault)."""
        now = workflow.now().timestamp()
        observation = Observation(
            replica=placement.replica,
            model=placement.model,
            tenant=self.spec.tenant,
            ok=False,
            replica_fault=False,
            error="NotDispatched",
            probe=placement.probe,
            cold_start=placement.cold_start,
            dispatched_at=now,
            ended_at=now,
        )
        try:
            await uncancellable(
                self._local(OBSERVE_ACTIVITY, observation, ObservationVerdict, None)
            )
        except ApplicationError as err:
            # The task already fails for its own reason, which this must not replace.
            workflow.logger.warning("scheduler: could not release %s: %s", placement.replica, err)

    async def _observe(
        self,
        placement: Placement,
        failure: _Failure | None,
        result: InferenceResult | None = None,
        *,
        dispatched_at: datetime,
    ) -> ObservationVerdict:
        """Tell the scheduler how an attempt ended, and when it was sent and ended.

        The times let the control plane judge a timeout: a call that waited on a queue no
        worker polled, or one that an outage of Temporal itself cut; the answer says whether
        it was the latter.
        """
        sent, ended = dispatched_at.timestamp(), workflow.now().timestamp()
        # Past the step's objective: a late tier-1 call makes lower tiers leave it headroom.
        slo = self.spec.step_slo_s
        late = None if slo is None else ended - sent > slo
        if failure is not None:
            observation = Observation(
                replica=placement.replica,
                model=placement.model,
                tenant=self.spec.tenant,
                ok=False,
                # A request the replica rejected as invalid says nothing about the replica.
                replica_fault=failure.retryable,
                error=failure.error_type,
                prompt_tokens=failure.attempt.prompt_tokens,
                cached_tokens=failure.attempt.cached_tokens,
                completion_tokens=failure.attempt.completion_tokens,
                cost_micros=failure.attempt.cost_micros,
                probe=placement.probe,
                cold_start=placement.cold_start,
                dispatched_at=sent,
                ended_at=ended,
                late=late,
            )
        else:
            assert result is not None
            observation = Observation(
                replica=placement.replica,
                model=placement.model,
                tenant=self.spec.tenant,
                ok=True,
                queue_s=result.timings.queue_wait_s,
                ttft_s=(result.timings.ttft_s or 0.0) + result.timings.queue_wait_s,
                duration_s=result.timings.total_s + result.timings.queue_wait_s,
                prompt_tokens=result.usage.prompt_tokens,
                cached_tokens=result.usage.cached_tokens,
                completion_tokens=result.usage.completion_tokens,
                cost_micros=result.cost_micros,
                probe=placement.probe,
                cold_start=placement.cold_start,
                dispatched_at=sent,
                ended_at=ended,
                late=late,
            )
        # The scheduler must hear how the call ended (its in-flight count), cancelled or not.
        verdict: ObservationVerdict | None = await uncancellable(
            self._local(OBSERVE_ACTIVITY, observation, ObservationVerdict, None)
        )
        # A history recorded before `observe` answered holds None.
        return ObservationVerdict() if verdict is None else verdict

    # ---- tools and the saga ------------------------------------------------------------------

    async def tool(
        self,
        activity: Callable[..., Any] | str,
        arg: Any,
        *,
        compensation: Callable[..., Any] | str | None = None,
        compensation_arg: Any = None,
        step: str | None = None,
        result_type: type | None = None,
        start_to_close: timedelta = TOOL_START_TO_CLOSE,
        retry_policy: RetryPolicy | None = None,
        heartbeat_timeout: timedelta | None = None,
    ) -> Any:
        """Run a tool activity; when it succeeds, remember its compensation for the saga.

        The compensation receives `compensation_arg` (default: the tool's own argument) and
        runs, newest first, if the task later fails or is cancelled.

        A tool call is bounded twice. Each attempt gets `start_to_close`, and all attempts
        together end at the task's deadline (Temporal's schedule-to-close timeout) when the
        task has a latency budget. `retry_policy` (default `TOOL_RETRY`: 3 attempts, 1 s then
        2 s apart) says how often an attempt that raised is tried again; a tool that fails
        for good raises a non-retryable `ApplicationError` and is not retried. When the
        attempts are spent or the error is not retryable the task fails with `ToolFailed`;
        when the deadline cuts the tool off, with `DeadlineExceeded`. Either way the
        compensations of the tools that succeeded run.

        Any attempt may have done its work before it failed (its worker died before
        reporting), so a tool that changes the world must not do it twice: inside the
        activity, `kvflow.tool_idempotency_key()` is the same on every attempt of this call
        and different for every other call; give it to the system the tool changes.

        An attempt whose worker died is noticed when `start_to_close` passes, unless the tool
        heartbeats (`async with kvflow.tool_heartbeats():` around its body) and
        `heartbeat_timeout` is given: then it is retried once the heartbeats stop.

        When the task is cancelled while a tool with a compensation runs, the task waits for
        the tool: one that heartbeats hears of the cancellation and may stop; one that
        finishes its work anyway is undone with the others, after it has finished. A tool
        without a compensation is left to stop on its own.
        """
        name = step or (activity if isinstance(activity, str) else activity.__name__)
        self._refuse_outside_block("tool", name)
        record = StepSpend(index=len(self.steps) + 1, name=name, kind="tool")
        self.steps.append(record)
        policy = retry_policy or TOOL_RETRY
        remaining = self._remaining_s()
        if remaining is not None and remaining <= 0:
            record.outcome = "failed"
            raise self._error(
                errors.TaskErrorType.DEADLINE_EXCEEDED,
                record,
                f"the task's {self.spec.latency_budget_s:g} s latency budget is spent",
            )
        until_deadline = timedelta(seconds=remaining) if remaining is not None else None
        cancelled_before = workflow.cancellation_reason() is not None
        # Cancelled while it runs, a tool that can be undone is waited for: had it done its
        # work by then, its compensation must run, and only once it has. Any other tool is
        # left to stop on its own.
        waits = compensation is not None and workflow.patched(WAIT_FOR_UNDOABLE_TOOLS_PATCH)
        try:
            result = await workflow.execute_activity(
                cast(Any, activity),
                arg,
                start_to_close_timeout=min(start_to_close, until_deadline or start_to_close),
                schedule_to_close_timeout=until_deadline,
                heartbeat_timeout=heartbeat_timeout,
                retry_policy=policy,
                result_type=result_type,
                summary=f"tool {name}",
                cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED
                if waits
                else ActivityCancellationType.TRY_CANCEL,
            )
        except ActivityError as err:
            record.outcome = "cancelled" if _is_cancellation(err) else "failed"
            self._publish()
            if _is_cancellation(err):
                raise
            if waits:
                # It failed after the task's cancellation reached it: the task is cancelled.
                self._stop_if_cancelled(record, cancelled_before=cancelled_before)
            what = _tool_failure(err.cause)
            # Cut off by the deadline: no time for another try, or the last one timed out at
            # it. A tool's own non-retryable error stays its verdict, whenever it came.
            if self._deadline is not None and (
                err.retry_state == RetryState.TIMEOUT
                or (isinstance(err.cause, TimeoutError) and workflow.now() >= self._deadline)
            ):
                raise self._error(
                    errors.TaskErrorType.DEADLINE_EXCEEDED,
                    record,
                    f"the task's {self.spec.latency_budget_s:g} s latency budget ran out "
                    f"before the tool succeeded; last failure: {what}",
                ) from None
            if err.retry_state == RetryState.MAXIMUM_ATTEMPTS_REACHED:
                what = f"{what} (attempt {policy.maximum_attempts} of {policy.maximum_attempts})"
            raise self._error(errors.TaskErrorType.TOOL_FAILED, record, what) from None
        record.outcome = "ok"
        if compensation is not None:
            self._compensations.append(
                (name, compensation, arg if compensation_arg is None else compensation_arg)
            )
        self._publish()
        if waits:
            # It finished after the task's cancellation reached it: it is undone with the rest.
            self._stop_if_cancelled(record, cancelled_before=cancelled_before, outcome="ok")
        return result

    async def compensate(self) -> bool:
        """Run the registered compensations newest first; True if there were any."""
        ran = bool(self._compensations)
        self._compensating = True
        try:
            await self._run_compensations()
        finally:
            self._compensating = False
        self._publish()
        return ran

    async def _run_compensations(self) -> None:
        while self._compensations:
            name, compensation, arg = self._compensations.pop()
            record = StepSpend(index=len(self.steps) + 1, name=f"undo {name}", kind="compensation")
            self.steps.append(record)
            try:
                await workflow.execute_activity(
                    cast(Any, compensation),
                    arg,
                    start_to_close_timeout=timedelta(seconds=60),
                    retry_policy=RetryPolicy(maximum_attempts=5),
                    summary=f"compensate {name}",
                )
                record.outcome = "ok"
            except ActivityError as err:
                # Keep undoing the rest; the failed compensation is on the record for an operator.
                record.outcome = f"failed: {err.cause}"
                workflow.logger.error("compensation for %s failed: %s", name, err.cause)

    # ---- context -----------------------------------------------------------------------------

    async def text_of(self, result: InferenceResult) -> str:
        """The whole answer of `result`, from the context store when it was too large to inline.

        The text is then the result of a local activity, whose marker in history holds it in
        full unless the client's codec claim-checks large payloads (`KvflowPlugin` does).
        """
        if result.text_ref is None:
            return result.text
        return await self.read(result.text_ref)

    async def read(self, ref: ContextRef) -> str:
        """The content a `ContextRef` points at."""
        read = ContextGet(ref=ref, tenant=self.spec.tenant)
        return await self._local(CONTEXT_GET_ACTIVITY, read, str, None)

    async def _store_if_large(self, text: str) -> str | ContextRef:
        if not needs_store(text):
            return text
        digest = digest_of(text)
        ref = self._refs.get(digest)
        if ref is None:
            put = ContextPut(text=text, tenant=self.spec.tenant)
            ref = await self._local(CONTEXT_PUT_ACTIVITY, put, ContextRef, None)
            self._refs[digest] = ref
        return ref

    async def _compact(self, chat: list[ChatMessage] | None) -> dict[str, Any]:
        """`messages` (and `earlier_messages`) for an inference request.

        A long conversation's earlier messages go to the context store as one document, so
        each call adds one reference to history instead of one per message.
        """
        if chat is None or len(chat) <= KEEP_INLINE_MESSAGES:
            return {"messages": chat}
        earlier = CONVERSATION.dump_json(chat[:-KEEP_INLINE_MESSAGES]).decode()
        if not needs_store(earlier):
            return {"messages": chat}
        return {
            "messages": chat[-KEEP_INLINE_MESSAGES:],
            "earlier_messages": await self._store_if_large(earlier),
        }

    async def _externalize(self, messages: list[ChatMessage]) -> list[ChatMessage]:
        out: list[ChatMessage] = []
        for message in messages:
            if isinstance(message.content, str) and needs_store(message.content):
                message = message.model_copy(
                    update={"content": await self._store_if_large(message.content)}
                )
            out.append(message)
        return out

    # ---- spend and what the UI shows ---------------------------------------------------------

    @property
    def spend_micros(self) -> int:
        """Everything the task has spent so far, failed attempts included."""
        return self.spend.spend_micros

    @property
    def attempts(self) -> int:
        """Model call attempts that ran somewhere so far, failed ones included."""
        return self.spend.attempts

    def breakdown(self) -> SpendBreakdown:
        """The full spend breakdown (also the `kvflow_spend` query)."""
        return self.spend.breakdown(outcome=self.outcome, retries=self.retries)

    def _step_done(self, record: StepSpend, result: InferenceResult) -> InferenceResult:
        record.outcome = "ok"
        self._publish()
        return result

    def _publish(self) -> None:
        """Search attributes and current details after a step.

        Only the attributes that changed are upserted, and the running figures (spend, steps,
        re-placements) at most once per `SEARCH_ATTRIBUTE_INTERVAL` of workflow time: each
        upsert is a history event, and a task of quick steps would otherwise write one per
        step. A change of outcome is upserted at once, and the close always is, so the
        figures a finished task shows are exact; while it runs they may trail by the steps of
        the last interval (the `kvflow.spend` query is always exact).
        """
        done = sum(1 for s in self.steps if s.outcome == "ok")
        values: dict[str, tuple[SearchAttributeUpdate[Any], str | int]] = {
            attrs.SPEND_MICROS.name: (
                attrs.SPEND_MICROS.value_set(self.spend_micros),
                self.spend_micros,
            ),
            attrs.STEPS.name: (attrs.STEPS.value_set(done), done),
            attrs.RETRIES.name: (attrs.RETRIES.value_set(self.retries), self.retries),
            attrs.OUTCOME.name: (attrs.OUTCOME.value_set(self.outcome), self.outcome),
        }
        changed = {
            name: pair for name, pair in values.items() if self._published.get(name) != pair[1]
        }
        now = workflow.now()
        due = (
            attrs.OUTCOME.name in changed
            or self._published_at is None
            or now - self._published_at >= SEARCH_ATTRIBUTE_INTERVAL
        )
        if changed and due:
            workflow.upsert_search_attributes([update for update, _ in changed.values()])
            self._published.update({name: value for name, (_, value) in changed.items()})
            self._published_at = now
        workflow.set_current_details(self._details_table())

    def _details_table(self) -> str:
        lines = [
            f"**{self.spec.tenant}** · spent ${_usd(self.spend_micros)} · "
            f"{self.attempts} attempts · {self.retries} re-placements",
            "",
            "| # | step | where | outcome | cost |",
            "|---|---|---|---|---|",
        ]
        for step in self.steps:
            where = " → ".join(a.replica for a in step.attempts) or step.kind
            lines.append(
                f"| {step.index} | {step.name} | {where} | {step.outcome} | "
                f"${_usd(step.cost_micros)} |"
            )
        return "\n".join(lines)

    def _summary(self, record: StepSpend, placement: Placement) -> str:
        return f"{self._step_label(record)} · {placement.model} · {placement.reason}"[:400]

    def _step_label(self, record: StepSpend) -> str:
        """How UI summaries and task errors name a step: "step 2/3 'draft'", "tool 'refund'".

        The counter counts model calls only, numerator and denominator alike: its total is
        `TaskSpec.expected_steps`, the one count a task declares, and that count is of model
        calls because the scheduler multiplies it by a call's model time to judge the
        deadline. Counting tools in the numerator only would read "step 4/2". Tool calls and
        compensations are named by kind instead. The number runs on over the task's runs
        (continue-as-new), and the total grows when a task makes more calls than it declared.
        """
        if record.kind == "infer":
            before = sum(1 for s in self.steps[: record.index - 1] if s.kind == "infer")
            number = before + 1 + (self._carried.steps_done if self._carried else 0)
            total = max(self.spec.expected_steps, number)
            return f"step {number}/{total} '{record.name}'"
        return f"{record.kind} '{record.name}'"

    def _remaining_s(self) -> float | None:
        if self._deadline is None:
            return None
        return (self._deadline - workflow.now()).total_seconds()

    def _error(
        self, error_type: str, record: StepSpend, what: str, **details: Any
    ) -> ApplicationError:
        return errors.task_error(
            error_type,
            f"{self._step_label(record)}: {what}",
            step=record.name,
            spend_micros=self.spend_micros,
            **details,
        )

    async def _close(self, outcome: TaskOutcome) -> None:
        """Write the task row, then publish the outcome; the outcome never changes here.

        The row is written first so that the search attribute never names an outcome the
        ledger could contradict; if the row cannot be written (the ledger is down past
        `LEDGER_SCHEDULE_TO_CLOSE`), the task still ends as `outcome` with its own result or
        error, the attribute says so, and `kvflow ledger reconcile` writes the row from it.
        """
        self.outcome = outcome.value
        await self._book(outcome)
        self._publish()

    async def _book(self, outcome: TaskOutcome) -> None:
        """End the task in the scheduler and write the run's row, cancelled or not."""
        closing = asyncio.ensure_future(self._end_and_record(outcome))
        try:
            await asyncio.shield(closing)
        except asyncio.CancelledError:
            # Cancelled while closing: the task's work is over and its outcome stands.
            await closing

    async def _end_and_record(self, outcome: TaskOutcome) -> None:
        """Tell the scheduler the task ended, unless it goes on in a next run; write the row.

        The scheduler first, so that a ledger that is down delays no new task that its
        admission holds (`AdmissionConfig.open_task_kv_by_tier`). A local activity: it runs
        on this worker, whose scheduler placed the task's calls. If it fails the task still
        ends as `outcome`; that scheduler forgets it after `open_task_idle_s`.
        """
        if outcome.final and workflow.patched(END_TASK_PATCH):
            try:
                await bounded_local(END_TASK_ACTIVITY, workflow.info().workflow_id, bool)
            except FailureError as err:
                workflow.logger.warning("scheduler: the task's end was not heard: %s", err)
        chain = self._carried.chain_run_id if self._carried else None
        await self.spend.close(outcome, started_at=self._run_started_at, chain=chain)


_CONTROL_PLANE_FIXES: dict[str, tuple[errors.TaskErrorType, str]] = {
    # The control plane's message names the value and the fix itself.
    "PlacementInputError": (errors.TaskErrorType.INVALID_TASK, ""),
    "ContextNotFound": (
        errors.TaskErrorType.CONTEXT_NOT_FOUND,
        "every worker must use the same context store (--context-dir)",
    ),
}
"""Permanent control-plane errors: the task error each becomes and what would fix it."""


def _worker_went_silent(err: ActivityError) -> bool:
    """The call started but its GPU worker stopped heartbeating or answering (it died)."""
    cause = err.cause
    return isinstance(cause, TimeoutError) and cause.type in (
        TimeoutType.HEARTBEAT,
        TimeoutType.START_TO_CLOSE,
    )


def _tool_failure(cause: BaseException | None) -> str:
    """What made a tool call fail, in one line: `RuntimeError: card declined`."""
    if isinstance(cause, ApplicationError):
        return f"{cause.type or 'ApplicationError'}: {cause.message}"
    if isinstance(cause, TimeoutError):
        kind = cause.type.name.lower().replace("_", "-") if cause.type else "a"
        last = f" after {_tool_failure(cause.cause)}" if cause.cause else ""
        return f"{kind} timeout{last}"
    return str(cause) if cause else "no cause given"


def _task_started_at(info: workflow.Info) -> datetime:
    """When the task's latency budget starts counting: when its workflow was started.

    `Info.start_time` is the first workflow task's time, later than the start by however long
    no workflow worker was polling (an outage, a deploy); the budget counts that wait too.
    `workflow_start_time` comes from the `WorkflowExecutionStarted` event, so replay agrees.
    A cron run or a workflow retry is created when the previous run closes and then waits out
    its backoff by design: its budget starts with its first workflow task. A `start_delay`
    cannot be told apart from an outage here, so a delayed task counts its delay.
    """
    if info.cron_schedule or info.attempt > 1:
        return info.start_time
    return info.workflow_start_time


def _usd(micros: int) -> str:
    # Exact decimals, trailing zeros dropped: "0.0021", not "0.002100".
    return format_usd(micros).rstrip("0").rstrip(".") if micros else "0"


def _call_timeout(remaining: float | None) -> timedelta:
    if remaining is None:
        return DEFAULT_CALL_TIMEOUT
    return timedelta(seconds=max(1.0, remaining))


def _failure_of(err: ActivityError, placement: Placement) -> _Failure:
    """Classify a failed inference attempt and recover its partial output and its cost.

    Raises `UnreadableDetails` when the failure's details are not an `AttemptProgress`.
    """
    cause = err.cause
    progress: AttemptProgress | None = None
    error_type = type(cause).__name__ if cause else "ActivityError"
    message = str(cause or err)
    retryable = False
    if isinstance(cause, ApplicationError):
        error_type = cause.type or "ApplicationError"
        message = cause.message
        retryable = error_type in RETRYABLE_TYPES
        progress = AttemptProgress.from_details(
            cause.details, source=f"the details of {error_type} from {placement.replica}"
        )
    elif isinstance(cause, TimeoutError):
        # The replica did not take the call in time, or stopped heartbeating (crashed): both
        # are the replica's fault. A heartbeat timeout carries the last heartbeat's progress.
        error_type = (
            "ScheduleToStart"
            if cause.type == TimeoutType.SCHEDULE_TO_START
            else f"Timeout{cause.type.name.title().replace('_', '') if cause.type else ''}"
        )
        retryable = True
        progress = AttemptProgress.from_details(
            cause.last_heartbeat_details,
            source=f"the last heartbeat details from {placement.replica}",
        )
    progress = progress or AttemptProgress()
    return _Failure(
        error_type=error_type,
        message=message,
        retryable=retryable,
        checkpoint=progress.resumable(),
        attempt=AttemptSpend(
            replica=placement.replica,
            outcome=error_type,
            cost_micros=progress.cost_micros,
            prompt_tokens=progress.usage.prompt_tokens,
            cached_tokens=progress.usage.cached_tokens,
            completion_tokens=progress.usage.completion_tokens,
        ),
    )


__all__ = [
    "SPEND_QUERY",
    "Agent",
    "AttemptSpend",
    "ChatMessage",
    "SpendBreakdown",
    "StepSpend",
    "TaskSpec",
]

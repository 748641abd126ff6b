"""`TaskCarry`: what a task's next run takes over when the task continues as new.

A task is one workflow id, but Temporal runs it as a chain of runs when its workflow continues
as new. The task's caps are the task's, not each run's: the next run starts with what the
earlier runs spent, the re-placements they used and the task's own start (so its deadline),
and it books its row under the same chain of runs (`TaskRecord.chain_run_id`).

The carry travels with the continue-as-new itself, as a header of the next run's start
(`ContinuedRunInterceptor` writes and reads it). `workflow.info()` cannot tell a continued run
from a cron run or a workflow retry: all three name the run before them as `continued_run_id`
and share `first_execution_run_id`, and Temporal copies a run's start headers into the cron
run or the retry that follows it. So the carry names the run that wrote it, and a run takes it
only when that run is the one it continued from: a cron run or a retry starts a task of its
own.
"""

from __future__ import annotations

from contextvars import ContextVar

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError
from temporalio.api.common.v1 import Payload

TASK_CARRY_HEADER = "kvflow-task"
"""The start header that carries a task into its next run."""
TASK_CARRY_PATCH = "kvflow-task-carried"
"""`workflow.patched` id of the rule that a continued run takes over its task's spend, retries,
start and chain (`TaskCarry`); runs recorded before it replay as fresh tasks."""


class TaskCarry(BaseModel):
    """The task as the run that continued as new leaves it to the next run."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    from_run_id: str = Field(min_length=1, description="the run that continued as new")
    chain_run_id: str = Field(min_length=1, description="the first run of the task")
    started_at: AwareDatetime = Field(description="when the task's latency budget started")
    spend_micros: int = Field(default=0, ge=0, description="what the earlier runs spent")
    retries: int = Field(default=0, ge=0, description="re-placements the earlier runs used")
    steps_done: int = Field(default=0, ge=0, description="model calls they completed")

    def to_payload(self) -> Payload:
        """The header's payload: plain JSON, whatever the client's data converter is."""
        return Payload(metadata={"encoding": b"json/plain"}, data=self.model_dump_json().encode())

    @classmethod
    def from_payload(cls, payload: Payload) -> TaskCarry | None:
        """The carry in `payload`, or None when it cannot be read (another codec's bytes)."""
        try:
            return cls.model_validate_json(payload.data)
        except ValidationError:
            return None


_ARRIVED: ContextVar[TaskCarry | None] = ContextVar("kvflow_task_carry", default=None)
"""The carry in the running workflow's start headers (set by `ContinuedRunInterceptor`)."""


def arrived(carry: TaskCarry | None) -> None:
    """Note the carry the running workflow started with (None: it started without one)."""
    _ARRIVED.set(carry)


def carried_into(continued_run_id: str | None) -> TaskCarry | None:
    """The carry of the running workflow, if the run that wrote it is the one it continued from.

    A cron run or a retry starts with the headers of the run before it, whose own carry names
    the run before that: it is no continuation, and gets None.
    """
    carry = _ARRIVED.get()
    if carry is None or continued_run_id is None or carry.from_run_id != continued_run_id:
        return None
    return carry

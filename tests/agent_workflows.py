"""Agent workflows the step-API tests run (a real workflow worker runs them)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from pydantic import BaseModel, Field
from temporalio import activity, workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from kvflow.activities.tools import tool_heartbeats, tool_idempotency_key
    from kvflow.activities.wire import ChatMessage, ContextRef, InferenceResult, Sampling, ToolSpec
    from kvflow.workflows.agent import Agent, TaskSpec


class StepsInput(BaseModel):
    spec: TaskSpec
    model: str
    steps: int = 5
    max_tokens: int = 16
    context: str = "You are a careful research agent."


class StepsOutput(BaseModel):
    replicas: list[str]
    answers: list[str]
    answer_bytes: list[int]


@workflow.defn
class MultiStepAgent:
    """A conversation of `steps` model calls; each answer joins the conversation."""

    @workflow.run
    async def run(self, task: StepsInput) -> StepsOutput:
        agent = Agent(task.spec)
        out = StepsOutput(replicas=[], answers=[], answer_bytes=[])
        async with agent:
            conversation = [ChatMessage(role="system", content=task.context)]
            for i in range(task.steps):
                conversation.append(ChatMessage(role="user", content=f"Now do part {i + 1}."))
                result = await agent.infer(
                    conversation,
                    model=task.model,
                    max_tokens=task.max_tokens,
                    step=f"part-{i + 1}",
                    sampling=Sampling(ignore_eos=True, seed=i),
                )
                conversation.append(
                    ChatMessage(role="assistant", content=result.text_ref or result.text)
                )
                out.replicas.append(result.replica)
                out.answers.append(result.text)
                size = result.text_ref.size if result.text_ref else len(result.text.encode())
                out.answer_bytes.append(size)
        return out


class Refund(BaseModel):
    account: str
    amount_cents: int


REFUNDS: list[Refund] = []
REVERSED: list[Refund] = []


@activity.defn
async def issue_refund(refund: Refund) -> str:
    REFUNDS.append(refund)
    return f"refund-{len(REFUNDS)}"


@activity.defn
async def reverse_refund(refund: Refund) -> None:
    REVERSED.append(refund)


REFUNDS_STARTED: set[str] = set()
"""Accounts whose `issue_refund_slowly` has begun."""


@activity.defn
async def issue_refund_slowly(refund: Refund) -> str:
    """Issue the refund a second after starting; it never heartbeats, so never hears a cancel."""
    REFUNDS_STARTED.add(refund.account)
    await asyncio.sleep(1.0)
    REFUNDS.append(refund)
    return f"refund-{len(REFUNDS)}"


class RefundInput(BaseModel):
    spec: TaskSpec
    model: str
    refund: Refund
    max_tokens: int = 16


@workflow.defn
class RefundThenReply:
    """Issue a refund (a tool with a compensation), then draft the reply with a model call."""

    @workflow.run
    async def run(self, task: RefundInput) -> str:
        agent = Agent(task.spec)
        async with agent:
            return (await refund_then_reply(agent, task)).text


async def refund_then_reply(agent: Agent, task: RefundInput) -> InferenceResult:
    """The refund (with its compensation), then the model call that drafts the reply."""
    await agent.tool(issue_refund, task.refund, compensation=reverse_refund, step="refund")
    return await agent.infer(
        [ChatMessage(role="user", content="Draft the reply to the customer.")],
        model=task.model,
        max_tokens=task.max_tokens,
        step="reply",
        sampling=Sampling(ignore_eos=True),
    )


class Verdict(BaseModel):
    approve: bool
    reason: str
    score: int


class VerdictInput(BaseModel):
    spec: TaskSpec
    model: str


@workflow.defn
class StructuredVerdict:
    """One model call with structured output."""

    @workflow.run
    async def run(self, task: VerdictInput) -> Verdict:
        agent = Agent(task.spec)
        async with agent:
            return await agent.infer(
                [ChatMessage(role="user", content="Review the change and give a verdict.")],
                model=task.model,
                max_tokens=200,
                output=Verdict,
                step="verdict",
            )


class Report(BaseModel):
    title: str
    body: str = Field(min_length=3000)


class ReportInput(BaseModel):
    spec: TaskSpec
    model: str
    brief: str


@workflow.defn
class LongReport:
    """One model call whose prompt and structured answer are both larger than 2 KB."""

    @workflow.run
    async def run(self, task: ReportInput) -> Report:
        agent = Agent(task.spec)
        async with agent:
            return await agent.infer(
                [ChatMessage(role="user", content=task.brief)],
                model=task.model,
                max_tokens=4000,
                output=Report,
                step="report",
            )


class ReadInput(BaseModel):
    spec: TaskSpec
    ref: ContextRef
    model: str | None = None
    """With a model, the reference goes to a model call as a message (the GPU worker reads it)."""


@workflow.defn
class ReadContext:
    """Read a context reference for the task's tenant: with `Agent.read`, or in a model call."""

    @workflow.run
    async def run(self, task: ReadInput) -> str:
        agent = Agent(task.spec)
        async with agent:
            if task.model is None:
                return await agent.read(task.ref)
            answer = await agent.infer(
                [ChatMessage(role="user", content=task.ref)],
                model=task.model,
                max_tokens=4,
                step="summarise",
            )
            return answer.text


class Trip(BaseModel):
    traveller: str
    """Unique per test: the records below are shared by every test in the process."""
    card_declined: bool = True
    lose_first_booking_answer: bool = False
    """The first booking attempt books, then fails as if its answer was lost on the way."""


BOOKINGS: dict[str, str] = {}
"""The hotel's bookings by idempotency key: a key seen again returns its booking."""
BOOKING_KEYS: dict[str, list[str]] = {}
"""The idempotency key each attempt of `book_hotel` saw, by traveller."""
CANCELLED: list[str] = []
"""Travellers whose booking `cancel_hotel` undid."""
CHARGE_ATTEMPTS: dict[str, list[int]] = {}
"""The attempt numbers `charge_card` ran, by traveller."""


@activity.defn
async def book_hotel(trip: Trip) -> str:
    key = tool_idempotency_key()
    BOOKING_KEYS.setdefault(trip.traveller, []).append(key)
    booking = BOOKINGS.setdefault(key, f"booking-{len(BOOKINGS) + 1}")
    if trip.lose_first_booking_answer and activity.info().attempt == 1:
        raise RuntimeError("connection reset after the hotel confirmed")
    return booking


@activity.defn
async def cancel_hotel(trip: Trip) -> None:
    CANCELLED.append(trip.traveller)


@activity.defn
async def charge_card(trip: Trip) -> str:
    CHARGE_ATTEMPTS.setdefault(trip.traveller, []).append(activity.info().attempt)
    if trip.card_declined:
        raise RuntimeError(f"the card of {trip.traveller} was declined by the processor")
    return "charged"


class TripInput(BaseModel):
    spec: TaskSpec
    trip: Trip
    charge_attempts: int | None = None
    """`maximum_attempts` of the charge's retry policy (0: unlimited); None: the default."""


@workflow.defn
class BookTrip:
    """Book a hotel (a tool with a compensation), then charge the card (a tool)."""

    @workflow.run
    async def run(self, task: TripInput) -> str:
        agent = Agent(task.spec)
        async with agent:
            booking: str = await agent.tool(
                book_hotel,
                task.trip,
                compensation=cancel_hotel,
                step="book hotel",
                result_type=str,
            )
            policy = (
                None
                if task.charge_attempts is None
                else RetryPolicy(
                    initial_interval=timedelta(milliseconds=500),
                    backoff_coefficient=1.0,
                    maximum_attempts=task.charge_attempts,
                )
            )
            await agent.tool(charge_card, task.trip, step="charge card", retry_policy=policy)
            return booking


@activity.defn
async def check_in(trip: Trip) -> str:
    """Heartbeats while it works; its first attempt then goes silent, as a dead worker does."""
    async with tool_heartbeats(timedelta(milliseconds=200)):
        await asyncio.sleep(0.3)
    if activity.info().attempt == 1:
        await asyncio.sleep(5)  # no heartbeats: Temporal gives up on this attempt first
        return "too late"
    return f"checked in {trip.traveller}"


@workflow.defn
class CheckIn:
    """One tool that heartbeats, with a heartbeat timeout far below its start-to-close."""

    @workflow.run
    async def run(self, task: TripInput) -> str:
        agent = Agent(task.spec)
        async with agent:
            result: str = await agent.tool(
                check_in,
                task.trip,
                step="check in",
                result_type=str,
                heartbeat_timeout=timedelta(seconds=1),
            )
            return result


class CallInput(BaseModel):
    spec: TaskSpec
    model: str
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    max_tokens: int = 16


@workflow.defn
class OneCall:
    """One model call made exactly as the input gives it, however wrong."""

    @workflow.run
    async def run(self, task: CallInput) -> str:
        agent = Agent(task.spec)
        async with agent:
            result = await agent.infer(
                task.messages,
                prompt=task.prompt,
                model=task.model,
                max_tokens=task.max_tokens,
                step="call",
            )
            return result.text


WEATHER = ToolSpec(
    name="get_weather",
    description="Today's weather in a city",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
    },
)


class ToolLoopInput(BaseModel):
    spec: TaskSpec
    model: str
    question: str = "What should I wear in Lisbon today?"
    first_choice: str = "required"


class ToolLoopOutput(BaseModel):
    calls: list[dict[str, str]]
    finish_reasons: list[str]
    answer: str
    replicas: list[str]


@workflow.defn
class ToolLoop:
    """Ask with a tool, run the call the model made, give it the result, ask again."""

    @workflow.run
    async def run(self, task: ToolLoopInput) -> ToolLoopOutput:
        agent = Agent(task.spec)
        async with agent:
            chat = [ChatMessage(role="user", content=task.question)]
            first = await agent.infer(
                chat,
                model=task.model,
                max_tokens=200,
                tools=[WEATHER],
                tool_choice=task.first_choice,
                step="decide",
            )
            chat.append(
                ChatMessage(role="assistant", content=first.text, tool_calls=first.tool_calls)
            )
            for call in first.tool_calls:
                chat.append(
                    ChatMessage(role="tool", tool_call_id=call.id, content="18 degrees, light rain")
                )
            second = await agent.infer(
                chat,
                model=task.model,
                max_tokens=40,
                tools=[WEATHER],
                tool_choice="none",
                step="answer",
            )
            return ToolLoopOutput(
                calls=[c.model_dump() for c in first.tool_calls],
                finish_reasons=[first.finish_reason, second.finish_reason],
                answer=second.text,
                replicas=[first.replica, second.replica],
            )


@activity.defn
async def slow_lookup(seconds: float) -> str:
    """A tool of another library: it takes `seconds`, and heartbeats nothing."""
    await asyncio.sleep(seconds)
    return "found"


class RawActivityInput(BaseModel):
    spec: TaskSpec
    seconds: float
    refund: Refund | None = None


@workflow.defn
class RawActivityInBlock:
    """An activity started as a framework starts its tools: not through `agent.tool`."""

    @workflow.run
    async def run(self, task: RawActivityInput) -> str:
        agent = Agent(task.spec)
        async with agent:
            if task.refund is not None:
                await agent.tool(issue_refund, task.refund, compensation=reverse_refund)
            return await workflow.execute_activity(
                slow_lookup,
                task.seconds,
                start_to_close_timeout=timedelta(seconds=60),
                retry_policy=RetryPolicy(maximum_attempts=1),
            )


@workflow.defn
class BugAfterRefund:
    """A refund (with its compensation) and a model call, then a bug in the workflow's code."""

    @workflow.run
    async def run(self, task: RefundInput) -> str:
        agent = Agent(task.spec)
        async with agent:
            reply = await refund_then_reply(agent, task)
            answer = {"reply": reply.text}
            return answer["text"]  # the bug: a KeyError, which Temporal retries as a task


@workflow.defn
class RefundReplyFollowUp:
    """The refund and the reply of `RefundThenReply`, then a second model call."""

    @workflow.run
    async def run(self, task: RefundInput) -> str:
        agent = Agent(task.spec)
        async with agent:
            reply = await refund_then_reply(agent, task)
            follow_up = await agent.infer(
                [ChatMessage(role="user", content=f"Summarise: {reply.text}")],
                model=task.model,
                max_tokens=4,
                step="follow-up",
            )
            return follow_up.text


@workflow.defn
class SlowRefundThenReply:
    """`RefundThenReply` with a refund that takes a second and ignores cancellation."""

    @workflow.run
    async def run(self, task: RefundInput) -> str:
        agent = Agent(task.spec)
        async with agent:
            await agent.tool(
                issue_refund_slowly, task.refund, compensation=reverse_refund, step="refund"
            )
            reply = await agent.infer(
                [ChatMessage(role="user", content="Draft the reply to the customer.")],
                model=task.model,
                max_tokens=task.max_tokens,
                step="reply",
            )
            return reply.text


@workflow.defn
class AnswerThenGiveUp:
    """One model call, then the task fails when it is told to give up (signal `give_up`)."""

    def __init__(self) -> None:
        self.giving_up = False

    @workflow.signal
    def give_up(self) -> None:
        self.giving_up = True

    @workflow.run
    async def run(self, task: StepsInput) -> str:
        agent = Agent(task.spec)
        async with agent:
            await agent.infer(
                [ChatMessage(role="system", content=task.context)],
                model=task.model,
                max_tokens=task.max_tokens,
                step="answer",
            )
            await workflow.wait_condition(lambda: self.giving_up)
            raise ApplicationError("the user gave up", non_retryable=True)


class ContinueInput(BaseModel):
    spec: TaskSpec
    model: str
    runs_left: int = 1
    pause_s: float = 0.0
    """How long each run that continues as new waits after its call (workflow time)."""
    max_tokens: int = 8
    fail_first_try: bool = False
    """The last run fails (retryably) on the workflow's first attempt: a retry runs it again."""


@workflow.defn
class ContinueOnce:
    """One model call a run; continues as new while runs are left, then returns its answer."""

    @workflow.run
    async def run(self, task: ContinueInput) -> str:
        agent = Agent(task.spec)
        async with agent:
            answer = await agent.infer(
                [ChatMessage(role="user", content=f"Runs left: {task.runs_left}.")],
                model=task.model,
                max_tokens=task.max_tokens,
                step="answer",
            )
            if task.runs_left > 0:
                if task.pause_s:
                    await workflow.sleep(task.pause_s)
                workflow.continue_as_new(task.model_copy(update={"runs_left": task.runs_left - 1}))
            if task.fail_first_try and workflow.info().attempt == 1:
                raise ApplicationError("the first try fails; the workflow's retry runs it again")
            return answer.text


class CronInput(BaseModel):
    spec: TaskSpec
    model: str
    continued: bool = False


@workflow.defn
class CronContinuesOnce:
    """A cron workflow's run: one model call; the second cron run continues as new once."""

    @workflow.run
    async def run(self, task: CronInput) -> str:
        agent = Agent(task.spec)
        async with agent:
            answer = await agent.infer(
                [ChatMessage(role="user", content="What time is it?")],
                model=task.model,
                max_tokens=8,
                step="answer",
            )
            info = workflow.info()
            # A cron run after the first names the run before it, as a continued run does.
            if info.cron_schedule and info.continued_run_id and not task.continued:
                workflow.continue_as_new(task.model_copy(update={"continued": True}))
            return answer.text


class OutsideInput(BaseModel):
    spec: TaskSpec
    model: str
    tool: bool = False


@workflow.defn
class CallsOutsideTheBlock:
    """Makes a model call (or a tool call) with an `Agent` whose block it never enters."""

    @workflow.run
    async def run(self, task: OutsideInput) -> str:
        agent = Agent(task.spec)
        if task.tool:
            return str(await agent.tool(slow_lookup, 0.0, step="lookup"))
        answer = await agent.infer(
            [ChatMessage(role="user", content="Hello?")],
            model=task.model,
            max_tokens=8,
            step="answer",
        )
        return answer.text


ALL_WORKFLOWS = [
    MultiStepAgent,
    SlowRefundThenReply,
    BugAfterRefund,
    RefundThenReply,
    RefundReplyFollowUp,
    StructuredVerdict,
    LongReport,
    ReadContext,
    BookTrip,
    CheckIn,
    OneCall,
    ToolLoop,
    RawActivityInBlock,
    AnswerThenGiveUp,
    ContinueOnce,
    CronContinuesOnce,
    CallsOutsideTheBlock,
]
ALL_ACTIVITIES = [
    issue_refund,
    issue_refund_slowly,
    reverse_refund,
    book_hotel,
    cancel_hotel,
    charge_card,
    check_in,
    slow_lookup,
]

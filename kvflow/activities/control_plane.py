"""The activities the workflow worker runs for the step API: place, observe, bill, store.

`place` and `observe` are local activities: the scheduler lives in the workflow worker's
process, answers from memory in microseconds, and its answer is recorded in history as a
marker, so a replay takes the same decision without asking again. Their inputs are not written
to history, which is why `place` can receive the whole conversation (as context references)
and compute the prompt's block hashes itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

from temporalio import activity
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from kvflow.activities.context_store import ContextNotFound, ContextStore, DirectoryContextStore
from kvflow.activities.errors import capped
from kvflow.activities.inference import AttemptSink
from kvflow.activities.tokenize import FleetTokenizers
from kvflow.activities.wire import (
    AttemptBill,
    AttemptKey,
    ContextGet,
    ContextPut,
    ContextRef,
    LostAttempt,
    PlaceAnswer,
    PlaceInput,
    ResumedAttempts,
    Usage,
)
from kvflow.ledger.errors import LedgerNotFound, LedgerSchemaError, LedgerUrlError
from kvflow.ledger.records import AttemptOutcome, AttemptRecord, TaskRecord
from kvflow.scheduler.blocks import block_hashes, call_cache_salt
from kvflow.scheduler.fleet import Fleet
from kvflow.scheduler.placement import (
    Observation,
    ObservationVerdict,
    Placement,
    PlacementInputError,
    PlacementRequest,
    Refusal,
)

log = logging.getLogger(__name__)

PLACE_ACTIVITY = "kvflow.place"
OBSERVE_ACTIVITY = "kvflow.observe"
RECORD_TASK_ACTIVITY = "kvflow.record_task"
END_TASK_ACTIVITY = "kvflow.end_task"
CONTEXT_PUT_ACTIVITY = "kvflow.context_put"
CONTEXT_GET_ACTIVITY = "kvflow.context_get"
RECORD_LOST_ATTEMPT_ACTIVITY = "kvflow.record_lost_attempt"
ATTEMPT_BILL_ACTIVITY = "kvflow.attempt_bill"
MARK_RESUMED_ACTIVITY = "kvflow.mark_resumed"

PERMANENT_ERRORS: tuple[type[Exception], ...] = (
    PlacementInputError,
    ContextNotFound,
    LedgerNotFound,
    LedgerSchemaError,
    LedgerUrlError,
)
"""Errors no retry can fix: the request names what does not exist, or the ledger is misconfigured.

The control-plane activities raise them as non-retryable `ApplicationError`s typed by class
name, so Temporal runs them once and the workflow fails the task with a message to act on."""


@contextmanager
def permanent_errors_fail_at_once() -> Iterator[None]:
    """Re-raise a `PERMANENT_ERRORS` exception as a non-retryable `ApplicationError`."""
    try:
        yield
    except PERMANENT_ERRORS as exc:
        # KeyError's str() quotes its message; the message is its first argument.
        message = str(exc.args[0]) if exc.args else type(exc).__name__
        # Not chained: Temporal would record the cause, with its message uncapped, in history.
        # BENIGN: an expected refusal, logged as one line, its traceback only at DEBUG.
        raise ApplicationError(
            capped(message),
            type=type(exc).__name__,
            non_retryable=True,
            category=ApplicationErrorCategory.BENIGN,
        ) from None


def check_servable(fleet: Fleet, request: PlacementRequest) -> None:
    """Raise `PlacementInputError` for a call no state of `fleet` could ever serve.

    That is a tenant or a model the fleet does not list, or a prompt and output longer than
    the context of the model and of every fallback it could degrade to. The message names the
    value and what would fix it, for the task's error in the Temporal UI; a call that fits
    some model is the scheduler's to place or refuse.
    """
    tenants = sorted(t.name for t in fleet.tenants)
    if request.tenant not in tenants:
        raise PlacementInputError(
            f"unknown tenant {request.tenant!r}: set TaskSpec.tenant to one of "
            f"{', '.join(tenants)}, or add it as a [[tenants]] entry of the fleet file"
        )
    models = {m.name: m for m in fleet.models}
    model = models.get(request.model)
    if model is None:
        raise PlacementInputError(
            f"unknown model {request.model!r}: ask for one of {', '.join(sorted(models))}, "
            "or add it as a [[models]] entry of the fleet file"
        )
    chain = [model]
    while chain[-1].fallback in models and models[chain[-1].fallback] not in chain:
        chain.append(models[chain[-1].fallback])
    needed = request.prompt_tokens + request.max_output_tokens
    longest = max(chain, key=lambda m: m.context_length)
    if needed > longest.context_length:
        contexts = ", ".join(f"{m.name} {m.context_length:,}" for m in chain)
        raise PlacementInputError(
            f"the prompt's {request.prompt_tokens:,} tokens and max_tokens "
            f"{request.max_output_tokens:,} exceed the context of every model that could "
            f"serve the call ({contexts} tokens): shorten the prompt or lower max_tokens to "
            f"fit {longest.context_length:,} tokens, or ask for a model with a longer context"
        )


class PlacementPolicy(Protocol):
    """The scheduler, as the control plane uses it."""

    def place(self, request: PlacementRequest) -> Placement | Refusal:
        """Choose a replica for one call, or refuse and say why."""
        ...

    def observe(self, observation: Observation) -> None:
        """Learn from how a call ended."""
        ...

    def settle(self) -> None:
        """Apply what answered placements changed; called right after each answer."""
        ...

    def end_task(self, workflow_id: str) -> bool:
        """The task ended, whatever its outcome; its conversation will not come back.

        True when this scheduler was counting it among its open tasks.
        """
        ...


class FailureTriage(Protocol):
    """What the control plane does with a failed call before the scheduler learns of it."""

    def triage(self, observation: Observation) -> Observation:
        """The observation to record for a failed call; may start checks of its replica.

        It sets `control_plane_fault` (and clears `replica_fault`) for a failure its own
        outage explains.
        """
        ...


class LedgerSink(AttemptSink, Protocol):
    """Stores task rows, and attempt rows a dead GPU worker could not (`AsyncLedger` does)."""

    async def record_task(self, record: TaskRecord) -> bool:
        """Store the task's row; idempotent on (workflow id, run id)."""
        ...

    async def attempts_for(self, workflow_id: str, run_id: str) -> list[AttemptRecord]:
        """Every attempt row of one workflow run."""
        ...

    async def mark_resumed(self, workflow_id: str, run_id: str, activity_ids: Sequence[str]) -> int:
        """Mark failed attempts whose partial output was reused as `resumed_elsewhere`."""
        ...


class ControlPlaneActivities:
    """Activities of the workflow worker, bound to its scheduler, ledger and context store.

    Prompt sizes and block hashes come from each model's tokenizer as the fleet configures it
    (`kvflow.activities.tokenize`): the model's own, so the hashes match what vLLM caches, or
    the built-in one for the simulator's models. Either way every workflow worker computes the
    same ids, which is what the prefix index and rendezvous hashing need to agree.
    """

    def __init__(
        self,
        scheduler: PlacementPolicy,
        *,
        fleet: Fleet,
        block_size: int,
        ledger: LedgerSink | None = None,
        store: ContextStore | None = None,
        tokenizers: FleetTokenizers | None = None,
        triage: FailureTriage | None = None,
        on_task_end: Callable[[str], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.on_task_end = on_task_end
        """Called with the workflow id after the scheduler hears a task's end (`end_task`):
        the control plane tells the engines (`kvflow.scheduler.task_end`)."""
        self.triage = triage
        """Sees each failed call first (the `ControlPlane`); None: the scheduler alone."""
        self.fleet = fleet
        self.block_size = block_size
        self.ledger = ledger
        self.store = store or DirectoryContextStore()
        self.tokenizers = tokenizers or FleetTokenizers(fleet)

    async def _text(self, content: str | ContextRef, tenant: str) -> str:
        # The task's own tenant: a reference to another tenant's content opens nothing here
        # either, not even its token count.
        return content if isinstance(content, str) else await self.store.aget(content, tenant)

    async def prompt_tokens(self, place: PlaceInput) -> list[int]:
        """The prompt's token ids, from the model's configured tokenizer, as the engine sees it."""
        tokenizer = self.tokenizers.for_model(place.request.model)
        tenant = place.request.tenant
        partial = await self._text(place.checkpoint_text, tenant)
        if place.messages is not None:
            messages = [m.to_api(await self._text(m.content, tenant)) for m in place.messages]
            # A chat resume sends the partial answer without its trailing whitespace.
            partial = partial.rstrip()
            if partial:
                messages.append({"role": "assistant", "content": partial})
            # Tools, and earlier tool calls, are part of the prompt the engine caches: each
            # tokenizer renders them the way its engine does.
            return await tokenizer.encode_chat(
                messages,
                add_generation_prompt=not partial,
                continue_final_message=bool(partial),
                tools=[tool.to_api() for tool in place.tools or ()],
            )
        assert place.prompt is not None
        return await tokenizer.encode(await self._text(place.prompt, tenant) + partial)

    async def cache_salt(self, place: PlaceInput) -> str | None:
        """The `cache_salt` the GPU worker sends with this call (`call_cache_salt`)."""
        shared = self.fleet.cache.shared_prefixes
        first: str | None = None
        if shared and place.messages:
            first = await self._text(place.messages[0].content, place.request.tenant)
        # The GPU worker runs the call in the same namespace and salts it with the same value.
        namespace = activity.info().namespace if activity.in_activity() else "default"
        return call_cache_salt(namespace, place.request.tenant, first, shared)

    @activity.defn(name=PLACE_ACTIVITY)
    async def place(self, place: PlaceInput) -> PlaceAnswer:
        """Ask the scheduler where the call should run (a local activity)."""
        with permanent_errors_fail_at_once():
            ids = await self.prompt_tokens(place)
            salt = await self.cache_salt(place)
            request = place.request.model_copy(
                update={
                    "prompt_tokens": len(ids),
                    "block_hashes": block_hashes(ids, self.block_size, cache_salt=salt),
                }
            )
            check_servable(self.fleet, request)
            answer = self.scheduler.place(request)
        # The placement's bookkeeping runs once this answer is on its way, not before.
        asyncio.get_running_loop().call_soon(self.scheduler.settle)
        if isinstance(answer, Placement):
            return PlaceAnswer(placement=answer, prompt_tokens=len(ids))
        return PlaceAnswer(refusal=answer, prompt_tokens=len(ids))

    @activity.defn(name=OBSERVE_ACTIVITY)
    async def observe(self, observation: Observation) -> ObservationVerdict:
        """Tell the scheduler how a call ended (a local activity); answer whose fault it was.

        A failure that an outage of the control plane's own explains (`FailureTriage`) is no
        retry: the answer tells the workflow so.
        """
        with permanent_errors_fail_at_once():
            if not observation.ok and self.triage is not None:
                observation = self.triage.triage(observation)
            self.scheduler.observe(observation)
        return ObservationVerdict(control_plane_fault=observation.control_plane_fault)

    @activity.defn(name=END_TASK_ACTIVITY)
    async def end_task(self, workflow_id: str) -> bool:
        """Tell the scheduler the task ended, whatever its outcome (a local activity).

        The workflow runs it as it closes. A local activity runs in the process that runs the
        workflow, whose scheduler placed the task's calls (`place` is local too), so that
        scheduler is the one that stops counting the task (`Scheduler.end_task`), however
        many workflow workers there are. True when it was counting it.
        """
        counted = self.scheduler.end_task(workflow_id)
        if self.on_task_end is not None:
            self.on_task_end(workflow_id)
        return counted

    @activity.defn(name=RECORD_TASK_ACTIVITY)
    async def record_task(self, record: TaskRecord) -> bool:
        """Write the task's ledger row (idempotent); False if it was already there.

        It also ends the task in this process's scheduler (`Scheduler.end_task`, first, so
        that a ledger that is down delays no new task): runs started before
        `END_TASK_PATCH` end their tasks only here. With several workflow workers this
        activity may run on another one than the task's, which is why the workflow ends the
        task with the local `end_task`. A run that continued as new ends nothing: its task
        goes on, open, in the next run.
        """
        if record.outcome.final:
            self.scheduler.end_task(record.workflow_id)
        if self.ledger is None:
            log.warning("no ledger configured; task %s not recorded", record.key)
            return False
        with permanent_errors_fail_at_once():
            return await self.ledger.record_task(record)

    @activity.defn(name=RECORD_LOST_ATTEMPT_ACTIVITY)
    async def record_lost_attempt(self, lost: LostAttempt) -> bool:
        """Write the ledger row of an attempt whose GPU worker died before writing it.

        Billed from its last heartbeat, at the prices of the replica's pool. If the worker did
        write the row after all, the idempotent write changes nothing.
        """
        if self.ledger is None:
            return False
        pool = self.fleet.pool(lost.replica.split("/")[0])
        record = AttemptRecord(
            workflow_id=lost.workflow_id,
            run_id=lost.run_id,
            activity_id=lost.activity_id,
            attempt=lost.attempt,
            step=lost.step,
            tenant=lost.tenant,
            workflow_type=lost.workflow_type,
            model=lost.model,
            pool=pool.name,
            replica=lost.replica,
            gpu=pool.gpu.value,
            started_at=lost.started_at,
            ended_at=max(lost.ended_at, lost.started_at),
            outcome=AttemptOutcome.FAILED,
            prompt_tokens=lost.prompt_tokens,
            cached_tokens=min(lost.cached_tokens, lost.prompt_tokens),
            completion_tokens=lost.completion_tokens,
            prices=pool.token_prices,
            cost_micros=lost.cost_micros,
            error_type=lost.error_type,
            # An estimate: the GPU worker's exact row for this key, if it comes, replaces it.
            provisional=True,
        )
        with permanent_errors_fail_at_once():
            return await self.ledger.record_attempt(record)

    @activity.defn(name=ATTEMPT_BILL_ACTIVITY)
    async def attempt_bill(self, key: AttemptKey) -> AttemptBill | None:
        """What the GPU worker billed for one attempt, from its ledger row (a local activity).

        The workflow asks after a cancelled call: a cancellation carries no details, so the
        attempt's usage and cost are known only from the row the worker wrote as it stopped.
        None when there is no ledger or no row.
        """
        if self.ledger is None:
            return None
        with permanent_errors_fail_at_once():
            rows = await self.ledger.attempts_for(key.workflow_id, key.run_id)
        for row in rows:
            if row.activity_id == key.activity_id:
                usage = Usage(
                    prompt_tokens=row.prompt_tokens,
                    cached_tokens=row.cached_tokens,
                    completion_tokens=row.completion_tokens,
                )
                return AttemptBill(replica=row.replica, usage=usage, cost_micros=row.cost_micros)
        return None

    @activity.defn(name=MARK_RESUMED_ACTIVITY)
    async def mark_resumed(self, resumed: ResumedAttempts) -> int:
        """Mark cut attempts whose output a later attempt continued (idempotent)."""
        if self.ledger is None:
            return 0
        with permanent_errors_fail_at_once():
            return await self.ledger.mark_resumed(
                resumed.workflow_id, resumed.run_id, resumed.activity_ids
            )

    @activity.defn(name=CONTEXT_PUT_ACTIVITY)
    async def context_put(self, put: ContextPut) -> ContextRef:
        """Store content for the task's tenant; the text stays out of history."""
        with permanent_errors_fail_at_once():
            return await self.store.aput(put.text, put.tenant)

    @activity.defn(name=CONTEXT_GET_ACTIVITY)
    async def context_get(self, get: ContextGet) -> str:
        """Read the task's tenant's content back (the result is recorded: small contents)."""
        with permanent_errors_fail_at_once():
            return await self.store.aget(get.ref, get.tenant)

    def all(self) -> list[Callable[..., Any]]:
        """Every activity of the control plane, to register on the workflow worker."""
        return [
            self.place,
            self.observe,
            self.end_task,
            self.record_task,
            self.record_lost_attempt,
            self.attempt_bill,
            self.mark_resumed,
            self.context_put,
            self.context_get,
        ]

"""`ContinuedRunInterceptor`: a task's next run starts `running`; the run it leaves says why.

A task that continues as new (`workflow.continue_as_new` inside `async with agent:`) closes
one run and goes on in the next, under the same workflow id. Without a word from kvflow,
Temporal copies the closing run's search attributes to the next run, and so:

- if the closing run published its outcome (`KvflowOutcome = 'continued_as_new'`), the next
  run would start with it, and an operator's `KvflowOutcome = 'running'` filter would miss a
  live task until its first step publishes again;
- if it did not, the closed run would keep `running` for good, with the spend last published
  (up to `SEARCH_ATTRIBUTE_INTERVAL` old).

So the closing run publishes its outcome and exact spend (`Agent.__aexit__`), and this
interceptor, which `KvflowPlugin` installs on workflow workers, gives the next run its own
search attributes: the closing run's, with `KvflowOutcome = 'running'` and without the
closing run's spend, steps and re-placements (the next run publishes its own). A
`continue_as_new` given its own `search_attributes` keeps them. Runs recorded before this
(patch `kvflow-continued-run-outcome`) replay as they ran.

It also carries the task into the next run (`kvflow.workflows.carry.TaskCarry`: spend,
re-placements used, the task's start and chain of runs), as a header of the next run's start,
so that the task's caps hold across its runs.
"""

from __future__ import annotations

from typing import Any, NoReturn

from temporalio import workflow
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.worker import (
    ContinueAsNewInput,
    ExecuteWorkflowInput,
    Interceptor,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
    WorkflowOutboundInterceptor,
)

from kvflow.workflows import search_attributes as attrs
from kvflow.workflows.agent import CONTINUED_RUN_OUTCOME_PATCH, Agent
from kvflow.workflows.carry import TASK_CARRY_HEADER, TaskCarry, arrived

PER_RUN = frozenset(key.name for key in (attrs.SPEND_MICROS, attrs.STEPS, attrs.RETRIES))
"""kvflow's search attributes that count one run's work: the next run starts without them."""


def next_run_attributes(current: TypedSearchAttributes) -> TypedSearchAttributes:
    """The next run's search attributes: `current` with the outcome `running`.

    kvflow's per-run figures are dropped; every other attribute (the tenant, the user's own)
    is kept.
    """
    kept: list[SearchAttributePair[Any]] = [
        pair
        for pair in current.search_attributes
        if pair.key.name not in PER_RUN and pair.key.name != attrs.OUTCOME.name
    ]
    kept.append(SearchAttributePair(attrs.OUTCOME, "running"))
    return TypedSearchAttributes(kept)


class _Outbound(WorkflowOutboundInterceptor):
    def continue_as_new(self, input: ContinueAsNewInput) -> NoReturn:
        agent = Agent.current()
        if (
            input.search_attributes is None
            and agent is not None
            and workflow.patched(CONTINUED_RUN_OUTCOME_PATCH)
        ):
            input.search_attributes = next_run_attributes(workflow.info().typed_search_attributes)
        if agent is not None:
            # A header is no command attribute that replay compares: no patch needed here.
            input.headers = {**input.headers, TASK_CARRY_HEADER: agent.carry().to_payload()}
        super().continue_as_new(input)


class _Inbound(WorkflowInboundInterceptor):
    def init(self, outbound: WorkflowOutboundInterceptor) -> None:
        super().init(_Outbound(outbound))

    async def execute_workflow(self, input: ExecuteWorkflowInput) -> Any:
        header = input.headers.get(TASK_CARRY_HEADER)
        carry = None if header is None else TaskCarry.from_payload(header)
        if header is not None and carry is None:
            # The task still runs, with caps counted from this run's start.
            workflow.logger.warning("kvflow: the task's carry from its last run is unreadable")
        arrived(carry)
        return await super().execute_workflow(input)


class ContinuedRunInterceptor(Interceptor):
    """Gives a task's next run its own search attributes (module docstring)."""

    def workflow_interceptor_class(
        self, input: WorkflowInterceptorClassInput
    ) -> type[WorkflowInboundInterceptor] | None:
        """The interceptor every workflow on the worker runs with."""
        return _Inbound

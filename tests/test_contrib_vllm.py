"""The two agent-framework samples on a real vLLM server (CPU build, the tiny local model).

The model has random weights: it writes text, not tool calls, so the travel agent runs with
`tool_choice: "auto"` (vLLM's Hermes parser finds no call and returns the text). Greedy, it
writes whitespace between a JSON answer's tokens for as long as the grammar allows it, so the
server's grammar allows none (`JsonWithoutFreeWhitespace`); the support agent's reply is
bounded by its schema, and its structured answer then parses. What must hold: every model call
is kvflow's inference activity on the vLLM replica's queue, billed in the ledger with the
tokens vLLM counted, and the task row's spend is the sum of its attempts.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.plugin import SimplePlugin

import samples.openai_agents_travel as travel
import samples.pydantic_ai_support as support
from kvflow.activities.inference import INFER_ACTIVITY
from kvflow.ledger.records import AttemptRecord, TaskOutcome
from kvflow.scheduler.fleet import task_queue_for
from kvflow.workers.vllm_server import VllmInstall, VllmServer
from kvflow.workflows.agent import SPEND_QUERY, SpendBreakdown
from tests.fixtures_vllm import early_vllm, vllm_servers
from tests.fleets import one_pool_fleet
from tests.stacks import Stack, fleet_stack

pytestmark = pytest.mark.vllm

MODEL = "llama-3.2-1b"
"""The name both samples ask for; the server serves the tiny model under it."""
CONTEXT = 4096


class JsonWithoutFreeWhitespace(VllmServer):
    """vLLM whose JSON grammar leaves no whitespace to the model (xgrammar, named for it)."""

    def command(self) -> list[str]:
        """vLLM's command line, with the structured-output settings."""
        config = {"backend": "xgrammar", "disable_any_whitespace": True}
        return [*super().command(), "--structured-outputs-config", json.dumps(config)]


def _samples_server(install: VllmInstall, log_dir: Path) -> dict[str, VllmServer]:
    server = JsonWithoutFreeWhitespace(
        install, log_path=log_dir / "vllm.log", served_model_names=[MODEL], max_model_len=CONTEXT
    )
    return {"samples": server}


SAMPLES_SERVER = early_vllm(__name__, "vllm-samples", _samples_server)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real vLLM server serving the tiny model as `MODEL`, with the Hermes tool parser."""
    assert travel.workflow.MODEL == MODEL and support.workflow.MODEL == MODEL
    with vllm_servers(tmp_path_factory, SAMPLES_SERVER) as servers:
        yield servers["samples"].base_url


def vllm_stack(
    temporal_client: Client, tmp_path: Path, url: str, sample: Any, plugin: SimplePlugin
) -> AbstractAsyncContextManager[Stack]:
    """One replica on the real server, its GPU worker, and the sample's workflow worker, whose
    client carries `plugin` after kvflow's."""
    return fleet_stack(
        temporal_client,
        tmp_path,
        fleet=one_pool_fleet(MODEL, endpoints=[url], context_length=CONTEXT),
        workflows=[sample.WORKFLOW],
        activities=sample.ACTIVITIES,
        plugins=[plugin],
    )


async def run(stack: Stack, workflow: Any, task: Any) -> tuple[WorkflowHandle[Any, Any], Any]:
    """Run `task` to its end: (its handle, its result or the failure)."""
    handle = await stack.start(workflow.run, task)
    try:
        return handle, await handle.result()
    except WorkflowFailureError as failure:
        return handle, failure


async def assert_every_call_ran_on_vllm_and_was_billed(
    stack: Stack, handle: WorkflowHandle[Any, Any], outcome: TaskOutcome | None = None
) -> list[AttemptRecord]:
    history = await handle.fetch_history()
    infers = [
        e.activity_task_scheduled_event_attributes
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == INFER_ACTIVITY
    ]
    task, attempts = await stack.rows(handle)
    assert infers and len(attempts) == len(infers)
    assert {a.task_queue.name for a in infers} == {task_queue_for("cpu", 0)}
    assert all(a.replica == "cpu/0" and a.prompt_tokens > 0 for a in attempts)
    assert task is not None and task.spend_micros == sum(a.cost_micros for a in attempts)
    if outcome is not None:
        assert task.outcome == outcome
    breakdown = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
    assert breakdown.spend_micros == task.spend_micros
    return attempts


@pytest.mark.timeout(240)
async def test_openai_agents_travel_sample_runs_on_real_vllm(
    temporal_client: Client, served: str, tmp_path: Path
) -> None:
    from kvflow.contrib.openai_agents import KvflowAgentsPlugin

    async with vllm_stack(temporal_client, tmp_path, served, travel, KvflowAgentsPlugin()) as s:
        task = travel.example_input(random.Random(0), "acme").model_copy(
            update={"name_tools": False}
        )
        handle, plan = await run(s, travel.WORKFLOW, task)
        assert isinstance(plan, travel.TravelPlan), plan
        # No tool call in random text: one answer per turn, each vLLM's own words.
        assert plan.tools_called == [] and plan.model_calls == 2
        assert plan.weather and plan.answer
        attempts = await assert_every_call_ran_on_vllm_and_was_billed(
            s, handle, TaskOutcome.SUCCEEDED
        )
        assert [a.step for a in attempts] == ["travel-agent", "travel-agent"]
        # What the SDK counted is what vLLM reported and the ledger billed.
        assert plan.input_tokens == sum(a.prompt_tokens for a in attempts)
        assert plan.output_tokens == sum(a.completion_tokens for a in attempts)
        # The second turn repeats the first: vLLM's prefix cache served part of it.
        assert attempts[1].cached_tokens > 0


@pytest.mark.timeout(240)
async def test_pydantic_ai_support_sample_runs_on_real_vllm(
    temporal_client: Client, served: str, tmp_path: Path
) -> None:
    from kvflow.contrib.pydantic_ai import KvflowPydanticAIPlugin

    async with vllm_stack(
        temporal_client, tmp_path, served, support, KvflowPydanticAIPlugin()
    ) as s:
        task = support.example_input(random.Random(0), "acme")
        handle, answer = await run(s, support.WORKFLOW, task)
        assert isinstance(answer, support.SupportAnswer), answer
        assert answer.reply.reply and answer.model_requests >= 1
        attempts = await assert_every_call_ran_on_vllm_and_was_billed(
            s, handle, TaskOutcome.SUCCEEDED
        )
        assert all(a.step == "support" for a in attempts)

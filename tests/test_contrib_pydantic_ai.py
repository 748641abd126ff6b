"""Pydantic AI agents on kvflow: `kvflow.contrib.pydantic_ai` end to end.

A real Temporal dev server, simulated vLLM replicas with a GPU worker each, a workflow worker
whose client carries `KvflowPlugin` then `KvflowPydanticAIPlugin`, and a SQLite ledger. The
sample's agent runs as Pydantic AI wrote it but for its model and durability capability; each
test checks what its user and finance would see.
"""

from __future__ import annotations

import random
import subprocess
import sys
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai import UserError
from pydantic_ai.durable_exec.temporal import PydanticAIPayloadConverter
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.worker import Replayer, Worker

import samples.pydantic_ai_support as sample
from kvflow.activities.claim_check import ClaimCheckCodec, claim_check_of, is_claim_check
from kvflow.activities.inference import INFER_ACTIVITY
from kvflow.activities.wire import Sampling
from kvflow.contrib.pydantic_ai import KvflowPydanticAIPlugin, sampling_of
from kvflow.ledger.records import TaskOutcome
from kvflow.scheduler.fleet import task_queue_for
from kvflow.workers.plugin import KvflowPlugin
from kvflow.workflows import errors
from kvflow.workflows.agent import SPEND_QUERY, SpendBreakdown
from tests import pydantic_ai_workflows as wf
from tests.history import payloads_in
from tests.stacks import MODEL, PoolPlan, Stack, cheap_pool_that_crashes, fleet_stack, task_spec

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS: list[type] = [sample.WORKFLOW, *wf.ALL_WORKFLOWS]


def _plugins(context_dir: Path) -> list[Any]:
    """The client's plugins, in the order `KvflowPydanticAIPlugin` asks for."""
    return [KvflowPlugin(context_dir=context_dir), KvflowPydanticAIPlugin()]


def pai_stack(
    temporal_client: Client, tmp_path: Path, pools: list[PoolPlan]
) -> AbstractAsyncContextManager[Stack]:
    """`fleet_stack` for this module's workflows, the tasks' and the workflow worker's client
    carrying `_plugins`; every worker decodes the payloads the codec claim-checked."""
    return fleet_stack(
        temporal_client,
        tmp_path,
        pools,
        workflows=WORKFLOWS,
        activities=(),
        plugins=[KvflowPydanticAIPlugin()],
    )


def _scheduled(history: Any) -> list[Any]:
    """The attributes of every activity the workflow scheduled, in order."""
    return [
        e.activity_task_scheduled_event_attributes
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    ]


@pytest.mark.timeout(60)
async def test_sample_agent_answers_with_each_model_call_placed_and_billed_by_kvflow(
    temporal_client: Client, tmp_path: Path
) -> None:
    async with pai_stack(temporal_client, tmp_path, [PoolPlan("gpu", replicas=2)]) as s:
        assert sample.workflow.MODEL == MODEL  # the model the test fleet serves
        task = sample.example_input(random.Random(0), "acme")
        # Over 2 KB: the workflow's input travels as a claim check, the codec's own payload.
        history_text = "\n".join(f"{day} March: order A-10{day:02d} placed." for day in range(80))
        task = task.model_copy(update={"question": f"{task.question}\n\n{history_text}"})
        handle = await s.start(sample.WORKFLOW.run, task)
        answer = await handle.result()
        assert isinstance(answer.reply, sample.SupportReply) and answer.reply.reply
        assert (answer.model_requests, answer.tool_calls) == (2, 1)

        # Every model call was kvflow's inference activity on a GPU worker's queue; the tool
        # ran as the activity the durability capability makes of it, on the workflow's queue.
        history = await handle.fetch_history()
        scheduled = _scheduled(history)
        infers = [a for a in scheduled if a.activity_type.name == INFER_ACTIVITY]
        tools = [a for a in scheduled if "call_tool" in a.activity_type.name]
        assert len(infers) == 2 and len(tools) == 1
        assert not [a for a in scheduled if "model_request" in a.activity_type.name]
        assert tools[0].activity_type.name.startswith("agent__support__")
        assert tools[0].task_queue.name == s.task_queue
        _, attempts = await s.rows(handle)
        assert [a.step for a in attempts] == ["support", "support"]
        assert all(a.outcome == "ok" and a.cost_micros > 0 for a in attempts)
        for call, attempt in zip(infers, attempts, strict=True):
            pool, index = attempt.replica.split("/")
            assert call.task_queue.name == task_queue_for(pool, int(index))
        # The answer's call carries the tool's result: it costs more prompt, mostly cached.
        assert attempts[1].prompt_tokens > attempts[0].prompt_tokens
        assert attempts[1].cached_tokens > 0

        # Finance: the task row, the attempt rows and the spend query agree.
        breakdown = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
        row, _ = await s.rows(handle)
        assert row is not None and row.outcome == TaskOutcome.SUCCEEDED and row.attempts == 2
        assert row.spend_micros == breakdown.spend_micros == sum(a.cost_micros for a in attempts)
        assert [st.name for st in breakdown.steps] == ["support", "support"]

        # Both kinds of payload round-tripped: kvflow's claim check and Pydantic AI's own.
        converter = s.client.data_converter
        assert issubclass(converter.payload_converter_class, PydanticAIPayloadConverter)
        assert isinstance(converter.payload_codec, ClaimCheckCodec)
        assert any(is_claim_check(p) for e in history.events for p in payloads_in(e))

        # The history replays with the same plugins (the replayer reads the claim checks too).
        replayer = Replayer(workflows=[sample.WORKFLOW], plugins=_plugins(tmp_path / "context"))
        await replayer.replay_workflow(history)


@pytest.mark.timeout(30)
async def test_worker_that_would_bypass_kvflow_refuses_to_start_with_the_fix(
    temporal_client: Client, tmp_path: Path
) -> None:
    async def connect(plugins: list[Any]) -> Client:
        return await Client.connect(
            temporal_client.service_client.config.target_host,
            namespace=temporal_client.namespace,
            plugins=plugins,
        )

    # In either order the client gets Pydantic AI's payload converter and kvflow's claim
    # check: KvflowPlugin keeps a converter it was given.
    client = await connect(list(reversed(_plugins(tmp_path / "context"))))
    assert issubclass(client.data_converter.payload_converter_class, PydanticAIPayloadConverter)
    assert claim_check_of(client.data_converter) is not None
    # Pydantic AI's plugin on the Worker alone cannot change the client's converter: named.
    client = await connect([KvflowPlugin(context_dir=tmp_path / "context")])
    with pytest.raises(ValueError, match=r"KvflowPlugin\(...\), KvflowPydanticAIPlugin\(\)"):
        Worker(
            client, task_queue="unused", workflows=[sample.WORKFLOW],
            plugins=[KvflowPydanticAIPlugin()],
        )  # fmt: skip
    # A fleet model under TemporalDurability would be asked from an activity.
    client = await connect(_plugins(tmp_path / "context"))
    with pytest.raises(UserError, match=r"capabilities=\[KvflowDurability\(\)\]"):
        Worker(client, task_queue="unused", workflows=[wf.Bypassing])
    # Without KvflowPlugin(fleet) every task would wait forever on kvflow's activities.
    for client_plugins in ([KvflowPydanticAIPlugin()], _plugins(tmp_path / "context")):
        client = await connect(client_plugins)
        with pytest.raises(ValueError, match=r"^KvflowPydanticAIPlugin\(\) needs KvflowPlugin"):
            Worker(client, task_queue="unused", workflows=[sample.WORKFLOW])


@pytest.mark.timeout(60)
async def test_registered_model_of_another_provider_keeps_its_activity(
    temporal_client: Client, tmp_path: Path
) -> None:
    async with pai_stack(temporal_client, tmp_path, [PoolPlan("gpu")]) as s:
        task = wf.Question(spec=task_spec(expected_steps=1), question="Say hello.")
        handle = await s.start(wf.MixedModels.run, task)
        on_fleet, offline = await handle.result()
        assert on_fleet and offline == "offline"
        names = [a.activity_type.name for a in _scheduled(await handle.fetch_history())]
        assert names.count(INFER_ACTIVITY) == 1
        assert [n for n in names if "model_request" in n] == ["agent__mixed__model_request"]
        _, [attempt] = await s.rows(handle)
        assert attempt.step == "mixed"


@pytest.mark.timeout(60)
async def test_text_answer_cut_by_a_crash_resumes_on_the_backup_and_both_attempts_are_billed(
    temporal_client: Client, tmp_path: Path
) -> None:
    async with pai_stack(temporal_client, tmp_path, cheap_pool_that_crashes()) as s:
        # A question whose answer runs to the agent's 60 output tokens.
        task = wf.Question(spec=task_spec(expected_steps=1), question="Why do agents retry?")
        handle = await s.start(wf.BriefAnswer.run, task)
        answer = await handle.result()
        _, (cut, whole) = await s.rows(handle)
        assert (cut.replica, whole.replica) == ("cheap/0", "backup/0")
        assert cut.outcome != "ok" and cut.completion_tokens > 0 and cut.cost_micros > 0
        # The backup continued from what the crashed replica had streamed, and the agent got
        # the whole answer.
        assert whole.outcome == "ok" and whole.reused_tokens > 0
        assert whole.reused_tokens + whole.completion_tokens == 60
        assert len(answer.split()) > 30
        breakdown = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
        assert breakdown.retries == 1
        assert breakdown.spend_micros == cut.cost_micros + whole.cost_micros


@pytest.mark.timeout(60)
async def test_same_conversation_costs_the_same_through_pydantic_ai_as_through_agent_infer(
    temporal_client: Client, tmp_path: Path
) -> None:
    task = sample.example_input(random.Random(1), "acme")
    bills = []
    # A fresh fleet each, so that neither run finds the other's prefix cached.
    for run, name in ((sample.WORKFLOW.run, "pydantic-ai"), (wf.DirectSupport.run, "direct")):
        async with pai_stack(temporal_client, tmp_path / name, [PoolPlan("gpu")]) as s:
            handle = await s.start(run, task)
            out = await handle.result()
            reply = out.reply if isinstance(out, sample.SupportAnswer) else out
            _, attempts = await s.rows(handle)
            bills.append(
                (
                    reply,
                    [
                        (a.step, a.prompt_tokens, a.cached_tokens, a.completion_tokens)
                        for a in attempts
                    ],
                    [a.cost_micros for a in attempts],
                )
            )
    through_pydantic_ai, direct = bills
    assert len(direct[1]) == 2  # the tool call, then the answer
    assert through_pydantic_ai == direct


@pytest.mark.timeout(60)
async def test_agent_outside_the_task_bracket_or_streamed_fails_with_the_fix(
    temporal_client: Client, tmp_path: Path
) -> None:
    question = sample.example_input(random.Random(2), "acme")
    async with pai_stack(temporal_client, tmp_path, [PoolPlan("gpu")]) as s:
        handle = await s.start(wf.Unbracketed.run, question)
        with pytest.raises(WorkflowFailureError) as failed:
            await handle.result()
        cause = failed.value.cause
        assert isinstance(cause, ApplicationError) and cause.non_retryable
        assert cause.type == errors.TaskErrorType.INVALID_TASK
        assert "'support'" in cause.message and "async with kvflow.Agent(spec)" in cause.message
        assert await s.rows(handle) == (None, [])

        handle = await s.start(wf.StreamedSupport.run, question)
        with pytest.raises(WorkflowFailureError) as failed:
            await handle.result()
        assert "does not stream" in str(failed.value.cause)
        assert "agent.run()" in str(failed.value.cause)
        row, _ = await s.rows(handle)
        assert row is not None and row.outcome == TaskOutcome.FAILED and row.attempts == 0

    # Outside any workflow there is no task to bill the call to.
    with pytest.raises(UserError, match="only inside a Temporal workflow"):
        await sample.workflow.support.run("Where is my order A-1001?")


@pytest.mark.timeout(60)
async def test_tool_asking_to_retry_sends_its_prompt_back_to_the_model(
    temporal_client: Client, tmp_path: Path
) -> None:
    async with pai_stack(temporal_client, tmp_path, [PoolPlan("gpu")]) as s:
        task = wf.Question(spec=task_spec(expected_steps=2), question="Find invoice 7 for me.")
        handle = await s.start(wf.PickyLookup.run, task)
        *kinds, output = await handle.result()
        # The model called the tool, the tool raised ModelRetry, the model answered in text.
        assert kinds == ["request", "response", "request", "response"] and output
        tools = [
            a
            for a in _scheduled(await handle.fetch_history())
            if "call_tool" in a.activity_type.name
        ]
        assert len(tools) == 1
        _, (first, second) = await s.rows(handle)
        assert second.prompt_tokens > first.prompt_tokens  # the retry prompt is in it


def test_importing_kvflow_imports_no_framework_and_a_missing_extra_names_the_install() -> None:
    script = (
        "import sys\n"
        "import kvflow\n"
        "from kvflow import Agent, KvflowPlugin, TaskSpec\n"
        "assert 'pydantic_ai' not in sys.modules, 'import kvflow imported pydantic_ai'\n"
        "sys.modules['pydantic_ai'] = None  # as if the extra were not installed\n"
        "try:\n"
        "    import kvflow.contrib.pydantic_ai\n"
        "except ImportError as missing:\n"
        "    print(missing)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "pip install 'kvflow[pydantic-ai]'" in done.stdout


def test_sampling_the_run_leaves_unset_is_not_sent() -> None:
    # As Pydantic AI's own models: no value, so the engine's default applies, not greedy 0.
    assert sampling_of({}) == Sampling(temperature=None, top_p=None)
    given = sampling_of({"temperature": 0.0, "top_p": 0.5, "seed": 3, "stop_sequences": ["\n"]})
    assert given == Sampling(temperature=0.0, top_p=0.5, seed=3, stop=["\n"])

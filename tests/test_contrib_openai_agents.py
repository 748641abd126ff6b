"""OpenAI Agents SDK agents on kvflow: `kvflow.contrib.openai_agents` end to end.

A real Temporal dev server, simulated vLLM replicas with a GPU worker each, and a workflow
worker whose client carries `KvflowPlugin` and `KvflowAgentsPlugin`, as a user's would. The
GPU workers' client carries only `KvflowPlugin`, as `kvflow worker gpu`'s does: each reads the
other's payloads. The agents are written as for Temporal's own OpenAI Agents plugin.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import agents
import httpx
import pytest
from agents import (
    AgentOutputSchema,
    ModelBehaviorError,
    ModelResponse,
    ModelSettings,
    ModelTracing,
    UserError,
)
from agents.mcp import MCPServerStdio
from agents.usage import Usage
from openai.types.responses import ResponseOutputMessage
from pydantic import BaseModel
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DataConverter
from temporalio.exceptions import ApplicationError
from temporalio.openai_agents import AgentsWorkflowError, OpenAIAgentsPlugin, OpenAIPayloadConverter
from temporalio.worker import Replayer, Worker

import samples.openai_agents_travel as travel
from kvflow.activities.claim_check import ClaimCheckCodec, is_claim_check
from kvflow.activities.wire import ChatMessage, Sampling, ToolCall, ToolSpec
from kvflow.contrib.openai_agents import (
    KvflowAgentsPayloadConverter,
    KvflowAgentsPlugin,
    KvflowModel,
    KvflowRunner,
    answer_items,
    chat_messages,
    json_schema,
    output_items,
    sampling_of,
    tool_choice,
    tool_specs,
)
from kvflow.ledger.records import TaskOutcome
from kvflow.simulator.faults import FaultSpec
from kvflow.workers.plugin import KvflowPlugin, role_worker
from kvflow.workflows import search_attributes
from kvflow.workflows.agent import SPEND_QUERY, AttemptSpend, SpendBreakdown, StepSpend
from kvflow.workflows.errors import TaskErrorType
from tests import agents_sdk_workflows as wf
from tests.stacks import MODEL, PoolPlan, Stack, cheap_pool_that_crashes, fleet_stack, task_spec

ROOT = Path(__file__).resolve().parent.parent


def plugins(context_dir: Path) -> list[Any]:
    """What a user puts in the workflow worker's client: kvflow's, then the agents plugin."""
    return [KvflowPlugin(context_dir=context_dir), KvflowAgentsPlugin()]


def agents_stack(
    temporal_client: Client,
    tmp_path: Path,
    pools: list[PoolPlan],
    faults: dict[str, FaultSpec] | None = None,
) -> AbstractAsyncContextManager[Stack]:
    """`fleet_stack` for this module's workflows: the tasks' and the workflow worker's client
    carries the agents plugin, the GPU workers' client kvflow's alone."""
    return fleet_stack(
        temporal_client,
        tmp_path,
        pools,
        workflows=wf.WORKFLOWS,
        activities=wf.ACTIVITIES,
        plugins=[KvflowAgentsPlugin()],
        faults=faults,
    )


def task_rows(stack: Stack, handle: WorkflowHandle[Any, Any]) -> list[str]:
    """The outcome of every task row the ledger holds for the workflow, any run."""
    with sqlite3.connect(stack.ledger_url.removeprefix("sqlite:///")) as db:
        rows = db.execute("SELECT outcome FROM tasks WHERE workflow_id = ?", (handle.id,))
        return [outcome for (outcome,) in rows]


@pytest.fixture(scope="module")
async def stack(
    temporal_client: Client, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    tmp_path = tmp_path_factory.mktemp("openai-agents")
    async with agents_stack(temporal_client, tmp_path, [PoolPlan("gpu", replicas=2)]) as s:
        yield s


async def assert_replays(stack: Stack, handle: WorkflowHandle[Any, Any]) -> None:
    """The run's history replays on a `Replayer` with the same plugins (no fleet, no GPU)."""
    history = await handle.fetch_history()
    replayer = Replayer(workflows=wf.WORKFLOWS, plugins=plugins(stack.context_dir))
    await replayer.replay_workflow(history)


def scheduled(history: Any) -> list[Any]:
    return [
        e.activity_task_scheduled_event_attributes
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    ]


@pytest.mark.timeout(60)
async def test_travel_sample_answers_and_every_model_call_is_a_billed_kvflow_step(stack: Stack):
    task = travel.example_input(random.Random(3), "acme")
    handle = await stack.start(travel.WORKFLOW.run, task)
    plan = await handle.result()

    # Two turns, each a tool call and an answer: the function tool ran in the workflow, the
    # activity tool as an activity.
    assert plan.weather and plan.answer
    assert plan.tools_called == ["get_weather", "find_flights"]
    assert plan.model_calls == 4

    # Every model call went through kvflow.infer to a GPU worker's queue; no model activity of
    # the Temporal plugin ran. find_flights ran on the workflow worker's queue.
    events = scheduled(await handle.fetch_history())
    infers = [e for e in events if e.activity_type.name == "kvflow.infer"]
    assert len(infers) == 4
    assert all(e.task_queue.name.startswith("kvflow.gpu.gpu.") for e in infers)
    tools = [e for e in events if e.activity_type.name == "find_flights"]
    assert len(tools) == 1 and tools[0].task_queue.name == stack.task_queue
    # The activity tool is held to the task's deadline, not only to its own timeout.
    assert task.spec.latency_budget_s is not None
    assert tools[0].schedule_to_close_timeout.ToTimedelta() <= timedelta(
        seconds=task.spec.latency_budget_s
    )
    assert not [e for e in events if "invoke_model" in e.activity_type.name]

    # The ledger: one row per model attempt, each named after the agent, and the task row;
    # the task's spend is their sum and what the spend query says.
    spend = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
    row, attempts = await stack.rows(handle)
    assert len(attempts) == 4 and all(a.cost_micros > 0 for a in attempts)
    assert {a.step for a in attempts} == {"travel-agent"}
    assert row is not None and row.outcome == TaskOutcome.SUCCEEDED
    assert row.spend_micros == sum(a.cost_micros for a in attempts) == spend.spend_micros
    assert row.attempts == 4 and [s.name for s in spend.steps] == ["travel-agent"] * 4
    # The SDK's usage is the ledger's tokens; the second turn repeats the first, so its
    # prompt was mostly cached where the scheduler kept the conversation.
    assert plan.input_tokens == sum(a.prompt_tokens for a in attempts)
    assert plan.output_tokens == sum(a.completion_tokens for a in attempts)
    assert attempts[2].cached_tokens > 0 and attempts[2].replica == attempts[1].replica
    await assert_replays(stack, handle)


@pytest.mark.timeout(60)
async def test_runner_outside_a_kvflow_agent_block_fails_with_the_fix(stack: Stack):
    handle = await stack.start(
        wf.Writer.run, wf.OneAgentInput(spec=task_spec(), kvflow_block=False)
    )
    with pytest.raises(WorkflowFailureError) as failed:
        await handle.result()
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "AgentsWorkflowError"
    assert "writer" in cause.message and "async with kvflow.Agent(spec):" in cause.message
    row, attempts = await stack.rows(handle)
    assert row is None and attempts == []


@pytest.mark.timeout(60)
async def test_failing_tools_follow_the_sdk(stack: Stack):
    # A function tool's error goes back to the model, which answers.
    handle = await stack.start(
        wf.FailingTool.run, wf.ToolFailureInput(spec=task_spec(), activity_tool=False)
    )
    out = await handle.result()
    assert out.requests == 2 and "visa service does not know" in out.tool_outputs[0]
    # An activity tool that fails for good fails the workflow, and kvflow records the task
    # as failed with the model call it paid for.
    handle = await stack.start(
        wf.FailingTool.run, wf.ToolFailureInput(spec=task_spec(), activity_tool=True)
    )
    with pytest.raises(WorkflowFailureError) as failed:
        await handle.result()
    causes = [failed.value.cause]
    while causes[-1].__cause__ is not None:
        causes.append(causes[-1].__cause__)
    assert isinstance(causes[0], ApplicationError) and causes[0].non_retryable
    assert causes[0].type == "UserError" and "Error running tool book_hotel" in causes[0].message
    assert any("no rooms left in" in str(c) for c in causes)
    row, attempts = await stack.rows(handle)
    assert row is not None and row.outcome == TaskOutcome.FAILED
    assert len(attempts) == 1 and row.spend_micros == attempts[0].cost_micros


@pytest.mark.timeout(60)
async def test_a_handoff_runs_the_next_agent_on_kvflow_under_its_own_name(stack: Stack):
    handle = await stack.start(wf.Triage.run, wf.OneAgentInput(spec=task_spec()))
    out = await handle.result()
    assert out.final_output.startswith("flight-agent: ") and out.requests == 2
    _, attempts = await stack.rows(handle)
    assert [a.step for a in attempts] == ["triage-agent", "flight-agent"]
    await assert_replays(stack, handle)


@pytest.mark.timeout(60)
async def test_replica_cut_mid_answer_resumes_elsewhere_and_both_attempts_are_billed(
    temporal_client: Client, tmp_path: Path
):
    async with agents_stack(temporal_client, tmp_path, cheap_pool_that_crashes()) as s:
        handle = await s.start(wf.Writer.run, wf.OneAgentInput(spec=task_spec(expected_steps=1)))
        out = await handle.result()
        spend = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
        [step] = spend.steps
        first, second = step.attempts
        assert step.name == "writer"
        assert first.replica == "cheap/0" and first.outcome in {"StreamCut", "TimeoutHeartbeat"}
        assert second.replica == "backup/0" and second.outcome == "ok"
        assert second.reused_tokens > 0 and out.final_output
        row, attempts = await s.rows(handle)
        assert {a.replica for a in attempts} == {"cheap/0", "backup/0"}
        assert all(a.cost_micros > 0 for a in attempts)
        assert row is not None and row.spend_micros == spend.spend_micros
        assert spend.spend_micros == sum(a.cost_micros for a in attempts)
        # The SDK counts both requests and all their tokens, as the ledger does.
        assert out.requests == 2
        assert out.input_tokens == sum(a.prompt_tokens for a in attempts)
        assert out.output_tokens == sum(a.completion_tokens for a in attempts)
        await assert_replays(s, handle)


@pytest.mark.timeout(60)
async def test_the_sdk_costs_what_the_same_calls_through_agent_infer_cost(
    temporal_client: Client, tmp_path: Path
):
    async def bills(name: str, run: Any) -> list[tuple[Any, ...]]:
        # A fresh fleet for each, so that neither finds the other's prefix cached.
        async with agents_stack(temporal_client, tmp_path / name, [PoolPlan(name)]) as s:
            handle = await s.start(run, wf.OneAgentInput(spec=task_spec()))
            await handle.result()
            _, attempts = await s.rows(handle)
        return [
            (a.prompt_tokens, a.cached_tokens, a.completion_tokens, a.cost_micros) for a in attempts
        ]

    through_sdk = await bills("sdk", wf.SdkWeather.run)
    direct = await bills("direct", wf.DirectWeather.run)
    assert len(through_sdk) == 2  # the tool call, then the answer
    assert through_sdk == direct


@pytest.mark.timeout(60)
def test_import_kvflow_does_not_import_the_agents_sdk_and_a_missing_extra_names_it():
    lazy = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, kvflow, kvflow.contrib; kvflow.Agent; kvflow.KvflowPlugin; "
            "print(sorted(m for m in ('agents', 'openai') if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert lazy.returncode == 0 and lazy.stdout.strip() == "[]", lazy.stderr
    missing = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.modules['agents'] = None; import kvflow.contrib.openai_agents",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert missing.returncode != 0
    assert "pip install 'kvflow[openai-agents]'" in missing.stderr


@pytest.mark.timeout(120)
async def test_starter_runs_its_worker_and_plans_one_trip_on_a_running_fleet(
    stack: Stack, temporal_client: Client, tmp_path: Path
):
    # The module's fleet as a fleet file; its GPU workers and simulators are the ones running.
    fleet_file = tmp_path / "fleet.toml"
    fleet_file.write_text(FLEET_FILE.format(model=MODEL))
    endpoints = [f"--endpoint={name}={sim.base_url}" for name, sim in stack.embedded.sims.items()]
    starter = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "samples.openai_agents_travel.starter",
        "--address",
        temporal_client.service_client.config.target_host,
        "--task-queue",
        f"travel-{uuid.uuid4()}",
        "--context-dir",
        str(stack.context_dir),
        "--fleet",
        str(fleet_file),
        *endpoints,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "COLUMNS": "200", "KVFLOW_LEDGER_URL": f"sqlite:///{tmp_path}/l.db"},
    )
    output, _ = await asyncio.wait_for(starter.communicate(), timeout=90)
    text = output.decode()
    assert starter.returncode == 0, text
    assert "tools called: get_weather, find_flights" in text
    assert "4. travel-agent: gpu/" in text and "4 model calls, $0." in text


FLEET_FILE = """
[[models]]
name = "{model}"
parameters_b = 1.2
layers = 16
kv_heads = 8
head_dim = 64
context_length = 32768

[[pools]]
name = "gpu"
gpu = "H100"
replicas = 2
endpoints = "simulated"
price_per_gpu_hour_usd = "2.00"
warm_models = ["{model}"]
max_concurrency = 16
[pools.token_prices]
input_per_mtok_usd = "0.20"
cached_input_per_mtok_usd = "0.02"
output_per_mtok_usd = "0.60"

[[tenants]]
name = "acme"
tier = 1
"""


# ---- errors that end a run, refusals and settings ---------------------------------------------


async def failure_of(handle: WorkflowHandle[Any, Any]) -> ApplicationError:
    """The workflow's failure, which comes at once: not a workflow task retried forever."""
    with pytest.raises(WorkflowFailureError) as failed:
        await asyncio.wait_for(handle.result(), timeout=10)
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError), repr(cause)
    assert cause.non_retryable
    return cause


async def assert_recorded_as_failed(stack: Stack, handle: WorkflowHandle[Any, Any]) -> None:
    """One task row, failed, and the workflow's KvflowOutcome says so to the Temporal UI."""
    assert task_rows(stack, handle) == [TaskOutcome.FAILED]
    description = await handle.describe()
    assert description.typed_search_attributes.get(search_attributes.OUTCOME) == "failed"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("error", "error_type", "message"),
    [
        ("max_turns", "MaxTurnsExceeded", "Max turns (1) exceeded"),
        ("input_guardrail", "InputGuardrailTripwireTriggered", "triggered tripwire"),
        ("output_guardrail", "OutputGuardrailTripwireTriggered", "triggered tripwire"),
        ("cut_output", "ModelBehaviorError", "Invalid JSON"),
    ],
)
async def test_sdk_error_that_ends_the_run_fails_the_task_at_once_under_its_type(
    stack: Stack, error: wf.SdkError, error_type: str, message: str
):
    handle = await stack.start(
        wf.EndsInSdkError.run, wf.SdkErrorInput(spec=task_spec(), error=error)
    )
    failure = await failure_of(handle)
    assert failure.type == error_type and message in failure.message
    await assert_recorded_as_failed(stack, handle)


@pytest.mark.timeout(60)
async def test_model_settings_timeout_stops_a_stalled_call_and_fails_the_task(
    temporal_client: Client, tmp_path: Path
):
    # The only replica never answers: the agent's 1 s timeout is what ends the call.
    faults = {"stalled/0": FaultSpec(stall_after=0)}
    async with agents_stack(temporal_client, tmp_path, [PoolPlan("stalled")], faults) as s:
        handle = await s.start(
            wf.EndsInSdkError.run, wf.SdkErrorInput(spec=task_spec(), error="timeout")
        )
        failure = await failure_of(handle)
        assert (
            failure.type == "ModelTimeoutError" and "timed out after 1 seconds" in failure.message
        )
        await assert_recorded_as_failed(s, handle)
        # kvflow cancelled the call on its GPU worker, and billed the attempt.
        spend = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
        [step] = spend.steps
        assert step.outcome == "cancelled" and [a.outcome for a in step.attempts] == ["cancelled"]
        _, attempts = await s.rows(handle)
        assert [a.replica for a in attempts] == ["stalled/0"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("refusal", "error_type", "message"),
    [
        ("previous_response_id", TaskErrorType.INVALID_TASK, "pass the conversation as input"),
        ("conversation_id", TaskErrorType.INVALID_TASK, "pass the conversation as input"),
        ("prompt", TaskErrorType.INVALID_TASK, "stored prompts are an OpenAI platform feature"),
        ("no_model", TaskErrorType.INVALID_TASK, "it names no model"),
        ("streamed", "AgentsWorkflowError", "Runner.run_streamed is not offered by kvflow"),
    ],
)
async def test_run_asking_for_what_kvflow_does_not_offer_fails_with_the_fix_before_any_call(
    stack: Stack, refusal: wf.Refusal, error_type: str, message: str
):
    handle = await stack.start(
        wf.RefusedRun.run, wf.RefusalInput(spec=task_spec(), refusal=refusal)
    )
    failure = await failure_of(handle)
    assert failure.type == error_type and message in failure.message
    await assert_recorded_as_failed(stack, handle)
    _, attempts = await stack.rows(handle)
    assert attempts == []


@pytest.mark.timeout(60)
async def test_settings_kvflow_does_not_send_are_named_in_one_warning(
    stack: Stack, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.WARNING, logger="temporalio.workflow")
    settings = {
        "frequency_penalty": 0.5,
        "parallel_tool_calls": False,
        "extra_args": {"logit_bias": {"11": 5}, "seed": 3},
        "timeout": 30.0,  # the SDK's own, honoured
        "temperature": 0.2,
    }
    handle = await stack.start(
        wf.ConfiguredWriter.run, wf.SettingsInput(spec=task_spec(), settings=settings)
    )
    assert (await handle.result()).final_output
    warned = [r.getMessage() for r in caplog.records if "does not send" in r.getMessage()]
    assert len(warned) == 1
    assert (
        "agent 'writer': kvflow does not send the model settings frequency_penalty, "
        "parallel_tool_calls, logit_bias; the replica uses its defaults"
    ) in warned[0]


@contextmanager
def engine_requests(stack: Stack) -> Iterator[list[dict[str, Any]]]:
    """The chat requests the fleet's GPU workers send to their vLLM servers meanwhile."""
    sent: list[dict[str, Any]] = []

    async def record(request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            sent.append(json.loads(request.content))

    clients = [worker.http for worker in stack.gpu_workers.values()]
    for client in clients:
        hooks = client.event_hooks
        client.event_hooks = {**hooks, "request": [*hooks["request"], record]}
    try:
        yield sent
    finally:
        for client in clients:
            hooks = client.event_hooks
            client.event_hooks = {**hooks, "request": [h for h in hooks["request"] if h != record]}


@pytest.mark.timeout(60)
async def test_sampling_the_agent_leaves_unset_reaches_the_engine_unset(stack: Stack):
    with engine_requests(stack) as sent:
        for settings in ({}, {"temperature": 0.7, "top_p": 0.9}):
            handle = await stack.start(
                wf.ConfiguredWriter.run, wf.SettingsInput(spec=task_spec(), settings=settings)
            )
            await handle.result()
    unset, given = sent
    # As the SDK's own models: no value, so vLLM uses the model's default, not greedy 0.
    assert unset.get("temperature") is None and unset.get("top_p") is None
    assert (given["temperature"], given["top_p"]) == (0.7, 0.9)


@pytest.mark.timeout(30)
async def test_worker_without_kvflow_plugin_refuses_to_start_and_names_it(
    temporal_client: Client, tmp_path: Path
):
    # Its tasks would wait forever on kvflow's placement and ledger activities.
    for client_plugins in ([KvflowAgentsPlugin()], plugins(tmp_path / "context")):
        client = Client(
            temporal_client.service_client,
            namespace=temporal_client.namespace,
            plugins=client_plugins,
        )
        with pytest.raises(
            ValueError, match=r"^KvflowAgentsPlugin\(\) needs KvflowPlugin\(fleet\)"
        ):
            Worker(client, task_queue="unused", workflows=wf.WORKFLOWS)
    # A worker of activity tools alone runs no task.
    Worker(client, task_queue="unused", activities=wf.ACTIVITIES)


@pytest.mark.timeout(30)
async def test_kvflow_plugin_beside_temporals_agents_plugin_or_without_kvflows_is_refused(
    stack: Stack, temporal_client: Client, tmp_path: Path
):
    context_dir = tmp_path / "context"

    def client_of(*client_plugins: Any) -> Client:
        return Client(
            temporal_client.service_client,
            namespace=temporal_client.namespace,
            plugins=list(client_plugins),
        )

    # Temporal's plugin would send the model calls to OpenAI, around kvflow: in either order.
    replace = r"^OpenAIAgentsPlugin sends .*: put KvflowAgentsPlugin\(\) from kvflow"
    with pytest.raises(ValueError, match=replace):
        client_of(KvflowPlugin(context_dir=context_dir), OpenAIAgentsPlugin())
    with pytest.raises(ValueError, match=replace):
        client_of(OpenAIAgentsPlugin(), KvflowPlugin(context_dir=context_dir))
    # Without kvflow's agents plugin the sandbox would refuse the SDK's imports.
    workflow_worker_plugin = KvflowPlugin(control_plane=stack.control)
    with pytest.raises(ValueError, match=r"^workflow \w+ runs OpenAI Agents SDK agents, which"):
        role_worker(
            client_of(KvflowPlugin(context_dir=context_dir)),
            workflow_worker_plugin,
            task_queue="unused",
            workflows=wf.WORKFLOWS,
        )


# ---- the parts, without a server --------------------------------------------------------------


@pytest.mark.timeout(30)
async def test_one_converter_reads_kvflow_records_and_sdk_items_and_keeps_the_claim_check(
    tmp_path: Path,
):
    config: Any = {"data_converter": DataConverter.default, "interceptors": [], "plugins": []}
    for plugin in plugins(tmp_path / "context"):
        config = plugin.configure_client(config)
    converter: DataConverter = config["data_converter"]
    assert converter.payload_converter_class is KvflowAgentsPayloadConverter
    assert isinstance(converter.payload_codec, ClaimCheckCodec)

    # A kvflow record whose list grew after it was built ("unset" to pydantic), an Agents SDK
    # output item, and a payload over the claim-check threshold.
    step = StepSpend(index=1, name="travel-agent", kind="infer")
    step.attempts.append(AttemptSpend(replica="gpu/0", outcome="ok", cost_micros=12))
    breakdown = SpendBreakdown(
        tenant="acme", outcome="succeeded", spend_micros=12, steps=[step], retries=0, attempts=1
    )
    [message] = output_items("It will rain.", [])
    large = "a long document " * 200
    payloads = await converter.encode([breakdown, message, large])
    assert [is_claim_check(p) for p in payloads] == [False, False, True]
    # The SDK's item is written as Temporal's OpenAI plugin writes it.
    assert payloads[1] == OpenAIPayloadConverter().to_payloads([message])[0]
    decoded = await converter.decode(payloads, [SpendBreakdown, ResponseOutputMessage, str])
    assert decoded == [breakdown, message, large]
    # A GPU worker's plain pydantic converter reads kvflow's payloads, and the other way round.
    assert pydantic_data_converter.payload_converter.from_payloads(
        payloads[:1], [SpendBreakdown]
    ) == [breakdown]
    plain = pydantic_data_converter.payload_converter.to_payloads([breakdown])
    assert converter.payload_converter.from_payloads(plain, [SpendBreakdown]) == [breakdown]


def test_the_sdks_converter_writes_the_messages_tools_and_answers_kvflow_sends():
    call = ToolCall(id="call-1", name="get_weather", arguments='{"city": "Oslo", "day": "Fri"}')
    answer = ModelResponse(output=output_items("", [call]), usage=Usage(), response_id=None)
    items: list[Any] = [
        {"role": "user", "content": "Weather in Oslo?"},
        *answer.to_input_items(),
        {"type": "function_call_output", "call_id": "call-1", "output": "Oslo: sunny"},
        *ModelResponse(
            output=output_items("Sunny.", []), usage=Usage(), response_id=None
        ).to_input_items(),
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Thanks."},
                {"type": "input_text", "text": "Flights?"},
            ],
        },
    ]
    assert chat_messages("Be brief.", items) == [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Weather in Oslo?"),
        ChatMessage(role="assistant", content="", tool_calls=[call]),
        ChatMessage(role="tool", content="Oslo: sunny", tool_call_id="call-1"),
        ChatMessage(role="assistant", content="Sunny."),
        ChatMessage(role="user", content="Thanks.\nFlights?"),
    ]
    image: list[Any] = [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
    with pytest.raises(UserError, match="kvflow sends text"):
        chat_messages(None, image)

    weather = travel.workflow.get_weather
    flights = agents.Agent(name="flight-agent")
    specs = tool_specs([weather], [agents.handoff(flights)])
    assert [s.name for s in specs] == ["get_weather", "transfer_to_flight_agent"]
    assert specs[0] == ToolSpec(
        name="get_weather",
        description=weather.description,
        parameters=weather.params_json_schema,
        strict=True,
    )
    assert tool_choice(ModelSettings(tool_choice="get_weather")) == "get_weather"
    assert tool_choice(ModelSettings(tool_choice="required")) == "required"
    assert tool_choice(ModelSettings()) is None

    class Plan(BaseModel):
        steps: list[str]

    assert json_schema(AgentOutputSchema(str)) is None
    assert json_schema(AgentOutputSchema(Plan)) == AgentOutputSchema(Plan).json_schema()

    settings = ModelSettings(
        temperature=0.3,
        top_p=0.9,
        extra_args={"seed": 7, "stop": "\n"},
        extra_body={"ignore_eos": 1},
    )
    assert sampling_of(settings) == Sampling(
        temperature=0.3, top_p=0.9, seed=7, stop=["\n"], ignore_eos=True
    )
    # Unset stays unset, as the SDK's own models send nothing: the engine's default applies.
    assert sampling_of(ModelSettings()) == Sampling(temperature=None, top_p=None)

    assert [type(item).__name__ for item in output_items("Here.", [call])] == [
        "ResponseOutputMessage",
        "ResponseFunctionToolCall",
    ]
    # An answer cut before its first token gives the agent nothing: the SDK's model error.
    assert answer_items("", [call], "length", step="s", max_tokens=1) == output_items("", [call])
    assert answer_items("A", [], "length", step="s", max_tokens=1) == output_items("A", [])
    with pytest.raises(ModelBehaviorError, match="'writer' ran out of its 40 output tokens"):
        answer_items("", [], "length", step="writer", max_tokens=40)


def test_runner_gives_every_agent_of_a_run_a_kvflow_model_named_after_it():
    flights = agents.Agent(name="flight-agent", model="llama-3.1-8b")
    planner = agents.Agent(name="travel-agent", handoffs=[flights])
    flights.handoffs = [planner]  # a cycle: converted once, kept a cycle
    runner = KvflowRunner(default_model=MODEL, max_tokens=300)

    kwargs: Any = {}
    converted = runner._prepare(planner, kwargs)
    model = converted.model
    assert isinstance(model, KvflowModel)
    assert (model.model, model.step, model.max_tokens) == (MODEL, "travel-agent", 300)
    [flights_converted] = converted.handoffs
    assert isinstance(flights_converted, agents.Agent)
    assert isinstance(flights_converted.model, KvflowModel)
    assert flights_converted.model.model == "llama-3.1-8b"
    assert flights_converted.handoffs == [converted]
    assert planner.model is None and flights.model == "llama-3.1-8b"  # the user's untouched

    # RunConfig(model=...) is every agent's model, as in the SDK; each step keeps its name.
    kwargs = {"run_config": {"model": "llama-3.2-1b"}}
    converted = runner._prepare(planner, kwargs)
    assert kwargs["run_config"].model is None
    assert isinstance(converted.model, KvflowModel)
    assert converted.model.model == "llama-3.2-1b"

    with pytest.raises(AgentsWorkflowError, match="MCP servers are not offered"):
        runner._prepare(
            agents.Agent(name="mcp", mcp_servers=[MCPServerStdio({"command": "x"})]), {}
        )
    with pytest.raises(AgentsWorkflowError, match="activity_as_tool"):
        runner._prepare(agents.Agent(name="bad", tools=[wf.book_hotel]), {})  # type: ignore[list-item]

    # Nor does a KvflowModel stream, whoever asks it.
    with pytest.raises(AgentsWorkflowError, match="run_streamed is not offered by kvflow"):
        KvflowModel(MODEL).stream_response(
            None,
            wf.WRITER,
            ModelSettings(),
            [],
            None,
            [],
            ModelTracing.DISABLED,
            previous_response_id=None,
            conversation_id=None,
            prompt=None,
        )

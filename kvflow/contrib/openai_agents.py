"""Agents of the OpenAI Agents SDK, on Temporal, with their model calls placed by kvflow.

Agents written for Temporal's OpenAI Agents integration run as they are; what changes is the
plugin in the worker's client (`KvflowAgentsPlugin` instead of `OpenAIAgentsPlugin`) and a
`kvflow.Agent` block around the run, which holds the task's budgets:

    import kvflow
    from agents import Agent, Runner

    @workflow.defn
    class Travel:
        @workflow.run
        async def run(self, task: TravelTask) -> str:
            planner = Agent(name="travel-agent", model="llama-3.1-8b", tools=[...])
            async with kvflow.Agent(task.spec):    # the task: budgets, ledger row, saga
                result = await Runner.run(planner, task.question)
            return result.final_output

    client = await Client.connect(address, plugins=[KvflowPlugin(fleet), KvflowAgentsPlugin()])

Inside a workflow the plugin's runner (`KvflowRunner`) gives every agent of the run (through
its handoffs too) a `KvflowModel`, which makes each model call one `kvflow.Agent.infer` step
named after the agent: placed on a GPU worker by KV-cache affinity, streamed, resumed on
another replica when one is cut, and billed attempt by attempt in the ledger. The SDK's own
Chat Completions converter turns its input items, tools, handoffs, tool choice and output
schema into kvflow's messages and tool specs, and the answer back into output items. Tools
keep working as the SDK defines them: `function_tool` tools run in the workflow,
`temporalio.openai_agents.workflow.activity_as_tool` tools run as activities (register those
activities on the worker, as with `OpenAIAgentsPlugin`), and a failing tool fails or answers
the model as the SDK says.

An SDK error that ends the run (`MaxTurnsExceeded`, `ModelTimeoutError` after
`ModelSettings.timeout`, `ModelBehaviorError`, a guardrail's tripwire, `UserError`...) fails
the workflow with a non-retryable `ApplicationError` of the error's type and message, and the
task is recorded as failed; with Temporal's plugin such an error fails workflow tasks, which
Temporal retries until a new version is deployed.

What the SDK calls `Runner.run_streamed` is not offered: kvflow streams each call from the
replica itself (that is how it resumes a cut one), and the agent gets each whole answer.
Hosted tools, MCP servers, sandbox agents, stored prompts and server-side conversation state
(`previous_response_id`, `conversation_id`) are OpenAI-platform features with no kvflow
equivalent; an agent that uses them fails with a message that says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, cast, get_args

try:
    from agents import (
        Agent,
        AgentOutputSchemaBase,
        AgentsException,
        Handoff,
        Model,
        ModelBehaviorError,
        ModelResponse,
        ModelSettings,
        ModelTracing,
        RunConfig,
        RunContextWrapper,
        RunResult,
        RunResultStreaming,
        RunState,
        SQLiteSession,
        TContext,
        Tool,
        TResponseInputItem,
        UserError,
    )
    from agents.items import TResponseStreamEvent
    from agents.models.chatcmpl_converter import Converter
    from agents.retry import ModelRetryAdvice, ModelRetryAdviceRequest
    from agents.run import (
        AgentRunner,
        RunOptions,
        get_default_agent_runner,
        set_default_agent_runner,
    )
    from agents.sandbox import SandboxAgent
    from agents.tracing import generation_span
    from agents.usage import Usage
    from openai import Omit
    from openai.types.chat import ChatCompletionMessage, ChatCompletionMessageFunctionToolCall
    from openai.types.chat.chat_completion_message_function_tool_call import Function
    from openai.types.responses.response_prompt_param import ResponsePromptParam
    from openai.types.responses.response_usage import InputTokensDetails
    from temporalio.openai_agents import (
        AgentsWorkflowError,
        OpenAIAgentsPlugin,
        OpenAIPayloadConverter,
    )
except ImportError as missing:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        f"kvflow.contrib.openai_agents needs the OpenAI Agents SDK and Temporal's integration "
        f"({missing.name or missing} is not installed): pip install 'kvflow[openai-agents]'"
    ) from missing

from pydantic import ValidationError
from temporalio import workflow
from temporalio.api.common.v1 import Payload
from temporalio.contrib.pydantic import PydanticJSONPlainPayloadConverter, PydanticPayloadConverter
from temporalio.converter import (
    CompositePayloadConverter,
    DataConverter,
    DefaultPayloadConverter,
    JSONPlainPayloadConverter,
)
from temporalio.exceptions import ApplicationError
from temporalio.worker import WorkerConfig, WorkflowRunner
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner
from typing_extensions import Unpack

from kvflow.activities.wire import ChatMessage, InferenceResult, Sampling, ToolCall, ToolSpec
from kvflow.contrib import require_kvflow_worker
from kvflow.workflows.agent import Agent as KvflowAgent
from kvflow.workflows.agent import StepSpend
from kvflow.workflows.errors import TaskErrorType, task_error

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "KvflowAgentsPayloadConverter",
    "KvflowAgentsPlugin",
    "KvflowModel",
    "KvflowRunner",
]

DEFAULT_MAX_TOKENS = 1024
"""The output tokens a model call may use when the agent's `ModelSettings.max_tokens` is unset:
kvflow places a call by how long it will run, so every call needs a bound."""

NO_TASK = (
    "a model call of agent {agent!r} ran outside a kvflow task: wrap Runner.run in "
    "`async with kvflow.Agent(spec):` inside the workflow, so that kvflow can place it on a "
    "GPU worker, hold it to the task's budgets and bill it"
)
"""The message of the error a model call outside any `kvflow.Agent` block fails with."""

_SAMPLING_EXTRAS = ("seed", "stop", "ignore_eos")
"""`ModelSettings.extra_args` / `extra_body` keys kvflow passes to vLLM (as `Sampling`)."""
_UNSENT_SETTINGS = (
    "frequency_penalty",
    "presence_penalty",
    "parallel_tool_calls",
    "top_logprobs",
    "reasoning",
    "verbosity",
)
"""`ModelSettings` fields that change what a model writes but that kvflow does not send.

(`timeout` is the SDK's own: its timer in the workflow cancels the call, which kvflow stops
and bills, and the run fails with `ModelTimeoutError`.)"""


# ---- one model call ---------------------------------------------------------------------------


class KvflowModel(Model):
    """An Agents SDK model whose calls are `kvflow.Agent.infer` steps of the running task.

    `KvflowRunner` gives one to every agent of a run inside a workflow; `model` is the agent's
    model name, which must be a model of the kvflow fleet, and `step` (the agent's name) names
    the step in the ledger, the Temporal UI and the `kvflow_spend` query. From the agent's
    `ModelSettings` it sends `temperature`, `top_p`, `max_tokens` (default `max_tokens`) and
    `tool_choice`, and from `extra_args` or `extra_body` the vLLM sampling keys `seed`, `stop`
    and `ignore_eos`. A setting the agent leaves unset is not sent, so the engine's default
    applies, as with the SDK's own models. `timeout` bounds each call as the SDK does.
    """

    def __init__(
        self,
        model: str | None,
        *,
        step: str | None = None,
        max_tokens: int = DEFAULT_MAX_TOKENS,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens is {max_tokens}: allow at least 1 output token")
        self.model = model
        self.step = step or model or "model"
        self.max_tokens = max_tokens

    def get_retry_advice(self, request: ModelRetryAdviceRequest) -> ModelRetryAdvice | None:
        """Never retry here: kvflow re-placed the call already, within the task's budget."""
        return ModelRetryAdvice(
            suggested=False,
            reason="kvflow re-places a failed call itself; its failure is final",
        )

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: ResponsePromptParam | None,
    ) -> ModelResponse:
        """Run the call as a step of the current `kvflow.Agent` and return its answer."""
        task = KvflowAgent.current()
        if task is None:
            raise AgentsWorkflowError(NO_TASK.format(agent=self.step))
        if self.model is None:
            raise self._invalid(
                "it names no model: give the agent `model=` (or RunConfig(model=...), or "
                "KvflowAgentsPlugin(default_model=...)) a model of the kvflow fleet"
            )
        if previous_response_id is not None or conversation_id is not None:
            raise self._invalid(
                "server-side conversation state (previous_response_id, conversation_id) is an "
                "OpenAI Responses API feature: pass the conversation as input "
                "(result.to_input_list())"
            )
        if prompt is not None:
            raise self._invalid("stored prompts are an OpenAI platform feature: give instructions")
        self._warn_unsent(model_settings)
        try:
            messages = chat_messages(system_instructions, input, model=self.model)
            specs = tool_specs(tools, handoffs)
            choice = tool_choice(model_settings) if specs else None
            schema = json_schema(output_schema)
            sampling = sampling_of(model_settings)
        except (UserError, ValidationError, ValueError) as problem:
            raise self._invalid(str(problem)) from None
        max_tokens = model_settings.max_tokens or self.max_tokens
        # The generation in the Agents SDK's trace, as its own models record one.
        with generation_span(
            model=self.model,
            model_config={
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "max_tokens": max_tokens,
                "tool_choice": choice,
            },
            disabled=tracing.is_disabled(),
        ) as span:
            if tracing.include_data():
                span.span_data.input = [m.model_dump(exclude_none=True) for m in messages]
            # `infer` adds its step record before it first awaits: this call's is at `index`.
            index = len(task.steps)
            result = await task.infer(
                messages,
                model=self.model,
                max_tokens=max_tokens,
                tools=specs or None,
                tool_choice=choice,
                json_schema=schema,
                sampling=sampling,
                step=self.step,
            )
            text = await task.text_of(result)
            record = task.steps[index] if index < len(task.steps) else None
            if record is not None and (record.kind, record.name) != ("infer", self.step):
                record = None
            usage = usage_of(result, record)
            span.span_data.usage = {
                "requests": usage.requests,
                "input_tokens": usage.input_tokens,
                "output_tokens": usage.output_tokens,
                "total_tokens": usage.total_tokens,
            }
            if tracing.include_data():
                span.span_data.output = [
                    {
                        "role": "assistant",
                        "content": text,
                        "tool_calls": [c.model_dump() for c in result.tool_calls],
                    }
                ]
        return ModelResponse(
            output=answer_items(
                text,
                result.tool_calls,
                result.finish_reason,
                step=self.step,
                max_tokens=max_tokens,
            ),
            usage=usage,
            response_id=None,
        )

    def stream_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: ResponsePromptParam | None,
    ) -> AsyncIterator[TResponseStreamEvent]:
        """Not offered: kvflow streams each call from the replica and returns it whole.

        Streaming is how kvflow resumes a call cut mid-answer on another replica; the agent
        gets the whole answer. Use `Runner.run`.
        """
        raise AgentsWorkflowError(_NO_STREAMING)

    def _invalid(self, what: str) -> ApplicationError:
        """The task's failure for a call that can never be served as the agent wrote it."""
        return task_error(TaskErrorType.INVALID_TASK, f"agent {self.step!r}: {what}")

    def _warn_unsent(self, settings: ModelSettings) -> None:
        unsent = [name for name in _UNSENT_SETTINGS if getattr(settings, name) is not None]
        extras = {**_as_dict(settings.extra_body), **(settings.extra_args or {})}
        unsent += sorted(key for key in extras if key not in _SAMPLING_EXTRAS)
        if unsent:
            workflow.logger.warning(
                "agent %r: kvflow does not send the model settings %s; the replica uses its "
                "defaults",
                self.step,
                ", ".join(unsent),
            )


_NO_STREAMING = (
    "Runner.run_streamed is not offered by kvflow: use Runner.run. kvflow streams each model "
    "call from the replica itself, to resume a cut one on another, and returns it whole"
)


# ---- the SDK's items and kvflow's messages ----------------------------------------------------


def chat_messages(
    system_instructions: str | None,
    items: str | list[TResponseInputItem],
    *,
    model: str | None = None,
) -> list[ChatMessage]:
    """The conversation as kvflow sends it: the SDK's Chat Completions messages, as text.

    `Converter.items_to_messages` does the conversion, as for any Chat Completions model; the
    system instructions come first. Content parts are joined as vLLM joins them; a part that
    is not text (an image, audio, a file) cannot be sent (`UserError`).
    """
    converted = Converter.items_to_messages(items, model=model)
    messages: list[ChatMessage] = []
    if system_instructions:
        messages.append(ChatMessage(role="system", content=system_instructions))
    for param in converted:
        message = cast(Mapping[str, Any], param)
        role = message["role"]
        if role == "developer":
            role = "system"
        content = _text(message.get("content"), role)
        if role == "assistant":
            if not content and message.get("refusal"):
                content = str(message["refusal"])
            calls = [
                ToolCall(
                    id=call["id"],
                    name=call["function"]["name"],
                    arguments=call["function"]["arguments"],
                )
                for call in message.get("tool_calls") or ()
                if call.get("type") == "function"
            ]
            messages.append(
                ChatMessage(role="assistant", content=content, tool_calls=calls or None)
            )
        elif role == "tool":
            messages.append(
                ChatMessage(role="tool", content=content, tool_call_id=message["tool_call_id"])
            )
        elif role in ("system", "user"):
            messages.append(ChatMessage(role=role, content=content))
        else:
            raise UserError(
                f"kvflow sends chat messages of roles system, user, assistant and "
                f"tool, not {role!r}"
            )
    return messages


def _text(content: Any, role: str) -> str:
    """The text of a message's content: a string, or the text of its parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for part in cast(Iterable[Mapping[str, Any]], content):
        kind = part.get("type")
        if kind == "text":
            texts.append(str(part["text"]))
        elif kind == "refusal":
            texts.append(str(part["refusal"]))
        else:
            raise UserError(
                f"a {role} message holds a {kind!r} part: kvflow sends text to the fleet's "
                "models, so give the content as text"
            )
    # vLLM joins a message's text parts with newlines before the chat template sees them.
    return "\n".join(texts)


def tool_specs(tools: Sequence[Tool], handoffs: Sequence[Handoff[Any, Any]]) -> list[ToolSpec]:
    """The agent's function tools, then its handoffs, as the tools of a chat call.

    `Converter.tool_to_openai` and `Converter.convert_handoff_tool` write them, as for any
    Chat Completions model; a hosted tool (web search, file search...) cannot be served by
    the fleet's models (`UserError`).
    """
    converted = [Converter.tool_to_openai(tool) for tool in tools]
    converted += [Converter.convert_handoff_tool(handoff) for handoff in handoffs]
    specs: list[ToolSpec] = []
    for entry in converted:
        function = cast(Mapping[str, Any], entry["function"])
        specs.append(
            ToolSpec(
                name=function["name"],
                description=function.get("description"),
                parameters=dict(function.get("parameters") or {}),
                strict=function.get("strict"),
            )
        )
    return specs


def tool_choice(settings: ModelSettings) -> str | None:
    """The agent's `tool_choice` as kvflow takes it: auto, required, none or a tool's name."""
    choice = Converter.convert_tool_choice(settings.tool_choice)
    if isinstance(choice, Omit):
        return None
    if isinstance(choice, str):
        return choice
    return str(cast(Mapping[str, Any], choice)["function"]["name"])


def json_schema(output_schema: AgentOutputSchemaBase | None) -> dict[str, Any] | None:
    """The JSON schema of an agent's structured output; None for plain text."""
    response_format = Converter.convert_response_format(output_schema)
    if isinstance(response_format, Omit):
        return None
    body = cast(Mapping[str, Any], response_format)
    return dict(body["json_schema"]["schema"])


def sampling_of(settings: ModelSettings) -> Sampling:
    """The sampling parameters of `settings`; vLLM's `seed`, `stop`, `ignore_eos` from extras.

    An unset `temperature` or `top_p` stays unset (None): the engine's default applies.
    """
    extras = {**_as_dict(settings.extra_body), **(settings.extra_args or {})}
    fields: dict[str, Any] = {"temperature": settings.temperature, "top_p": settings.top_p}
    if extras.get("seed") is not None:
        fields["seed"] = extras["seed"]
    stop = extras.get("stop")
    if stop is not None:
        fields["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if extras.get("ignore_eos") is not None:
        fields["ignore_eos"] = bool(extras["ignore_eos"])
    return Sampling(**fields)


def _as_dict(value: object) -> dict[str, Any]:
    return dict(cast(Mapping[str, Any], value)) if isinstance(value, Mapping) else {}


def output_items(text: str, calls: Sequence[ToolCall]) -> list[Any]:
    """The answer as the SDK's output items: the text message, then one item per tool call.

    `Converter.message_to_output_items` builds them from the Chat Completions message the
    answer would have been, as for any Chat Completions model.
    """
    message = ChatCompletionMessage(
        role="assistant",
        content=text or None,
        tool_calls=[
            ChatCompletionMessageFunctionToolCall(
                id=call.id,
                type="function",
                function=Function(name=call.name, arguments=call.arguments),
            )
            for call in calls
        ]
        or None,
    )
    return list(Converter.message_to_output_items(message))


def answer_items(
    text: str,
    calls: Sequence[ToolCall],
    finish_reason: str,
    *,
    step: str,
    max_tokens: int,
) -> list[Any]:
    """A call's answer as the SDK's output items; refused when cut before it began.

    An answer that ran out of its output tokens before any text or tool call has nothing to
    give the agent: `ModelBehaviorError`, what the SDK's Chat Completions model says of it.
    """
    if finish_reason == "length" and not text and not calls:
        raise ModelBehaviorError(
            f"the answer of {step!r} ran out of its {max_tokens} output tokens before any "
            "text or tool call"
        )
    return output_items(text, calls)


def usage_of(result: InferenceResult, record: StepSpend | None) -> Usage:
    """The call's tokens as the SDK counts them: every attempt kvflow billed for it.

    A call cut on one replica and resumed on another made two requests; the SDK's usage then
    says so, and its figures are the ledger's. Without the step's record, the answer's own.
    """
    attempts = record.attempts if record is not None and record.attempts else None
    if attempts is None:
        requests = 1
        prompt = result.usage.prompt_tokens
        cached = result.usage.cached_tokens
        completion = result.usage.completion_tokens
    else:
        requests = len(attempts)
        prompt = sum(a.prompt_tokens for a in attempts)
        cached = sum(a.cached_tokens for a in attempts)
        completion = sum(a.completion_tokens for a in attempts)
    return Usage(
        requests=requests,
        input_tokens=prompt,
        input_tokens_details=InputTokensDetails.model_validate(
            {"cached_tokens": cached, "cache_write_tokens": 0}
        ),
        output_tokens=completion,
        total_tokens=prompt + completion,
    )


# ---- the runner ------------------------------------------------------------------------------


class KvflowRunner(AgentRunner):
    """The Agents SDK runner that, inside a workflow, runs every model call through kvflow.

    Outside a workflow it is the SDK's own runner, unchanged. Inside one it checks what the
    Temporal integration checks (tools are tool objects, not activities; no SQLite sessions;
    model names are strings), gives each agent of the run a `KvflowModel` named after the
    agent (`RunConfig(model=...)`, when given, is the model of every agent, as in the SDK),
    and fails the workflow when the run ends in an error of the SDK's: a non-retryable
    `ApplicationError` typed after it (e.g. `MaxTurnsExceeded`), not workflow-task failures
    that Temporal would retry forever.
    """

    def __init__(
        self, *, default_model: str | None = None, max_tokens: int = DEFAULT_MAX_TOKENS
    ) -> None:
        super().__init__()
        self.default_model = default_model
        self.max_tokens = max_tokens

    async def run(
        self,
        starting_agent: Agent[TContext],
        input: str | list[TResponseInputItem] | RunState[TContext],
        **kwargs: Unpack[RunOptions[TContext]],
    ) -> RunResult:
        """Run the agent; inside a workflow, with every model call a kvflow step."""
        if not workflow.in_workflow():
            return await super().run(starting_agent, input, **kwargs)
        try:
            agent = self._prepare(starting_agent, kwargs)
            return await super().run(agent, input, **kwargs)
        except (AgentsException, AgentsWorkflowError) as ended:
            failure = _run_failure(ended)
            raise failure from failure.__cause__

    def run_sync(
        self,
        starting_agent: Agent[TContext],
        input: str | list[TResponseInputItem] | RunState[TContext],
        **kwargs: Unpack[RunOptions[TContext]],
    ) -> RunResult:
        """The SDK's `run_sync` outside a workflow; a workflow must `await Runner.run`."""
        if not workflow.in_workflow():
            return super().run_sync(starting_agent, input, **kwargs)
        raise _run_failure(
            AgentsWorkflowError(
                "Runner.run_sync cannot run in a workflow: use `await Runner.run(...)`"
            )
        )

    def run_streamed(
        self,
        starting_agent: Agent[TContext],
        input: str | list[TResponseInputItem] | RunState[TContext],
        **kwargs: Unpack[RunOptions[TContext]],
    ) -> RunResultStreaming:
        """The SDK's `run_streamed` outside a workflow; not offered in one (see the module)."""
        if not workflow.in_workflow():
            return super().run_streamed(starting_agent, input, **kwargs)
        raise _run_failure(AgentsWorkflowError(_NO_STREAMING))

    def _prepare(self, agent: Agent[Any], kwargs: RunOptions[Any]) -> Agent[Any]:
        """Check the run as the Temporal integration does, and give its agents kvflow models.

        A configuration that cannot run fails the workflow (`AgentsWorkflowError`) with what to
        change, instead of failing workflow tasks until a new version is deployed.
        """
        if isinstance(kwargs.get("session"), SQLiteSession):
            raise AgentsWorkflowError("Temporal workflows don't support SQLite sessions.")
        run_config = kwargs.get("run_config")
        if run_config is None:
            run_config = RunConfig()
        elif isinstance(run_config, dict):
            try:
                run_config = RunConfig(**run_config)
            except TypeError as unknown:
                raise AgentsWorkflowError(f"run_config: {unknown}") from None
        if run_config.sandbox is not None or _has_sandbox_agent(agent, set()):
            raise AgentsWorkflowError(
                "sandbox agents run their tools in OpenAI's sandbox clients, which kvflow does "
                "not offer: use function tools or activity_as_tool"
            )
        model = run_config.model
        forced: str | None = None
        if isinstance(model, str):
            # The SDK gives every agent the run's model; so does kvflow, per agent, so that
            # each step is still named after the agent that made it.
            forced = model
            run_config = dataclasses.replace(run_config, model=None)
        elif model is not None and not isinstance(model, KvflowModel):
            raise AgentsWorkflowError(
                "Temporal workflows require a model name to be a string in the run config."
            )
        kwargs["run_config"] = run_config
        return self._convert(agent, forced, {})

    def _convert(
        self, agent: Agent[Any], forced: str | None, seen: dict[int, Agent[Any]]
    ) -> Agent[Any]:
        """`agent` with a `KvflowModel`, and its handoffs converted too (cycles kept)."""
        if id(agent) in seen:
            return seen[id(agent)]
        if isinstance(agent.model, KvflowModel):
            return agent
        if agent.model is not None and not isinstance(agent.model, str):
            raise AgentsWorkflowError(
                f"agent {agent.name!r}: Temporal workflows require a model name to be a string "
                "in the agent."
            )
        if agent.mcp_servers:
            raise AgentsWorkflowError(
                f"agent {agent.name!r}: MCP servers are not offered by KvflowAgentsPlugin: give "
                "the agent function tools, or activities with activity_as_tool"
            )
        for tool in agent.tools:
            if callable(tool):
                raise AgentsWorkflowError(
                    f"agent {agent.name!r}: provided tool is not a tool type. If using an "
                    "activity, make sure to wrap it with openai_agents.workflow.activity_as_tool."
                )
        converted = dataclasses.replace(agent)
        seen[id(agent)] = converted
        handoffs: list[Agent[Any] | Handoff[Any, Any]] = []
        for handoff in agent.handoffs:
            if isinstance(handoff, Agent):
                handoffs.append(self._convert(handoff, forced, seen))
            elif isinstance(handoff, Handoff):
                handoffs.append(
                    dataclasses.replace(
                        handoff,
                        on_invoke_handoff=self._converting(handoff.on_invoke_handoff, forced, seen),
                    )
                )
            else:
                raise AgentsWorkflowError(f"Unknown handoff type: {type(handoff)}")
        converted.handoffs = handoffs
        converted.model = KvflowModel(
            forced or agent.model or self.default_model,
            step=agent.name,
            max_tokens=self.max_tokens,
        )
        return converted

    def _converting(
        self,
        invoke: Callable[[RunContextWrapper[Any], str], Awaitable[Any]],
        forced: str | None,
        seen: dict[int, Agent[Any]],
    ) -> Callable[[RunContextWrapper[Any], str], Awaitable[Any]]:
        """A handoff's invocation whose agent, chosen when it runs, gets a kvflow model too."""

        async def on_invoke(context: RunContextWrapper[Any], arguments: str) -> Any:
            return self._convert(await invoke(context, arguments), forced, seen)

        return on_invoke


def _has_sandbox_agent(agent: Agent[Any], seen: set[int]) -> bool:
    if id(agent) in seen:
        return False
    seen.add(id(agent))
    if isinstance(agent, SandboxAgent):
        return True
    return any(isinstance(h, Agent) and _has_sandbox_agent(h, seen) for h in agent.handoffs)


def _run_failure(ended: Exception) -> ApplicationError:
    """The workflow's failure for an error that ended an agent run, typed after that error.

    A non-retryable `ApplicationError` whose type is the error's class (`MaxTurnsExceeded`,
    `ModelTimeoutError`, `ModelBehaviorError`, `InputGuardrailTripwireTriggered`, `UserError`;
    `AgentsWorkflowError` for a run this runner refuses) and whose message is the error's: the
    workflow fails and `kvflow.Agent` records the task as failed, where the bare error would
    fail workflow tasks that Temporal retries until a new version is deployed. An error caused
    by a Temporal failure (an activity tool that failed for good) keeps that failure as its
    `__cause__`, as Temporal's plugin keeps it under its `AgentsWorkflowError`.
    """
    failure = ApplicationError(str(ended), type=type(ended).__name__, non_retryable=True)
    failure.__traceback__ = ended.__traceback__
    cause = ended.__cause__
    if cause is not None and workflow.is_failure_exception(cause):
        failure.__cause__ = cause
    return failure


# ---- the plugin ------------------------------------------------------------------------------


class KvflowAgentsPlugin(OpenAIAgentsPlugin):
    """Temporal's `OpenAIAgentsPlugin`, with kvflow running the agents' model calls.

    Put it where `OpenAIAgentsPlugin(...)` was, after `KvflowPlugin`:
    `Client.connect(..., plugins=[KvflowPlugin(fleet), KvflowAgentsPlugin()])`. It keeps what
    the Temporal plugin does (the OpenAI payload conversion of the SDKs' types, here beside
    kvflow's and with kvflow's claim-check codec kept, see `KvflowAgentsPayloadConverter`;
    the Agents SDK's tracing interceptors; `agents` and `openai` passed through the workflow
    sandbox) but registers no model activities: while the worker (or a
    `Replayer`) runs, `KvflowRunner` is the Agents SDK's default runner. `activity_as_tool`
    activities are registered on the worker by the user, as with the Temporal plugin. A
    workflow worker without `KvflowPlugin(fleet)` (on it or on its client) refuses to start.

    Args:
        default_model: the fleet model of agents that name none (the SDK would use OpenAI's
            default model, which the fleet does not serve).
        max_tokens: the output tokens of a model call whose agent sets no `max_tokens`.
        add_temporal_spans: add Temporal's spans to the Agents SDK's traces.

    """

    def __init__(
        self,
        *,
        default_model: str | None = None,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        add_temporal_spans: bool = True,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens is {max_tokens}: allow at least 1 output token")
        super().__init__(register_activities=False, add_temporal_spans=add_temporal_spans)
        self.runner = KvflowRunner(default_model=default_model, max_tokens=max_tokens)
        """The default agent runner while a worker or replayer with this plugin runs."""
        self.data_converter = with_openai_payloads
        sandbox = self.workflow_runner
        assert callable(sandbox)  # the Temporal plugin's: passes agents and openai through

        def workflow_runner(existing: WorkflowRunner | None) -> WorkflowRunner:
            runner = sandbox(existing)
            if isinstance(runner, SandboxedWorkflowRunner):
                # KvflowModel runs outside the sandbox and finds the task through kvflow's
                # `Agent.current()`: the workflow must see the same kvflow modules (a replayer
                # has no KvflowPlugin(fleet) that would pass them through).
                return dataclasses.replace(
                    runner, restrictions=runner.restrictions.with_passthrough_modules("kvflow")
                )
            return runner

        self.workflow_runner = workflow_runner
        sdk_context = self.run_context
        assert sdk_context is not None  # the Temporal plugin's: tracing, its runner

        @asynccontextmanager
        async def run_context() -> AsyncIterator[None]:
            async with sdk_context():
                previous = get_default_agent_runner()
                set_default_agent_runner(self.runner)
                try:
                    yield
                finally:
                    set_default_agent_runner(previous)

        self.run_context = run_context

    def configure_worker(self, config: WorkerConfig) -> WorkerConfig:
        """Refuse a workflow worker without `KvflowPlugin(fleet)`; then as Temporal's plugin."""
        require_kvflow_worker(config, "KvflowAgentsPlugin()")
        return super().configure_worker(config)

    def name(self) -> str:
        """The plugin's name, as workers report it."""
        return "kvflow.OpenAIAgentsPlugin"


class KvflowAgentsPayloadConverter(CompositePayloadConverter):
    """Temporal's payload converters, JSON by pydantic: the OpenAI way for the SDKs' types.

    Values of the OpenAI and Agents SDKs' own types are written and read as Temporal's
    `OpenAIPayloadConverter` does (unset fields left out, a lenient read of what strict
    validation refuses); everything else, kvflow's records included, as pydantic's converter
    does, whole. kvflow's records must not lose their unset fields: a step's attempts are
    appended to a default list, which "unset" would drop.
    """

    def __init__(self) -> None:
        json_converter = _AgentsJSONPayloadConverter()
        super().__init__(
            *(
                json_converter if isinstance(c, JSONPlainPayloadConverter) else c
                for c in DefaultPayloadConverter.default_encoding_payload_converters
            )
        )


class _AgentsJSONPayloadConverter(PydanticJSONPlainPayloadConverter):
    """Pydantic JSON; the OpenAI plugin's own JSON converter for the SDKs' types."""

    def __init__(self) -> None:
        super().__init__()
        self._openai = OpenAIPayloadConverter().converters[self.encoding.encode()]

    def to_payload(self, value: Any) -> Payload | None:
        """See base class."""
        if _of_the_sdks(value):
            return self._openai.to_payload(value)
        return super().to_payload(value)

    def from_payload(self, payload: Payload, type_hint: type | None = None) -> Any:
        """See base class."""
        if type_hint is not None and _an_sdk_type(type_hint):
            return self._openai.from_payload(payload, type_hint)
        return super().from_payload(payload, type_hint)


_SDK_MODULES = ("openai.", "agents.")


def _of_the_sdks(value: Any) -> bool:
    if isinstance(value, list | tuple):
        return any(_of_the_sdks(item) for item in value)
    return type(value).__module__.startswith(_SDK_MODULES)


def _an_sdk_type(hint: Any) -> bool:
    if str(getattr(hint, "__module__", "")).startswith(_SDK_MODULES):
        return True
    return any(_an_sdk_type(arg) for arg in get_args(hint))


def with_openai_payloads(existing: DataConverter | None) -> DataConverter:
    """`existing` with `KvflowAgentsPayloadConverter`, its codec (kvflow's claim check) kept."""
    if existing is None:
        return DataConverter(payload_converter_class=KvflowAgentsPayloadConverter)
    if existing.payload_converter_class in (
        KvflowAgentsPayloadConverter,
        DefaultPayloadConverter,
        PydanticPayloadConverter,
        OpenAIPayloadConverter,
    ):
        return dataclasses.replace(existing, payload_converter_class=KvflowAgentsPayloadConverter)
    raise ValueError(
        f"KvflowAgentsPlugin needs the client's payload converter to be Temporal's default, "
        f"pydantic's or OpenAIPayloadConverter, not {existing.payload_converter_class.__name__}"
    )

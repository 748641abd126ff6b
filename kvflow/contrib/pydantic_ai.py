"""Pydantic AI agents made durable with Temporal, their model calls placed and billed by kvflow.

An agent written for Pydantic AI's Temporal integration runs unchanged but for three names: its
model is a `KvflowModel` (a model of the kvflow fleet), its durability capability is
`KvflowDurability` instead of `TemporalDurability`, and the client's plugins end with
`KvflowPydanticAIPlugin` instead of `PydanticAIPlugin`. The workflow runs the agent inside the
task's bracket:

    support = Agent(
        KvflowModel("llama-3.1-8b"),
        name="support",
        instructions="You are a support agent.",
        capabilities=[KvflowDurability()],
    )

    @support.tool_plain
    async def lookup_order(order_id: str) -> str: ...

    @workflow.defn
    class Support:
        __pydantic_ai_agents__ = [support]

        @workflow.run
        async def run(self, task: SupportTask) -> str:
            async with kvflow.Agent(task.spec):
                return (await support.run(task.question)).output

    client = await Client.connect(..., plugins=[KvflowPlugin(fleet), KvflowPydanticAIPlugin()])

**What changes.** `TemporalDurability` sends every model request to one static activity,
`<agent>__model_request`, run on the workflow's task queue with a fixed `ActivityConfig`.
With `KvflowDurability` a request whose model is a `KvflowModel` is answered in the workflow
by `KvflowModel.request`, which is one `kvflow.Agent.infer` call: placed by the scheduler,
streamed on the chosen replica's GPU worker, re-placed and resumed from its partial output
when the replica fails, and billed per attempt in the ledger (the step is named after the
Pydantic AI agent). Everything else stays Pydantic AI's: its hooks and retries run as before,
and tools still run as the activities `TemporalDurability` makes of them, so a tool failure
follows the framework's rules (`ModelRetry` goes back to the model; another error fails the
tool's activity under its retry policy). A request on another model (a `models=` entry, a
provider string) still goes to its activity.

**The seam, and why.** Pydantic AI's durability capability installs its activity-backed model
(`DurableModel`, from `_build_durable_model`) through three public capability hooks:
`wrap_model_request`, `before_model_request` and `prepare_model_request`. `KvflowDurability`
overrides those three, and only for a `KvflowModel`: the request then reaches the model
itself, the seam every Pydantic AI model adapter implements (`Model.request`), with the
messages, settings and request parameters already prepared by the framework. The other
candidates lean on private API: overriding `_build_durable_model` or building a `DurableModel`
(both private and documented as reserved for the bundled integrations), or a second
capability that unwraps the durable model (which would rely on `DurableModel`'s type and on
the order the two capabilities' hooks run in). The hooks above are public and their contract
(return the request context, call the handler once) is what any capability relies on.

**Limits.** Streaming is refused (`run_stream`, an `event_stream_handler`): kvflow streams each
call from vLLM to its GPU worker and resumes a cut stream itself, but hands the workflow the
whole answer; run the agent with `agent.run()`. The content is text: images, audio, documents
and files a tool returns are refused with a `UserError`, and so are native tools. Only the
current `TemporalDurability` capability is supported, not the deprecated `TemporalAgent`.
`KvflowModel` answers only inside a workflow: outside one (a script, a test) run the agent
with another model, e.g. `agent.override(model=...)`, or point an OpenAI-compatible model at
the fleet's vLLM servers.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any, ClassVar

try:
    from pydantic_ai import (
        ModelSettings,
        RequestUsage,
        RunContext,
        ToolDefinition,
        ToolOrOutput,
        UserError,
    )
    from pydantic_ai.agent import AbstractAgent
    from pydantic_ai.capabilities import WrapModelRequestHandler
    from pydantic_ai.durable_exec.temporal import (
        PydanticAIPayloadConverter,
        PydanticAIPlugin,
        TemporalDurability,
    )
    from pydantic_ai.messages import (
        CachePoint,
        FinishReason,
        ModelMessage,
        ModelRequest,
        ModelResponse,
        ModelResponsePart,
        RetryPromptPart,
        SystemPromptPart,
        TextContent,
        TextPart,
        ThinkingPart,
        ToolCallPart,
        ToolReturnPart,
        UserPromptPart,
    )
    from pydantic_ai.models import (
        Model,
        ModelRequestContext,
        ModelRequestParameters,
        StreamedResponse,
    )
    from pydantic_ai.models.wrapper import WrapperModel
    from pydantic_ai.profiles import ModelProfile, ModelProfileSpec
    from pydantic_ai.settings import ModelSettingName
    from pydantic_ai.tools import AgentDepsT
except ImportError as missing:  # pragma: no cover - exercised in a subprocess without the extra
    raise ImportError(
        "kvflow.contrib.pydantic_ai needs Pydantic AI with its Temporal integration: "
        "pip install 'kvflow[pydantic-ai]'"
    ) from missing

from temporalio import activity, workflow
from temporalio.worker import WorkerConfig

from kvflow.activities.wire import ChatMessage, InferenceResult, Sampling, ToolCall, ToolSpec
from kvflow.contrib import require_kvflow_worker
from kvflow.workflows import errors
from kvflow.workflows.agent import Agent as KvflowTask

DEFAULT_MAX_TOKENS = 1024
"""Output tokens a call may use when neither the model nor the run sets `max_tokens`."""
PROVIDER_NAME = "kvflow"
"""`ModelResponse.provider_name` of every answer `KvflowModel` returns."""

_STEP: ContextVar[str | None] = ContextVar("kvflow_pydantic_ai_step", default=None)
"""The step name of the model request in progress: the Pydantic AI agent's name."""
_BYPASSED: ContextVar[bool] = ContextVar("kvflow_pydantic_ai_bypassed", default=False)
"""The request in progress started on a `KvflowModel`, so no activity-backed model was set up."""

_FINISH_REASONS: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_call",
    "content_filter": "content_filter",
}


class KvflowModel(Model):
    """A model of the kvflow fleet, for a Pydantic AI agent durable with `KvflowDurability`.

    Inside a workflow, in `async with kvflow.Agent(spec):`, each request is one
    `kvflow.Agent.infer` call. Outside a workflow there is no task to bill, so a request is
    refused with a `UserError`.

    Args:
        model_name: a model the fleet file lists (`[[models]]`), e.g. `"llama-3.1-8b"`.
        max_tokens: output tokens a call may use when the run's settings give no `max_tokens`.
        settings: default settings of every request (merged under the run's).
        profile: overrides of the model profile; by default the model takes tools, native
            (JSON-schema) output and text.

    """

    # Settings the call ignores that change what a request guarantees; Pydantic AI warns of
    # them. Temperature, top_p, seed, max_tokens, stop_sequences and tool_choice are sent.
    unsupported_settings: ClassVar[frozenset[ModelSettingName]] = frozenset(
        {
            "timeout",
            "parallel_tool_calls",
            "presence_penalty",
            "frequency_penalty",
            "logit_bias",
            "extra_headers",
            "extra_body",
        }
    )

    def __init__(
        self,
        model_name: str,
        *,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        settings: ModelSettings | None = None,
        profile: ModelProfileSpec | None = None,
    ) -> None:
        if not model_name:
            raise UserError("KvflowModel needs a model name of the fleet, e.g. 'llama-3.1-8b'")
        if max_tokens < 1:
            raise UserError(f"KvflowModel max_tokens is {max_tokens}: give at least 1")
        super().__init__(
            settings=settings,
            profile=profile
            if profile is not None
            else ModelProfile(supports_tools=True, supports_json_schema_output=True),
        )
        self._model_name = model_name
        self.max_tokens = max_tokens

    @property
    def model_name(self) -> str:
        """The fleet's name of the model."""
        return self._model_name

    @property
    def system(self) -> str:
        """`kvflow`: the calls go to the fleet's vLLM replicas through kvflow."""
        return PROVIDER_NAME

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        """Answer with one `kvflow.Agent.infer` call of the task whose block is running."""
        step = _STEP.get() or "pydantic-ai"
        task = self._task(step)
        settings, params = self.prepare_request(model_settings, model_request_parameters)
        if params.native_tools:
            names = ", ".join(type(tool).__name__ for tool in params.native_tools)
            raise UserError(
                f"KvflowModel cannot use native tools ({names}): the fleet's vLLM servers run "
                "function tools only; give the agent function tools instead"
            )
        tools, tool_choice = tools_and_choice(params, settings)
        schema = None
        if params.output_mode == "native" and params.output_object is not None:
            schema = params.output_object.json_schema
        settings = settings or {}
        result = await task.infer(
            chat_messages(messages, params),
            model=self.model_name,
            max_tokens=settings.get("max_tokens", self.max_tokens),
            tools=tools or None,
            tool_choice=tool_choice,
            json_schema=schema,
            sampling=sampling_of(settings),
            step=step,
        )
        return model_response(result, await task.text_of(result))

    @asynccontextmanager
    async def request_stream(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
        run_context: RunContext[Any] | None = None,
    ) -> AsyncIterator[StreamedResponse]:
        """Refused: kvflow hands the workflow whole answers (see the module docstring)."""
        raise UserError(
            f"KvflowModel({self.model_name!r}) does not stream into Pydantic AI: kvflow streams "
            "each call from vLLM to its GPU worker and resumes a cut stream on another replica, "
            "but the workflow receives the whole answer. Run the agent with `agent.run()`, "
            "without `run_stream` and without an `event_stream_handler` on KvflowDurability; "
            "follow a running task in the Temporal UI or with the `kvflow_spend` query"
        )
        yield  # pragma: no cover - makes this a generator, as the interface expects

    def _task(self, step: str) -> KvflowTask:
        """The kvflow task whose `async with` block runs this request; refuses without one."""
        if not workflow.in_workflow():
            if activity.in_activity():
                raise UserError(
                    f"KvflowModel({self.model_name!r}) was asked from a Temporal activity: the "
                    "agent's durability sent the model request to an activity, as "
                    "TemporalDurability and the deprecated TemporalAgent do. Give the agent "
                    "`capabilities=[KvflowDurability()]` so that kvflow places the call"
                )
            raise UserError(
                f"KvflowModel({self.model_name!r}) answers only inside a Temporal workflow, "
                "in `async with kvflow.Agent(spec):`, where kvflow places and bills the call. "
                "Outside one, run the agent with another model, e.g. "
                "`with agent.override(model=...):`"
            )
        task = KvflowTask.current()
        if task is None:
            raise errors.task_error(
                errors.TaskErrorType.INVALID_TASK,
                f"the Pydantic AI agent {step!r} asked {self.model_name!r} outside "
                "`async with kvflow.Agent(spec):`: run the agent inside that block in the "
                "workflow (`async with Agent(task.spec): result = await agent.run(...)`), so "
                "that kvflow places and bills its model calls",
                step=step,
            )
        return task


def kvflow_model_of(model: Model) -> KvflowModel | None:
    """The `KvflowModel` that answers `model`'s requests (under any wrappers), or None."""
    while isinstance(model, WrapperModel):
        model = model.wrapped
    return model if isinstance(model, KvflowModel) else None


class KvflowDurability(TemporalDurability[AgentDepsT]):
    """`TemporalDurability` whose requests to a `KvflowModel` are placed and billed by kvflow.

    Takes `TemporalDurability`'s arguments; its activity configs apply to the tools (and to
    requests on any model that is not a `KvflowModel`). See the module docstring for what
    changes and why these hooks.
    """

    async def wrap_model_request(
        self,
        ctx: RunContext[AgentDepsT],
        *,
        request_context: ModelRequestContext,
        handler: WrapModelRequestHandler,
    ) -> ModelResponse:
        """A `KvflowModel`'s request reaches the model itself, in the workflow."""
        step = _STEP.set(self.name)
        try:
            if not self.in_durable_context or kvflow_model_of(request_context.model) is None:
                return await super().wrap_model_request(
                    ctx, request_context=request_context, handler=handler
                )
            bypassed = _BYPASSED.set(True)
            try:
                return await handler(request_context)
            finally:
                _BYPASSED.reset(bypassed)
        finally:
            _STEP.reset(step)

    async def before_model_request(
        self,
        ctx: RunContext[AgentDepsT],
        request_context: ModelRequestContext,
    ) -> ModelRequestContext:
        """Continue as new when Temporal suggests it; keep a `KvflowModel` as it is."""
        if not self._keeps_model(request_context):
            return await super().before_model_request(ctx, request_context)
        if self.continue_as_new is not None and workflow.info().is_continue_as_new_suggested():
            # What TemporalDurability does before each request, kept for kvflow's requests.
            suggested = self.continue_as_new(ctx)
            if inspect.isawaitable(suggested):
                await suggested
        return request_context

    async def prepare_model_request(
        self,
        ctx: RunContext[AgentDepsT],
        request_context: ModelRequestContext,
    ) -> ModelRequestContext:
        """Keep a `KvflowModel` as it is for each attempt; others get their activity."""
        if not self._keeps_model(request_context):
            return await super().prepare_model_request(ctx, request_context)
        return request_context

    def _keeps_model(self, request_context: ModelRequestContext) -> bool:
        """Whether the request goes to a `KvflowModel` in the workflow (no activity for it)."""
        if not self.in_durable_context:
            return False
        if kvflow_model_of(request_context.model) is not None:
            return True
        if _BYPASSED.get():
            # The request started on a KvflowModel, so no activity-backed model exists for it.
            raise UserError(
                f"a capability moved a request of the agent {self.name!r} from its KvflowModel "
                f"to {request_context.model.model_name!r}: with KvflowDurability a request that "
                "starts on a KvflowModel stays on kvflow (the fleet's fallback models cover a "
                "model that cannot serve it); choose another model before the request starts, "
                "e.g. `agent.run(..., model=...)`"
            )
        return False


class KvflowPydanticAIPlugin(PydanticAIPlugin):
    """Pydantic AI's Temporal plugin for a worker whose agents' model calls run on kvflow.

    Put it beside `KvflowPlugin` in the client's plugins, in either order: `KvflowPlugin` adds
    its claim-check codec (payloads over 2 KB kept in the context store) and keeps a pydantic
    payload converter it finds; this plugin swaps in Pydantic AI's payload converter and keeps
    the codec, so both kinds of payload round-trip. On a worker it does what `PydanticAIPlugin`
    does (the sandbox lets Pydantic AI through, the tool activities of the agents that
    workflows list in `__pydantic_ai_agents__` are registered) and refuses to start, with the
    fix, when the worker has no `KvflowPlugin(fleet)`, when the client's converter is not
    Pydantic AI's, or when a listed agent on a `KvflowModel` lacks `KvflowDurability`.
    """

    def configure_worker(self, config: WorkerConfig) -> WorkerConfig:
        """Check the converter, the listed agents and kvflow's plugin; then as Pydantic AI."""
        converter = config["client"].data_converter
        if not issubclass(converter.payload_converter_class, PydanticAIPayloadConverter):
            raise ValueError(
                f"the client's payload converter is {converter.payload_converter_class.__name__}, "
                "not Pydantic AI's: connect the client with "
                "`plugins=[KvflowPlugin(...), KvflowPydanticAIPlugin()]` (a plugin on the "
                "Worker alone does not change the client's data converter)"
            )
        for workflow_class in config.get("workflows") or ():
            for agent in getattr(workflow_class, "__pydantic_ai_agents__", None) or ():
                check_agent(agent)
        require_kvflow_worker(config, "KvflowPydanticAIPlugin()")
        return super().configure_worker(config)


def check_agent(agent: Any) -> None:
    """Refuse an agent on a `KvflowModel` whose durability would send its calls to activities."""
    if not isinstance(agent, AbstractAgent):
        return
    model = agent.model
    if not isinstance(model, Model) or kvflow_model_of(model) is None:
        return
    if not isinstance(TemporalDurability.from_agent(agent), KvflowDurability):
        raise UserError(
            f"the agent {agent.name!r} runs on {model.model_name!r} of the kvflow fleet but is "
            "not durable with KvflowDurability: give it `capabilities=[KvflowDurability()]` "
            "instead of TemporalDurability, so that kvflow places and bills its model calls"
        )


# ---- conversions ---------------------------------------------------------------------------


def chat_messages(
    messages: Sequence[ModelMessage], params: ModelRequestParameters
) -> list[ChatMessage]:
    """Pydantic AI's conversation as kvflow's chat messages, instructions after system prompts.

    The order is what Pydantic AI's OpenAI chat model sends: each request's parts in order
    (system prompts, user prompts, tool results), each response as one assistant message with
    its text and tool calls, and the request's instructions as system messages after the
    leading system prompts. Thinking is not sent back, as vLLM's chat API takes none.
    """
    chat: list[ChatMessage] = []
    for message in messages:
        if isinstance(message, ModelRequest):
            chat.extend(_request_messages(message))
        else:
            chat.append(_response_message(message))
    leading = 0
    while leading < len(chat) and chat[leading].role == "system":
        leading += 1
    chat[leading:leading] = [
        ChatMessage(role="system", content=text) for text in _instructions(messages, params)
    ]
    return chat


def _instructions(messages: Sequence[ModelMessage], params: ModelRequestParameters) -> list[str]:
    """The request's instructions: the prepared parts, or a direct request's own."""
    if params.instruction_parts is not None:
        return [part.content for part in params.instruction_parts if part.content]
    for message in reversed(messages):
        if isinstance(message, ModelRequest) and message.instructions:
            return [message.instructions]
    return []


def _request_messages(request: ModelRequest) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    for part in request.parts:
        if isinstance(part, SystemPromptPart):
            out.append(ChatMessage(role="system", content=part.content))
        elif isinstance(part, UserPromptPart):
            out.append(ChatMessage(role="user", content=_user_text(part)))
        elif isinstance(part, ToolReturnPart):
            text, files = part.model_response_str_and_user_content()
            if files:
                raise UserError(
                    f"the tool {part.tool_name!r} returned files; kvflow sends text only: "
                    "return text (e.g. a description or a URL) instead"
                )
            out.append(ChatMessage(role="tool", tool_call_id=part.tool_call_id, content=text))
        elif isinstance(part, RetryPromptPart):  # a direct request may still hold one
            if part.tool_name is None:
                out.append(ChatMessage(role="user", content=part.model_response()))
            else:
                out.append(
                    ChatMessage(
                        role="tool", tool_call_id=part.tool_call_id, content=part.model_response()
                    )
                )
        else:
            raise UserError(
                f"KvflowModel cannot send a {type(part).__name__}: the agent's history holds "
                "a part this model does not map (Pydantic AI translates them before an agent "
                "run's request; a direct `model.request` must give prepared messages)"
            )
    return out


def _user_text(part: UserPromptPart) -> str:
    if isinstance(part.content, str):
        return part.content
    texts: list[str] = []
    for item in part.content:
        if isinstance(item, str):
            texts.append(item)
        elif isinstance(item, TextContent):
            texts.append(item.content)
        elif not isinstance(item, CachePoint):  # a cache hint: vLLM caches prefixes itself
            raise UserError(
                f"KvflowModel sends text only, and the user prompt holds a {type(item).__name__}"
                ": give the fleet's model text"
            )
    return "\n".join(texts)


def _response_message(response: ModelResponse) -> ChatMessage:
    texts: list[str] = []
    calls: list[ToolCall] = []
    for part in response.parts:
        if isinstance(part, TextPart):
            texts.append(part.content)
        elif isinstance(part, ToolCallPart):
            calls.append(
                ToolCall(
                    id=part.tool_call_id, name=part.tool_name, arguments=part.args_as_json_str()
                )
            )
        elif not isinstance(part, ThinkingPart):
            raise UserError(
                f"KvflowModel cannot send back a {type(part).__name__} that another model "
                "answered with: the fleet's models take text and function tool calls"
            )
    return ChatMessage(role="assistant", content="".join(texts), tool_calls=calls or None)


def tools_and_choice(
    params: ModelRequestParameters, settings: ModelSettings | None
) -> tuple[list[ToolSpec], str | None]:
    """The tools to send and kvflow's `tool_choice`, as Pydantic AI's `tool_choice` means them.

    Function and output tools go as function tools. Unset or "auto": the model may answer in
    text when the agent's output allows it ("auto"), else must call a tool ("required");
    "none": only output tools; "required": a tool; a list of names: one of those (by name when
    there is one); `ToolOrOutput`: those function tools or the output.
    """
    definitions = list(params.declared_tool_defs.values())
    if not definitions:
        return [], None
    allow_text = params.allow_text_output
    mode = "auto" if allow_text else "required"
    output_names = {tool.name for tool in params.output_tools}
    choice = (settings or {}).get("tool_choice")
    keep: set[str] | None = None  # None: every tool
    if choice in ("none", []):
        if not output_names:
            return _specs(definitions), "none"
        keep = output_names
    elif choice == "required":
        if not params.declared_function_tools:
            raise UserError(
                'tool_choice is "required" but the agent has no function tools: give it tools '
                'or set tool_choice to "auto" or "none"'
            )
        mode = "required"
    elif isinstance(choice, list):
        keep = set(choice)
        mode = "required"
    elif isinstance(choice, ToolOrOutput):
        keep = set(choice.function_tools) | output_names
    chosen = [tool for tool in definitions if keep is None or tool.name in keep]
    if not chosen:
        known = sorted(tool.name for tool in definitions)
        raise UserError(f"tool_choice {choice!r} names none of the agent's tools {known}")
    if keep is not None and mode == "required" and len(chosen) == 1:
        return _specs(chosen), chosen[0].name
    return _specs(chosen), mode


def _specs(definitions: Sequence[ToolDefinition]) -> list[ToolSpec]:
    return [
        ToolSpec(
            name=tool.name,
            description=tool.description,
            parameters=tool.parameters_json_schema,
            strict=tool.strict,
        )
        for tool in definitions
    ]


def sampling_of(settings: ModelSettings) -> Sampling:
    """The run's sampling settings as kvflow's; an unset one is not sent (the engine's default)."""
    given: dict[str, Any] = {
        "temperature": settings.get("temperature"),
        "top_p": settings.get("top_p"),
    }
    if "seed" in settings:
        given["seed"] = settings["seed"]
    if "stop_sequences" in settings:
        given["stop"] = list(settings["stop_sequences"])
    return Sampling(**given)


def model_response(result: InferenceResult, text: str) -> ModelResponse:
    """A kvflow answer as Pydantic AI's response: text, tool calls, tokens, where it ran."""
    parts: list[ModelResponsePart] = []
    if text:
        parts.append(TextPart(content=text))
    for call in result.tool_calls:
        parts.append(ToolCallPart(call.name, call.arguments, tool_call_id=call.id))
    return ModelResponse(
        parts=parts,
        usage=RequestUsage(
            input_tokens=result.usage.prompt_tokens,
            cache_read_tokens=result.usage.cached_tokens,
            output_tokens=result.usage.completion_tokens,
        ),
        model_name=result.model,
        provider_name=PROVIDER_NAME,
        provider_details={
            "replica": result.replica,
            "cost_micros": result.cost_micros,
            "reused_tokens": result.reused_tokens,
        },
        finish_reason=_FINISH_REASONS.get(result.finish_reason),
    )


__all__ = [
    "DEFAULT_MAX_TOKENS",
    "PROVIDER_NAME",
    "KvflowDurability",
    "KvflowModel",
    "KvflowPydanticAIPlugin",
    "chat_messages",
    "kvflow_model_of",
    "model_response",
    "sampling_of",
    "tools_and_choice",
]

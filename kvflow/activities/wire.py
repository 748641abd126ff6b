"""The wire types: every record that crosses the boundary between workflows and activities.

Workflow code builds these records and activities receive them (or the other way round), so
both layers import them from here and nowhere else. The module imports nothing above the
activities layer and does no I/O: it is safe to pass through Temporal's workflow sandbox.

Temporal decodes a heartbeat's or a failure's details without knowing their type, so they come
back as plain dicts. `AttemptProgress.from_details` is the one way to read them back: it
rebuilds the record and says clearly what is wrong when the details are not one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Literal, Self

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from kvflow.scheduler.placement import Placement, PlacementRequest, Refusal

# ---- context references ---------------------------------------------------------------------

INLINE_LIMIT_BYTES = 2048
"""Contents larger than this travel as a `ContextRef`."""


class ContextRef(BaseModel):
    """A pointer to content in the context store, so conversations live outside history.

    Temporal caps a payload at 2 MB and a history at 50 MB, and agent prompts grow every step.
    Contents above `INLINE_LIMIT_BYTES` are kept in a context store (see
    `kvflow.activities.context_store`) under the SHA-256 of their bytes, and travel as a
    reference of about a hundred bytes. The same digests are the prefix keys the scheduler
    matches on, so two steps that share a long context share its keys.
    """

    digest: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the UTF-8 bytes")
    size: int = Field(ge=0, description="bytes")
    preview: str = Field(
        default="",
        max_length=120,
        description="the first characters, for UIs; empty unless asked for (`ref_for`)",
    )
    tenant: str | None = Field(
        default=None,
        description="the tenant the content is stored for; None for shared content. The "
        "store resolves it only for that tenant",
    )


class ContextPut(BaseModel):
    """Content to store for one tenant (the `context_put` control-plane activity's input)."""

    model_config = ConfigDict(extra="ignore")

    text: str
    tenant: str = Field(min_length=1)


class ContextGet(BaseModel):
    """A reference to read back for one tenant (the `context_get` activity's input).

    The store refuses a reference to another tenant's content, so a digest seen in one task's
    history does not open it in another's.
    """

    model_config = ConfigDict(extra="ignore")

    ref: ContextRef
    tenant: str = Field(min_length=1)


PREVIEW_CHARS = 80
"""The length of a preview, when one is asked for."""


def digest_of(text: str) -> str:
    """The SHA-256 hex digest of `text` as UTF-8: the key it is stored under."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def ref_for(text: str, *, preview: bool = False) -> ContextRef:
    """The reference `text` is stored under (computing it does not store anything).

    With `preview`, the reference carries the first `PREVIEW_CHARS` characters for UIs. Off by
    default: a reference travels through history, and a preview of a prompt or an answer is
    content the store was meant to keep out of it.
    """
    data = text.encode("utf-8")
    return ContextRef(
        digest=hashlib.sha256(data).hexdigest(),
        size=len(data),
        preview=text[:PREVIEW_CHARS] if preview else "",
    )


def needs_store(text: str) -> bool:
    """Whether `text` is too large to travel inline."""
    return len(text.encode("utf-8")) > INLINE_LIMIT_BYTES


# ---- one model call ---------------------------------------------------------------------------


TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"
"""What OpenAI's API (and so vLLM) accepts as a function's name."""


class ToolSpec(BaseModel):
    """A function the model may call: one entry of the OpenAI API's `tools`."""

    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="the arguments' JSON schema",
    )
    strict: bool | None = None

    def to_api(self) -> dict[str, Any]:
        """The tool as an entry of the API's `tools` (fields in the API's order)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


class ToolCall(BaseModel):
    """A call of a `ToolSpec` the model asked for; `arguments` is the JSON text it wrote."""

    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str = "{}"


ToolChoice = str
"""`"auto"`, `"required"`, `"none"`, or the name of the one tool the model must call."""


class ChatMessage(BaseModel):
    """One message of a chat conversation; large contents travel as a `ContextRef`.

    An assistant message may carry the `tool_calls` it made (its content then often empty); a
    `tool` message answers one of them, named by `tool_call_id`.
    """

    role: Literal["system", "user", "assistant", "tool"]
    content: str | ContextRef = ""
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def to_api(self, content: str) -> dict[str, Any]:
        """The message as the API takes it, with `content` (resolved); unset fields left out."""
        body: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            body["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            body["tool_call_id"] = self.tool_call_id
        return body


CONVERSATION = TypeAdapter(list[ChatMessage])
"""How a stored run of messages (`InferenceRequest.earlier_messages`) is encoded."""


class Sampling(BaseModel):
    """Sampling parameters, passed to vLLM as they are.

    A `temperature` or `top_p` of None is sent as no value, so the engine's own default
    applies: what an agent framework's unset setting means.
    """

    temperature: float | None = Field(default=0.0, ge=0)
    top_p: float | None = Field(default=1.0, gt=0, le=1)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    ignore_eos: bool = False


class Checkpoint(BaseModel):
    """Output an earlier attempt already produced, to continue from.

    `text` is a `ContextRef` when the output is larger than `INLINE_LIMIT_BYTES`: checkpoints
    travel in heartbeat and failure details and in the next attempt's input, all of which
    Temporal writes to history.
    """

    text: str | ContextRef = ""
    completion_tokens: int = Field(default=0, ge=0)
    """The output tokens `text` holds, over every attempt that produced it."""


class InferenceRequest(BaseModel):
    """One model call: what to send, and who it is for (for the ledger and the UI)."""

    model: str
    messages: list[ChatMessage] | None = None
    earlier_messages: ContextRef | None = None
    """The conversation before `messages`, stored as a JSON list of `ChatMessage`: a long
    conversation then costs history one reference per call, not one per message."""
    prompt: str | ContextRef | None = None
    max_tokens: int = Field(ge=1)
    sampling: Sampling = Field(default_factory=Sampling)
    json_schema: dict[str, Any] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    tenant: str = "default"
    step: str = "infer"
    deadline: datetime | None = None
    checkpoint: Checkpoint | None = None
    priority: int | None = None
    """The engine priority the scheduler chose (`Placement.engine_priority`, lower first);
    sent to engines that schedule by priority, None for calls placed without one."""
    step_deadline: datetime | None = None
    """When the call's step should end (its objective, `TaskSpec.step_slo_s` from when the
    call was asked); sent to engines that pause lower tiers by it (`Pool.deadline_pause`)."""

    @model_validator(mode="after")
    def _messages_or_prompt(self) -> Self:
        problem = call_input_problem(
            self.model,
            self.messages,
            self.prompt,
            self.max_tokens,
            tools=self.tools,
            tool_choice=self.tool_choice,
        )
        if problem is not None:
            raise ValueError(problem)
        return self


def call_input_problem(
    model: str,
    messages: Sequence[ChatMessage] | None,
    prompt: str | ContextRef | None,
    max_tokens: int,
    *,
    tools: Sequence[ToolSpec] | None = None,
    tool_choice: ToolChoice | None = None,
) -> str | None:
    """What makes a model call's input unusable, and how to fix it; None when it is usable.

    The rule of `InferenceRequest`, kept in one function so that the step API can check a
    call before it builds one and fail the task with a typed error instead.
    """
    if not model:
        return "the model is empty: name a model of the fleet"
    if (messages is None) == (prompt is None):
        return "give exactly one of `messages` (chat) or `prompt` (completion)"
    if messages is not None and not messages:
        return "`messages` is empty: give at least one ChatMessage"
    if prompt == "":
        return "`prompt` is empty: give the text to complete"
    if max_tokens < 1:
        return f"max_tokens is {max_tokens}: ask for at least 1 output token"
    return _tools_problem(messages, tools, tool_choice)


def _tools_problem(
    messages: Sequence[ChatMessage] | None,
    tools: Sequence[ToolSpec] | None,
    tool_choice: ToolChoice | None,
) -> str | None:
    """What is wrong with a call's tools and its choice among them; None when nothing is."""
    if (tools or tool_choice is not None) and messages is None:
        return "tools need a chat call: give `messages`, not `prompt`"
    names = [tool.name for tool in tools or ()]
    if len(set(names)) < len(names):
        twice = sorted({name for name in names if names.count(name) > 1})
        return f"tools {twice} are given twice: give each tool once"
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if not names:
        return f"tool_choice is {tool_choice!r} but no tools are given: give `tools`"
    if tool_choice != "required" and tool_choice not in names:
        return (
            f"tool_choice {tool_choice!r} is not one of the tools {names}: name one of them, "
            '"auto", "required" or "none"'
        )
    return None


class Usage(BaseModel):
    """Tokens of one attempt, as the server counted them."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class Timings(BaseModel):
    """Where the time of one attempt went, in seconds."""

    queue_wait_s: float = 0.0
    """From Temporal scheduling the attempt to a worker starting it."""
    ttft_s: float | None = None
    """From sending the request to the first output token."""
    total_s: float = 0.0
    """From sending the request to the end of the stream."""


class InferenceResult(BaseModel):
    """The answer of one model call and what it cost."""

    text: str
    """The whole answer, including any text reused from a checkpoint; when it is larger than
    `INLINE_LIMIT_BYTES` only its preview, and the answer itself is in the context store."""
    text_ref: ContextRef | None = None
    """Where the whole answer is when it was too large to return inline."""
    finish_reason: str
    usage: Usage
    timings: Timings
    model: str
    replica: str
    pool: str
    gpu: str
    cost_micros: int
    reused_tokens: int = 0
    """Output tokens taken from a checkpoint instead of decoded again."""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    """The tools the model asked to call (`finish_reason` is then "tool_calls")."""


# ---- an attempt in flight, and how it failed -------------------------------------------------


class UnreadableDetails(ValueError):
    """Heartbeat or failure details that are not the `AttemptProgress` this version writes."""


class AttemptBill(BaseModel):
    """What one attempt has cost so far, and where it ran."""

    replica: str | None = None
    """`pool/index`; absent only in failures raised before the worker knew its replica."""
    usage: Usage = Field(default_factory=Usage)
    """This attempt's tokens (output reused from a checkpoint is not decoded, so not here)."""
    cost_micros: int = Field(default=0, ge=0)
    """At the prices of the replica's pool, computed on the GPU worker."""


class AttemptProgress(Checkpoint, AttemptBill):
    """An attempt's partial output and its bill so far.

    The inference activity heartbeats it, and puts it in the details of the error a failed
    attempt raises: the workflow bills the failed attempt from it and resumes the call from
    its text. The fields are flat (a `Checkpoint`'s and an `AttemptBill`'s side by side), as
    the plain dicts they replace were, so details already recorded in histories still read.
    """

    def resumable(self) -> Checkpoint | None:
        """The output to continue from, or None when the attempt produced no text."""
        if not self.text:
            return None
        return Checkpoint(text=self.text, completion_tokens=self.completion_tokens)

    @classmethod
    def from_details(cls, details: Sequence[Any], *, source: str) -> Self | None:
        """Rebuild the record from Temporal details (`details[0]`); None when there are none.

        `source` names where the details came from, for the error: `UnreadableDetails` when
        they are not an `AttemptProgress`, e.g. from a GPU worker of another kvflow version.
        """
        if not details:
            return None
        try:
            return cls.model_validate(details[0])
        except ValidationError as invalid:
            raise UnreadableDetails(
                f"{source} are not an {cls.__name__} ({invalid.error_count()} errors: "
                f"{first_error(invalid)}); do the GPU workers run the same kvflow version "
                "as the workflow worker?"
            ) from invalid


def first_error(invalid: ValidationError) -> str:
    """The first thing `invalid` found wrong, as `where: what` for a one-line message."""
    first = invalid.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "the document"
    return f"{where}: {first['msg']}"


# ---- the control plane's activities ----------------------------------------------------------


class PlaceInput(BaseModel):
    """What the step API knows about a call when it asks for a placement."""

    request: PlacementRequest
    """Everything but the prompt's size and block hashes, which `place` computes."""
    messages: list[ChatMessage] | None = None
    prompt: str | ContextRef | None = None
    checkpoint_text: str | ContextRef = ""
    """Partial output a resume will send as well (it is part of the prompt then)."""
    tools: list[ToolSpec] | None = None
    """The call's tools: the engine renders them into the prompt."""


class PlaceAnswer(BaseModel):
    """A placement, or a refusal; and the prompt size it was computed for.

    Recorded in history (a local activity's result), so it must read back on every later
    version: unknown fields are ignored and every field added later needs a default.
    """

    model_config = ConfigDict(extra="ignore")

    placement: Placement | None = None
    refusal: Refusal | None = None
    prompt_tokens: int = Field(default=0, ge=0)


class AttemptKey(BaseModel):
    """One attempt's ledger key, as the workflow knows it (attempt 1 of the activity id)."""

    workflow_id: str
    run_id: str
    activity_id: str


class ResumedAttempts(BaseModel):
    """Cut attempts of one run whose partial output a later attempt continued."""

    workflow_id: str
    run_id: str
    activity_ids: list[str]


class LostAttempt(BaseModel):
    """An attempt whose GPU worker died (heartbeat timeout), as the workflow saw it last."""

    workflow_id: str
    run_id: str
    activity_id: str
    attempt: int
    workflow_type: str
    step: str
    tenant: str
    model: str
    replica: str
    started_at: AwareDatetime
    ended_at: AwareDatetime
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost_micros: int = 0
    error_type: str

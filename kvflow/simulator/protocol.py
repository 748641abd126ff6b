"""Request bodies and error bodies of vLLM's OpenAI-compatible API, as the simulator reads them.

Unknown fields are accepted and ignored, as vLLM does. Errors use vLLM's body::

    {"error": {"message": str, "type": str, "param": str | None, "code": int}}

with `BadRequestError` (400: bad parameters, among them the cross-field checks of a body such as
`tool_choice` without `tools`, a prompt over the context length with param `input_tokens`,
`max_tokens` above the context length with param `max_tokens`), `Bad Request`
(400: a body that fails schema validation, param its location such as `body.max_tokens`),
`NotFoundError` (404: unknown model, param `model`), and the fault statuses (429, 5xx).
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class ApiError(Exception):
    """An error answered with vLLM's error body and an HTTP status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.error_type = error_type or _ERROR_TYPES.get(status) or HTTPStatus(status).phrase

    def body(self) -> dict[str, Any]:
        """The JSON body: `{"error": {"message", "type", "param", "code"}}`."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status,
            }
        }


class ParameterError(Exception):
    """A cross-field check of a request body failed (vLLM's `VLLMValidationError`).

    Raised inside a body model's validator. Not a `ValueError`, so pydantic lets it through
    instead of wrapping it in a `ValidationError`: vLLM 0.32 answers it as a plain
    `BadRequestError` naming `parameter` (`api_error`), not as a list of validation problems.
    Its text ends with the parameter and the value, as vLLM's does.
    """

    def __init__(self, message: str, *, parameter: str, value: object = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value

    def __str__(self) -> str:
        extras = [f"parameter={self.parameter}"]
        if self.value is not None:
            extras.append(f"value={self.value}")
        return f"{super().__str__()} ({', '.join(extras)})"

    def api_error(self) -> ApiError:
        """The 400 answer: type `BadRequestError`, param the parameter."""
        return ApiError(str(self), param=self.parameter)


def validation_error(exc: ValidationError) -> ApiError:
    """A request body that fails validation, as vLLM reports it: 400, type `Bad Request`.

    The message lists each problem with its location under `body`; `param` is the first
    problem's location (e.g. `body.max_tokens`).
    """
    problems = []
    for error in exc.errors(include_url=False, include_context=False):
        location = ".".join(["body", *(str(p) for p in error["loc"])])
        problems.append(
            {"type": error["type"], "loc": location, "msg": error["msg"], "input": error["input"]}
        )
    count = len(problems)
    lines = "\n  ".join(repr(p) for p in problems)
    message = f"{count} validation error{'s' if count != 1 else ''}:\n  {lines}"
    param = problems[0]["loc"] if problems else None
    return ApiError(message, param=param, error_type="Bad Request")


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class StreamOptions(_Body):
    """`stream_options` of a streaming request."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(_Body):
    """`response_format.json_schema`."""

    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """`response_format`: free text, any JSON object, or an instance of a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's own `structured_outputs` parameter (only `json` is simulated)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")


class SamplingBody(_Body):
    """Sampling fields common to completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int = 1
    min_tokens: int = 0
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    cache_salt: str | None = None
    """vLLM's prefix-cache salt: it enters the hash of the prompt's first block only, so
    requests with other salts (or none) share no cached block with this one."""


class CompletionBody(SamplingBody):
    """`POST /v1/completions`."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False


class FunctionDefinition(_Body):
    """A function a chat request offers the model: its name and its arguments' JSON schema."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Body):
    """One entry of `tools` (only function tools exist in the chat API)."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


MAX_TOP_LOGPROBS = 20
"""vLLM's default `--max-logprobs`: the most `top_logprobs` a request may ask for."""

_NAMED_CHOICE_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


class ChatBody(SamplingBody):
    """`POST /v1/chat/completions`.

    `tools`, `tool_choice` and `top_logprobs` are checked as vLLM checks them (a
    `ParameterError`); `tool_choice` defaults to `"auto"` when tools are given.
    """

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    logprobs: bool | None = False
    top_logprobs: int | None = 0

    @model_validator(mode="after")
    def _check_tool_usage(self) -> Self:
        # vLLM's `check_tool_usage`, with its messages and parameters.
        if self.tools == []:
            raise ParameterError(
                "`tools` must not be an empty array. Either provide at least one tool or omit "
                "the field entirely.",
                parameter="tools",
            )
        choice = self.tool_choice
        if choice is None and self.tools:
            self.tool_choice = choice = "auto"
        if choice is None or choice == "none":
            return self
        if self.tools is None:
            raise ParameterError(
                "When using `tool_choice`, `tools` must be set.", parameter="tool_choice"
            )
        if isinstance(choice, str):
            if choice not in ("auto", "required"):
                raise ParameterError(
                    f"Invalid value for `tool_choice`: {choice}! Only named tools, "
                    '"none", "auto" or "required" are supported.',
                    parameter="tool_choice",
                )
            return self
        function = choice.get("function")
        if not isinstance(function, dict):
            raise ParameterError(
                f"Invalid value for `function`: `{function}` in `tool_choice`! "
                f"{_NAMED_CHOICE_USAGE}",
                parameter="tool_choice.function",
            )
        if "name" not in function:
            raise ParameterError(
                f"Expected field `name` in `function` in `tool_choice`! {_NAMED_CHOICE_USAGE}",
                parameter="tool_choice.function.name",
            )
        name = function["name"]
        if not isinstance(name, str) or not name:
            raise ParameterError(
                f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_NAMED_CHOICE_USAGE}",
                parameter="tool_choice.function.name",
            )
        if all(tool.function.name != name for tool in self.tools):
            raise ParameterError(
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                parameter="tool_choice",
            )
        return self

    @model_validator(mode="after")
    def _check_logprobs(self) -> Self:
        # vLLM's `check_logprobs`; the engine's cap (MAX_TOP_LOGPROBS) is the server's check.
        top = self.top_logprobs
        if top is None:
            self.top_logprobs = top = 0
        if top < 0 and top != -1:
            raise ParameterError(
                "`top_logprobs` must be a positive value or -1.",
                parameter="top_logprobs",
                value=top,
            )
        if top != 0 and not self.logprobs:
            raise ParameterError(
                "when using `top_logprobs`, `logprobs` must be set to true.",
                parameter="top_logprobs",
            )
        return self

    @property
    def named_tool(self) -> ChatTool | None:
        """The tool a named `tool_choice` (`{"type": "function", ...}`) asks for, else None."""
        choice = self.tool_choice
        if not isinstance(choice, dict) or not self.tools:
            return None
        name = choice["function"]["name"]
        return next(tool for tool in self.tools if tool.function.name == name)


class TokenizeBody(_Body):
    """`POST /tokenize`: a prompt, or messages (and tools) rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[ChatTool] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeBody(_Body):
    """`POST /detokenize`."""

    model: str | None = None
    tokens: list[int]


def template_tools(tools: list[ChatTool] | None) -> list[dict[str, Any]]:
    """A request's `tools` as the chat template takes them (none: an empty list).

    The built-in tokenizer writes them into the prompt with
    `kvflow.scheduler.tokens.render_tools`, as it does for the scheduler's placements, so that
    a placement hashes the prompt the simulated engine caches.
    """
    return [tool.model_dump(exclude_none=True) for tool in tools or ()]

"""Request bodies and error bodies of vLLM's OpenAI-compatible API, as the simulator reads them.

Unknown fields are accepted and ignored, as vLLM does. Errors use vLLM's body::

    {"error": {"message": str, "type": str, "param": str | None, "code": int}}

with `BadRequestError` (400: bad parameters, a prompt over the context length with param
`input_tokens`, `max_tokens` above the context length with param `max_tokens`), `Bad Request`
(400: a body that fails schema validation, param its location such as `body.max_tokens`),
`NotFoundError` (404: unknown model, param `model`), and the fault statuses (429, 5xx).
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

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


class CompletionBody(SamplingBody):
    """`POST /v1/completions`."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False


class ChatBody(SamplingBody):
    """`POST /v1/chat/completions`."""

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class TokenizeBody(_Body):
    """`POST /tokenize`: a prompt, or messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeBody(_Body):
    """`POST /detokenize`."""

    model: str | None = None
    tokens: list[int]

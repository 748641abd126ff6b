"""Every way a model call can fail, and the one place where failures become Temporal errors.

The hierarchy says what is retryable. The control plane (the workflow's step API) retries a
retryable failure by re-placing the call on another replica; Temporal itself never retries an
inference activity (`maximum_attempts=1`), so paid calls are never multiplied by stacked
retries. HTTP statuses and transport errors are mapped here and nowhere else.

    InferenceError
    ├── RetryableInferenceError          the replica failed; another may succeed
    │   ├── ReplicaUnreachable           connect error, connection refused or reset
    │   ├── ReplicaTimeout               no answer (or no token) in time
    │   ├── ReplicaOverloaded            429
    │   ├── ReplicaServerError           5xx
    │   ├── ReplicaShuttingDown          its GPU worker stopped mid-call and handed it back
    │   ├── StreamCut                    the stream ended before the answer did
    │   ├── MalformedResponse            a 200 answer that is not an OpenAI stream
    │   └── InvalidUsage                 token counts missing, or ones that cannot be true
    └── PermanentInferenceError          the request itself is wrong; retrying cannot help
        ├── ContextLengthExceeded        prompt + max_tokens over the model's context
        ├── UnknownModel                 404 / model not served
        ├── InvalidRequest               any other 4xx
        └── SchemaInvalidOutput          structured output still invalid after repairs
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar

import httpx
from temporalio.exceptions import ApplicationError

from kvflow.activities.wire import AttemptProgress


class InferenceError(Exception):
    """A model call failed."""

    retryable: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        replica: str | None = None,
        status: int | None = None,
        details: AttemptProgress | None = None,
    ) -> None:
        self.replica = replica
        self.status = status
        self.details = details
        """What the attempt produced and cost before it failed; the activity fills it in."""
        where = f"replica {replica}: " if replica else ""
        code = f"HTTP {status}: " if status else ""
        super().__init__(f"{where}{code}{message}")

    @property
    def error_type(self) -> str:
        """The `ApplicationError.type` this failure travels under (the class name)."""
        return type(self).__name__

    def to_application_error(self) -> ApplicationError:
        """The Temporal error the activity raises; `details[0]` is its `AttemptProgress`.

        Details travel as plain JSON, so any payload converter encodes them; the workflow
        reads them back with `AttemptProgress.from_details`.
        """
        details = [] if self.details is None else [self.details.model_dump(mode="json")]
        return ApplicationError(
            str(self),
            *details,
            type=self.error_type,
            non_retryable=not self.retryable,
        )


class RetryableInferenceError(InferenceError):
    """The replica failed; another replica (or the same one later) may succeed."""

    retryable = True


class ReplicaUnreachable(RetryableInferenceError):
    """The replica refused or dropped the connection."""


class ReplicaTimeout(RetryableInferenceError):
    """The replica did not answer, or stopped streaming, within the timeout."""


class ReplicaOverloaded(RetryableInferenceError):
    """The replica answered 429: it is shedding load."""


class ReplicaServerError(RetryableInferenceError):
    """The replica answered 5xx."""


class ReplicaShuttingDown(RetryableInferenceError):
    """The GPU worker shut down mid-call; details carry the partial output."""


class StreamCut(RetryableInferenceError):
    """The stream ended before a finish reason; details carry the partial output."""


class MalformedResponse(RetryableInferenceError):
    """The replica answered 200 with something other than an OpenAI event stream.

    A body that is not an event stream, an event whose data is not a JSON object, or a chunk
    of the wrong shape. Details carry the output parsed before it, to continue from.
    """


class InvalidUsage(RetryableInferenceError):
    """The replica's token counts are missing or cannot be true, so its bill cannot be either.

    The attempt is billed from its last valid report, or from what the stream showed (the
    prompt, by the built-in tokenizer, once an answer chunk arrived; the chunks decoded), and
    its output is not continued: an engine that miscounts the prompt may not have seen it all.
    """


class PermanentInferenceError(InferenceError):
    """The request itself is wrong; sending it again anywhere gives the same answer."""


class ContextLengthExceeded(PermanentInferenceError):
    """The prompt plus `max_tokens` do not fit in the model's context."""


class UnknownModel(PermanentInferenceError):
    """The replica does not serve the requested model."""


class InvalidRequest(PermanentInferenceError):
    """The replica rejected the request's parameters."""


class SchemaInvalidOutput(PermanentInferenceError):
    """Structured output did not match the schema after the allowed repairs."""


RETRYABLE_TYPES: frozenset[str] = frozenset(
    cls.__name__
    for cls in (
        ReplicaUnreachable,
        ReplicaTimeout,
        ReplicaOverloaded,
        ReplicaServerError,
        ReplicaShuttingDown,
        StreamCut,
        MalformedResponse,
        InvalidUsage,
    )
) | {"WorkerShutdown"}  # the SDK's type for a call that a stopping worker did not finish
"""`ApplicationError.type` values that the step API re-places on another replica."""


def vllm_error_text(body: bytes | str) -> str:
    """The message of a vLLM error body (`{"error": {"message": ...}}`), or the raw text."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        parsed = json.loads(text)
    except ValueError:
        return text.strip()[:500] or "(empty body)"
    if isinstance(parsed, dict):
        error = parsed.get("error", parsed)
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "detail" in parsed:
            return str(parsed["detail"])
    return text.strip()[:500]


def from_status(status: int, body: bytes | str, *, replica: str) -> InferenceError:
    """Map a non-2xx answer from a vLLM server to the error it means."""
    message = vllm_error_text(body)
    return _error_class(status, message)(message, replica=replica, status=status)


_STATUS_OF_ERROR_TYPE = {
    "badrequesterror": 400,
    "bad request": 400,
    "invalid_request_error": 400,
    "notfounderror": 404,
    "not_found_error": 404,
    "ratelimiterror": 429,
    "rate_limit_error": 429,
    "internalservererror": 500,
    "server_error": 500,
    "serviceunavailableerror": 503,
}
"""The HTTP status an error body's `type` stands for, when its `code` is not one."""


def error_of(document: object) -> Mapping[str, Any] | None:
    """The error a JSON document reports, or None when it reports none.

    vLLM writes `{"error": {"message", "type", "param", "code"}}`; versions before 0.6 wrote
    the fields at the top level with `"object": "error"`. Either may come with status 200: in
    the body of a streamed answer, or as one of its events.
    """
    if not isinstance(document, Mapping):
        return None
    error = document.get("error")
    if isinstance(error, Mapping):
        return error
    if error is not None:
        return {"message": str(error)}
    if document.get("object") == "error":
        return document
    return None


def from_error_body(error: Mapping[str, Any], *, replica: str) -> InferenceError:
    """Map an error reported inside a 200 answer (see `error_of`) to the error it means.

    Its `code` is the HTTP status the engine meant (vLLM writes it), or else its `type` names
    one; an error that says neither is taken for the replica's own fault (500, retryable).
    """
    status = _status_of(error)
    message = str(error.get("message") or error.get("type") or "(no message)")[:500]
    return _error_class(status, message)(
        f"error in a 200 answer (code {status}): {message}", replica=replica
    )


def _status_of(error: Mapping[str, Any]) -> int:
    code = error.get("code")
    if isinstance(code, str) and code.strip().isdigit():
        code = int(code)
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599:
        return code
    kind = error.get("type")
    if isinstance(kind, str):
        return _STATUS_OF_ERROR_TYPE.get(kind.lower(), 500)
    return 500


def _error_class(status: int, message: str) -> type[InferenceError]:
    lowered = message.lower()
    cls: type[InferenceError]
    if status == 429:
        cls = ReplicaOverloaded
    elif status >= 500:
        cls = ReplicaServerError
    elif status == 404 or ("model" in lowered and "does not exist" in lowered):
        cls = UnknownModel
    elif "maximum context length" in lowered or "context length" in lowered:
        cls = ContextLengthExceeded
    elif status == 408:
        cls = ReplicaTimeout
    else:
        cls = InvalidRequest
    return cls


def from_transport(exc: httpx.TransportError, *, replica: str) -> InferenceError:
    """Map an httpx transport failure (no HTTP answer, or a broken stream) to its error."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        return ReplicaTimeout(text, replica=replica)
    if isinstance(exc, httpx.ConnectError):
        return ReplicaUnreachable(text, replica=replica)
    # RemoteProtocolError, ReadError: the server went away in the middle of an answer.
    return StreamCut(text, replica=replica)

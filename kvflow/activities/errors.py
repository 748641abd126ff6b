"""Every way a model call can fail, and the one place where failures become Temporal errors.

The hierarchy says what is retryable. The control plane (the workflow's step API) retries a
retryable failure by re-placing the call on another replica; Temporal itself never retries an
inference activity (`maximum_attempts=1`), so paid calls are never multiplied by stacked
retries. HTTP statuses and transport errors are mapped here and nowhere else, and every text
they carry is capped (`ENGINE_TEXT_LIMIT`, `MESSAGE_LIMIT_BYTES`): Temporal records it.

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
from kvflow.scheduler.redact import scrub_secrets


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
        # Capped here, not only in `to_application_error`: Temporal records an error's cause
        # (`raise ... from exc`) in history too, with this message.
        super().__init__(capped(f"{where}{code}{message}"))

    @property
    def error_type(self) -> str:
        """The `ApplicationError.type` this failure travels under (the class name)."""
        return type(self).__name__

    def to_application_error(self) -> ApplicationError:
        """The Temporal error the activity raises; `details[0]` is its `AttemptProgress`.

        Details travel as plain JSON, so any payload converter encodes them; the workflow
        reads them back with `AttemptProgress.from_details`. The message is `capped` (at
        construction).
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


class ContextStoreFailed(RetryableInferenceError):
    """The GPU worker could not store the answer (disk full, read-only, store unreachable)."""


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
        ContextStoreFailed,
        StreamCut,
        MalformedResponse,
        InvalidUsage,
    )
) | {"WorkerShutdown"}  # the SDK's type for a call that a stopping worker did not finish
"""`ApplicationError.type` values that the step API re-places on another replica."""


ENGINE_TEXT_LIMIT = 500
"""Characters kept of any text an engine or a transport error supplies.

vLLM's own messages fit (a context-length error with its numbers is about 200); what does not
is an echo of the request, e.g. a 400 that quotes the prompt or a validation
error's `input`. That would put the conversation, kept out of history by the context store,
back into the failure Temporal records."""

MESSAGE_LIMIT_BYTES = 1024
"""UTF-8 bytes of an `ApplicationError` message an activity raises, whatever built it.

Temporal writes the message to history. Content over `INLINE_LIMIT_BYTES` (2 KiB) travels by
reference, so no text in history is longer than that; half of it leaves room for what a
workflow adds when it quotes the message in the task's own failure."""


def capped(text: str, limit_bytes: int = MESSAGE_LIMIT_BYTES) -> str:
    """`text`, or its start and the count of characters cut, in at most `limit_bytes` bytes."""
    if len(text.encode("utf-8")) <= limit_bytes:
        return text
    suffix = f"... ({len(text):,} characters, cut)"
    room = limit_bytes - len(suffix.encode("utf-8"))
    head = text.encode("utf-8")[: max(room, 0)].decode("utf-8", "ignore")
    return head + suffix


def engine_text(text: str) -> str:
    """Text from an engine or a transport error, stripped and cut to `ENGINE_TEXT_LIMIT`."""
    text = text.strip()
    return text if len(text) <= ENGINE_TEXT_LIMIT else text[:ENGINE_TEXT_LIMIT] + "..."


def vllm_error_text(body: bytes | str) -> str:
    """The message of a vLLM error body (`{"error": {"message": ...}}`), or the raw text.

    Either way at most `ENGINE_TEXT_LIMIT` characters: a message may quote the request.
    """
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        parsed = json.loads(text)
    except ValueError:
        return engine_text(text) or "(empty body)"
    if isinstance(parsed, dict):
        error = parsed.get("error", parsed)
        if isinstance(error, dict) and "message" in error:
            return engine_text(str(error["message"]))
        if "detail" in parsed:
            return engine_text(str(parsed["detail"]))
    return engine_text(text)


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
    message = engine_text(str(error.get("message") or error.get("type") or "(no message)"))
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
    """Map an httpx transport failure (no HTTP answer, or a broken stream) to its error.

    Its text is `engine_text`, and holds no secret of the URL it was sent to: some errors
    quote the URL, or a piece of a password they could not parse.
    """
    text = engine_text(scrub_secrets(str(exc), _request_url(exc)))
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        return ReplicaTimeout(text, replica=replica)
    if isinstance(exc, httpx.ConnectError):
        return ReplicaUnreachable(text, replica=replica)
    # RemoteProtocolError, ReadError: the server went away in the middle of an answer.
    return StreamCut(text, replica=replica)


def _request_url(exc: httpx.TransportError) -> str | None:
    try:
        return str(exc.request.url)
    except RuntimeError:  # raised without a request (httpx sets it on every transport error)
        return None

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

import hashlib
import json
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import httpx
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

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
            # Classified, so expected: Temporal logs its traceback at DEBUG only, and kvflow's
            # workers log it as one line (`kvflow.workers.failure_log`).
            category=ApplicationErrorCategory.BENIGN,
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

vLLM's own messages fit (a context-length error with its numbers is about 200). Text that
quotes the request (a 400 that echoes the prompt, a validation error's `input`) is not kept
at all (`SentText`): that would put the conversation, kept out of history by the context
store, back into the failure Temporal records."""

QUOTE_MIN_CHARS = 8
"""The shortest run of the request's text that makes an engine's message a quote of it.

Shorter runs are common words ("tokens", "length") that an engine's own message and a prompt
share by chance; eight characters of a conversation are already a piece of it."""

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


class SentText:
    """The request's own text, as a call sent it: what an engine's message must not quote.

    Message contents, the prompt, the partial answer a call continues and tool-call arguments
    travel through history by reference when they are large, so no piece of them may come
    back in a failure's message. Built from the request body; read only when a call fails.
    """

    def __init__(self, body: Mapping[str, Any] | None = None) -> None:
        self._body = body
        self._haystack: str | None = None

    def _text(self) -> str:
        if self._haystack is None:
            forms: set[str] = set()
            for text in _contents(self._body or {}):
                if len(text) >= QUOTE_MIN_CHARS:
                    # An engine may quote the request as it parsed it or as JSON (escaped).
                    forms |= {
                        text,
                        json.dumps(text)[1:-1],
                        json.dumps(text, ensure_ascii=False)[1:-1],
                    }
            self._haystack = "\x00".join(forms)
        return self._haystack

    def quoted_in(self, text: str) -> bool:
        """Whether `text` holds a run of `QUOTE_MIN_CHARS` characters of the request's text."""
        haystack = self._text()
        if not haystack:
            return False
        runs = {text[i : i + QUOTE_MIN_CHARS] for i in range(len(text) - QUOTE_MIN_CHARS + 1)}
        return any(run in haystack for run in runs)

    def kept(self, text: str) -> str:
        """`engine_text(text)`, or a line naming it by digest when it quotes the request."""
        short = engine_text(text)
        if not self.quoted_in(short):
            return short
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
        return (
            f"(message left out: it quotes the request; {len(text):,} characters, sha256 {digest})"
        )


NOTHING_SENT = SentText()
"""For a failure with no request text to hide (no request was built)."""


def _contents(body: Mapping[str, Any]) -> Iterator[str]:
    """The conversation's text in a chat or completion request body."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        yield prompt
    for message in body.get("messages") or ():
        if not isinstance(message, Mapping):
            continue
        content = message.get("content")
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):  # content parts: [{"type": "text", "text": ...}]
            yield from (str(part.get("text")) for part in content if isinstance(part, Mapping))
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(function, Mapping) and isinstance(function.get("arguments"), str):
                yield function["arguments"]


def vllm_error_text(body: bytes | str, sent: SentText = NOTHING_SENT) -> str:
    """What identifies the error in a vLLM error body, without any quote of the request.

    vLLM writes `{"error": {"message", "type", "param", "code"}}`: the type, code and param
    are kept, and the message unless it quotes the request (`SentText.kept`). A validation
    error's `detail` keeps each problem's place and text, never its `input`. Other bodies
    are raw text, under the same rule. Either way at most about `ENGINE_TEXT_LIMIT` characters.
    """
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        parsed = json.loads(text)
    except ValueError:
        return sent.kept(text) or "(empty body)"
    if isinstance(parsed, dict):
        error = error_of(parsed)
        if error is not None:
            return describe_error(error, sent)
        if "detail" in parsed:
            return sent.kept(_detail_text(parsed["detail"]))
    return sent.kept(text)


def describe_error(error: Mapping[str, Any], sent: SentText = NOTHING_SENT) -> str:
    """`type (code C, param P): message` of an engine's error object.

    The type, code and param are vLLM's own short names; the message is kept as
    `SentText.kept` keeps it. None of them is kept if it quotes the request.
    """
    labels = [
        f"{name} {engine_text(str(error[name]))[:64]}"
        for name in ("code", "param")
        if error.get(name) is not None and not sent.quoted_in(str(error[name]))
    ]
    kind = error.get("type")
    head = engine_text(str(kind))[:64] if kind and not sent.quoted_in(str(kind)) else ""
    head = f"{head} ({', '.join(labels)})" if labels else head
    message = error.get("message")
    if message is None:
        return head or "(no message)"
    message = sent.kept(str(message))
    return f"{head}: {message}" if head else message


def _detail_text(detail: object) -> str:
    """A validation error's `detail` as `loc: msg` lines, without the `input` it quotes."""
    if not isinstance(detail, list):
        return str(detail)
    problems = [
        f"{'.'.join(str(part) for part in item.get('loc') or ())}: {item.get('msg')}"
        for item in detail
        if isinstance(item, Mapping)
    ]
    return "; ".join(problems) or str(detail)


def from_status(status: int, body: bytes | str, *, replica: str, sent: SentText) -> InferenceError:
    """Map a non-2xx answer from a vLLM server to the error it means.

    The class is chosen on the engine's own message (a context-length error stays one even
    when its text is left out); the error's text keeps only what `vllm_error_text` keeps
    with `sent`, so no piece of the request reaches history.
    """
    cls = _error_class(status, vllm_error_text(body))
    return cls(vllm_error_text(body, sent), replica=replica, status=status)


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


def from_error_body(error: Mapping[str, Any], *, replica: str, sent: SentText) -> InferenceError:
    """Map an error reported inside a 200 answer (see `error_of`) to the error it means.

    Its `code` is the HTTP status the engine meant (vLLM writes it), or else its `type` names
    one; an error that says neither is taken for the replica's own fault (500, retryable).
    The text keeps what `describe_error` keeps: no piece of the request (`sent`).
    """
    status = _status_of(error)
    whole = str(error.get("message") or error.get("type") or "(no message)")
    message = describe_error({**error, "code": None}, sent)
    return _error_class(status, whole)(
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


def from_transport(
    exc: httpx.TransportError, *, replica: str, sent: SentText = NOTHING_SENT
) -> InferenceError:
    """Map an httpx transport failure (no HTTP answer, or a broken stream) to its error.

    Its text is kept as `SentText.kept` keeps it, and holds no secret of the URL it was sent
    to: some errors quote the URL, or a piece of a password they could not parse.
    """
    text = sent.kept(scrub_secrets(str(exc), _request_url(exc)))
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

"""An engine's error text cannot carry a conversation back into workflow history.

Conversations above 2 KiB travel as context references, so history holds none of them. An
engine's 400 may quote the request it refused, though, and the failure Temporal records
would then hold the conversation in the clear. An engine's text that quotes any run of
`QUOTE_MIN_CHARS` characters of the request is left out (its error type, code and a digest
stay); other text is capped: an engine's at `ENGINE_TEXT_LIMIT` characters, a whole activity
error at `MESSAGE_LIMIT_BYTES`; so no text in history exceeds 2 KiB.
"""

from __future__ import annotations

import contextlib
import json
import random
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from google.protobuf.message import Message
from starlette.responses import JSONResponse, Response
from temporalio.client import Client
from temporalio.exceptions import ApplicationError

from kvflow.activities.control_plane import permanent_errors_fail_at_once
from kvflow.activities.errors import (
    ENGINE_TEXT_LIMIT,
    MESSAGE_LIMIT_BYTES,
    NOTHING_SENT,
    QUOTE_MIN_CHARS,
    InvalidRequest,
    SentText,
    from_error_body,
    from_status,
    from_transport,
)
from kvflow.activities.wire import INLINE_LIMIT_BYTES, ChatMessage, InferenceRequest, Sampling
from kvflow.ledger.errors import LedgerNotFound
from tests.test_engine_responses import (  # noqa: F401 - the fixtures of the scripted engine
    MAX_TOKENS,
    MODEL,
    WORKFLOW_QUEUE,
    BrokenReplica,
    Call,
    CallBrokenEngine,
    CallOutcome,
    chunk,
    engine,
    replica,
    sse,
    workflow_worker,
)

END_OF_CONVERSATION = "END-OF-THE-CONVERSATION-7f3a"


def _conversation(chars: int = 8_000) -> str:
    """A long conversation as an engine would quote it, ending with a marker."""
    turns = "".join(f"user: turn {i} of a long research task; " for i in range(chars // 40))
    return turns + END_OF_CONVERSATION


def _size(text: str) -> int:
    return len(text.encode("utf-8"))


def _sent(conversation: str) -> SentText:
    """What a chat call with `conversation` as its one message sent."""
    return SentText({"messages": [{"role": "user", "content": conversation}]})


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "body",
    [
        {"error": {"message": f"bad request: {_conversation()}", "code": 400}},
        {"object": "error", "message": f"messages: {_conversation()}", "code": 400},
        {"detail": [{"loc": ["body"], "msg": "invalid", "input": _conversation()}]},
        {"error": {"message": "é€𝄞" * 3_000, "code": 400}},  # 1 to 4 bytes a character
    ],
    ids=["error.message", "old vLLM message", "validation detail", "non-ASCII"],
)
def test_a_json_error_quoting_the_request_is_capped(body: dict[str, Any]) -> None:
    sent = _sent(_conversation() if "é" not in json.dumps(body) else "é€𝄞" * 3_000)
    error = from_status(400, json.dumps(body), replica="h100/0", sent=sent).to_application_error()
    assert error.type == "InvalidRequest"
    assert END_OF_CONVERSATION not in error.message
    assert not sent.quoted_in(error.message)
    assert _size(error.message) <= MESSAGE_LIMIT_BYTES
    assert error.message.startswith("replica h100/0: HTTP 400: ")
    assert len(error.message) <= len("replica h100/0: HTTP 400: ") + ENGINE_TEXT_LIMIT + 3


@pytest.mark.timeout(10)
def test_an_engine_message_that_quotes_no_request_text_is_kept_with_its_type_and_code() -> None:
    message = (
        "This model's maximum context length is 2048 tokens. However, you requested 2100 "
        "tokens (1900 in the messages, 200 in the completion)."
    )
    body = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
    error = from_status(400, json.dumps(body), replica="h100/0", sent=_sent(_conversation()))
    assert error.error_type == "ContextLengthExceeded"
    assert str(error) == f"replica h100/0: HTTP 400: BadRequestError (code 400): {message}"


@pytest.mark.timeout(10)
def test_an_engine_message_quoting_a_short_run_of_the_request_is_left_out_but_typed() -> None:
    # Twelve characters of the prompt are enough to leave the whole message out; the class
    # is still chosen on it (a context-length error stays one).
    prompt = "Summarise the quarterly figures of ACME-7731 for the board."
    message = "maximum context length exceeded while reading 'figures of ACME-7731'"
    body = {"error": {"message": message, "type": "BadRequestError", "code": 400}}
    error = from_status(400, json.dumps(body), replica="h100/0", sent=_sent(prompt))
    assert error.error_type == "ContextLengthExceeded"
    assert "ACME" not in str(error) and "figures" not in str(error)
    assert str(error).startswith(
        "replica h100/0: HTTP 400: BadRequestError (code 400): (message left out"
    )
    assert "sha256 " in str(error)


@pytest.mark.timeout(10)
def test_every_other_outside_text_is_capped() -> None:
    long = _conversation()
    sent = _sent(long)
    in_a_200 = from_error_body({"message": long, "code": 400}, replica="h100/0", sent=sent)
    assert END_OF_CONVERSATION not in str(in_a_200)
    assert not sent.quoted_in(str(in_a_200))
    request = httpx.Request("POST", "http://10.0.0.5:8000/v1/chat/completions")
    error = httpx.RemoteProtocolError(long, request=request)
    cut = from_transport(error, replica="h100/0", sent=NOTHING_SENT)
    assert END_OF_CONVERSATION not in str(cut)
    assert not sent.quoted_in(str(from_transport(error, replica="h100/0", sent=sent)))
    # Any message kvflow builds: the cap holds for the error and for its `str`, which Temporal
    # records as the cause of the activity's error.
    built = InvalidRequest(f"the request was {long}", replica="h100/0")
    assert _size(str(built)) <= MESSAGE_LIMIT_BYTES
    assert _size(built.to_application_error().message) <= MESSAGE_LIMIT_BYTES
    with pytest.raises(ApplicationError) as failed, permanent_errors_fail_at_once():
        raise LedgerNotFound(f"no ledger: {long}")
    assert _size(failed.value.message) <= MESSAGE_LIMIT_BYTES
    assert failed.value.__cause__ is None


def _texts(message: Message) -> Iterator[str | bytes]:
    """Every string and bytes value inside a history event, however deeply nested."""
    for _field, value in message.ListFields():
        if isinstance(value, str | bytes):
            yield value
        elif isinstance(value, Message):
            yield from _texts(value)
        elif not isinstance(value, int | float | bool):
            items = value.values() if hasattr(value, "values") else value
            for item in items:
                if isinstance(item, Message):
                    yield from _texts(item)
                elif isinstance(item, str | bytes):
                    yield item


def _history_texts(texts: list[str | bytes]) -> list[str]:
    """Each text of a history as it reads, and each payload's JSON decoded to its strings."""
    found: list[str] = []

    def strings(value: object) -> Iterator[str]:
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            for key, item in value.items():
                yield key
                yield from strings(item)
        elif isinstance(value, list):
            for item in value:
                yield from strings(item)

    for text in texts:
        decoded = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        found.append(decoded)
        with contextlib.suppress(ValueError):  # not a JSON payload: searched as it is
            found.extend(strings(json.loads(decoded)))
    return found


def _runs(text: str, length: int = QUOTE_MIN_CHARS) -> set[str]:
    return {text[i : i + length] for i in range(len(text) - length + 1)}


def _private_conversation(words: int = 600) -> str:
    """A long conversation of made-up words (letters no id or digest uses), over 2 KiB."""
    pick = random.Random(11)  # the same words every run
    letters = "ghjkmnpqrstvwxyz"
    return " ".join("".join(pick.choices(letters, k=pick.randint(3, 9))) for _ in range(words))


ENGINE_ANSWERS_THAT_QUOTE: dict[str, Callable[[dict[str, Any]], Response]] = {
    # vLLM's 400 when it cannot render the request: the message embeds what it was sent.
    "400 quoting the body": lambda sent: JSONResponse(
        {
            "error": {
                "message": f"Invalid request {json.dumps(sent)}",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
        },
        status_code=400,
    ),
    # FastAPI's validation error: each problem carries the `input` it refused.
    "validation detail": lambda sent: JSONResponse(
        {
            "detail": [
                {
                    "type": "string_too_long",
                    "loc": ["body", "messages", 0, "content"],
                    "msg": "String should have at most 1000 characters",
                    "input": sent["messages"][0]["content"],
                }
            ]
        },
        status_code=400,
    ),
    # An error event in a 200 stream, quoting the conversation's start.
    "error event in a stream": lambda sent: sse(
        chunk(role=True),  # no usage yet: the error comes before the engine counts
        {"error": {"message": f"render failed: {sent['messages'][0]['content'][:300]}"}},
    ),
    # A proxy's page with status 200 that echoes the request.
    "page echoing the request": lambda sent: Response(
        f"<html>rejected: {sent['messages'][0]['content'][:400]}</html>", media_type="text/html"
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("quoting", "error_type"),
    [
        ("400 quoting the body", "InvalidRequest"),
        ("validation detail", "InvalidRequest"),
        ("error event in a stream", "ReplicaServerError"),
        ("page echoing the request", "MalformedResponse"),
    ],
)
async def test_no_piece_of_a_conversation_an_engine_quotes_reaches_history(
    quoting: str,
    error_type: str,
    replica: BrokenReplica,  # noqa: F811 - the fixture imported above
    temporal_client: Client,
) -> None:
    conversation = _private_conversation()
    assert _size(conversation) > INLINE_LIMIT_BYTES  # it travels by reference
    ref = await replica.worker.activities.store.aput(conversation, "acme")
    answer_with = ENGINE_ANSWERS_THAT_QUOTE[quoting]
    replica.engine.script = lambda: answer_with(replica.engine.bodies[-1])
    request = InferenceRequest(
        model=MODEL,
        messages=[ChatMessage(role="user", content=ref)],
        max_tokens=MAX_TOKENS,
        sampling=Sampling(seed=7),
        tenant="acme",
        step="test",
    )
    handle = await temporal_client.start_workflow(
        CallBrokenEngine.run,
        Call(request=request, task_queue=replica.worker.task_queue),
        id=f"quoting-engine-{uuid.uuid4()}",
        task_queue=WORKFLOW_QUEUE,
    )
    outcome: CallOutcome = await handle.result()
    assert outcome.error_type == error_type, outcome
    assert (outcome.message or "").startswith(f"replica {replica.worker.binding.name}: ")
    assert replica.engine.bodies[-1]["messages"][0]["content"] == conversation  # it was sent

    history = await handle.fetch_history()
    texts = _history_texts([text for event in history.events for text in _texts(event)])
    assert any(outcome.message == text for text in texts)  # the failure is in history
    seen = set().union(*(_runs(text) for text in texts))
    leaked = _runs(conversation) & seen
    assert not leaked, f"{len(leaked)} pieces of the conversation in history: {sorted(leaked)[:5]}"
    assert max(_size(text) for text in texts) <= INLINE_LIMIT_BYTES

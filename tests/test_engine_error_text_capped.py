"""An engine's error text cannot carry a conversation back into workflow history.

Conversations above 2 KiB travel as context references, so history holds none of them. An
engine's 400 may quote the request it refused, though, and the failure Temporal records
would then hold the conversation in the clear. Whatever the engine answers, each failure
message is capped: an engine's text at `ENGINE_TEXT_LIMIT` characters, a whole activity
error at `MESSAGE_LIMIT_BYTES`; so no text in history exceeds 2 KiB.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
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
    InvalidRequest,
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
    engine,
    replica,
    workflow_worker,
)

END_OF_CONVERSATION = "END-OF-THE-CONVERSATION-7f3a"


def _conversation(chars: int = 8_000) -> str:
    """A long conversation as an engine would quote it, ending with a marker."""
    turns = "".join(f"user: turn {i} of a long research task; " for i in range(chars // 40))
    return turns + END_OF_CONVERSATION


def _size(text: str) -> int:
    return len(text.encode("utf-8"))


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
    error = from_status(400, json.dumps(body), replica="h100/0").to_application_error()
    assert error.type == "InvalidRequest"
    assert END_OF_CONVERSATION not in error.message
    assert _size(error.message) <= MESSAGE_LIMIT_BYTES
    assert error.message.startswith("replica h100/0: HTTP 400: ")
    assert len(error.message) <= len("replica h100/0: HTTP 400: ") + ENGINE_TEXT_LIMIT + 3


@pytest.mark.timeout(10)
def test_every_other_outside_text_is_capped() -> None:
    long = _conversation()
    in_a_200 = from_error_body({"message": long, "code": 400}, replica="h100/0")
    assert END_OF_CONVERSATION not in str(in_a_200)
    request = httpx.Request("POST", "http://10.0.0.5:8000/v1/chat/completions")
    cut = from_transport(httpx.RemoteProtocolError(long, request=request), replica="h100/0")
    assert END_OF_CONVERSATION not in str(cut)
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


@pytest.mark.timeout(60)
async def test_a_400_that_quotes_the_conversation_leaves_it_out_of_history(
    replica: BrokenReplica,  # noqa: F811 - the fixture imported above
    temporal_client: Client,
) -> None:
    def quote_the_request() -> Response:
        sent = json.dumps(replica.engine.bodies[-1])
        message = f"Invalid request {sent}; conversation: {_conversation()}"
        return JSONResponse({"error": {"message": message, "code": 400}}, status_code=400)

    replica.engine.script = quote_the_request
    request = InferenceRequest(
        model=MODEL,
        messages=[ChatMessage(role="user", content="Plan a three step research task.")],
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
    assert outcome.error_type == "InvalidRequest"
    assert (outcome.message or "").startswith(f"replica {replica.worker.binding.name}: HTTP 400")

    history = await handle.fetch_history()
    texts = [
        text.encode() if isinstance(text, str) else text
        for event in history.events
        for text in _texts(event)
    ]
    assert any(b"Invalid request" in text for text in texts)  # the failure is in history
    assert not any(END_OF_CONVERSATION.encode() in text for text in texts)
    assert max(len(text) for text in texts) <= INLINE_LIMIT_BYTES

"""Reading a workflow as tests check it: its history's payloads, its streaming call's progress."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

from google.protobuf.message import Message
from temporalio.api.common.v1 import Payload
from temporalio.client import WorkflowHandle

from kvflow.activities.claim_check import CLAIM_CHECK_ENCODING
from kvflow.activities.wire import AttemptProgress


def payloads_in(message: Message) -> Iterator[Payload]:
    """Every `Payload` inside a history event, however deeply nested."""
    if isinstance(message, Payload):
        yield message
        return
    for _field, value in message.ListFields():
        if isinstance(value, Message):
            yield from payloads_in(value)
        elif not isinstance(value, str | bytes | int | float | bool):
            # A repeated field or a map (of which the values).
            items = value.values() if hasattr(value, "values") else value
            for item in items:
                if isinstance(item, Message):
                    yield from payloads_in(item)


async def wait_until_streaming(handle: WorkflowHandle[Any, Any], timeout_s: float = 20) -> None:
    """Return once the task's pending call has heartbeated some output (or after `timeout_s`).

    A heartbeat over the claim-check limit travels as a reference to the context store (its
    encoding says so): one that large carries output already.
    """
    for _ in range(int(timeout_s / 0.05)):
        pending = (await handle.describe()).raw_description.pending_activities
        if pending and pending[0].heartbeat_details.payloads:
            payload = pending[0].heartbeat_details.payloads[0]
            if payload.metadata.get("encoding") == CLAIM_CHECK_ENCODING:
                return
            beat = json.loads(payload.data)
            if AttemptProgress.model_validate(beat).completion_tokens:
                return
        await asyncio.sleep(0.05)

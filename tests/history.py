"""Reading a workflow's history as tests check it: every payload, however deeply nested."""

from __future__ import annotations

from collections.abc import Iterator

from google.protobuf.message import Message
from temporalio.api.common.v1 import Payload


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

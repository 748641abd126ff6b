"""A deployment's own payload codec, for tests of kvflow beside one (`tests.codecs:XorCodec`)."""

from __future__ import annotations

from collections.abc import Sequence

from temporalio.api.common.v1 import Payload
from temporalio.converter import PayloadCodec

XOR_ENCODING = b"binary/xor"


class XorCodec(PayloadCodec):
    """Stands for encryption: every payload's bytes XORed, under an encoding of its own, so
    that none of the original text is readable in what it makes."""

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        """Each payload, serialized and XORed."""
        return [
            Payload(metadata={"encoding": XOR_ENCODING}, data=_xor(p.SerializeToString()))
            for p in payloads
        ]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        """Each payload this codec made, restored; others as they are."""
        return [
            Payload.FromString(_xor(p.data)) if p.metadata.get("encoding") == XOR_ENCODING else p
            for p in payloads
        ]


def _xor(data: bytes) -> bytes:
    return bytes(b ^ 0x5A for b in data)

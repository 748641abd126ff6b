"""vLLM's KV-cache events over ZMQ, decoded into the scheduler's precise prefix index.

vLLM publishes `[topic, 8-byte big-endian sequence number, msgpack EventBatch]` on a ZMQ PUB
socket (`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`) and
replays buffered batches from a ROUTER socket when asked with `[b"", start sequence]`, ending
with sequence −1. A replayed message reaches the asking DEALER socket as
`[b"", topic, sequence, batch]` (vLLM 0.32; the end marker has an empty topic and batch) or,
from older vLLM, as `[b"", sequence, batch]`: the last two frames are the sequence and batch.

The batch and its events are msgspec structs in vLLM (`vllm/distributed/kv_events.py`). Their
encoding changed across versions, and this decoder takes all of them without importing vLLM:

- the batch: an array `[ts, events, data_parallel_rank?]` or a map `{"ts", "events", ...}`;
- each event: a tagged array `["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, ...]` or a tagged map `{"type": "BlockStored", ...}`;
- block hashes: 64-bit integers, or bytes (sha256-based hashing).
- `extra_keys` (vLLM 0.11 and later): one entry per block; the first block's holds the
  request's `cache_salt`, which the precise index hashes into that block as vLLM did.

Blocks of LoRA adapters and blocks on a medium other than the GPU are skipped: kvflow's block
hashes cover the base model's tokens only, and only GPU blocks are prefix-cache hits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvflow.scheduler.core import Scheduler
from kvflow.scheduler.prefix_index import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    KvEvent,
)

logger = logging.getLogger(__name__)

END_OF_REPLAY = -1
"""The sequence number vLLM's replay socket sends after the last buffered batch."""

_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")
_STORED_OPTIONAL = ("medium", "lora_name", "extra_keys")
_REMOVED_FIELDS = ("block_hashes", "medium")
_GPU_MEDIA = (None, "GPU", "gpu")


class KvEventDecodeError(ValueError):
    """A payload that is not a vLLM KV-event batch."""


def _as_fields(raw: Any, names: Sequence[str]) -> dict[str, Any]:
    """A tagged event's fields by name, from its array or map form."""
    if isinstance(raw, dict):
        return raw
    values = list(raw[1:])
    return dict(zip(names, values, strict=False))


def _hash(value: Any) -> EngineHash:
    if isinstance(value, int | bytes):
        return value
    raise KvEventDecodeError(f"a block hash must be an int or bytes, got {type(value).__name__}")


def _first_block_salt(extra_keys: Any) -> str | None:
    """The `cache_salt` among the first block's `extra_keys`, None without one.

    vLLM lists one entry per block: the LoRA name, `(mm_identifier, offset)` pairs, the salt
    and prompt-embedding digests (bytes), in that order; LoRA blocks are skipped before this,
    so the first block's last string is its salt.
    """
    if not isinstance(extra_keys, list | tuple) or not extra_keys:
        return None
    first = extra_keys[0]
    if not isinstance(first, list | tuple):
        return None
    salts = [key for key in first if isinstance(key, str) and key]
    return salts[-1] if salts else None


def _event(raw: Any) -> KvEvent | None:
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, list | tuple) and raw:
        tag = raw[0]
    else:
        raise KvEventDecodeError(f"an event must be a tagged array or map, got {raw!r:.80}")
    if tag == "BlockStored":
        fields = _as_fields(raw, _STORED_FIELDS + _STORED_OPTIONAL)
        if fields.get("lora_id") is not None or fields.get("lora_name") is not None:
            return None
        if fields.get("medium") not in _GPU_MEDIA:
            return None
        parent = fields.get("parent_block_hash")
        return BlockStored(
            block_hashes=tuple(_hash(h) for h in fields["block_hashes"]),
            parent_block_hash=None if parent is None else _hash(parent),
            token_ids=tuple(int(t) for t in fields["token_ids"]),
            block_size=int(fields["block_size"]),
            cache_salt=_first_block_salt(fields.get("extra_keys")) if parent is None else None,
        )
    if tag == "BlockRemoved":
        fields = _as_fields(raw, _REMOVED_FIELDS)
        if fields.get("medium") not in _GPU_MEDIA:
            return None
        return BlockRemoved(block_hashes=tuple(_hash(h) for h in fields["block_hashes"]))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    logger.debug("ignoring KV event of unknown type %r", tag)
    return None


def decode_event_batch(payload: bytes) -> tuple[float, list[KvEvent]]:
    """The timestamp and the kvflow events of one msgpack `EventBatch`."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise KvEventDecodeError(f"not msgpack: {exc}") from exc
    try:
        if isinstance(raw, dict):
            ts, raw_events = raw["ts"], raw["events"]
        else:
            ts, raw_events = raw[0], raw[1]
        events = [e for e in (_event(r) for r in raw_events) if e is not None]
        return float(ts), events
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        if isinstance(exc, KvEventDecodeError):
            raise
        raise KvEventDecodeError(f"not a vLLM EventBatch: {exc!r}") from exc


class KvEventSubscriber:
    """Subscribes to one replica's KV events and applies them to the scheduler.

    Sequence numbers are tracked: a batch that arrives after a gap (including the first batch
    when it is not number 0, i.e. this subscriber joined late) triggers a replay of the missing
    batches from `replay_endpoint` when one is given. With `bind=True` the subscriber binds
    `endpoint` instead of connecting (vLLM connects its publisher to `tcp://host:port`
    endpoints that have no wildcard).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        replica: str,
        endpoint: str,
        *,
        topic: str = "",
        replay_endpoint: str | None = None,
        model: str | None = None,
        bind: bool = False,
        replay_timeout_s: float = 2.0,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        if replica not in scheduler.replica_names():
            raise ValueError(f"unknown replica {replica!r}")
        self.scheduler = scheduler
        self.replica = replica
        self.endpoint = endpoint
        self.topic = topic
        self.replay_endpoint = replay_endpoint
        self.model = model
        self.bind = bind
        self.replay_timeout_s = replay_timeout_s
        self._context = context or zmq.asyncio.Context.instance()
        self._stop = asyncio.Event()
        self._ready = asyncio.Event()
        self.last_seq: int | None = None
        self.batches = 0
        """Batches applied."""
        self.events = 0
        """Events applied."""
        self.gaps = 0
        """Gaps in the sequence that could not be replayed."""
        self.replayed = 0
        """Batches recovered from the replay socket."""
        self.undecodable = 0
        """Messages that were not vLLM event batches."""

    async def wait_ready(self) -> None:
        """Wait until the subscription socket is connected (or bound)."""
        await self._ready.wait()

    async def run(self) -> None:
        """Receive and apply batches until `stop()`."""
        self._stop.clear()
        socket = self._context.socket(zmq.SUB)
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            if self.bind:
                socket.bind(self.endpoint)
            else:
                socket.connect(self.endpoint)
            self._ready.set()
            while not self._stop.is_set():
                if not await socket.poll(timeout=100):
                    continue
                frames = await socket.recv_multipart()
                await self._handle(frames)
        finally:
            socket.close(linger=0)
            self._ready.clear()

    def stop(self) -> None:
        """Make `run()` return within about 0.1 s."""
        self._stop.set()

    async def _handle(self, frames: Sequence[bytes]) -> None:
        if len(frames) != 3:
            self.undecodable += 1
            logger.warning(
                "KV event message of %s has %d frames, expected [topic, seq, payload]",
                self.replica,
                len(frames),
            )
            return
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        last = self.last_seq
        if last is not None and seq <= last:
            return  # a duplicate (already seen, e.g. through a replay)
        expected = 0 if last is None else last + 1
        if seq > expected:
            if self.replay_endpoint is not None:
                await self._replay(expected, seq)
            if self.last_seq is None or self.last_seq < seq - 1:
                self.gaps += 1
                logger.info(
                    "KV events of %s: %d batch(es) before %d missed; prefix entries may be stale",
                    self.replica,
                    seq - (self.last_seq + 1 if self.last_seq is not None else 0),
                    seq,
                )
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            _, events = decode_event_batch(payload)
        except KvEventDecodeError as exc:
            self.undecodable += 1
            logger.warning("KV event batch %d of %s skipped: %s", seq, self.replica, exc)
            self.last_seq = seq
            return
        self.scheduler.apply_kv_events(self.replica, events, self.model)
        self.last_seq = seq
        self.batches += 1
        self.events += len(events)

    async def _replay(self, start: int, until: int) -> None:
        """Apply batches [start, until) from the replay socket, as far as it still has them."""
        assert self.replay_endpoint is not None
        dealer = self._context.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(timeout=int(self.replay_timeout_s * 1000)):
                    logger.warning("replay socket of %s did not answer", self.replica)
                    return
                frames = await dealer.recv_multipart()
                # [b"", topic, seq, batch] from vLLM 0.32, [b"", seq, batch] from older vLLM.
                if len(frames) < 3:
                    continue
                seq_bytes, payload = frames[-2], frames[-1]
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_OF_REPLAY:
                    return
                if seq >= until or (self.last_seq is not None and seq <= self.last_seq):
                    continue
                self._apply(seq, payload)
                self.replayed += 1
        finally:
            with contextlib.suppress(zmq.ZMQError):
                dealer.close(linger=0)

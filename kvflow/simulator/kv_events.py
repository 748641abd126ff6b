"""KV-cache events in vLLM's wire format, and a ZMQ publisher with a replay socket.

The message types mirror `vllm/distributed/kv_events.py`: msgspec structs encoded as msgpack
maps, events tagged by their class name in a `type` field::

    EventBatch      {"ts": float, "events": [...], "data_parallel_rank": 0}
    BlockStored     {"type": "BlockStored", "block_hashes": [u64...], "parent_block_hash": u64
                     | None, "token_ids": [int...], "block_size": int, "lora_id": None,
                     "medium": "GPU", "lora_name": None, "extra_keys"?: [[salt], None...]}
    BlockRemoved    {"type": "BlockRemoved", "block_hashes": [u64...], "medium": "GPU"}
    AllBlocksCleared {"type": "AllBlocksCleared"}

Block hashes are `kvflow.scheduler.blocks` hashes, so the scheduler's prefix index can match them
against its own. On the wire, every batch is one ZMQ multipart message on a PUB socket:
`[topic, sequence number as 8 bytes big-endian, msgpack batch]`. As in vLLM, the PUB socket
binds when the endpoint has `*`, `::`, `ipc://` or `inproc://` and connects otherwise. A ROUTER
replay socket answers a request `[b"", start sequence as 8 bytes big-endian]` with every
buffered batch from that sequence on (`[b"", seq, payload]` each) and then `[b"", -1, b""]`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
"""The medium of blocks in host memory (vLLM's offloading connector, `CPULoadStoreSpec`)."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence number that ends a replay answer."""


class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    """One step's KV-cache events, with the time they were published."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the KV-cache events (tagged by class name in the `type` field)."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the prefix cache: their hashes, parent hash and tokens."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[Any] | None] | None = None
    """Per block, the extra keys its hash covers, as vLLM publishes them: the request's
    `cache_salt` in the prompt's first block; absent when no block has any."""


class BlockRemoved(KVCacheEvent):
    """Cached blocks were evicted to make room."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset."""


class KVEventBatch(EventBatch):
    """An `EventBatch` whose events decode to the typed event structs."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


KV_EVENT_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
"""Decodes the payload of a KV-event message (vLLM's or the simulator's)."""


def _binds(endpoint: str) -> bool:
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


class ZmqEventPublisher:
    """Publishes `EventBatch`es on a ZMQ PUB socket from a thread, with a replay buffer.

    `publish` only queues the batch, so the engine loop never waits on the network.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode("utf-8")
        self._rank = data_parallel_rank
        self._queue: queue.Queue[EventBatch | None] = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            if _binds(endpoint):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"cannot open KV-event socket {endpoint!r}: {exc}") from None
        self._encoder = msgspec.msgpack.Encoder()
        self._sequence = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[Any], ts: float | None = None) -> None:
        """Queue one batch of events for publishing (no-op for an empty list)."""
        if events and self._running:
            batch = EventBatch(
                ts=time.time() if ts is None else ts, events=events, data_parallel_rank=self._rank
            )
            self._queue.put(batch)

    def shutdown(self, timeout: float = 1.0) -> None:
        """Send what is queued (up to `timeout`), stop the thread and close the sockets."""
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = self._encoder.encode(batch)
            sequence = self._sequence
            self._sequence += 1
            try:
                self._pub.send_multipart((self._topic, sequence.to_bytes(8, "big"), payload))
            except zmq.ZMQError:
                logger.exception("could not publish KV events")
            self._buffer.append((sequence, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("ignoring a malformed KV-event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for sequence, payload in list(self._buffer):
            if sequence >= first:
                self._replay.send_multipart((client, b"", sequence.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

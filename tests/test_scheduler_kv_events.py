"""vLLM KV-cache events over a real ZMQ socket, encoded exactly as vLLM encodes them."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq

from kvflow.scheduler.blocks import block_hashes
from kvflow.scheduler.core import Scheduler
from kvflow.scheduler.fleet import Fleet
from kvflow.scheduler.kv_events import (
    KvEventDecodeError,
    KvEventSubscriber,
    decode_event_batch,
)
from kvflow.scheduler.placement import Placement, PlacementRequest
from kvflow.scheduler.prefix_index import AllBlocksCleared, BlockRemoved, BlockStored
from tests.fleets import one_pool_fleet
from tests.waiting import eventually

MODEL = "tiny-llama"
TOPIC = "kv"
ENGINE_BLOCK = 64
Hash = int | bytes


# vLLM's wire types (vllm/distributed/kv_events.py), as msgspec structs. Current vLLM: the
# batch is an array, each event a map tagged "type". Older vLLM: events are tagged arrays.


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of current vLLM's events (tagged maps)."""


class BlockStoredEvent(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemovedEvent(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksClearedEvent(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class OldKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of older vLLM's events (tagged arrays)."""


class OldBlockStored(OldKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldBlockRemoved(OldKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


encoder = msgspec.msgpack.Encoder()


def encode(events: list[Any]) -> bytes:
    return encoder.encode(EventBatch(ts=1_700_000_000.0, events=events))


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(count)]


def stored(chunk: list[int], hashes: list[Hash], parent: Hash | None) -> BlockStoredEvent:
    return BlockStoredEvent(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=chunk,
        block_size=ENGINE_BLOCK,
        lora_id=None,
        medium="GPU",
    )


def tiny_fleet() -> Fleet:
    return one_pool_fleet(MODEL, replicas=3)


def ask(scheduler: Scheduler, prompt: list[int], workflow: str) -> Placement:
    result = scheduler.place(
        PlacementRequest(
            model=MODEL,
            block_hashes=block_hashes(prompt, 16),
            prompt_tokens=len(prompt),
            max_output_tokens=16,
            tenant="acme",
            workflow_id=workflow,
        )
    )
    assert isinstance(result, Placement), result
    return result


class Publisher:
    """vLLM's side: a PUB socket of [topic, seq, batch] and a ROUTER that replays the buffer.

    Replayed messages carry the topic as vLLM 0.32 sends them, or with `replay_topic=False`
    leave it out as older vLLM (and kvflow's simulator) do.
    """

    def __init__(
        self, context: zmq.Context[zmq.Socket[bytes]], *, replay_topic: bool = True
    ) -> None:
        self.replay_topic = replay_topic
        self.pub = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.router = context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_requests: list[int] = []
        self.seq = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def publish(self, payload: bytes) -> None:
        with self._lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
            self.pub.send_multipart([TOPIC.encode(), seq.to_bytes(8, "big"), payload])

    def _serve_replay(self) -> None:
        # As vLLM 0.32's ZmqEventPublisher._service_replay: [identity, b"", start] in; one
        # [identity, b"", topic, seq, payload] per buffered batch from start on, then
        # [identity, b"", b"", seq -1, b""]. Older vLLM sends the same without the topic frame.
        end = (-1).to_bytes(8, "big", signed=True)
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            identity, _, start_bytes = self.router.recv_multipart()
            start = int.from_bytes(start_bytes, "big")
            self.replay_requests.append(start)
            with self._lock:
                buffered = [item for item in self.buffer if item[0] >= start]
            topic, no_topic = ([TOPIC.encode()], [b""]) if self.replay_topic else ([], [])
            for seq, payload in buffered:
                self.router.send_multipart([identity, b"", *topic, seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([identity, b"", *no_topic, end, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.pub.close(linger=0)
        self.router.close(linger=0)


@pytest.fixture
async def publisher(request: pytest.FixtureRequest) -> AsyncIterator[Publisher]:
    """vLLM 0.32's publisher; parametrized indirectly, `replay_topic` (True or False)."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    publisher = Publisher(context, replay_topic=getattr(request, "param", True))
    try:
        yield publisher
    finally:
        publisher.close()
        context.term()


async def subscribed(subscriber: KvEventSubscriber, publisher: Publisher) -> None:
    """Publish empty batches until the subscriber receives one.

    A ZMQ subscriber that has just connected still misses what is published until its
    subscription reaches the publisher ("slow joiner"), so one batch is not enough.
    """
    await subscriber.wait_ready()
    start = subscriber.batches

    def received() -> bool:
        if subscriber.batches > start:
            return True
        publisher.publish(encode([]))
        return False

    await eventually(received, within=4, what="the subscriber receives a batch", interval=0.01)


async def test_engine_events_make_the_scheduler_send_the_prompt_to_that_replica(
    publisher: Publisher,
) -> None:
    scheduler = Scheduler(tiny_fleet())
    subscriber = KvEventSubscriber(scheduler, "cpu/2", publisher.endpoint, topic=TOPIC)
    task = asyncio.create_task(subscriber.run())
    try:
        await subscribed(subscriber, publisher)
        prompt = tokens(1, 6 * ENGINE_BLOCK)
        # Engine hashes are the engine's own business (random here): the index re-hashes.
        publisher.publish(encode([stored(prompt[:256], [9001, 9002, 9003, 9004], None)]))
        publisher.publish(encode([stored(prompt[256:], [9005, 9006], 9004)]))
        await eventually(lambda: subscriber.events >= 2, within=5, what="both batches arrived")
        result = ask(scheduler, prompt + tokens(2, 40), "wf-1")
        assert result.replica == "cpu/2"
        assert result.expected_cached_tokens == 6 * ENGINE_BLOCK
        assert "384 of 424 prompt tokens cached" in result.reason

        publisher.publish(encode([BlockRemovedEvent(block_hashes=[9006, 9005], medium="GPU")]))
        await eventually(lambda: subscriber.events >= 3, within=5, what="the removal arrived")
        status = {s.replica: s for s in scheduler.status()}["cpu/2"]
        assert status.precise
        # Four engine blocks of 64 tokens are left: four index entries (one per 4 blocks of 16).
        assert status.blocks_indexed == 4
    finally:
        subscriber.stop()
        await asyncio.wait_for(task, timeout=5)


async def test_older_vllm_array_encoding_and_a_cache_reset_are_understood(
    publisher: Publisher,
) -> None:
    scheduler = Scheduler(tiny_fleet())
    subscriber = KvEventSubscriber(scheduler, "cpu/0", publisher.endpoint, topic=TOPIC)
    task = asyncio.create_task(subscriber.run())
    try:
        await subscribed(subscriber, publisher)
        prompt = tokens(3, 2 * ENGINE_BLOCK)
        publisher.publish(
            encode(
                [
                    OldBlockStored(
                        block_hashes=[5, 6],
                        parent_block_hash=None,
                        token_ids=prompt,
                        block_size=ENGINE_BLOCK,
                        lora_id=None,
                        medium=None,
                    )
                ]
            )
        )
        await eventually(lambda: subscriber.events >= 1, within=5, what="the batch arrived")
        assert ask(scheduler, prompt + [1] * 10, "wf-2").replica == "cpu/0"
        publisher.publish(encode([AllBlocksClearedEvent()]))
        await eventually(lambda: subscriber.events >= 2, within=5, what="the reset arrived")
        status = {s.replica: s for s in scheduler.status()}["cpu/0"]
        assert status.blocks_indexed == 0
    finally:
        subscriber.stop()
        await asyncio.wait_for(task, timeout=5)


@pytest.mark.parametrize(
    "publisher", [True, False], ids=["vllm-0.32-replay", "older-vllm-replay"], indirect=True
)
async def test_a_late_subscriber_recovers_earlier_batches_from_the_replay_socket(
    publisher: Publisher,
) -> None:
    scheduler = Scheduler(tiny_fleet())
    prompt = tokens(4, 3 * ENGINE_BLOCK)
    # Published before anyone listens: lost on the PUB socket, kept in the replay buffer.
    publisher.publish(encode([stored(prompt[:128], [b"\x01" * 32, b"\x02" * 32], None)]))
    publisher.publish(encode([stored(prompt[128:], [b"\x03" * 32], b"\x02" * 32)]))
    subscriber = KvEventSubscriber(
        scheduler,
        "cpu/1",
        publisher.endpoint,
        topic=TOPIC,
        replay_endpoint=publisher.replay_endpoint,
        # Long enough that a replay which misses the end marker shows as a stall.
        replay_timeout_s=8.0,
    )
    task = asyncio.create_task(subscriber.run())
    try:
        await subscribed(subscriber, publisher)
        # The live batch that revealed the gap is applied once the replay has ended.
        await eventually(
            lambda: subscriber.last_seq is not None and subscriber.last_seq >= 2,
            within=4,
            what="the replay ends at the end marker and the live batch is applied",
        )
        assert publisher.replay_requests and publisher.replay_requests[0] == 0
        assert subscriber.replayed >= 2 and subscriber.gaps == 0
        result = ask(scheduler, prompt + [7] * 20, "wf-3")
        assert result.replica == "cpu/1"
        assert result.expected_cached_tokens == 3 * ENGINE_BLOCK
    finally:
        subscriber.stop()
        await asyncio.wait_for(task, timeout=5)


def test_decoder_skips_lora_and_offloaded_blocks_and_rejects_garbage() -> None:
    lora = BlockStoredEvent(
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=list(range(64)),
        block_size=64,
        lora_id=3,
        medium="GPU",
        lora_name="adapter",
    )
    offloaded = BlockStoredEvent(
        block_hashes=[2],
        parent_block_hash=None,
        token_ids=list(range(64)),
        block_size=64,
        lora_id=None,
        medium="CPU",
    )
    plain = stored(list(range(64)), [3], None)
    ts, events = decode_event_batch(encode([lora, offloaded, plain, AllBlocksClearedEvent()]))
    assert ts == 1_700_000_000.0
    assert events == [
        BlockStored(
            block_hashes=(3,), parent_block_hash=None, token_ids=tuple(range(64)), block_size=64
        ),
        AllBlocksCleared(),
    ]
    removed = decode_event_batch(encode([OldBlockRemoved(block_hashes=[4, 5], medium=None)]))
    assert removed[1] == [BlockRemoved(block_hashes=(4, 5))]
    with pytest.raises(KvEventDecodeError):
        decode_event_batch(b"\xc1 not msgpack")
    with pytest.raises(KvEventDecodeError):
        decode_event_batch(msgspec.msgpack.encode({"hello": "world"}))

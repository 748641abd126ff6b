"""The scheduler's telemetry against a real vLLM server: /metrics and KV-cache events.

The decisive check: after vLLM reports, through its own KV events, the blocks it cached for a
prompt, the scheduler expects exactly the cached tokens vLLM then reports in `usage` when the
prompt comes again, although vLLM hashes blocks its own way. A subscriber that joins later
recovers those blocks from vLLM's replay socket.
"""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from kvflow.scheduler.blocks import block_hashes
from kvflow.scheduler.core import Scheduler
from kvflow.scheduler.fleet import Fleet
from kvflow.scheduler.kv_events import KvEventSubscriber
from kvflow.scheduler.placement import Placement, PlacementRequest
from kvflow.scheduler.telemetry import MetricsScraper, fleet_endpoints
from tests.fixtures_vllm import VllmServedModel
from tests.fleets import one_pool_fleet
from tests.waiting import eventually

pytestmark = pytest.mark.vllm


def fleet_for(server: VllmServedModel) -> Fleet:
    return one_pool_fleet(
        server.model, endpoints=[server.base_url], context_length=server.max_model_len
    )


async def test_the_scraper_reads_a_real_vllm_servers_cache_and_load(
    vllm_server: VllmServedModel,
) -> None:
    fleet = fleet_for(vllm_server)
    scheduler = Scheduler(fleet)
    async with MetricsScraper(scheduler, fleet_endpoints(fleet), timeout_s=5.0) as scraper:
        results = await scraper.scrape_once()
    metrics = results["cpu/0"]
    assert metrics is not None
    assert metrics.block_size == vllm_server.block_size
    assert metrics.num_gpu_blocks is not None and metrics.num_gpu_blocks > 0
    assert metrics.models == (vllm_server.model,)
    (status,) = scheduler.status()
    assert status.up and status.warm_models == [vllm_server.model]
    assert 0.0 <= status.kv_cache_usage <= 1.0


async def test_vllm_kv_events_predict_the_cached_tokens_vllm_reports(
    vllm_server: VllmServedModel,
) -> None:
    fleet = fleet_for(vllm_server)
    scheduler = Scheduler(fleet)
    subscriber = KvEventSubscriber(
        scheduler,
        "cpu/0",
        vllm_server.kv_events_endpoint,
        topic=vllm_server.kv_topic,
        replay_endpoint=vllm_server.kv_replay_endpoint,
    )
    task = asyncio.create_task(subscriber.run())
    try:
        await subscriber.wait_ready()
        async with httpx.AsyncClient(base_url=vllm_server.base_url, timeout=60.0) as client:

            async def unique_prompt() -> list[int]:
                text = f"[{uuid.uuid4().hex}] " + " ".join(
                    f"step{i % 13} tool{i % 5}" for i in range(300)
                )
                tokenized = await client.post(
                    "/tokenize", json={"model": vllm_server.model, "prompt": text}
                )
                tokenized.raise_for_status()
                prompt: list[int] = tokenized.json()["tokens"][:600]
                assert len(prompt) == 600
                return prompt

            async def complete(prompt: list[int]) -> int:
                response = await client.post(
                    "/v1/completions",
                    json={
                        "model": vllm_server.model,
                        "prompt": prompt,
                        "max_tokens": 2,
                        "ignore_eos": True,
                    },
                )
                response.raise_for_status()
                cached: int = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                return cached

            tokens = await unique_prompt()
            assert await complete(tokens) == 0
            request = PlacementRequest(
                model=vllm_server.model,
                block_hashes=block_hashes(tokens, scheduler.block_size),
                prompt_tokens=len(tokens),
                max_output_tokens=2,
                tenant="acme",
                workflow_id="wf-vllm",
            )

            def indexed() -> bool:
                status = scheduler.status()[0]
                return status.precise and status.blocks_indexed >= 8

            # The engine publishes its events shortly after the step; on a busy machine,
            # seconds after.
            await eventually(
                indexed,
                within=60,
                what="the scheduler indexes the prompt's blocks from vLLM's KV events",
                interval=0.02,
            )
            assert subscriber.events > 0 and subscriber.undecodable == 0
            placement = scheduler.place(request)
            assert isinstance(placement, Placement)
            expected = placement.expected_cached_tokens
            # 600 tokens: four whole blocks of 128; vLLM recomputes the last token.
            assert expected == 512, scheduler.status()
            assert await complete(tokens) == expected

            # A subscriber that joins now has missed the batches above. The next batch it
            # receives shows the gap, and it recovers them from vLLM's replay socket.
            late_scheduler = Scheduler(fleet)
            late = KvEventSubscriber(
                late_scheduler,
                "cpu/0",
                vllm_server.kv_events_endpoint,
                topic=vllm_server.kv_topic,
                replay_endpoint=vllm_server.kv_replay_endpoint,
            )
            late_task = asyncio.create_task(late.run())
            try:
                await late.wait_ready()
                # New blocks make vLLM publish; more than one prompt in case the first batch
                # goes out before the subscription reaches vLLM's socket.
                for _ in range(5):
                    await complete(await unique_prompt())
                    for _ in range(100):
                        if late.batches > late.replayed:
                            break
                        await asyncio.sleep(0.02)
                    if late.batches > late.replayed:
                        break
                assert late.batches > late.replayed, "the late subscriber received no batch"
                assert late.replayed > 0 and late.gaps == 0 and late.undecodable == 0
                placement = late_scheduler.place(request)
                assert isinstance(placement, Placement)
                assert placement.expected_cached_tokens == expected
            finally:
                late.stop()
                await asyncio.wait_for(late_task, timeout=5)
    finally:
        subscriber.stop()
        await asyncio.wait_for(task, timeout=5)

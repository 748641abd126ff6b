"""Real vLLM keeps two tenants' prefix caches apart with the `cache_salt` kvflow sends.

The inference activity sends each tenant's calls with its own salt; vLLM reports, in
`usage.prompt_tokens_details`, that the second tenant's identical prompt found nothing cached
while the first tenant's repeat did. The scheduler's precise index, fed by vLLM's own KV events
(whose `extra_keys` carry the salt), expects exactly that before the calls are sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from pathlib import Path

import httpx
import pytest
from temporalio.testing import ActivityEnvironment

from kvflow.activities.context_store import DirectoryContextStore
from kvflow.activities.inference import InferenceActivities, ReplicaBinding
from kvflow.activities.wire import InferenceRequest
from kvflow.scheduler.blocks import block_hashes, tenant_cache_salt
from kvflow.scheduler.core import Scheduler
from kvflow.scheduler.fleet import Fleet
from kvflow.scheduler.kv_events import KvEventSubscriber
from kvflow.scheduler.placement import Placement, PlacementRequest
from tests.fixtures_vllm import VllmServedModel
from tests.fleets import one_pool_fleet
from tests.waiting import eventually

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

NAMESPACE = "default"


async def test_vllm_gives_another_tenant_no_cached_tokens_for_an_identical_prompt(
    vllm_server: VllmServedModel, tmp_path: Path
) -> None:
    data = one_pool_fleet(
        vllm_server.model,
        endpoints=[vllm_server.base_url],
        context_length=vllm_server.max_model_len,
    ).model_dump(mode="json")
    data["tenants"].append({"name": "globex", "tier": 2})
    fleet = Fleet.model_validate(data)
    scheduler = Scheduler(fleet)
    binding = ReplicaBinding(pool=fleet.pools[0], index=0, base_url=vllm_server.base_url)
    text = f"[{uuid.uuid4().hex}] " + " ".join(f"step{i % 13} tool{i % 5}" for i in range(160))
    subscriber = KvEventSubscriber(
        scheduler,
        "cpu/0",
        vllm_server.kv_events_endpoint,
        topic=vllm_server.kv_topic,
        replay_endpoint=vllm_server.kv_replay_endpoint,
    )
    listening = asyncio.create_task(subscriber.run())
    try:
        await subscriber.wait_ready()
        async with httpx.AsyncClient(base_url=vllm_server.base_url, timeout=60.0) as http:
            activities = InferenceActivities(
                binding, http, store=DirectoryContextStore(tmp_path / "context")
            )

            async def cached_tokens(tenant: str) -> int:
                env = ActivityEnvironment()
                env.info = dataclasses.replace(env.info, namespace=NAMESPACE)
                call = InferenceRequest(
                    model=vllm_server.model, prompt=text, max_tokens=2, tenant=tenant
                )
                result = await env.run(activities.infer, call)
                assert result.usage.prompt_tokens > 4 * vllm_server.block_size
                return result.usage.cached_tokens

            def expected(tokens: list[int], tenant: str) -> int:
                salt = tenant_cache_salt(NAMESPACE, tenant)
                placement = scheduler.place(
                    PlacementRequest(
                        model=vllm_server.model,
                        block_hashes=block_hashes(tokens, scheduler.block_size, cache_salt=salt),
                        prompt_tokens=len(tokens),
                        max_output_tokens=2,
                        tenant=tenant,
                        workflow_id=f"wf-{tenant}-{uuid.uuid4().hex}",
                    )
                )
                assert isinstance(placement, Placement)
                return placement.expected_cached_tokens

            assert await cached_tokens("acme") == 0
            tokenized = await http.post(
                "/tokenize", json={"model": vllm_server.model, "prompt": text}
            )
            tokenized.raise_for_status()
            tokens: list[int] = tokenized.json()["tokens"]

            await eventually(
                lambda: scheduler.status()[0].blocks_indexed >= 4,
                within=60,
                what="the scheduler indexes acme's blocks from vLLM's KV events",
                interval=0.02,
            )
            assert subscriber.undecodable == 0
            # The index holds acme's blocks under acme's salt: globex's identical prompt
            # matches none of them.
            acme_expects = expected(tokens, "acme")
            assert acme_expects >= 4 * vllm_server.block_size
            assert expected(tokens, "globex") == 0

            assert await cached_tokens("globex") == 0
            assert await cached_tokens("acme") == acme_expects
    finally:
        subscriber.stop()
        await asyncio.wait_for(listening, timeout=5)

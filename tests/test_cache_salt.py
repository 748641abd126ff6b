"""A tenant's KV cache is its own: identical prompts of two tenants share no cached block.

Each tenant's calls carry their own vLLM `cache_salt`, hashed into the prompt's first block
only (vLLM's rule, `kvflow.scheduler.blocks`). The checks, from the hash rule up: the rule
itself; the simulator's HTTP server as vLLM takes the field; the inference activity's body on
the simulator (a second tenant gets no cached token where the first tenant's repeat is cached);
the scheduler's prefix index, approximate (from placements) and precise (from vLLM's KV
events); and a prompt the fleet shares on purpose (`[cache] shared_prefixes`), still shared.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from temporalio.testing import ActivityEnvironment

from kvflow.activities.context_store import DirectoryContextStore
from kvflow.activities.control_plane import ControlPlaneActivities
from kvflow.activities.inference import InferenceActivities, ReplicaBinding
from kvflow.activities.wire import ChatMessage, InferenceRequest, PlaceInput
from kvflow.scheduler.blocks import (
    ROOT_HASH,
    block_hashes,
    call_cache_salt,
    hash_block,
    prefix_content_hash,
    tenant_cache_salt,
)
from kvflow.scheduler.core import Scheduler
from kvflow.scheduler.fleet import Fleet
from kvflow.scheduler.kv_events import KvEventSubscriber, decode_event_batch
from kvflow.scheduler.placement import Placement, PlacementRequest
from kvflow.scheduler.prefix_index import BlockStored, PrefixIndex
from kvflow.simulator import SimServer
from kvflow.simulator.workloads import WORKLOADS, Workload
from kvflow.workers.config import FleetConfigError, load_fleet
from tests.fleets import one_pool_fleet
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(60)

NAMESPACE = "default"
SYSTEM = "You are the support assistant of Example Corp. " * 12
"""A system prompt of several blocks, the same for every tenant."""
QUESTION = "Which of our plans includes priority support? " * 6


def chat(question: str = QUESTION) -> list[ChatMessage]:
    return [
        ChatMessage(role="system", content=SYSTEM),
        ChatMessage(role="user", content=question),
    ]


# ---- the rule ----------------------------------------------------------------------------------


def test_the_salt_enters_only_the_first_blocks_hash() -> None:
    tokens = list(range(64))
    salted = block_hashes(tokens, 16, cache_salt="tenant-a")
    plain = block_hashes(tokens, 16)
    # vLLM: extra keys (the salt) only for the block that starts at token 0 ...
    assert salted[0] == hash_block(ROOT_HASH, tokens[:16], "tenant-a") != plain[0]
    # ... and every later block chains from it with its tokens alone.
    for i in range(1, 4):
        assert salted[i] == hash_block(salted[i - 1], tokens[16 * i : 16 * (i + 1)])
    # So the two chains share no block, and another salt gives a third chain.
    assert not set(salted) & set(plain)
    assert not set(salted) & set(block_hashes(tokens, 16, cache_salt="tenant-b"))
    # No salt, or an empty one (vLLM ignores it), hashes as before salts existed.
    assert block_hashes(tokens, 16, cache_salt="") == plain
    assert plain[0] == hash_block(ROOT_HASH, tokens[:16])


def test_a_tenants_salt_is_derived_not_its_name() -> None:
    salt = tenant_cache_salt(NAMESPACE, "acme")
    assert "acme" not in salt and len(salt) <= 128
    assert salt == tenant_cache_salt(NAMESPACE, "acme")
    assert salt != tenant_cache_salt(NAMESPACE, "globex")
    assert salt != tenant_cache_salt("other-namespace", "acme")
    shared = frozenset({prefix_content_hash(SYSTEM)})
    # A call that starts with a shared prompt goes unsalted; any other call keeps its salt.
    assert call_cache_salt(NAMESPACE, "acme", SYSTEM, shared) is None
    assert call_cache_salt(NAMESPACE, "acme", "another prompt", shared) == salt
    assert call_cache_salt(NAMESPACE, "acme", None, shared) == salt


# ---- the simulator's server, as vLLM ------------------------------------------------------------


@pytest.fixture
def sim(sim_server_factory: Callable[..., SimServer]) -> SimServer:
    """A fresh simulator: nothing cached yet."""
    return sim_server_factory()


async def test_the_simulator_salts_the_prefix_cache_as_vllm_does(sim: SimServer) -> None:
    prompt = SYSTEM + QUESTION

    async def cached(http: httpx.AsyncClient, **salt: str) -> int:
        response = await http.post(
            "/v1/completions",
            json={"model": sim.model, "prompt": prompt, "max_tokens": 1, **salt},
        )
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        assert usage["prompt_tokens"] > 4 * sim.block_size
        return int(usage["prompt_tokens_details"]["cached_tokens"])

    async with httpx.AsyncClient(base_url=sim.base_url, timeout=30) as http:
        assert await cached(http, cache_salt="tenant-a") == 0
        assert await cached(http, cache_salt="tenant-b") == 0
        assert await cached(http) == 0
        assert await cached(http, cache_salt="tenant-a") > 0
        assert await cached(http, cache_salt="tenant-b") > 0
        # vLLM refuses an empty salt, and one with a character it forbids.
        for bad in ("", "a/b"):
            response = await http.post(
                "/v1/completions",
                json={"model": sim.model, "prompt": prompt, "max_tokens": 1, "cache_salt": bad},
            )
            assert response.status_code == 400
            assert "cache_salt" in response.json()["error"]["message"]


# ---- the inference activity on the simulator ------------------------------------------------------


async def infer(
    sim: SimServer, tenant: str, tmp_path: Path, shared_prefixes: frozenset[str] = frozenset()
) -> int:
    """Cached prompt tokens of one chat call of `tenant`, sent as a GPU worker sends it."""
    fleet = one_pool_fleet(sim.model, endpoints=[sim.base_url])
    binding = ReplicaBinding(pool=fleet.pools[0], index=0, base_url=sim.base_url)
    if shared_prefixes:
        binding = dataclasses.replace(binding, shared_prefixes=shared_prefixes)
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, namespace=NAMESPACE, workflow_id=f"wf-{tenant}")
    request = InferenceRequest(
        model=sim.model, messages=chat(), max_tokens=2, tenant=tenant, step="answer"
    )
    async with httpx.AsyncClient(timeout=30) as http:
        activities = InferenceActivities(
            binding, http, store=DirectoryContextStore(tmp_path / "context")
        )
        result = await env.run(activities.infer, request)
    assert result.usage.prompt_tokens > 4 * sim.block_size
    return result.usage.cached_tokens


async def test_another_tenants_identical_prompt_gets_no_cached_tokens(
    sim: SimServer, tmp_path: Path
) -> None:
    assert await infer(sim, "acme", tmp_path) == 0
    # globex sends acme's prompt word for word: it is billed and timed as a cold prompt.
    assert await infer(sim, "globex", tmp_path) == 0
    # Each tenant's own repeat is cached.
    assert await infer(sim, "acme", tmp_path) > 0
    assert await infer(sim, "globex", tmp_path) > 0


async def test_a_system_prompt_the_fleet_shares_is_cached_across_tenants(
    sim: SimServer, tmp_path: Path
) -> None:
    shared = frozenset({prefix_content_hash(SYSTEM)})
    assert await infer(sim, "acme", tmp_path, shared) == 0
    assert await infer(sim, "globex", tmp_path, shared) > 0


# ---- the scheduler's prefix index -----------------------------------------------------------------


def two_tenant_fleet(replicas: int = 2, model: str = "m", **cache: Any) -> Fleet:
    data = one_pool_fleet(model, replicas=replicas).model_dump(mode="json")
    data["tenants"].append({"name": "globex", "tier": 2})
    if cache:
        data["cache"] = cache
    return Fleet.model_validate(data)


async def place(activities: ControlPlaneActivities, tenant: str, workflow_id: str) -> Placement:
    """Place one chat call of `tenant` as the workflow's local activity does."""
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, namespace=NAMESPACE)
    request = PlacementRequest(
        model="m", prompt_tokens=0, max_output_tokens=8, tenant=tenant, workflow_id=workflow_id
    )
    answer = await env.run(activities.place, PlaceInput(request=request, messages=chat()))
    activities.scheduler.settle()
    assert answer.placement is not None, answer.refusal
    return answer.placement


async def test_the_prefix_index_scores_no_replica_for_another_tenants_blocks() -> None:
    fleet = two_tenant_fleet()
    scheduler = Scheduler(fleet)
    activities = ControlPlaneActivities(scheduler, fleet=fleet, block_size=16)
    first = await place(activities, "acme", "wf-1")
    assert first.expected_cached_tokens == 0
    again = await place(activities, "acme", "wf-2")
    assert again.replica == first.replica and again.expected_cached_tokens > 0
    # acme's blocks are no reason to send globex to that replica, and no discount is expected.
    other = await place(activities, "globex", "wf-3")
    assert other.expected_cached_tokens == 0
    assert "new prefix" in other.reason


async def test_the_prefix_index_matches_a_shared_prompt_across_tenants() -> None:
    fleet = two_tenant_fleet(shared_prefixes=[prefix_content_hash(SYSTEM)])
    scheduler = Scheduler(fleet)
    activities = ControlPlaneActivities(scheduler, fleet=fleet, block_size=16)
    first = await place(activities, "acme", "wf-1")
    other = await place(activities, "globex", "wf-2")
    assert other.replica == first.replica and other.expected_cached_tokens > 0


def test_the_precise_index_hashes_a_salted_vllm_event_under_its_salt() -> None:
    # A BlockStored as vLLM (0.11+) publishes it: untagged extra keys, one entry per block, the
    # first one holding the request's cache_salt.
    tokens = list(range(1000, 1064))
    salt = tenant_cache_salt(NAMESPACE, "acme")
    batch = msgspec.msgpack.encode(
        [
            1.0,
            [
                [
                    "BlockStored",
                    [11, 12],
                    None,
                    tokens,
                    32,
                    None,
                    "GPU",
                    None,
                    [(salt,), None],
                ]
            ],
        ]
    )
    _, events = decode_event_batch(batch)
    index = PrefixIndex(block_size=16, speculative_ttl_s=5.0)
    replica = index.add_replica(capacity_blocks=100)
    index.apply(replica, events)
    acme = block_hashes(tokens, 16, cache_salt=salt)
    globex = block_hashes(tokens, 16, cache_salt=tenant_cache_salt(NAMESPACE, "globex"))
    assert index.match(acme, now=0.0) == {replica: 4}
    assert index.match(globex, now=0.0) == {}
    assert index.match(block_hashes(tokens, 16), now=0.0) == {}
    [event] = events
    assert isinstance(event, BlockStored) and event.cache_salt == salt


async def test_the_simulators_kv_events_index_a_tenants_blocks_under_its_salt(
    sim_server_factory: Callable[..., SimServer], tmp_path: Path
) -> None:
    # The simulator publishes the salt in its KV events as vLLM does; the precise index that
    # re-hashes their token ids then holds acme's blocks under acme's salt only.
    endpoint = f"ipc://{tmp_path}/events.sock"
    sim = sim_server_factory(kv_events_endpoint=endpoint, kv_events_topic="kv")
    fleet = two_tenant_fleet(replicas=1, model=sim.model)
    scheduler = Scheduler(fleet)
    subscriber = KvEventSubscriber(scheduler, "cpu/0", endpoint, topic="kv")
    listening = asyncio.create_task(subscriber.run())
    try:
        await subscriber.wait_ready()
        prompt = SYSTEM + QUESTION
        acme = tenant_cache_salt(NAMESPACE, "acme")
        async with httpx.AsyncClient(base_url=sim.base_url, timeout=30) as http:
            sent = await http.post(
                "/v1/completions",
                json={"model": sim.model, "prompt": prompt, "max_tokens": 1, "cache_salt": acme},
            )
            assert sent.status_code == 200, sent.text
            tokens = (await http.post("/tokenize", json={"prompt": prompt})).json()["tokens"]
        await eventually(
            lambda: scheduler.status()[0].blocks_indexed >= 4,
            within=30,
            what="the scheduler indexes acme's blocks from the simulator's KV events",
            interval=0.02,
        )

        def expected(tenant: str) -> int:
            salt = tenant_cache_salt(NAMESPACE, tenant)
            placement = scheduler.place(
                PlacementRequest(
                    model=sim.model,
                    block_hashes=block_hashes(tokens, scheduler.block_size, cache_salt=salt),
                    prompt_tokens=len(tokens),
                    max_output_tokens=1,
                    tenant=tenant,
                    workflow_id=f"wf-{tenant}",
                )
            )
            assert isinstance(placement, Placement)
            return placement.expected_cached_tokens

        assert expected("acme") >= 4 * sim.block_size
        assert expected("globex") == 0
    finally:
        subscriber.stop()
        await asyncio.wait_for(listening, timeout=5)


# ---- the fleet file -------------------------------------------------------------------------------


def test_a_shared_prefix_that_is_not_a_content_hash_is_refused_with_how_to_write_it(
    tmp_path: Path,
) -> None:
    fleet_file = tmp_path / "fleet.toml"
    example = (Path(__file__).parent.parent / "fleet.toml").read_text()
    fleet_file.write_text(example + '\n[cache]\nshared_prefixes = ["You are helpful"]\n')
    with pytest.raises(FleetConfigError) as caught:
        load_fleet(fleet_file)
    [problem] = caught.value.problems
    assert problem.key_path == "cache.shared_prefixes"
    assert "sha256" in problem.message and "You are helpful" in problem.message
    # The commented example in fleet.toml, uncommented, loads.
    uncommented = example.replace("# [cache]", "[cache]").replace(
        "# shared_prefixes", "shared_prefixes"
    )
    fleet_file.write_text(uncommented)
    assert len(load_fleet(fleet_file).cache.shared_prefixes) == 1


# ---- the benchmark's workloads ----------------------------------------------------------------


def first_blocks(workload: Workload) -> dict[str, set[int]]:
    """Tenant → the first block hashes of its calls."""
    seen: dict[str, set[int]] = {}
    for task in workload:
        for step in task.steps:
            for call in step.calls:
                seen.setdefault(task.tenant, set()).add(call.chain[0])
    return seen


def test_benchmark_tenants_share_only_the_system_prompts_the_workload_names() -> None:
    tenants = [("acme", 1), ("globex", 3)]
    spec = WORKLOADS["hotspot"]
    named = first_blocks(Workload(spec, tenants, tasks=60, task_rate=1.0))
    # The built-in workloads name their system prompt shared: both tenants reuse it.
    assert named["acme"] & named["globex"]
    unnamed_spec = dataclasses.replace(spec, shared_system_prompts=False)
    unnamed = Workload(unnamed_spec, tenants, tasks=60, task_rate=1.0)
    salted = first_blocks(unnamed)
    assert not salted["acme"] & salted["globex"]
    # One application, one prompt per tenant: each tenant's own tasks still share it.
    assert len(salted["acme"]) == len(salted["globex"]) == 1
    # What the precise index re-hashes from a KV event (tokens and the first block's salt)
    # is the chain the workload gave.
    task = next(iter(unnamed))
    chain = task.steps[0].calls[0].chain
    parent = ROOT_HASH
    for i, h in enumerate(chain):
        salt = unnamed.cache_salts.get(h) if i == 0 else None
        assert (salt is not None) == (i == 0)
        assert hash_block(parent, unnamed.tokens_of(parent, h), salt) == h
        parent = h

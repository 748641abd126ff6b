"""SGLang model gateway's `cache_aware` policy, and its `manual` routing-key policy.

Source: sglang (`sgl-project/sglang`), `sgl-model-gateway/src/policies/cache_aware.rs`
(`select_worker`, `select_worker_min_load`) and its approximate radix tree
`sgl-model-gateway/src/policies/tree.rs` (`insert`, `prefix_match_with_counts`); defaults
from the gateway's CLI (`docs/advanced_features/sgl_model_gateway.md`, "Cache-Aware Policy
Tuning"): `--cache-threshold` 0.3, `--balance-abs-threshold` 64,
`--balance-rel-threshold` 1.5, `--max-tree-size` 2²⁶.

    load(w) = requests the gateway sent to worker w that have not ended (its own count)
    if max load − min load > 64 and max load > 1.5 · min load:   the least loaded worker
    else: walk the tree (all workers' routed text together) as deep as the prompt matches;
          rate = matched / prompt length; if rate > 0.3 the tenant of the deepest matched
          node, else the least loaded worker (the first of the least loaded on ties)
    the chosen worker's prompt is inserted into the tree either way

The tenant of a node is the one cached in its `last_tenant`: the worker whose insert created
the node (a split copies it to both halves), as long as that worker still holds the node;
otherwise another holder, which is cached from then on. Equal matches therefore go to the
worker that first placed that part of the prompt, not to the lowest index. The tree works
here on blocks of the fleet's block size instead of characters (the same share of the
prompt at block granularity); each worker keeps at most `max_tree_size` characters, ≈
2²⁶ / 4 characters a token / block size blocks, least recently used evicted first.

`sglang-tuned` follows the gateway's `manual` policy for stateful sessions
(`sgl-model-gateway/src/policies/manual.rs`: "stateful chat sessions where context is stored
on the worker"), keyed by the `X-SMG-Routing-Key` header, here the call's session (the
context's session hint, else its workflow id) when the harness sends hints. A key's first
call goes to the least loaded worker (`ManualAssignmentMode::MinLoad`, ties at random);
later calls go to the first of its (at most 2) remembered workers that is healthy, or to a
new least-loaded one that is remembered too; a key idle for 4 hours is forgotten. A call
without a key goes to a random worker.
"""

from __future__ import annotations

import random

from kvflow.simulator.des import FleetRequest, FleetView, candidates
from kvflow.simulator.policies.base import (
    ApproximatePrefixCache,
    AttemptEnd,
    PolicySetup,
    RequestRouter,
    prompt_blocks,
)
from kvflow.simulator.policies.dynamo import hints_enabled, session_hint

CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5
MAX_TREE_SIZE_CHARS = 1 << 26
CHARACTERS_PER_TOKEN = 4
MAX_CANDIDATE_WORKERS = 2
"""`manual.rs`: workers remembered per routing key."""
MAX_IDLE_S = 4 * 3600.0
"""`ManualConfig::default().max_idle_secs`."""


class _GatewayLoad:
    """The gateway's count of in-flight requests per worker (`Worker::load`)."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self._routed: dict[str, int] = {}

    def __getitem__(self, worker: int) -> int:
        return self.counts.get(worker, 0)

    def sent(self, request: FleetRequest, worker: int) -> None:
        """The gateway sent `request` to `worker`."""
        self.counts[worker] = self.counts.get(worker, 0) + 1
        self._routed[request.request_id] = worker

    def ended(self, request: FleetRequest) -> None:
        """`request` is done (whatever the worker the harness names)."""
        worker = self._routed.pop(request.request_id, None)
        if worker is not None:
            self.counts[worker] = max(0, self.counts.get(worker, 0) - 1)


class SglangCacheAwarePolicy(RequestRouter):
    """SGLang's cache-aware routing (module docstring)."""

    name = "sglang"

    def __init__(self, setup: PolicySetup) -> None:
        self.block_size = setup.block_size
        self.cache_threshold = CACHE_THRESHOLD
        self.balance_abs_threshold = BALANCE_ABS_THRESHOLD
        self.balance_rel_threshold = BALANCE_REL_THRESHOLD
        capacity = MAX_TREE_SIZE_CHARS // CHARACTERS_PER_TOKEN // setup.block_size
        self.tree = ApproximatePrefixCache(max(1, capacity))
        self.node_tenant: dict[int, int] = {}
        """Block → the cached `last_tenant` of the tree node holding it."""
        self.load = _GatewayLoad()

    def route(self, request: FleetRequest, fleet: FleetView, now: float) -> int | None:
        """Shortest queue when imbalanced, else the best prefix match above the threshold."""
        serving = candidates(request, fleet)
        if not serving:
            return None
        loads = [self.load[i] for i in serving]
        least = serving[loads.index(min(loads))]
        high, low = max(loads), min(loads)
        blocks = prompt_blocks(request, self.block_size)
        imbalanced = (
            high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low
        )
        chosen = least
        if not imbalanced:
            depth, tenant = self.prefix_match(blocks)
            rate = depth * self.block_size / max(request.prompt_tokens, 1)
            if rate > self.cache_threshold and tenant in serving:
                chosen = tenant
        self.insert(blocks, chosen)
        self.load.sent(request, chosen)
        return chosen

    def prefix_match(self, blocks: list[int]) -> tuple[int, int | None]:
        """(blocks matched, tenant of the deepest matched node) (`prefix_match_with_counts`)."""
        held = self.tree.match(blocks)
        if not held:
            return 0, None
        depth = max(held.values())
        node = blocks[depth - 1]
        tenant = self.node_tenant.get(node)
        if tenant is None or held.get(tenant, 0) < depth:
            # The cached tenant left the node: any holder, cached from now on.
            tenant = min(w for w, d in held.items() if d >= depth)
            self.node_tenant[node] = tenant
        return depth, tenant

    def insert(self, blocks: list[int], worker: int) -> None:
        """`worker` was sent `blocks`: blocks new to the tree are its nodes (`insert`)."""
        for h in blocks:
            if h not in self.node_tenant or not self.tree.match([h]):
                self.node_tenant[h] = worker
        self.tree.record(worker, blocks)

    def on_attempt_end(self, end: AttemptEnd) -> None:
        """The request left the worker."""
        self.load.ended(end.request)

    def on_replica_down(self, replica: int) -> None:
        """The worker was removed: its tree goes with it."""
        self.tree.forget(replica)


class SglangManualPolicy(RequestRouter):
    """SGLang's `manual` routing-key policy (module docstring)."""

    name = "sglang-tuned"

    def __init__(self, setup: PolicySetup) -> None:
        self.hints = hints_enabled(setup)
        self._rng = random.Random(setup.seed)
        self.load = _GatewayLoad()
        self.keys: dict[str, tuple[list[int], float]] = {}
        """Routing key → (remembered workers, last access)."""

    def route(self, request: FleetRequest, fleet: FleetView, now: float) -> int | None:
        """The key's remembered worker, else a least-loaded one; without a key, random."""
        serving = candidates(request, fleet)
        if not serving:
            return None
        key = self._routing_key(request)
        if key is None:
            chosen = self._rng.choice(serving)
        else:
            workers, last = self.keys.get(key, ([], now))
            if now - last >= MAX_IDLE_S:
                workers = []
            chosen = next((w for w in workers if w in serving), -1)
            if chosen < 0:
                chosen = self._min_load(serving)
                workers = [*workers, chosen][-MAX_CANDIDATE_WORKERS:]
            self.keys[key] = (workers, now)
        self.load.sent(request, chosen)
        return chosen

    def _routing_key(self, request: FleetRequest) -> str | None:
        return session_hint(request.context) if self.hints else None

    def _min_load(self, serving: list[int]) -> int:
        low = min(self.load[i] for i in serving)
        return self._rng.choice([i for i in serving if self.load[i] == low])

    def on_attempt_end(self, end: AttemptEnd) -> None:
        """The request left the worker."""
        self.load.ended(end.request)

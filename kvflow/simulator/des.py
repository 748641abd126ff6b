"""A fleet of simulated replicas under a discrete-event clock: no HTTP, no sleeping.

`DiscreteEventFleet` keeps one event queue for the whole fleet: request arrivals and the ends
of engine steps. At an arrival a `Router` picks the replica (the scheduler's placement policy
plugs in here); at a step end the replica's engine applies the step (`EngineCore.end_step`)
and, if it has work, begins the next one (`begin_step`), whose end is the next event. Time
jumps from event to event, so an hour of a 16-replica fleet simulates in seconds.

A batch that only decodes, with no request due to finish, repeats the same step with one
more token of context each time; the engine takes such a run as one event
(`EngineCore.begin_step` with a horizon) and an arrival routed to that replica cuts it at the
next step boundary, where vLLM would admit the request. The result is the same as stepping
one at a time, except that a router looking at a replica in the middle of a run sees its KV
cache as of the run's start.

Workload requests (`FleetRequest`) carry their prompt's block hashes instead of text: a
session's hash chain is extended, never recomputed, as its prompt grows (`AgentWorkload`), so
prefix caching across an agent's steps is modelled exactly with little work per request.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import statistics
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvflow.scheduler.blocks import ROOT_HASH, hash_block
from kvflow.simulator.engine import SimReplica, SimRequest, StepResult


@dataclass(slots=True)
class FleetRequest:
    """One request of a workload.

    `block_hashes` is the hash chain of the request's tokens at the fleet's block size; it may
    go past the prompt into the output (so the engine can cache output blocks for the next
    step of the same session). `output_tokens` is where the output ends on its own (end of
    sequence); `max_tokens`, if smaller, cuts it.
    """

    arrival_time: float
    model: str
    prompt_tokens: int
    output_tokens: int
    block_hashes: list[int] = field(default_factory=list)
    max_tokens: int | None = None
    tenant: str = ""
    session: str = ""
    request_id: str = ""
    exclude: frozenset[int] = frozenset()
    """Replicas the router must not choose (ones that failed this call before)."""
    attempt: int = 1
    """1, or 2+ when this call is re-placed after a failure."""
    priority: int = 0
    """The engine's waiting-queue order (lower first); a router may set it when it routes."""
    retention_priority: int | None = None
    """KV retention priority of the call's blocks once it ends (0–100, TensorRT-LLM's; None:
    the default), where the engine keeps blocks by retention (`EngineConfig.kv_retention`)."""
    retention_s: float | None = None
    """How long after the call ends `retention_priority` holds (None: until evicted)."""
    deadline_at: float | None = None
    """When the call's step must end, for engines that pause by it (`deadline_pause`)."""
    context: Any = None
    """What the driver of the workload attaches (e.g. the task the call belongs to)."""


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request."""

    request: FleetRequest
    replica: int
    arrival_time: float
    queue_time: float
    ttft: float
    e2e_latency: float
    cached_tokens: int
    output_tokens: int
    preemptions: int
    finish_reason: str

    @property
    def tpot(self) -> float:
        """Mean seconds per output token after the first."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.e2e_latency - self.ttft) / (self.output_tokens - 1)


@dataclass(slots=True)
class ScrapedMetrics:
    """One scrape of a replica's `/metrics` (what vLLM exports), as of `at`."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    at: float = -math.inf


class FleetView:
    """What a router may look at: the replicas, their live state and their scraped metrics.

    `load`, `cached_tokens` and `active_tokens` read the engines live (what a router fed by
    KV events and its own bookkeeping knows); `metrics` is the last scrape of each replica,
    taken every `metrics_interval_s` of simulated time (what a router that polls `/metrics`
    knows). A replica that is down is not `up`; a router learns it only once the fleet
    marks it (after a detection delay), as a health check would.
    """

    def __init__(self, replicas: Sequence[SimReplica], metrics_interval_s: float = 0.05) -> None:
        self.replicas = replicas
        self.metrics_interval_s = metrics_interval_s
        self.metrics = [ScrapedMetrics() for _ in replicas]
        self.up = [True] * len(replicas)
        self.scraped_at = -math.inf

    def __len__(self) -> int:
        return len(self.replicas)

    def serves(self, index: int, model: str) -> bool:
        """Whether replica `index` serves `model`."""
        return model in self.replicas[index].engines

    def load(self, index: int) -> int:
        """Running plus waiting requests on replica `index`."""
        return self.replicas[index].load()

    def cached_tokens(self, index: int, model: str, block_hashes: Sequence[int]) -> int:
        """Tokens of a prompt with `block_hashes` that replica `index` holds in its cache now."""
        engine = self.replicas[index].engines.get(model)
        return 0 if engine is None else engine.cached_prefix_tokens(block_hashes)

    def holds_block(self, index: int, model: str, block_hash: int) -> bool:
        """Whether replica `index` has a block of `block_hash` cached now (one lookup)."""
        engine = self.replicas[index].engines.get(model)
        return engine is not None and engine.pool.is_cached(block_hash)

    def active_tokens(self, index: int) -> tuple[int, int]:
        """(prompt tokens still to prefill, KV tokens of decoding requests) on replica `index`."""
        prefill = decode = 0
        for engine in self.replicas[index].engines.values():
            for request in engine.waiting:
                prefill += request.num_prompt_tokens - max(request.num_cached_tokens, 0)
            for request in engine.running:
                left = request.num_prompt_tokens - request.num_computed_tokens
                if left > 0:
                    prefill += left
                else:
                    decode += request.num_computed_tokens
        return prefill, decode

    def scrape(self, now: float) -> bool:
        """Refresh every replica's metrics if `metrics_interval_s` passed; whether it did."""
        if now - self.scraped_at < self.metrics_interval_s:
            return False
        self.scraped_at = now
        for index, replica in enumerate(self.replicas):
            snapshot = self.metrics[index]
            snapshot.running = replica.num_running
            snapshot.waiting = replica.num_waiting
            snapshot.kv_cache_usage = replica.kv_cache_usage()
            snapshot.at = now
        return True


class Router(Protocol):
    """Chooses the replica of each request (a placement policy)."""

    def route(self, request: FleetRequest, fleet: FleetView, now: float) -> int | None:
        """The index of the replica that gets `request`, or None to refuse it."""
        ...


def candidates(request: FleetRequest, fleet: FleetView) -> list[int]:
    """Replicas that serve the request's model, are up and are not excluded (may be none).

    `ValueError` when no replica of the fleet serves the model at all (a workload mistake).
    """
    serving = [i for i in range(len(fleet)) if fleet.serves(i, request.model)]
    if not serving:
        raise ValueError(f"no replica serves model {request.model!r}")
    up, exclude = fleet.up, request.exclude
    return [i for i in serving if up[i] and i not in exclude]


class RoundRobinRouter:
    """Each replica that serves the model in turn."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def route(self, request: FleetRequest, fleet: FleetView, now: float) -> int | None:
        """The next replica in turn."""
        serving = candidates(request, fleet)
        return serving[next(self._turn) % len(serving)] if serving else None


class LeastLoadedRouter:
    """The replica with the fewest running plus waiting requests (lowest index on ties)."""

    def route(self, request: FleetRequest, fleet: FleetView, now: float) -> int | None:
        """The least loaded replica."""
        return min(candidates(request, fleet), key=fleet.load, default=None)


class PrefixAwareRouter:
    """Most cached prefix tokens, unless that replica is overloaded.

    Score per replica:

        score = cached_tokens / prompt_tokens − load_weight · load / (mean_load + 1)

    (precise: it reads the engines' own caches, as a router fed by KV events would).
    """

    def __init__(self, load_weight: float = 0.5) -> None:
        self.load_weight = load_weight

    def route(self, request: FleetRequest, fleet: FleetView, now: float) -> int | None:
        """The replica with the best score."""
        serving = candidates(request, fleet)
        if not serving:
            return None
        loads = [fleet.load(i) for i in serving]
        mean = sum(loads) / len(loads)
        prompt = max(request.prompt_tokens, 1)
        hashes = request.block_hashes[: request.prompt_tokens // self._block(fleet, serving[0])]
        model = request.model
        best, best_score = serving[0], -math.inf
        for index, load in zip(serving, loads, strict=True):
            penalty = self.load_weight * load / (mean + 1)
            if best_score != -math.inf:
                # Probing a long prompt on every replica cost most of a simulation's time. A
                # replica whose cached prefix is shorter than `need` blocks cannot beat the
                # best so far, and it is if it lacks the prompt's `need`-th block: skipping it
                # then picks the same replica as the full probe.
                need = self._blocks_to_beat(
                    best_score, penalty, prompt, self._block(fleet, index), len(hashes)
                )
                if need is None or (need and not fleet.holds_block(index, model, hashes[need - 1])):
                    continue
            cached = fleet.cached_tokens(index, model, hashes)
            score = cached / prompt - penalty
            if score > best_score:
                best, best_score = index, score
        return best

    @staticmethod
    def _blocks_to_beat(
        best_score: float, penalty: float, prompt: int, block_size: int, blocks: int
    ) -> int | None:
        """Fewest cached blocks (of `blocks`) whose score beats `best_score`; None if none do.

        The score is computed as `route` computes it, and it never falls as the cached tokens
        grow (rounding is monotonic), so a binary search finds the exact threshold.
        """
        if (blocks * block_size) / prompt - penalty <= best_score:
            return None
        low, high = 0, blocks
        while low < high:
            middle = (low + high) // 2
            if (middle * block_size) / prompt - penalty > best_score:
                high = middle
            else:
                low = middle + 1
        return low

    @staticmethod
    def _block(fleet: FleetView, index: int) -> int:
        return fleet.replicas[index].config.block_size


@dataclass
class SimulationResult:
    """Every request's record and the fleet's totals."""

    records: list[RequestRecord]
    simulated_seconds: float
    steps: int
    preemptions: int
    unfinished: int

    def summary(self) -> dict[str, float]:
        """Throughput, latency percentiles (seconds) and the prefix-cache hit share."""
        records = self.records
        if not records:
            return {"requests": 0}
        ttft = sorted(r.ttft for r in records)
        e2e = sorted(r.e2e_latency for r in records)
        prompt = sum(r.request.prompt_tokens for r in records)
        cached = sum(r.cached_tokens for r in records)
        output = sum(r.output_tokens for r in records)
        seconds = max(self.simulated_seconds, 1e-9)
        return {
            "requests": len(records),
            "simulated_seconds": self.simulated_seconds,
            "requests_per_second": len(records) / seconds,
            "output_tokens_per_second": output / seconds,
            "ttft_p50": _percentile(ttft, 0.5),
            "ttft_p95": _percentile(ttft, 0.95),
            "e2e_p50": _percentile(e2e, 0.5),
            "e2e_p95": _percentile(e2e, 0.95),
            "tpot_mean": statistics.fmean(r.tpot for r in records),
            "cached_share": cached / prompt if prompt else 0.0,
            "preemptions": self.preemptions,
            "steps": self.steps,
        }


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[index]


_ARRIVAL = 0
_STEP_END = 1
_WAKE = 2
_CALL = 3


class DiscreteEventFleet:
    """Replicas, a router and one event queue (see the module docstring).

    `on_step(replica_index, result)` sees every step (e.g. to feed KV events to a prefix
    index); `on_finish(record)` every finished request; `on_fail(request, replica, sim)`
    every request that did not finish: refused by the router (replica −1), sent to a replica
    that is down, or running on one when it crashed or aborted (`sim` then says how far it
    got); `on_scrape(now)` every refresh of the routers' metrics (`FleetView.scrape`).
    `schedule(when, callback)` runs a callback at a simulated time (a workload's next step, a
    fault); `refresh_metrics()` scrapes now if the interval passed (a router-side queue looking
    again); `stop()` ends `run` once what a driver needs is done. `decode_runs=False` steps every
    replica one step at a time (slower, same results).
    """

    def __init__(
        self,
        replicas: Sequence[SimReplica],
        router: Router | None = None,
        *,
        on_step: Callable[[int, StepResult], None] | None = None,
        on_finish: Callable[[RequestRecord], None] | None = None,
        on_fail: Callable[[FleetRequest, int, SimRequest | None], None] | None = None,
        on_scrape: Callable[[float], None] | None = None,
        metrics_interval_s: float = 0.05,
        decode_runs: bool = True,
    ) -> None:
        if not replicas:
            raise ValueError("a fleet needs at least one replica")
        self.replicas = list(replicas)
        self.view = FleetView(self.replicas, metrics_interval_s)
        self.on_fail = on_fail
        self.on_scrape = on_scrape
        self.crashed = [False] * len(self.replicas)
        """Replicas that crashed: requests sent to them fail at once."""
        self.router: Router = router or LeastLoadedRouter()
        self.on_step = on_step
        self.on_finish = on_finish
        self.decode_runs = decode_runs
        self.now = 0.0
        self.records: list[RequestRecord] = []
        self._events: list[tuple[float, int, int, Any]] = []
        self._sequence = itertools.count()
        self._busy = [False] * len(self.replicas)
        # A step-end event is stale once its replica's run was cut and rescheduled.
        self._generation = [0] * len(self.replicas)
        self._wake_at: list[float | None] = [None] * len(self.replicas)
        self._horizon = math.inf
        self._ids = itertools.count()
        self._stopped = False
        self.steps = 0

    def submit(self, request: FleetRequest) -> None:
        """Schedule `request`'s arrival (at or after the current time)."""
        when = max(request.arrival_time, self.now)
        heapq.heappush(self._events, (when, next(self._sequence), _ARRIVAL, request))

    def schedule(self, when: float, callback: Callable[[], None]) -> None:
        """Run `callback` at simulated time `when` (or now, if that has passed)."""
        when = max(when, self.now)
        heapq.heappush(self._events, (when, next(self._sequence), _CALL, callback))

    def crash(self, index: int) -> None:
        """Replica `index` dies now: its requests fail, its cache is gone, it takes no more.

        Routers still see it up until `mark_down` (a health check's detection delay).
        """
        self.crashed[index] = True
        self._generation[index] += 1
        self._busy[index] = False
        replica = self.replicas[index]
        for engine in replica.engines.values():
            for sim in [*engine.running, *engine.waiting, *engine.loading]:
                engine.abort_request(sim.request_id, self.now)
                if self.on_fail is not None:
                    self.on_fail(sim.tag, index, sim)

    def refresh_metrics(self) -> None:
        """Scrape the replicas' metrics now if the interval passed (and tell `on_scrape`)."""
        if self.view.scrape(self.now) and self.on_scrape is not None:
            self.on_scrape(self.now)

    def stop(self) -> None:
        """End `run` after the current event (what is left of the run no figure needs)."""
        self._stopped = True

    def mark_down(self, index: int) -> None:
        """Routers see replica `index` as down from now on."""
        self.view.up[index] = False

    def abort(self, index: int, model: str, request_id: str) -> SimRequest | None:
        """Abort a request (its client gave up); the request as it stood, None if not there."""
        engine = self.replicas[index].engines.get(model)
        if engine is None:
            return None
        sim = engine.requests.get(request_id)
        if sim is None or not engine.abort_request(request_id, self.now):
            return None
        return sim

    def run(
        self, workload: Iterable[FleetRequest] = (), until: float | None = None
    ) -> SimulationResult:
        """Run until every request finished (or until `until`); arrivals in time order.

        `workload` is consumed lazily, so it can be a generator of any length.
        """
        arrivals: Iterator[FleetRequest] = iter(workload)
        pending = next(arrivals, None)
        events = self._events
        # Decode runs never pass `until`; arrivals cut them (see `_arrive`).
        self._horizon = math.inf if until is None else until
        self._stopped = False
        while not self._stopped:
            next_event = events[0][0] if events else math.inf
            if pending is not None and pending.arrival_time <= next_event:
                if until is not None and pending.arrival_time > until:
                    break
                self.now = max(self.now, pending.arrival_time)
                self._arrive(pending)
                pending = next(arrivals, None)
                continue
            if not events:
                break
            when, _, kind, payload = heapq.heappop(events)
            if until is not None and when > until:
                heapq.heappush(events, (when, next(self._sequence), kind, payload))
                break
            self.now = when
            if kind == _ARRIVAL:
                self._arrive(payload)
            elif kind == _STEP_END:
                index, generation = payload
                if generation == self._generation[index]:
                    self._end_step(index)
            elif kind == _CALL:
                payload()
            elif self._wake_at[payload] == when and not self.crashed[payload]:
                self._wake_at[payload] = None
                # A replica that started stepping since (an arrival) sees it at its step's end.
                if not self._busy[payload]:
                    self._begin_step(payload)
        unfinished = sum(
            e.num_running + e.num_waiting for r in self.replicas for e in r.engines.values()
        )
        preemptions = sum(
            e.stats.num_preemptions for r in self.replicas for e in r.engines.values()
        )
        return SimulationResult(self.records, self.now, self.steps, preemptions, unfinished)

    def _arrive(self, request: FleetRequest) -> None:
        self.refresh_metrics()
        index = self.router.route(request, self.view, self.now)
        if index is None or self.crashed[index]:
            if self.on_fail is None:
                raise RuntimeError(f"request {request.request_id or '?'} could not be placed")
            self.on_fail(request, -1 if index is None else index, None)
            return
        replica = self.replicas[index]
        request_id = request.request_id or f"r{next(self._ids)}"
        max_tokens = request.max_tokens or request.output_tokens
        sim = SimRequest(
            request_id,
            max_tokens=max(1, max_tokens),
            num_prompt_tokens=request.prompt_tokens,
            block_hashes=request.block_hashes,
            eos_after=max(1, request.output_tokens),
            tag=request,
            priority=request.priority,
            retention_priority=request.retention_priority,
            retention_s=request.retention_s,
            deadline_at=request.deadline_at,
        )
        replica.add_request(request.model, sim, self.now)
        if not self._busy[index]:
            self._begin_step(index)
            return
        # In vLLM the request joins at the next step: end a run of decode steps there.
        end = replica.cut_decode_run(self.now)
        if end is not None:
            self._generation[index] += 1
            heapq.heappush(
                self._events,
                (end, next(self._sequence), _STEP_END, (index, self._generation[index])),
            )

    def _begin_step(self, index: int) -> None:
        if self.crashed[index]:
            return
        replica = self.replicas[index]
        duration = replica.begin_step(self.now, self._horizon if self.decode_runs else None)
        if duration is None:
            self._busy[index] = False
            wake = replica.next_wake_time()
            if wake is not None and self._wake_at[index] != wake:
                self._wake_at[index] = wake
                heapq.heappush(self._events, (wake, next(self._sequence), _WAKE, index))
            return
        self._busy[index] = True
        heapq.heappush(
            self._events,
            (
                self.now + duration,
                next(self._sequence),
                _STEP_END,
                (index, self._generation[index]),
            ),
        )

    def _end_step(self, index: int) -> None:
        result = self.replicas[index].end_step()
        self.steps += result.num_steps
        if self.on_step is not None:
            self.on_step(index, result)
        for sim in result.finished:
            request: FleetRequest = sim.tag
            record = RequestRecord(
                request=request,
                replica=index,
                arrival_time=sim.arrival_time,
                queue_time=(sim.first_scheduled_time or sim.arrival_time) - sim.arrival_time,
                ttft=(sim.first_token_time or self.now) - sim.arrival_time,
                e2e_latency=self.now - sim.arrival_time,
                cached_tokens=max(sim.num_cached_tokens, 0),
                output_tokens=sim.num_output_tokens,
                preemptions=sim.num_preemptions,
                finish_reason=sim.finish_reason or "stop",
            )
            self.records.append(record)
            if self.on_finish is not None:
                self.on_finish(record)
        self._begin_step(index)


def simulate(
    workload: Iterable[FleetRequest],
    replicas: Sequence[SimReplica],
    router: Router | None = None,
    *,
    until: float | None = None,
    on_step: Callable[[int, StepResult], None] | None = None,
    decode_runs: bool = True,
) -> SimulationResult:
    """Run `workload` on `replicas` with `router` (least loaded by default) to the end."""
    fleet = DiscreteEventFleet(replicas, router, on_step=on_step, decode_runs=decode_runs)
    return fleet.run(workload, until)


class AgentWorkload:
    """Agent tasks as requests: each task is a session of steps over one growing context.

    A task starts with one of `system_prompts` shared system prompts (`system_tokens` each;
    shared by every tenant, as prompts a fleet names in `[cache] shared_prefixes` are), adds
    its own context (`context_tokens` range), and runs `steps` model calls; each call's
    prompt is the previous prompt, the previous answer and a new instruction
    (`turn_tokens`), and its answer is `output_tokens` long. Tasks arrive as a Poisson process
    at `task_rate` per second; a task's next call arrives `think_seconds` after the previous
    call's arrival plus an estimate of its duration. Deterministic for `seed`.
    """

    def __init__(
        self,
        *,
        model: str,
        block_size: int = 16,
        task_rate: float = 2.0,
        tasks: int = 100,
        steps: tuple[int, int] = (3, 8),
        system_prompts: int = 4,
        system_tokens: int = 1024,
        context_tokens: tuple[int, int] = (500, 3000),
        turn_tokens: tuple[int, int] = (50, 300),
        output_tokens: tuple[int, int] = (30, 400),
        think_seconds: float = 1.0,
        seconds_per_output_token: float = 0.02,
        tenants: Sequence[str] = ("acme", "globex", "initech"),
        seed: int = 0,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.task_rate = task_rate
        self.tasks = tasks
        self.steps = steps
        self.system_tokens = system_tokens - system_tokens % block_size
        self.context_tokens = context_tokens
        self.turn_tokens = turn_tokens
        self.output_tokens = output_tokens
        self.think_seconds = think_seconds
        self.seconds_per_output_token = seconds_per_output_token
        self.tenants = list(tenants)
        self.seed = seed
        self._system_chains = [
            self._chain(ROOT_HASH, (index + 1) << 40, 0, self.system_tokens // block_size)
            for index in range(system_prompts)
        ]

    def _chain(self, parent: int, base: int, first: int, last: int) -> list[int]:
        """Hashes of blocks `first` to `last - 1` of a synthetic token stream at `base`."""
        size = self.block_size
        hashes = []
        for block in range(first, last):
            start = base + block * size
            parent = hash_block(parent, range(start, start + size))
            hashes.append(parent)
        return hashes

    def __iter__(self) -> Iterator[FleetRequest]:
        """The requests in arrival order."""
        rng = random.Random(self.seed)
        size = self.block_size
        pending: list[tuple[float, int, FleetRequest]] = []
        order = itertools.count()
        start = 0.0
        for task in range(self.tasks):
            start += rng.expovariate(self.task_rate)
            system = rng.randrange(len(self._system_chains))
            chain = list(self._system_chains[system])
            base = (1000 + task) << 40
            tokens = self.system_tokens + rng.randint(*self.context_tokens)
            tenant = self.tenants[task % len(self.tenants)]
            when = start
            for step in range(rng.randint(*self.steps)):
                if step:
                    tokens += rng.randint(*self.turn_tokens)
                output = rng.randint(*self.output_tokens)
                full = (tokens + output) // size
                if full > len(chain):
                    chain.extend(
                        self._chain(chain[-1] if chain else ROOT_HASH, base, len(chain), full)
                    )
                request = FleetRequest(
                    arrival_time=when,
                    model=self.model,
                    prompt_tokens=tokens,
                    output_tokens=output,
                    block_hashes=chain[:full],
                    tenant=tenant,
                    session=f"task-{task}",
                    request_id=f"task-{task}-step-{step}",
                )
                heapq.heappush(pending, (when, next(order), request))
                tokens += output
                when += self.think_seconds + output * self.seconds_per_output_token
            # Emit what can no longer be preceded by a later task's request.
            while pending and pending[0][0] <= start:
                yield heapq.heappop(pending)[2]
        while pending:
            yield heapq.heappop(pending)[2]

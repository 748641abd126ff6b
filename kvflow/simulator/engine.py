"""The engine core: vLLM v1's scheduler over a paged KV cache, with step times from a GPU model.

One `EngineCore` serves one model. Each step, like vLLM's v1 scheduler:

1. Running requests first, in admission order: a request still in prefill gets the rest of its
   prompt (a chunk, if the step's token budget `max_num_batched_tokens` is smaller: chunked
   prefill); a decoding request gets one token. When the KV cache has no free block for it,
   a running request is preempted by recompute (its blocks freed, its progress recomputed
   when it is admitted again; `num_preemptions` counts it) until the request fits or is
   itself the one preempted. Which one, `EngineConfig.scheduling_policy` decides as vLLM
   does: under fcfs the one admitted last; under priority the one of highest `priority`
   value, then latest arrival, even one already scheduled in this step (its tokens go back
   to the step's budget).
2. Then, if nothing was preempted, waiting requests in queue order (fcfs: arrival, preempted
   ones first; priority: `priority`, then arrival) while the budget, the `max_num_seqs` limit
   and free blocks last. A request first looks up the longest cached prefix of its block-hash
   chain (at most all tokens but the last, as vLLM does); those tokens are not computed again
   and are reported as `cached_tokens`. It is admitted only if its whole prompt fits in the
   free blocks (`scheduler_reserve_full_isl`), though a chunk of it may be all it computes.

Blocks are registered in the prefix cache when the step that fills them is scheduled
(`kvflow.simulator.kvcache`), as vLLM's `allocate_slots` does: a request admitted later in
the same step already finds them.

The step's duration comes from `simulator.perf.PerfModel` (prefill grows with uncached tokens,
decode with weights and KV read). A step is split in two so that a driver can let time pass
in between: `begin_step(now)` schedules and returns the duration; `end_step()` applies it at
`now + duration` (tokens sampled, finished requests freed, newly full blocks cached). Requests
added in between wait for the next step, as in vLLM. Two drivers use it: the HTTP server
(`kvflow.simulator.server`, real time scaled by `time_scale`) and the discrete-event fleet
(`kvflow.simulator.des`, no sleeping).

`SimReplica` puts one or more engines on one GPU replica: they share its memory (weights of
all, KV cache split evenly) and its time (steps of different models take turns). A model that
is not warm loads on its first request (`PerfModel.load_seconds`) before it computes anything.

`EngineConfig.host_tier` adds a host-memory tier as vLLM's native CPU offloading has it
(`kvflow.simulator.kvcache.HostTier`): full blocks are written through to host memory as they
are computed; a waiting request whose prefix continues in host memory past its GPU hit has
those blocks copied back before it is scheduled (vLLM's asynchronous load: GPU blocks
allocated for them first, the request waiting meanwhile without holding the queue), and the
tokens count as cached. With `host_tier` 0 (the default) nothing of it runs. Left out: vLLM
keeps a finished request's GPU blocks until their copy to host memory ends (a 64k-token prompt
of an 8B model copies in about 0.17 s on an H100); here they are freed when it finishes.

`EngineConfig.kv_retention` swaps vLLM's eviction order for TensorRT-LLM's retention
priorities (`kvflow.simulator.kvcache.RetentionBlockPool`): a finished request's blocks are
kept by its `SimRequest.retention_priority`, for `retention_s` seconds.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from kvflow.scheduler.blocks import ROOT_HASH, block_hashes, hash_block
from kvflow.scheduler.fleet import ModelSpec
from kvflow.scheduler.gpus import GpuGeneration, GpuProfile
from kvflow.simulator.kvcache import (
    MAX_RETENTION_PRIORITY,
    MIN_RETENTION_PRIORITY,
    BlockPool,
    HostTier,
    RetentionBlockPool,
)
from kvflow.simulator.perf import GB, PerfModel, gpu_profile


class EngineConfig(BaseModel):
    """Engine settings, named as vLLM's engine arguments where vLLM has them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    block_size: int = Field(default=16, ge=1, le=1024, description="tokens per KV block")
    max_num_seqs: int = Field(default=256, ge=1, description="requests per step at most")
    max_num_batched_tokens: int = Field(default=8192, ge=1, description="tokens per step")
    max_model_len: int | None = Field(
        default=None, ge=2, description="longest prompt + output; default the model's context"
    )
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    num_gpu_blocks: int | None = Field(
        default=None,
        ge=2,
        description=(
            "KV blocks per model, vLLM's null block included (`--num-gpu-blocks-override`); "
            "overrides the memory estimate"
        ),
    )
    enable_prefix_caching: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        default="priority",
        description=(
            "vLLM's `--scheduling-policy`. fcfs: arrival order, a request's priority ignored, "
            "the running request admitted last preempted first. priority: lowest priority "
            "value first, then arrival; the running request of highest value, then latest "
            "arrival, preempted first. The default is priority, as kvflow's fleets run vLLM "
            "(kvflow sends a priority with every call); with every priority 0 it admits in "
            "arrival order as fcfs does"
        ),
    )
    scheduler_reserve_full_isl: bool = Field(
        default=True,
        description=(
            "admit a waiting request only if its whole prompt fits in the free blocks, not "
            "only its first chunk (vLLM's default)"
        ),
    )
    kv_retention: bool = Field(
        default=False,
        description=(
            "evict free cached blocks by retention priority, as TensorRT-LLM's "
            "`KvCacheRetentionConfig` does: a finished request's blocks are kept under its "
            "`retention_priority` (0-100, default 35) for `retention_s` seconds, then under "
            "the default; the lowest priority goes first, least recently freed first within "
            "one. vLLM has no such option. Off: vLLM's order (least recently freed first), the "
            "same results as without the option"
        ),
    )
    deadline_pause: bool = Field(
        default=False,
        description=(
            "a relaxation no engine offers, to bound what pausing buys: while a decoding "
            "request with a `deadline_at` would miss it at the last step's pace (its max_tokens "
            "left to decode), running requests of a lower priority (a larger number) are not "
            "stepped and none is admitted; they keep their KV cache"
        ),
    )
    deadline_hold: bool = Field(
        default=False,
        description=(
            "the admission half of `deadline_pause`, a relaxation no engine offers, to bound "
            "what a router holding lower tiers off a replica whose urgent calls would miss can "
            "buy: while a decoding request with a `deadline_at` would miss it at the last "
            "step's pace, no waiting request of a lower priority is admitted; running ones "
            "keep stepping"
        ),
    )
    deadline_priority_span: int = Field(
        default=1,
        ge=1,
        description=(
            "`deadline_pause` and `deadline_hold` pause only requests of a lower band of "
            "priority than the urgent one's, a band being `priority // span`: kvflow's "
            "priorities are tier · 10¹³ + the task's start in ms, so a span of 10¹³ pauses "
            "lower tiers and leaves the urgent request's own tier running. 1: every larger "
            "priority pauses, later tasks of the same tier included"
        ),
    )
    enable_kv_events: bool = Field(default=False, description="collect KV-cache events")
    host_tier: float = Field(
        default=0.0,
        ge=0,
        description=(
            "host memory for KV blocks, as a multiple of the GPU KV cache (vLLM's native "
            "offloading, `--kv-offloading-backend native --kv-offloading-size`): full blocks "
            "are written through to it, evicted least recently used first, and a prefix found "
            "there is copied back over the GPU's host link before the request runs. 0: none"
        ),
    )
    host_link_gbps: float | None = Field(
        default=None,
        gt=0,
        description=(
            "GB/s of each GPU's link to host memory, shared by copies both ways; default the "
            "GPU's (`kvflow.simulator.perf.HOST_LINK_GBPS`)"
        ),
    )
    host_store_threshold: int = Field(
        default=0,
        ge=0,
        description=(
            "vLLM's offloading `store_threshold`: a block is written to host memory only after "
            "that many lookups asked for it past the GPU cache; under 2, every full block is"
        ),
    )
    tensor_parallel: int = Field(default=1, ge=1, le=64, description="GPUs per replica")
    mfu: float = Field(default=0.4, gt=0, le=1, description="prefill share of peak FLOP/s")
    bandwidth_efficiency: float = Field(default=0.75, gt=0, le=1)
    step_overhead_s: float = Field(default=0.002, ge=0)
    load_bandwidth_gbps: float = Field(default=2.0, gt=0, description="cold weight loading")
    activation_reserve_gb: float = Field(
        default=1.0, ge=0, description="memory kept for activations, not KV"
    )
    slowdown: float = Field(
        default=1.0, ge=1, description="a fault: every step takes this many times longer"
    )


class TokenSampler(Protocol):
    """Chooses a request's next output token (the HTTP server's deterministic text)."""

    def next_token(self) -> tuple[int, bool]:
        """The next token id and whether it ends the output (end of sequence)."""
        ...


class RequestStatus(Enum):
    """Where a request is in the engine."""

    WAITING = "waiting"
    RUNNING = "running"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    """Its prefix is being copied back from host memory (vLLM's status of the same name)."""
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"


class SimRequest:
    """One generation request and its progress through the engine.

    Give `prompt_token_ids` (the HTTP server does) or just `num_prompt_tokens` with the prompt's
    `block_hashes` (a discrete-event workload does, to skip tokenizing). Output stops at
    `max_tokens`, at the engine's `max_model_len`, at end of sequence from `sampler`, or after
    `eos_after` tokens when there is no sampler. `retention_priority` and `retention_s` count
    only on an engine with `EngineConfig.kv_retention`.
    """

    __slots__ = (
        "arrival_order",
        "arrival_time",
        "block_hashes",
        "block_ids",
        "cache_salt",
        "deadline_at",
        "eos_after",
        "finish_reason",
        "finish_time",
        "first_scheduled_time",
        "first_token_time",
        "ignore_eos",
        "last_token_time",
        "load_end",
        "load_hashes",
        "max_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_external_tokens",
        "num_hashed_blocks",
        "num_offered_blocks",
        "num_output_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "priority",
        "request_id",
        "retention_priority",
        "retention_s",
        "sampler",
        "status",
        "tag",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        *,
        max_tokens: int,
        prompt_token_ids: Sequence[int] | None = None,
        num_prompt_tokens: int | None = None,
        block_hashes: list[int] | None = None,
        sampler: TokenSampler | None = None,
        eos_after: int | None = None,
        ignore_eos: bool = False,
        tag: Any = None,
        priority: int = 0,
        retention_priority: int | None = None,
        retention_s: float | None = None,
        deadline_at: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        if prompt_token_ids is not None:
            self.token_ids: list[int] | None = list(prompt_token_ids)
            self.num_prompt_tokens = len(self.token_ids)
        elif num_prompt_tokens is not None:
            self.token_ids = None
            self.num_prompt_tokens = num_prompt_tokens
        else:
            raise ValueError("give prompt_token_ids or num_prompt_tokens")
        if self.num_prompt_tokens < 1:
            raise ValueError("a prompt needs at least one token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if retention_priority is not None and not (
            MIN_RETENTION_PRIORITY <= retention_priority <= MAX_RETENTION_PRIORITY
        ):
            raise ValueError(f"retention_priority must be within 0..100, got {retention_priority}")
        if retention_s is not None and not retention_s >= 0:
            raise ValueError(f"retention_s must be at least 0, got {retention_s}")
        self.request_id = request_id
        self.max_tokens = max_tokens
        self.block_hashes: list[int] | None = block_hashes
        self.cache_salt = cache_salt
        """vLLM's `cache_salt`: hashed into the first block only (`kvflow.scheduler.blocks`).
        Given `block_hashes` must already be salted."""
        self.sampler = sampler
        self.eos_after = eos_after
        self.ignore_eos = ignore_eos
        self.tag = tag
        self.priority = priority
        """vLLM's `priority`: under the priority policy, lower runs first among the waiting
        and is preempted last; the fcfs policy ignores it."""
        self.retention_priority = retention_priority
        """With `EngineConfig.kv_retention`: the retention priority (0-100, kept longest at
        100; None: the default, 35) of the blocks this request frees when it finishes. Blocks
        freed by preemption or abort get the default."""
        self.retention_s = retention_s
        """With `EngineConfig.kv_retention`: seconds after it finishes that the request's
        blocks keep `retention_priority`, then the default; None: until evicted."""
        self.deadline_at = deadline_at
        """When the request's step must end (`EngineConfig.deadline_pause` only)."""
        self.status = RequestStatus.WAITING
        self.arrival_time = 0.0
        self.arrival_order = 0
        """Requests the engine received before this one (ties of `arrival_time`)."""
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.num_hashed_blocks = 0
        self.num_offered_blocks = 0
        """Blocks already offered to the host tier (vLLM's next block to offload)."""
        self.num_external_tokens = 0
        """Tokens of its prefix copied back from host memory at its latest admission."""
        self.load_hashes: list[int] = []
        """While it waits for a copy from host memory: the blocks copied."""
        self.load_end = 0.0
        """When that copy ends."""
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.block_ids: list[int] = []
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        self.finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """Output token ids so far (empty when the request has no token ids)."""
        if self.token_ids is None:
            return []
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        """Whether the request finished or was aborted."""
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival to first scheduling."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first output token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        """Seconds from arrival to the end."""
        if self.finish_time is None:
            return None
        return self.finish_time - self.arrival_time

    def __repr__(self) -> str:
        return (
            f"SimRequest({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}"
            f", output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )


@dataclass(slots=True)
class EngineStats:
    """Counters since the engine started (the source of the server's vLLM metrics)."""

    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache."""
    prefix_cache_hits: int = 0
    """Of those, tokens found cached."""
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    """Cached tokens of first admissions (what `usage` reports)."""
    generation_tokens: int = 0
    num_preemptions: int = 0
    requests_finished: int = 0
    host_hit_tokens: int = 0
    """Prompt tokens copied back from host memory rather than computed."""
    host_loads: int = 0
    """Copies from host memory (one per admission that found its prefix there)."""
    steps: int = 0
    busy_seconds: float = 0.0
    load_seconds: float = 0.0


@dataclass(slots=True)
class StepResult:
    """What one engine step did, and when."""

    start: float
    duration: float
    model: str = ""
    num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_requests: int = 0
    num_requests: int = 0
    """Requests the step computed (prefill chunks and decodes)."""
    outputs: list[SimRequest] = field(default_factory=list)
    """Requests that got new output tokens (one per step) in this step."""
    finished: list[SimRequest] = field(default_factory=list)
    num_preempted: int = 0
    kv_events: list[Any] = field(default_factory=list)
    num_steps: int = 1
    """Engine steps this result covers (more than one for a run of identical decode steps)."""

    @property
    def end(self) -> float:
        """When the step's tokens exist."""
        return self.start + self.duration


def _queue_key(request: SimRequest) -> tuple[int, float, int]:
    """The order of vLLM's priority queue: priority, then arrival.

    Arrival is the time, then the order the engine received requests in: vLLM's arrival
    clock tells apart what a simulated clock gives the same time.
    """
    return (request.priority, request.arrival_time, request.arrival_order)


def _victim_key(request: SimRequest) -> tuple[int, float, int]:
    """The running request with the largest key is the one vLLM's priority policy preempts."""
    return (request.priority, request.arrival_time, request.arrival_order)


class EngineCore:
    """One model's scheduler, KV cache and step timing (see the module docstring).

    `kv_cache_bytes` is the memory left for this model's KV cache; by default the GPU's memory
    times `gpu_memory_utilization`, less the weights and the activation reserve.
    """

    def __init__(
        self,
        gpu: GpuProfile | GpuGeneration | str,
        model: ModelSpec,
        config: EngineConfig | None = None,
        *,
        kv_cache_bytes: int | None = None,
        warm: bool = True,
    ) -> None:
        self.config = config = config or EngineConfig()
        self.model = model
        self.perf = perf = PerfModel(
            gpu=gpu_profile(gpu),
            model=model,
            tensor_parallel=config.tensor_parallel,
            mfu=config.mfu,
            bandwidth_efficiency=config.bandwidth_efficiency,
            step_overhead_s=config.step_overhead_s,
            load_bandwidth_gbps=config.load_bandwidth_gbps,
        )
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len or model.context_length
        if config.num_gpu_blocks is not None:
            num_blocks = config.num_gpu_blocks
        else:
            if kv_cache_bytes is None:
                kv_cache_bytes = int(
                    perf.memory_bytes() * config.gpu_memory_utilization
                    - perf.weight_bytes
                    - config.activation_reserve_gb * GB
                )
            num_blocks = kv_cache_bytes // (self.block_size * perf.kv_bytes_per_token)
        if num_blocks < 1:
            raise ValueError(
                f"{model.name} does not fit on {perf.gpu.generation.value}"
                f"×{config.tensor_parallel}: its weights take {perf.weight_bytes / GB:.1f} GB of "
                f"{perf.memory_bytes() * config.gpu_memory_utilization / GB:.1f} GB usable; "
                "use a larger GPU, more GPUs per replica, or a smaller model"
            )
        if (num_blocks - 1) * self.block_size < self.max_model_len:
            raise ValueError(
                f"{model.name} on {perf.gpu.generation.value}: the KV cache holds "
                f"{max(0, num_blocks - 1) * self.block_size} tokens, fewer than max_model_len "
                f"{self.max_model_len}; lower max_model_len or give it more memory"
            )
        self.num_gpu_blocks = num_blocks
        self._events: list[Any] | None = [] if config.enable_kv_events else None
        self._retention_pool: RetentionBlockPool | None = None
        """The pool again when it evicts by retention priority (`EngineConfig.kv_retention`)."""
        if config.kv_retention:
            self._retention_pool = RetentionBlockPool(
                num_blocks, self.block_size, config.enable_prefix_caching, self._events
            )
            self.pool: BlockPool = self._retention_pool
        else:
            self.pool = BlockPool(
                num_blocks, self.block_size, config.enable_prefix_caching, self._events
            )
        self.host: HostTier | None = None
        """The host-memory tier (`EngineConfig.host_tier`); None without one."""
        if config.host_tier > 0 and config.enable_prefix_caching:
            self.host = HostTier(
                max(1, int(config.host_tier * (num_blocks - 1))),
                self.block_size,
                self.block_size * perf.kv_bytes_per_token,
                PerfModel(
                    gpu=perf.gpu,
                    model=model,
                    tensor_parallel=config.tensor_parallel,
                    host_link_gbps=config.host_link_gbps,
                ).host_bytes_per_second,
                store_threshold=config.host_store_threshold,
                events=self._events,
            )
        self._loading: list[SimRequest] = []
        """Requests waiting for their prefix from host memory, by when the copy ends."""
        self._being_loaded: set[int] = set()
        """Hashes of blocks being copied from host memory (not copied twice at once)."""
        self._store_offers: list[list[int]] = []
        """Blocks this step writes to host memory once it has computed them."""
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.requests: dict[str, SimRequest] = {}
        self.stats = EngineStats()
        self._by_priority = config.scheduling_policy == "priority"
        self._arrivals = 0
        self._blocked: tuple[SimRequest, int, int | None] | None = None
        """The waiting request at the head that did not fit, the pool's `releases` then, and
        the first block of its prompt that was not cached (None: none could be)."""
        self._skip_blocked = True
        """Skip looking the blocked head up again while nothing that could let it in changed."""
        self.loaded = warm
        self.ready_at: float | None = None if not warm else 0.0
        self._inflight: list[tuple[SimRequest, int]] | None = None
        self._inflight_preempted = 0
        self._step_start = 0.0
        self._step_duration = 0.0
        self._step_prefill_tokens = 0
        self._totals: tuple[int, int, float, int] = (0, 0, 0.0, 0)
        self._run_steps = 0
        self._run_ends: list[float] = []
        # PerfModel.step_seconds with its constants folded (it runs once per step).
        self._flop_time = 2.0 * perf.parameters / perf.flops_per_second
        self._attention_time = 4.0 * model.layers * perf.hidden_size / perf.flops_per_second
        self._weight_time = perf.weight_bytes / perf.bytes_per_second
        self._kv_time = perf.kv_bytes_per_token / perf.bytes_per_second
        self._overhead = perf.step_overhead_s
        self._slowdown = config.slowdown

    # -- requests -----------------------------------------------------------------------

    def add_request(self, request: SimRequest, now: float) -> None:
        """Queue `request`, arrived at `now`; it is scheduled at the next step."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {request.num_prompt_tokens} input tokens."
            )
        if request.block_hashes is None:
            request.block_hashes = (
                block_hashes(request.token_ids, self.block_size, cache_salt=request.cache_salt)
                if request.token_ids is not None and self.config.enable_prefix_caching
                else []
            )
        request.arrival_time = now
        request.arrival_order = self._arrivals
        self._arrivals += 1
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._enqueue(request, front=False)

    def _enqueue(self, request: SimRequest, *, front: bool) -> None:
        """Into the waiting queue in the scheduling policy's order.

        fcfs (vLLM's `FCFSRequestQueue`): a new request at the back, a preempted one
        (`front`) at the front; priorities play no part. priority (`PriorityRequestQueue`):
        ordered by (priority, arrival time, arrival order), preempted or not.
        """
        waiting = self.waiting
        if not self._by_priority:
            if front:
                waiting.appendleft(request)
            else:
                waiting.append(request)
            return
        key = _queue_key(request)
        index = len(waiting)
        if front:
            index = 0
            while index < len(waiting) and _queue_key(waiting[index]) < key:
                index += 1
        else:
            while index > 0 and _queue_key(waiting[index - 1]) > key:
                index -= 1
        if index == len(waiting):
            waiting.append(request)
        elif index == 0:
            waiting.appendleft(request)
        else:
            waiting.insert(index, request)

    def abort_request(self, request_id: str, now: float | None = None) -> bool:
        """Stop a request (client gone, stop string met); False if it is not in the engine."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            # An abort frees at the default priority, whatever the request asked for.
            self.pool.release(request.block_ids, now or 0.0)
            request.block_ids = []
        elif request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            self._loading.remove(request)
            self._end_load(request)
            self.pool.release(request.block_ids, now or 0.0)
            request.block_ids = []
        elif request in self.waiting:
            self.waiting.remove(request)
            if request.block_ids:
                self.pool.release(request.block_ids, now or 0.0)
                request.block_ids = []
        request.status = RequestStatus.ABORTED
        request.finish_reason = request.finish_reason or "abort"
        request.finish_time = now
        return True

    @property
    def num_running(self) -> int:
        """Requests admitted to the batch."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued (new or preempted, or their prefix on its way from host memory)."""
        return len(self.waiting) + len(self._loading)

    @property
    def loading(self) -> list[SimRequest]:
        """Requests whose prefix is being copied back from host memory (a copy of the list)."""
        return list(self._loading)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running or self._loading)

    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use (`vllm:kv_cache_usage_perc`)."""
        return self.pool.usage()

    def cached_prefix_tokens(self, hashes: Sequence[int]) -> int:
        """Tokens of a prompt with these block hashes that are cached now (no side effects)."""
        return self.pool.cached_prefix_blocks(hashes) * self.block_size

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (`AllBlocksCleared`); False while requests hold blocks."""
        return self.pool.reset()

    def evict_first(self, block_hashes: Sequence[int]) -> int:
        """Evict the free blocks of `block_hashes` before any other cached block.

        What a client's "this conversation is over" does (Dynamo's `nvext.session_control`
        close, which frees an SGLang session's KV); vLLM has no such request. Returns how many
        blocks moved (`BlockPool.evict_first`).
        """
        return self.pool.evict_first(block_hashes)

    # -- stepping -----------------------------------------------------------------------

    def next_wake_time(self) -> float | None:
        """When a loading model becomes ready, if that is what the engine waits for."""
        if not self.loaded and self.ready_at is not None and self.has_unfinished_requests():
            return self.ready_at
        if self._loading:
            return self._loading[0].load_end
        return None

    def begin_step(self, now: float, horizon: float | None = None) -> float | None:
        """Schedule one step at `now` and return its duration; None if there is nothing to do.

        Nothing to do also while a cold model is loading: `next_wake_time` says until when.

        With a `horizon` (a time before which nothing new reaches this engine unannounced), a
        run of pure decode steps may be taken at once: when every running request is
        decoding, none waits, no request can finish and the blocks the steps need are free,
        the steps (up to the horizon, and up to the step before the first request could
        finish) are identical but for their growing context, so their durations are summed
        and `end_step` applies them together (`StepResult.num_steps`). A request that arrives
        meanwhile cuts the run at the next step boundary (`cut_decode_run`). The final state
        is the same as stepping one at a time; the discrete-event fleet uses this, the
        real-time server does not.
        """
        if self._inflight is not None:
            raise RuntimeError("end_step() must be called before the next begin_step()")
        host = self.host
        if host is not None:
            host.complete_stores(now)
            if self._loading:
                self._finish_loads(now)
                if horizon is not None and self._loading:
                    # A copy that ends during a run of decode steps joins at the next step.
                    horizon = min(horizon, self._loading[0].load_end)
        if not self.waiting and not self.running:
            return None
        if not self.loaded:
            if self.ready_at is None:
                load = self.perf.load_seconds()
                self.ready_at = now + load
                self.stats.load_seconds += load
            if now < self.ready_at:
                return None
            self.loaded = True
        if (
            horizon is not None
            and not self.waiting
            and not (
                # A planned decode run would step past the moment a deadline comes at risk.
                (self.config.deadline_pause or self.config.deadline_hold)
                and any(request.deadline_at is not None for request in self.running)
            )
        ):
            duration = self._begin_decode_run(now, horizon)
            if duration is not None:
                return duration
        scheduled, preempted = self._schedule(now)
        retries = 0
        while not scheduled and preempted and retries < 2:
            # Everything running was preempted: vLLM's next step takes them from the queue.
            scheduled, again = self._schedule(now)
            preempted += again
            retries += 1
        if preempted:
            self.stats.num_preemptions += preempted
        if not scheduled:
            if self._store_offers:
                self._issue_stores(now)
            return None
        new_tokens, context, pairs, prefill = self._totals
        compute = self._flop_time * new_tokens + self._attention_time * pairs
        memory = self._weight_time + self._kv_time * (context + new_tokens)
        duration = (max(compute, memory) + self._overhead) * self._slowdown
        if self._store_offers:
            # The copies start once the step has computed the blocks.
            self._issue_stores(now + duration)
        self._inflight = scheduled
        self._inflight_preempted = preempted
        self._step_start = now
        self._step_duration = duration
        self._step_prefill_tokens = prefill
        return duration

    def end_step(self) -> StepResult:
        """Apply the step begun by `begin_step` at its end time and say what happened."""
        scheduled = self._inflight
        if scheduled is None:
            raise RuntimeError("begin_step() did not schedule a step")
        self._inflight = None
        if self._run_steps:
            return self._end_decode_run()
        now = self._step_start + self._step_duration
        outputs: list[SimRequest] = []
        finished: list[SimRequest] = []
        stats = self.stats
        max_model_len = self.max_model_len
        running_status = RequestStatus.RUNNING
        retention_pool = self._retention_pool
        total = 0
        decodes = 0
        for request, num_new in scheduled:
            total += num_new
            if request.status is not running_status:
                continue  # aborted while the step ran
            computed = request.num_computed_tokens + num_new
            request.num_computed_tokens = computed
            produced = request.num_output_tokens
            if computed < request.num_prompt_tokens + produced:
                continue  # a chunk of a longer prefill: no token yet
            if num_new == 1 and produced:
                decodes += 1
            # The step computed every known token: sample the next one.
            produced += 1
            request.num_output_tokens = produced
            eos = False
            sampler = request.sampler
            if sampler is not None:
                token, eos = sampler.next_token()
                if request.token_ids is not None:
                    request.token_ids.append(token)
            elif request.eos_after is not None and produced >= request.eos_after:
                eos = True
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            outputs.append(request)
            if eos and not request.ignore_eos:
                reason = "stop"
            elif produced >= request.max_tokens or computed + 1 >= max_model_len:
                reason = "length"
            else:
                continue
            request.status = RequestStatus.FINISHED
            request.finish_reason = reason
            request.finish_time = now
            if retention_pool is None:
                self.pool.release(request.block_ids, now)
            else:
                retention_pool.release(
                    request.block_ids, now, request.retention_priority, request.retention_s
                )
            request.block_ids = []
            del self.requests[request.request_id]
            finished.append(request)
        stats.steps += 1
        stats.busy_seconds += self._step_duration
        stats.generation_tokens += len(outputs)
        if finished:
            stats.requests_finished += len(finished)
            self.running = [r for r in self.running if r.status is running_status]
        result = StepResult(
            start=self._step_start,
            duration=self._step_duration,
            model=self.model.name,
            num_scheduled_tokens=total,
            num_prefill_tokens=self._step_prefill_tokens,
            num_decode_requests=decodes,
            num_requests=len(scheduled),
            outputs=outputs,
            finished=finished,
            num_preempted=self._inflight_preempted,
        )
        if self._events:
            result.kv_events = self._events[:]
            self._events.clear()
        return result

    def step(self, now: float) -> StepResult:
        """`begin_step` and `end_step` at once; an idle step has duration 0."""
        duration = self.begin_step(now)
        if duration is None:
            result = StepResult(start=now, duration=0.0, model=self.model.name)
            if self._events:
                result.kv_events = self._events[:]
                self._events.clear()
            return result
        return self.end_step()

    # -- runs of decode steps (discrete-event clock) ------------------------------------

    def _begin_decode_run(self, now: float, horizon: float) -> float | None:
        """Plan several identical decode steps at once (see `begin_step`); None if not possible."""
        running = self.running
        batch = len(running)
        if batch > self.config.max_num_batched_tokens:
            return None
        max_model_len = self.max_model_len
        steps = max_model_len
        context = 0
        pairs = 0.0
        # Comparisons rather than min() calls here and a loop rather than sum() below: this
        # runs at every step boundary of every replica.
        for request in running:
            produced = request.num_output_tokens
            computed = request.num_computed_tokens
            if request.sampler is not None or computed != request.num_prompt_tokens + produced - 1:
                return None
            left = request.max_tokens - produced
            if max_model_len - computed - 1 < left:
                left = max_model_len - computed - 1
            eos_after = request.eos_after
            if eos_after is not None and eos_after - produced < left:
                left = eos_after - produced
            if left - 1 < steps:
                steps = left - 1  # the step that finishes a request is taken on its own
            context += computed
            pairs += computed + 0.5
        if steps < 2:
            return None
        block_size = self.block_size
        needed = 0
        for request in running:
            blocks = -(-(request.num_computed_tokens + steps) // block_size)
            needed += blocks - len(request.block_ids)
        if needed > self.pool.num_free_blocks:
            return None  # memory pressure: step one at a time, preempting as vLLM would
        if needed and self._retention_pool is not None:
            # The run's blocks are taken at its start (`_end_decode_run`); stepping one at a
            # time would take them later. Ending the run before a retention lapses keeps the
            # eviction order the same at every one of those times.
            expiry = self._retention_pool.next_expiry(now)
            if expiry is not None and now < expiry < horizon:
                horizon = expiry
        # Durations of steps i = 0..steps-1: context and pairs grow by one token per sequence.
        flop, attention = self._flop_time * batch, self._attention_time
        weights, kv = self._weight_time, self._kv_time
        overhead, slowdown = self._overhead, self._slowdown
        budget = horizon - now
        total = 0.0
        ends: list[float] = []
        for taken in range(steps):
            compute = flop + attention * (pairs + taken * batch)
            memory = weights + kv * (context + (taken + 1) * batch)
            duration = ((compute if compute > memory else memory) + overhead) * slowdown
            if taken and total + duration > budget:
                break
            total += duration
            ends.append(total)
        if len(ends) < 2:
            return None
        self._inflight = []
        self._run_ends = ends
        self._run_steps = len(ends)
        self._inflight_preempted = 0
        self._step_start = now
        self._step_duration = total
        self._step_prefill_tokens = 0
        return total

    def cut_decode_run(self, now: float) -> float | None:
        """End a run of decode steps at the first step boundary at or after `now`.

        Called when a request arrives during a run: in vLLM it would join at the next step.
        Returns the run's new end time, or None if no run is cut (none in flight, or it ends
        at that boundary anyway).
        """
        if not self._run_steps or self._inflight is None:
            return None
        index = bisect.bisect_left(self._run_ends, now - self._step_start)
        steps = index + 1
        if steps >= self._run_steps:
            return None
        self._run_steps = steps
        self._step_duration = self._run_ends[index]
        return self._step_start + self._step_duration

    def _end_decode_run(self) -> StepResult:
        steps = self._run_steps
        self._run_steps = 0
        self._run_ends = []
        now = self._step_start + self._step_duration
        block_size = self.block_size
        pool = self.pool
        outputs = list(self.running)
        for request in outputs:
            computed = request.num_computed_tokens + steps
            # Blocks are taken now rather than step by step: the same blocks leave the free
            # queue in the same order, so the cache ends up as if stepped one at a time.
            count = -(-computed // block_size) - len(request.block_ids)
            if count > 0:
                blocks = pool.allocate(count, self._step_start)
                assert blocks is not None
                request.block_ids.extend(blocks)
            request.num_computed_tokens = computed
            request.num_output_tokens += steps
            request.last_token_time = now
            if computed // block_size > request.num_hashed_blocks:
                # As the run's steps would have, each when it was scheduled.
                self._cache_full_blocks(request, computed)
            if self.host is not None and computed // block_size > request.num_offered_blocks:
                self._offer(request, computed)
        if self._store_offers:
            self._issue_stores(now)
        stats = self.stats
        stats.steps += steps
        stats.busy_seconds += self._step_duration
        stats.generation_tokens += steps * len(outputs)
        result = StepResult(
            start=self._step_start,
            duration=self._step_duration,
            model=self.model.name,
            num_scheduled_tokens=steps * len(outputs),
            num_decode_requests=len(outputs),
            num_requests=len(outputs),
            outputs=outputs,
            num_steps=steps,
        )
        if self._events:
            result.kv_events = self._events[:]
            self._events.clear()
        return result

    # -- scheduling ---------------------------------------------------------------------

    def _at_risk_band_top(self, now: float) -> int | None:
        """The last priority of the band at risk this step; None: no request is at risk.

        Requests of larger priorities pause (`deadline_pause`) or wait (`deadline_hold`).
        It is the last priority of the band (`deadline_priority_span`) of the most urgent decoding
        request whose deadline its `max_tokens` left, at the last step's duration, would pass.
        What an engine knows: the request's cap, not where its answer ends, as vLLM's
        scheduler (`kvflow_vllm.scheduler`) sees it.
        """
        step_s = self._step_duration
        urgent: int | None = None
        for request in self.running:
            due = request.deadline_at
            if due is None or now >= due or request.num_computed_tokens < request.num_prompt_tokens:
                continue
            left = request.max_tokens - request.num_output_tokens
            if now + left * step_s > due and (urgent is None or request.priority < urgent):
                urgent = request.priority
        if urgent is None:
            return None
        # The last priority of the urgent request's band: its own tier is never paused.
        span = self.config.deadline_priority_span
        return (urgent // span + 1) * span - 1

    def _schedule(self, now: float) -> tuple[list[tuple[SimRequest, int]], int]:
        """Pick this step's requests (module docstring); totals go to `self._totals`."""
        budget = self.config.max_num_batched_tokens
        block_size = self.block_size
        pool = self.pool
        scheduled: list[tuple[SimRequest, int]] = []
        append = scheduled.append
        preempted = 0
        new_tokens = 0
        context = 0
        pairs = 0.0
        prefill = 0
        running = self.running
        by_priority = self._by_priority
        config = self.config
        at_risk = (
            self._at_risk_band_top(now) if config.deadline_pause or config.deadline_hold else None
        )
        paused_above = at_risk if config.deadline_pause else None
        host = self.host
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            if paused_above is not None and request.priority > paused_above:
                index += 1
                continue
            computed = request.num_computed_tokens
            num_new = request.num_prompt_tokens + request.num_output_tokens - computed
            if num_new > budget:
                num_new = budget
            if computed + num_new > len(request.block_ids) * block_size:
                needed = -(-(computed + num_new) // block_size) - len(request.block_ids)
                blocks = pool.allocate(needed, now)
                while blocks is None:
                    if by_priority:
                        victim = max(running, key=_victim_key)
                        position = running.index(victim)
                        del running[position]
                        if position < index:
                            index -= 1
                            # Scheduled earlier in this step: its tokens go back to the budget.
                            taken = self._unschedule(scheduled, victim)
                            budget += taken
                            new_tokens -= taken
                            context -= victim.num_computed_tokens
                            if taken == 1:
                                pairs -= victim.num_computed_tokens + 0.5
                            else:
                                pairs -= taken * (victim.num_computed_tokens + taken * 0.5)
                                prefill -= taken
                    else:
                        victim = running.pop()
                    self._preempt(victim, now)
                    preempted += 1
                    if victim is request:
                        break
                    blocks = pool.allocate(needed, now)
                if blocks is None:
                    break
                request.block_ids.extend(blocks)
            if (computed + num_new) // block_size > request.num_hashed_blocks:
                self._cache_full_blocks(request, computed + num_new)
            if host is not None and (computed + num_new) // block_size > request.num_offered_blocks:
                self._offer(request, computed + num_new)
            append((request, num_new))
            budget -= num_new
            new_tokens += num_new
            context += computed
            if num_new == 1:
                pairs += computed + 0.5
            else:
                pairs += num_new * (computed + num_new * 0.5)
                prefill += num_new
            index += 1
        if not preempted:
            waiting = self.waiting
            max_seqs = self.config.max_num_seqs
            reserve_full = self.config.scheduler_reserve_full_isl
            stats = self.stats
            skipped: list[SimRequest] = []
            while waiting and budget > 0 and len(running) < max_seqs:
                request = waiting[0]
                if at_risk is not None and request.priority > at_risk:
                    break
                blocked = self._blocked
                if (
                    blocked is not None
                    and blocked[0] is request
                    and blocked[1] == pool.releases
                    and (blocked[2] is None or not pool.is_cached(blocked[2]))
                ):
                    # It did not fit, and since then no block was freed and its first missing
                    # block was not cached: free blocks only went down, its hits only down
                    # (or back up to where they were), so it still does not fit. A blocked
                    # head is otherwise looked up every step, the most of a thrashing run.
                    break
                num_tokens = request.num_prompt_tokens + request.num_output_tokens
                hits: list[int] = []
                hashes = request.block_hashes
                held = request.block_ids
                if held:
                    # Back from host memory: its blocks are held and its prefix computed.
                    num_cached = request.num_computed_tokens
                    max_blocks = 0
                else:
                    # Leave at least the last token to compute, as vLLM does.
                    max_blocks = min((num_tokens - 1) // block_size, len(hashes or ()))
                    if hashes:
                        hits = pool.longest_cached_prefix(hashes, max_blocks)
                    num_cached = len(hits) * block_size
                    if host is not None and hashes:
                        found = self._host_lookup(request, hashes, len(hits), max_blocks)
                        if found < 0:
                            # vLLM's connector asks to try again: skip it, keep its place.
                            skipped.append(waiting.popleft())
                            continue
                        if found:
                            if self._start_load(request, hits, found, num_tokens, now):
                                waiting.popleft()
                                continue
                            if reserve_full and self._skip_blocked:
                                self._blocked = (request, pool.releases, None)
                            break
                num_new = num_tokens - num_cached
                if num_new > budget:
                    num_new = budget
                owned = len(held) or len(hits)
                needed = -(-(num_cached + num_new) // block_size) - owned
                want = -(-num_tokens // block_size) - owned if reserve_full else needed
                # Free blocks among the hits stop being free once the request takes them.
                # Counting them walks every hit; it can change the answer only when the
                # request would not fit with all of them counted out.
                available = pool.num_free_blocks
                if hits and want > available - len(hits):
                    available -= pool.count_free(hits)
                if want > available:
                    if reserve_full and self._skip_blocked:
                        missing = hashes[len(hits)] if hashes and len(hits) < max_blocks else None
                        self._blocked = (request, pool.releases, missing)
                    break
                self._blocked = None
                pool.touch(hits)
                blocks = pool.allocate(needed, now)
                assert blocks is not None
                waiting.popleft()
                if held:
                    held.extend(blocks)
                else:
                    request.block_ids = hits + blocks
                    request.num_computed_tokens = num_cached
                    request.num_hashed_blocks = len(hits)
                    request.num_external_tokens = 0
                    stats.prefix_cache_queries += num_tokens
                    stats.prefix_cache_hits += num_cached
                request.status = RequestStatus.RUNNING
                running.append(request)
                if (num_cached + num_new) // block_size > request.num_hashed_blocks:
                    self._cache_full_blocks(request, num_cached + num_new)
                if (
                    host is not None
                    and (num_cached + num_new) // block_size > request.num_offered_blocks
                ):
                    self._offer(request, num_cached + num_new)
                if request.first_scheduled_time is None:
                    request.first_scheduled_time = now
                    request.num_cached_tokens = num_cached
                    stats.prompt_tokens += request.num_prompt_tokens
                    stats.cached_prompt_tokens += num_cached
                append((request, num_new))
                budget -= num_new
                new_tokens += num_new
                context += num_cached
                pairs += num_new * (num_cached + num_new * 0.5)
                prefill += num_new
            if skipped:
                for request in reversed(skipped):
                    self._enqueue(request, front=True)
        self._totals = (new_tokens, context, pairs, prefill)
        return scheduled, preempted

    @staticmethod
    def _unschedule(scheduled: list[tuple[SimRequest, int]], request: SimRequest) -> int:
        """Take `request` out of this step's schedule; the tokens it had been given."""
        for position, (entry, num_new) in enumerate(scheduled):
            if entry is request:
                del scheduled[position]
                return num_new
        raise AssertionError(f"{request.request_id} was not scheduled in this step")

    def _preempt(self, request: SimRequest, now: float) -> None:
        """Preempt by recompute: free the request's blocks and queue it again.

        The blocks go back at the default retention priority: the request is coming back.
        """
        self.pool.release(request.block_ids, now)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_hashed_blocks = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self._enqueue(request, front=True)

    # -- the host tier ------------------------------------------------------------------

    def _host_lookup(
        self, request: SimRequest, hashes: list[int], gpu_hits: int, max_blocks: int
    ) -> int:
        """Blocks of the prompt after its `gpu_hits` that can come back from host memory.

        As vLLM's offloading connector answers `get_num_new_matched_tokens`: -1 (try again
        at a later step) while as many copies are in flight as requests may run, or while
        another request copies one of those blocks; else every full block of the request is
        touched and the ready ones after the GPU hit counted (at most to `max_blocks`).
        """
        host = self.host
        assert host is not None
        if len(self._loading) >= self.config.max_num_seqs:
            return -1
        num_full = min(
            len(hashes), (request.num_prompt_tokens + request.num_output_tokens) // self.block_size
        )
        host.touch(hashes[:num_full])
        if max_blocks <= gpu_hits:
            return 0
        found = min(host.lookup(hashes[gpu_hits:num_full]), max_blocks - gpu_hits)
        being_loaded = self._being_loaded
        if (
            found
            and being_loaded
            and not being_loaded.isdisjoint(hashes[gpu_hits : gpu_hits + found])
        ):
            return -1
        return found

    def _start_load(
        self, request: SimRequest, hits: list[int], found: int, num_tokens: int, now: float
    ) -> bool:
        """Copy `found` blocks after the GPU `hits` back from host memory; False if no room.

        The request needs free GPU blocks for them (for its whole prompt under
        `scheduler_reserve_full_isl`), takes its hits and the new blocks at once, and waits
        until the copy ends (`_finish_loads`); it takes no token budget meanwhile.
        """
        host = self.host
        assert host is not None and request.block_hashes is not None
        pool = self.pool
        block_size = self.block_size
        start = len(hits)
        want = (
            -(-num_tokens // block_size) - start
            if self.config.scheduler_reserve_full_isl
            else found
        )
        available = pool.num_free_blocks
        if hits and want > available - start:
            available -= pool.count_free(hits)
        if want > available:
            return False
        self._blocked = None
        pool.touch(hits)
        blocks = pool.allocate(found, now)
        assert blocks is not None
        load = request.block_hashes[start : start + found]
        request.block_ids = hits + blocks
        request.num_computed_tokens = start * block_size
        request.num_hashed_blocks = start
        request.num_external_tokens = found * block_size
        request.num_offered_blocks = start + found
        request.load_hashes = load
        # One link, copies in the order issued: ends only grow, so the list stays sorted.
        request.load_end = host.begin_load(load, now)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self._being_loaded.update(load)
        self._loading.append(request)
        stats = self.stats
        stats.prefix_cache_queries += num_tokens
        stats.prefix_cache_hits += start * block_size
        stats.host_hit_tokens += found * block_size
        stats.host_loads += 1
        return True

    def _finish_loads(self, now: float) -> None:
        """Copies from host memory ended by `now`: cache the blocks, queue the requests again.

        As vLLM does when a load ends: the copied blocks enter the GPU prefix cache and the
        request, its prefix computed, goes back to the front of the waiting queue.
        """
        loading = self._loading
        done = 0
        while done < len(loading) and loading[done].load_end <= now:
            done += 1
        if not done:
            return
        finished = loading[:done]
        del loading[:done]
        block_size = self.block_size
        for request in finished:
            self._end_load(request)
            hashes = request.block_hashes
            assert hashes is not None
            start = request.num_hashed_blocks
            end = start + len(request.load_hashes)
            tokens = request.token_ids
            self.pool.cache_blocks(
                request.block_ids[start:end],
                hashes[start:end],
                hashes[start - 1] if start > 0 else None,
                tokens[start * block_size : end * block_size] if tokens is not None else [],
                request.cache_salt if start == 0 else None,
            )
            request.num_hashed_blocks = end
            request.num_computed_tokens = end * block_size
            request.load_hashes = []
            request.status = RequestStatus.WAITING
        for request in reversed(finished):
            self._enqueue(request, front=True)

    def _end_load(self, request: SimRequest) -> None:
        """Unpin the host blocks `request` copied."""
        assert self.host is not None
        self.host.end_load(request.load_hashes)
        self._being_loaded.difference_update(request.load_hashes)

    def _offer(self, request: SimRequest, num_tokens: int) -> None:
        """Offer the request's full blocks not offered yet to host memory (write-through).

        As vLLM's connector: blocks already there are skipped; when the tier cannot make
        room, nothing is stored and the same blocks are offered at a later step; after a
        store the request's blocks become the most recently used.
        """
        host = self.host
        assert host is not None
        hashes = request.block_hashes
        assert hashes is not None
        last = min(num_tokens // self.block_size, len(hashes))
        first = request.num_offered_blocks
        if last <= first:
            return
        fresh = host.prepare_store(hashes[first:last])
        if fresh is None:
            return
        request.num_offered_blocks = last
        if fresh:
            host.touch(hashes[:last])
            self._store_offers.append(fresh)

    def _issue_stores(self, when: float) -> None:
        """Start the copies of this step's offered blocks at `when` (the step's end)."""
        host = self.host
        assert host is not None
        for fresh in self._store_offers:
            host.store(fresh, when)
        self._store_offers.clear()

    def _cache_full_blocks(self, request: SimRequest, num_tokens: int) -> None:
        """Register the blocks full within the request's first `num_tokens` tokens."""
        block_size = self.block_size
        first = request.num_hashed_blocks
        full = num_tokens // block_size
        hashes = request.block_hashes
        assert hashes is not None
        tokens = request.token_ids
        if tokens is not None and self.config.enable_prefix_caching:
            # Output blocks get their hashes as they fill, so a later turn that repeats the
            # answer in its prompt reuses them.
            parent = hashes[-1] if hashes else ROOT_HASH
            for index in range(len(hashes), full):
                block = tokens[index * block_size : (index + 1) * block_size]
                # A prompt shorter than a block: its first block is output, and salted.
                parent = hash_block(parent, block, None if index else request.cache_salt)
                hashes.append(parent)
        last = min(full, len(hashes))
        if last <= first:
            request.num_hashed_blocks = full
            return
        self.pool.cache_blocks(
            request.block_ids[first:last],
            hashes[first:last],
            hashes[first - 1] if first > 0 else None,
            tokens[first * block_size : last * block_size] if tokens is not None else [],
            request.cache_salt if first == 0 else None,
        )
        request.num_hashed_blocks = full


class SimReplica:
    """One GPU replica running one engine per model; the engines take turns on the GPU.

    Memory: the weights of every model (warm and cold) are set aside, and what is left of
    `gpu_memory_utilization × memory − reserve` is split evenly between the models' KV caches.
    A cold model loads on its first request. Use `begin_step` / `end_step` as with
    `EngineCore`.
    """

    def __init__(
        self,
        gpu: GpuProfile | GpuGeneration | str,
        models: Sequence[ModelSpec],
        config: EngineConfig | None = None,
        *,
        cold_models: Sequence[ModelSpec] = (),
        name: str = "replica",
    ) -> None:
        if not models and not cold_models:
            raise ValueError("a replica needs at least one model")
        self.name = name
        self.config = config = config or EngineConfig()
        self.gpu = gpu_profile(gpu)
        all_models = [*models, *cold_models]
        names = [m.name for m in all_models]
        if len(set(names)) != len(names):
            raise ValueError(f"a model is listed twice: {', '.join(names)}")
        kv_share: int | None = None
        if config.num_gpu_blocks is None:
            perfs = [
                PerfModel(gpu=self.gpu, model=m, tensor_parallel=config.tensor_parallel)
                for m in all_models
            ]
            memory = perfs[0].memory_bytes()
            free = (
                memory * config.gpu_memory_utilization
                - sum(p.weight_bytes for p in perfs)
                - config.activation_reserve_gb * GB
            )
            if free <= 0:
                verb = "does" if len(names) == 1 else "do"
                raise ValueError(
                    f"{', '.join(names)} {verb} not fit on {self.gpu.generation.value}"
                    f"×{config.tensor_parallel}: weights take "
                    f"{sum(p.weight_bytes for p in perfs) / GB:.1f} GB of "
                    f"{memory * config.gpu_memory_utilization / GB:.1f} GB usable; use a larger "
                    "GPU, more GPUs per replica (tensor parallel), or a smaller model"
                )
            kv_share = int(free / len(all_models))
        self.engines: dict[str, EngineCore] = {}
        for model in all_models:
            self.engines[model.name] = EngineCore(
                self.gpu, model, config, kv_cache_bytes=kv_share, warm=model in models
            )
        self._order = list(self.engines.values())
        self._next = 0
        self._active: EngineCore | None = None

    @property
    def models(self) -> list[str]:
        """Names of the models this replica serves."""
        return list(self.engines)

    def engine(self, model: str) -> EngineCore:
        """The engine of `model`; `KeyError` if the replica does not serve it."""
        return self.engines[model]

    def add_request(self, model: str, request: SimRequest, now: float) -> None:
        """Queue `request` on `model`'s engine."""
        self.engines[model].add_request(request, now)

    def has_unfinished_requests(self) -> bool:
        """Whether any engine has work."""
        return any(e.has_unfinished_requests() for e in self._order)

    @property
    def num_running(self) -> int:
        """Running requests over all models."""
        if len(self._order) == 1:  # the usual replica; routers ask per request and replica
            return len(self._order[0].running)
        return sum(len(e.running) for e in self._order)

    @property
    def num_waiting(self) -> int:
        """Waiting requests over all models."""
        if len(self._order) == 1:
            return self._order[0].num_waiting
        return sum(e.num_waiting for e in self._order)

    def load(self) -> int:
        """Running plus waiting requests over all models."""
        if len(self._order) == 1:
            engine = self._order[0]
            return len(engine.running) + len(engine.waiting) + len(engine._loading)
        return sum(len(e.running) + e.num_waiting for e in self._order)

    def kv_cache_usage(self) -> float:
        """Mean KV usage over the models' caches."""
        return sum(e.kv_cache_usage() for e in self._order) / len(self._order)

    def begin_step(self, now: float, horizon: float | None = None) -> float | None:
        """Start the next engine's step (round robin); None when no engine can step now.

        `horizon` is passed on (see `EngineCore.begin_step`) only when one engine has work,
        so that models sharing the GPU keep taking turns step by step.
        """
        if self._active is not None:
            raise RuntimeError("end_step() must be called before the next begin_step()")
        engines = self._order
        count = len(engines)
        if horizon is not None and count > 1:
            busy = sum(1 for e in engines if e.waiting or e.running)
            if busy > 1:
                horizon = None
        for offset in range(count):
            engine = engines[(self._next + offset) % count]
            duration = engine.begin_step(now, horizon)
            if duration is not None:
                self._active = engine
                self._next = (self._next + offset + 1) % count
                return duration
        return None

    def cut_decode_run(self, now: float) -> float | None:
        """Cut the active engine's run of decode steps at the next boundary (`EngineCore`)."""
        return None if self._active is None else self._active.cut_decode_run(now)

    def end_step(self) -> StepResult:
        """Finish the step started by `begin_step`."""
        engine = self._active
        if engine is None:
            raise RuntimeError("begin_step() did not start a step")
        self._active = None
        return engine.end_step()

    def next_wake_time(self) -> float | None:
        """The earliest time a loading model becomes ready while requests wait for it."""
        times = [t for e in self._order if (t := e.next_wake_time()) is not None]
        return min(times) if times else None

"""How long one engine step takes on a GPU, how much KV cache fits, how long a model loads.

A roofline model over public datasheet figures (`scheduler.gpus.GPU_PROFILES`) and the model's
shape (`kvflow.scheduler.fleet.ModelSpec`). For one step that computes `T` new tokens in total:

    flops   = 2 · P · T + 4 · L · d · A
    bytes   = W + K · (C + T)
    seconds = max(flops / (F · mfu), bytes / (B · bandwidth_efficiency)) + overhead

where `P` is the parameter count, `W = P · dtype_bytes` the weight bytes read once per step,
`L` the layers, `d ≈ √(P / 12L)` the hidden size, `K` the KV bytes per token
(`ModelSpec.kv_bytes_per_token`), `C` the tokens of context already in the KV cache that the
step's sequences attend to (read from memory), and `A = Σ n·(c + n/2)` the query–key pairs of
the step's attention (a sequence with `c` cached and `n` new tokens). `F` and `B` are the
GPU's dense BF16 FLOP/s and memory bandwidth, times the tensor-parallel degree and its
efficiency.

So prefill is bound by compute and grows with uncached tokens; a decode step is bound by memory
(weights plus the KV cache it reads) and grows with the batch; an H200 (more bandwidth) decodes
faster than an H100, which is faster than an L4 in both phases.

KV capacity, as vLLM sizes it: `gpu_memory_utilization · memory − weights − reserve`, divided
by the bytes of one block (`block_size · K`). Cold load time: `W / load_bandwidth`.

A host-memory KV tier moves blocks over each GPU's PCIe link to the host
(`HOST_LINK_GBPS`): a block of `block_size · K` bytes takes `block_size · K / (link · tp)`
seconds, each GPU of a tensor-parallel replica carrying its share of every block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvflow.scheduler.fleet import ModelSpec
from kvflow.scheduler.gpus import GPU_PROFILES, GpuGeneration, GpuProfile

GB = 1_000_000_000

HOST_LINK_GBPS: dict[GpuGeneration, float] = {
    GpuGeneration.L4: 25.0,
    GpuGeneration.A100: 25.0,
    GpuGeneration.H100: 50.0,
    GpuGeneration.H200: 50.0,
    GpuGeneration.B200: 50.0,
}
"""GB/s one GPU copies KV between its memory and pinned host memory, one way, as measured.

A x16 link carries 32 GB/s per direction at PCIe Gen4 (L4, A100) and 64 GB/s at Gen5
(H100, H200; HGX B200 boards attach the GPU to the host at Gen5 too), by the PCI-SIG
specifications and NVIDIA's datasheets; pinned-memory copies reach about 80% of that
(NVIDIA's `bandwidthTest`): about 25 and 50 GB/s. Both directions at once reach about 83
GB/s on an H100, not 100; the simulator's link shares one rate between them
(`kvflow.simulator.kvcache.HostTier`).
"""


def gpu_profile(gpu: GpuProfile | GpuGeneration | str) -> GpuProfile:
    """The profile of `gpu` (a profile, a generation or its name such as `"H100"`)."""
    if isinstance(gpu, GpuProfile):
        return gpu
    try:
        return GPU_PROFILES[GpuGeneration(gpu)]
    except ValueError:
        known = ", ".join(g.value for g in GpuGeneration)
        raise ValueError(f"unknown GPU {gpu!r}; known GPUs: {known}") from None


@dataclass(frozen=True, slots=True)
class PerfModel:
    """Step time, KV capacity and load time of one model on one replica (see module docstring)."""

    gpu: GpuProfile
    model: ModelSpec
    tensor_parallel: int = 1
    mfu: float = 0.4
    """Fraction of peak FLOP/s that prefill reaches."""
    bandwidth_efficiency: float = 0.75
    """Fraction of peak memory bandwidth that decode reaches."""
    tp_efficiency: float = 0.9
    """Speed kept per GPU when a replica spans several GPUs (communication overhead)."""
    step_overhead_s: float = 0.002
    """Scheduling, sampling and kernel-launch time of every step."""
    dtype_bytes: int = 2
    load_bandwidth_gbps: float = 2.0
    """GB/s at which cold weights are read into GPU memory."""
    host_link_gbps: float | None = None
    """GB/s of one GPU's link to host memory (None: `HOST_LINK_GBPS` of the GPU)."""

    @property
    def parameters(self) -> float:
        """Parameter count."""
        return self.model.parameters_b * 1e9

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights (read once per step)."""
        return int(self.parameters * self.dtype_bytes)

    @property
    def hidden_size(self) -> float:
        """Hidden size estimated from the parameter count: `P ≈ 12 · L · d²`."""
        return math.sqrt(self.parameters / (12 * self.model.layers))

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token occupies in every layer."""
        return self.model.kv_bytes_per_token(self.dtype_bytes)

    @property
    def _scale(self) -> float:
        tp = self.tensor_parallel
        return tp * (self.tp_efficiency if tp > 1 else 1.0)

    @property
    def flops_per_second(self) -> float:
        """Usable FLOP/s for prefill: peak × MFU × tensor-parallel scale."""
        return self.gpu.bf16_tflops * 1e12 * self.mfu * self._scale

    @property
    def bytes_per_second(self) -> float:
        """Usable memory bandwidth for decode."""
        return self.gpu.memory_bandwidth_tbps * 1e12 * self.bandwidth_efficiency * self._scale

    def step_seconds(self, new_tokens: int, context_tokens: int, attention_pairs: float) -> float:
        """Seconds of one step (formula in the module docstring).

        `new_tokens` is `T`, `context_tokens` is `C` (already-cached tokens the step's
        sequences attend to) and `attention_pairs` is `A`.
        """
        if new_tokens <= 0:
            return 0.0
        flops = 2.0 * self.parameters * new_tokens + (
            4.0 * self.model.layers * self.hidden_size * attention_pairs
        )
        memory = self.weight_bytes + self.kv_bytes_per_token * (context_tokens + new_tokens)
        return (
            max(flops / self.flops_per_second, memory / self.bytes_per_second)
            + self.step_overhead_s
        )

    def prefill_seconds(self, uncached_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to prefill one prompt in one step (an estimate for planners)."""
        pairs = uncached_tokens * (cached_tokens + uncached_tokens / 2)
        return self.step_seconds(uncached_tokens, cached_tokens, pairs)

    def decode_step_seconds(self, batch: int, mean_context: int) -> float:
        """Seconds of one decode step for `batch` sequences of `mean_context` tokens each."""
        return self.step_seconds(batch, batch * mean_context, batch * (mean_context + 0.5))

    @property
    def host_bytes_per_second(self) -> float:
        """Bytes per second the replica moves between GPU and host memory (all its links)."""
        link = self.host_link_gbps
        if link is None:
            link = HOST_LINK_GBPS[self.gpu.generation]
        return link * GB * self.tensor_parallel

    def load_seconds(self) -> float:
        """Seconds to load the weights of a cold model."""
        return self.weight_bytes / (self.load_bandwidth_gbps * GB)

    def memory_bytes(self) -> int:
        """GPU memory of the replica (all its GPUs)."""
        return self.gpu.memory_gb * GB * self.tensor_parallel

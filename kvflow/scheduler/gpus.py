"""GPU generations and their public datasheet figures.

The simulator turns these into step times and the scheduler into speed estimates, so both
agree on what an H200 can do compared with an L4.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class GpuGeneration(StrEnum):
    """A GPU generation kvflow knows the speed of."""

    L4 = "L4"
    A100 = "A100"
    H100 = "H100"
    H200 = "H200"
    B200 = "B200"


@dataclass(frozen=True, slots=True)
class GpuProfile:
    """Dense BF16 compute, memory bandwidth and memory of one GPU, from its datasheet."""

    generation: GpuGeneration
    bf16_tflops: float
    memory_bandwidth_tbps: float
    memory_gb: int


GPU_PROFILES: dict[GpuGeneration, GpuProfile] = {
    GpuGeneration.L4: GpuProfile(GpuGeneration.L4, 121.0, 0.3, 24),
    GpuGeneration.A100: GpuProfile(GpuGeneration.A100, 312.0, 2.0, 80),
    GpuGeneration.H100: GpuProfile(GpuGeneration.H100, 989.0, 3.35, 80),
    GpuGeneration.H200: GpuProfile(GpuGeneration.H200, 989.0, 4.8, 141),
    GpuGeneration.B200: GpuProfile(GpuGeneration.B200, 2250.0, 8.0, 180),
}

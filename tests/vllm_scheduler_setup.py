"""What a vLLM V1 scheduler is built with, for the scripts that drive one step by step.

Imported by `tests/vllm_task_end_steps.py` and `tests/vllm_deadline_pause_steps.py`, which run
in vLLM's own interpreter with only `kvflow_vllm` on the path (this folder is the script's, so
it is importable there too). The tiny model (`KVFLOW_TINY_MODEL`) gives the model config; the
KV cache is sized by hand, since no model runner profiles the memory.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.structured_output import StructuredOutputManager


def scheduler_args(
    *,
    block_size: int,
    blocks: int,
    max_model_len: int,
    max_num_seqs: int,
    prefix_caching: bool,
    policy: str = "fcfs",
) -> dict[str, Any]:
    """The keyword arguments of vLLM's `Scheduler` (and kvflow's subclasses of it)."""
    model = ModelConfig(model=os.environ["KVFLOW_TINY_MODEL"], max_model_len=max_model_len)
    config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_model_len,
            max_model_len=max_model_len,
            policy=policy,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
    )
    config.cache_config.num_gpu_blocks = blocks
    kv_cache = KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=block_size, num_kv_heads=1, head_size=16, dtype=torch.float32
                ),
            )
        ],
    )
    return {
        "vllm_config": config,
        "kv_cache_config": kv_cache,
        "structured_output_manager": StructuredOutputManager(config),
        "block_size": block_size,
        "log_stats": True,
    }

"""The description of an OpenAI-compatible inference server that a test talks to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ServedModel:
    """A running vLLM-compatible server: the simulator or real vLLM."""

    kind: Literal["sim", "vllm"]
    base_url: str
    """e.g. `http://127.0.0.1:8000` (no trailing slash, no `/v1`)."""
    model: str
    """The model name the server serves (`model` field of requests)."""
    block_size: int
    """KV-cache block size in tokens: cached tokens come in multiples of it."""
    max_model_len: int
    """Longest prompt + output the server accepts, in tokens."""

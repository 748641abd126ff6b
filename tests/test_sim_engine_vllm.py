"""The simulated engine's prefix cache under pressure agrees with real vLLM, request by request.

A real vLLM server (the CPU build, `make vllm-env`) runs with a KV cache of a few blocks
(`--num-gpu-blocks-override`, prefix caching on, 128-token blocks). A fixed sequence of agent
turns that overflows it is sent one request at a time; each turn's prompt repeats earlier
turns with their answers, so what it finds cached depends on which blocks vLLM evicted, in
which order, and on output blocks being hashed as they fill. The simulated engine, given the
same number of blocks and the same token ids (the answers replayed from vLLM's), must report
the same `cached_tokens` for every request.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvflow.simulator import BUILTIN_MODELS, EngineConfig, EngineCore, SimRequest
from kvflow.workers.vllm_server import (
    CPU_BLOCK_SIZE,
    READY_TIMEOUT_S,
    STOP_TIMEOUT_S,
    VllmInstall,
    VllmServer,
)
from tests.fixtures_vllm import early_vllm, vllm_servers

pytestmark = pytest.mark.vllm

NUM_GPU_BLOCKS = 10
"""vLLM's `--num-gpu-blocks-override`: 9 blocks of 128 tokens for requests, 1 null block."""
MAX_MODEL_LEN = 1024
MODEL_NAME = "tiny-llama"


class SmallCacheVllm(VllmServer):
    """A real vLLM server whose KV cache holds `num_gpu_blocks` blocks."""

    def __init__(self, *args: object, num_gpu_blocks: int, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.num_gpu_blocks = num_gpu_blocks

    def command(self) -> list[str]:
        """vLLM's command line with the block count fixed."""
        return [*super().command(), "--num-gpu-blocks-override", str(self.num_gpu_blocks)]


def _small_cache_server(install: VllmInstall, log_dir: Path) -> dict[str, VllmServer]:
    server = SmallCacheVllm(
        install,
        log_path=log_dir / "vllm-server.log",
        served_model_names=[MODEL_NAME],
        max_model_len=MAX_MODEL_LEN,
        ready_timeout_s=READY_TIMEOUT_S,
        stop_timeout_s=STOP_TIMEOUT_S,
        num_gpu_blocks=NUM_GPU_BLOCKS,
    )
    return {"small-cache": server}


SMALL_CACHE = early_vllm(__name__, "vllm-small-cache", _small_cache_server)


@pytest.fixture(scope="module")
def small_cache_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of a real vLLM server with a KV cache of NUM_GPU_BLOCKS blocks."""
    with vllm_servers(tmp_path_factory, SMALL_CACHE) as servers:
        yield servers["small-cache"].base_url


def tokens(seed: int, count: int) -> list[int]:
    """`count` token ids of the tiny model's vocabulary, a different run for each seed."""
    return [3 + (seed * 7919 + i * 131) % 900 for i in range(count)]


Part = tuple[int, int] | str
"""A piece of a prompt: (seed, count) for `count` new tokens, or an earlier turn's name for
that turn's prompt and answer."""


@dataclass
class Turn:
    """One request of the sequence: its prompt's parts and how many tokens it answers."""

    name: str
    parts: list[Part]
    max_tokens: int


def system(seed: int) -> Part:
    """A conversation's 256-token system prompt (two blocks)."""
    return (100 + seed, 256)


# 9 blocks hold little more than one conversation, so most turns evict. The first turns are
# agent conversations ("a", "b", "c"; "a2" shares only a's system prompt) whose prompts repeat
# earlier prompts and answers; then a prompt sent twice ("p": the second recomputes its last
# block, a second copy under the same hash) and one that outlives the first copy.
TURNS = [
    Turn("a.1", [system(1), (1, 330)], 60),  # its answer fills block 4: hashed
    Turn("b.1", [system(2), (2, 400)], 20),
    Turn("a.2", ["a.1", (3, 150)], 30),
    Turn("c.1", [system(3), (4, 600)], 10),
    Turn("b.2", ["b.1", (5, 100)], 10),
    Turn("a2.1", [system(1), (6, 500)], 10),
    Turn("a.3", ["a.2", (7, 100)], 10),
    Turn("c.2", ["c.1"], 10),
    Turn("c.3", ["c.2"], 10),
    Turn("p.1", [system(4), (11, 256)], 1),  # 512 tokens: 4 full blocks
    Turn("p.2", [system(4), (11, 256)], 1),  # block 3 recomputed: a copy
    Turn("d.1", [system(5), (12, 344)], 1),  # evicts p.1's block 3, not the copy
    Turn("d.2", [system(5), (12, 344)], 1),  # reuses d.1's partial block first
    Turn("p.3", [system(4), (11, 256), (13, 100)], 10),  # finds the copy
    Turn("d.3", ["d.2", (14, 50)], 10),
]


def prompt_of(turn: Turn, done: dict[str, list[int]]) -> list[int]:
    """The turn's prompt token ids; `done` maps earlier turns to their prompt and answer."""
    prompt: list[int] = []
    for part in turn.parts:
        prompt += done[part] if isinstance(part, str) else tokens(*part)
    return prompt


def vllm_cached_tokens(base_url: str) -> list[tuple[str, list[int], list[int], int]]:
    """Send TURNS one at a time: (name, prompt ids, answer ids, cached tokens) of each."""
    sent: list[tuple[str, list[int], list[int], int]] = []
    done: dict[str, list[int]] = {}
    with httpx.Client(base_url=base_url, timeout=60.0) as client:
        for turn in TURNS:
            prompt = prompt_of(turn, done)
            assert len(prompt) + turn.max_tokens <= MAX_MODEL_LEN, turn
            response = client.post(
                "/v1/completions",
                json={
                    "model": MODEL_NAME,
                    "prompt": prompt,
                    "max_tokens": turn.max_tokens,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )
            assert response.status_code == 200, response.text
            body = response.json()
            answer = body["choices"][0]["token_ids"]
            assert len(answer) == turn.max_tokens
            assert body["usage"]["prompt_tokens"] == len(prompt)
            details = body["usage"].get("prompt_tokens_details") or {}
            sent.append((turn.name, prompt, answer, details.get("cached_tokens") or 0))
            done[turn.name] = prompt + answer
    return sent


class Replay:
    """Samples the answer vLLM gave, token by token."""

    def __init__(self, answer: list[int]) -> None:
        self._answer = iter(answer)

    def next_token(self) -> tuple[int, bool]:
        """vLLM's next answer token; never the end of sequence (ignore_eos)."""
        return next(self._answer), False


def simulated_cached_tokens(sent: list[tuple[str, list[int], list[int], int]]) -> list[int]:
    """The same requests, one at a time, through the simulated engine with the same cache."""
    config = EngineConfig(
        block_size=CPU_BLOCK_SIZE,
        num_gpu_blocks=NUM_GPU_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=True,
        scheduling_policy="fcfs",  # vLLM's default
    )
    engine = EngineCore("H100", BUILTIN_MODELS["llama-3.2-1b"], config)
    cached = []
    now = 0.0
    for name, prompt, answer, _ in sent:
        request = SimRequest(
            name,
            max_tokens=len(answer),
            prompt_token_ids=prompt,
            sampler=Replay(answer),
            ignore_eos=True,
        )
        engine.add_request(request, now)
        while engine.has_unfinished_requests():
            now = engine.step(now).end
        assert request.output_token_ids == answer
        cached.append(request.num_cached_tokens)
    return cached


@pytest.mark.timeout(300)
def test_cached_tokens_under_eviction_match_vllm_request_by_request(
    small_cache_vllm: str,
) -> None:
    """Exact agreement: tolerance 0 tokens for every request.

    One request at a time leaves nothing to timing: what each request finds cached is a
    function of the requests before it, their token ids and answers, and the cache's rules
    (null block, hash chain, when blocks are hashed, which free block is evicted next), all
    of which the simulated engine models as vLLM's `BlockPool` has them. Hits come in whole
    blocks, so any disagreement in those rules shows as at least 128 tokens on some request.
    """
    sent = vllm_cached_tokens(small_cache_vllm)
    simulated = simulated_cached_tokens(sent)
    rows = [
        (name, len(prompt), vllm, sim)
        for (name, prompt, _, vllm), sim in zip(sent, simulated, strict=True)
    ]
    print("\nturn   prompt  vLLM cached  simulated cached")
    for name, length, vllm, sim in rows:
        print(f"{name:6} {length:6} {vllm:12} {sim:17}")
    # The sequence must put the cache under pressure: hits that are partial, some none.
    assert any(0 < vllm < length - CPU_BLOCK_SIZE for _, length, vllm, _ in rows[1:])
    assert [vllm for *_, vllm, _ in rows] == [sim for *_, sim in rows]

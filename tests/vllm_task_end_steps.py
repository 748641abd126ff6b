"""Drives `TaskEndScheduler` inside vLLM's own interpreter, prefix caching on; prints JSON.

Run by `tests/test_vllm_task_end.py` with vLLM's python (`make vllm-env`) and only the
`kvflow_vllm` package on `PYTHONPATH`. The scheduler is vLLM's real one (its block pool, prefix
cache, free queue and LRU eviction) under kvflow's subclass; only the model runner is
scripted (each step "samples" one token for every request that finished its prompt).

The main scene: two tasks, A and B, share a one-block system prompt and each has three blocks of
its own. A's call finishes, then B's, so LRU would evict A's blocks first. Then B's task
ends (a `kvflow_release` request, or none in the LRU scene), an unrelated call needs three
cached blocks' worth of room, and A comes back with its whole conversation. The scene
prints how many of A's prompt tokens the engine found cached, the blocks the release moved
and which blocks the unrelated call was given. A second scene (`second_user`) runs three tasks
with the same system prompt one after another: only the first one's end releases the prompt.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm_scheduler_setup import scheduler_args  # this folder: see its docstring

from kvflow_vllm.scheduler import RELEASE_KEY, TASK_KEY, TaskEndScheduler

BLOCK_SIZE = 16
BLOCKS = 11
"""One null block, the shared prompt, three blocks of each task's own, three never used."""
MAX_MODEL_LEN = 256
SYSTEM = list(range(1, 1 + BLOCK_SIZE))
"""The system prompt both tasks start with: one block."""
OWN = 3 * BLOCK_SIZE
"""Each task's own prompt tokens: three blocks."""
FILLER = 5 * BLOCK_SIZE
"""The unrelated call: five blocks of prompt and a sixth for its answer (three evictions)."""


def engine() -> TaskEndScheduler:
    """kvflow's scheduler over vLLM's, prefix caching on, with `BLOCKS` KV blocks."""
    return TaskEndScheduler(
        **scheduler_args(
            block_size=BLOCK_SIZE,
            blocks=BLOCKS,
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=4,
            prefix_caching=True,
        )
    )


init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK_SIZE, sha256)


def call(request_id: str, prompt: list[int], xargs: dict[str, Any] | None = None) -> Request:
    """A one-token completion as vLLM's API server hands it to the engine."""
    params = SamplingParams(max_tokens=1, ignore_eos=True, extra_args=xargs or None)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=params,
        pooling_params=None,
        block_hasher=HASHER,
    )


def run(sched: TaskEndScheduler, req: Request) -> dict[str, Any]:
    """Add the request and step the engine until it finishes; what it found and was given."""
    sched.add_request(req)
    found: int | None = None
    given: list[int] = []
    while req.request_id in sched.requests:
        output = sched.schedule()
        scheduled = dict(output.num_scheduled_tokens)
        for new in output.scheduled_new_reqs:
            if new.req_id == req.request_id:
                found = new.num_computed_tokens  # what the prefix cache held
        if req.request_id in scheduled:
            given = sched.kv_cache_manager.get_block_ids(req.request_id)[0]
        ids = list(scheduled)
        sampled = []
        for request_id in ids:
            r = sched.requests[request_id]
            done = r.num_computed_tokens + scheduled[request_id] >= r.num_prompt_tokens
            sampled.append([7] if done else [])
        runner = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={request_id: i for i, request_id in enumerate(ids)},
            sampled_token_ids=sampled,
        )
        sched.update_from_output(output, runner)
    return {"found": found, "given": given}


def scene(name: str, *, release: bool, tag: bool = True) -> None:
    """A and B finish; B's task ends (or not); an unrelated call; A comes back."""
    sched = engine()
    prompt_a = SYSTEM + list(range(100, 100 + OWN))
    prompt_b = SYSTEM + list(range(300, 300 + OWN))
    first_a = run(sched, call("a-1", prompt_a, {TASK_KEY: "task-a"} if tag else None))
    first_b = run(sched, call("b-1", prompt_b, {TASK_KEY: "task-b"} if tag else None))
    if release:
        run(sched, call("b-end", [9], {RELEASE_KEY: "task-b"}))
    filler = run(sched, call("other", list(range(500, 500 + FILLER))))
    again = run(sched, call("a-2", [*prompt_a, 7, *range(700, 716)], {TASK_KEY: "task-a"}))
    print(
        json.dumps(
            {
                "scene": name,
                "a_first": first_a["given"],
                "b_first": first_b["given"],
                "b_found_system": first_b["found"],
                "filler_given": filler["given"],
                "a_found": again["found"],
                "released_blocks": sched.released_blocks,
                "tracked_tasks": len(sched._task_blocks),
            }
        )
    )


def second_user(name: str) -> None:
    """A runs alone and ends; then B, with the same system prompt, runs alone and ends; C
    comes with it too. The prompt is A's own at A's end, and not B's: A used it first."""
    sched = engine()
    released = []
    found = []
    for task, base in (("task-a", 100), ("task-b", 300), ("task-c", 500)):
        prompt = SYSTEM + list(range(base, base + OWN))
        found.append(run(sched, call(f"{task}-1", prompt, {TASK_KEY: task}))["found"])
        before = sched.released_blocks
        run(sched, call(f"{task}-end", [9], {RELEASE_KEY: task}))
        released.append(sched.released_blocks - before)
    for index in range(8):  # more ended tasks' hashes than the engine remembers
        prompt = list(range(1000 + 100 * index, 1000 + 100 * index + OWN))
        run(sched, call(f"more-{index}", prompt, {TASK_KEY: f"more-{index}"}))
        run(sched, call(f"more-{index}-end", [9], {RELEASE_KEY: f"more-{index}"}))
    print(
        json.dumps(
            {
                "scene": name,
                "found": found,
                "released": released,
                "given_out": len(sched._given_out),
            }
        )
    )


SCENES = {
    "second_user": lambda: second_user("second_user"),
    "lru": lambda: scene("lru", release=False),
    "release": lambda: scene("release", release=True),
    "untagged": lambda: scene("untagged", release=True, tag=False),
}


if __name__ == "__main__":
    for name in sys.argv[1:] or list(SCENES):
        SCENES[name]()

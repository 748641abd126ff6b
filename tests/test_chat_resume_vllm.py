"""A chat resume returns exactly what the model saw plus what it generated, on real vLLM.

The tiny local model's own template keeps message content as it is, so this test serves it
with a template that trims content the way Llama 3.x's does (`message['content'] | trim`):
that is the template that dropped a partial answer's trailing whitespace at the seam.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from temporalio.client import Client
from temporalio.worker import Worker

from kvflow.activities.inference import ReplicaBinding
from kvflow.activities.wire import Checkpoint
from kvflow.workers.gpu_worker import GpuWorker
from kvflow.workers.vllm_server import VllmInstall, VllmServer
from tests.compat.test_inference_activity import Call, CallOnce, _chat, _pool
from tests.fixtures_vllm import MAX_MODEL_LEN, SERVED_MODEL_NAME, early_vllm, vllm_servers
from tests.servers import ServedModel

# Llama 3.x's trimming, on the tiny model's own role markers.
TRIMMING_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + (message['content'] | trim) }}"
    "{% if not (loop.last and continue_final_message is defined and continue_final_message) %}"
    "{{ eos_token + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
QUEUE = f"chat-resume-{uuid.uuid4()}"


def _trimming_server(install: VllmInstall, log_dir: Path) -> dict[str, VllmServer]:
    model_dir = log_dir / "trimming-model"
    model_dir.mkdir()
    for file in install.model_dir.iterdir():
        if file.name != "chat_template.jinja":
            (model_dir / file.name).symlink_to(file)
    (model_dir / "chat_template.jinja").write_text(TRIMMING_TEMPLATE)
    server = VllmServer(
        install,
        log_path=log_dir / "vllm-trimming.log",
        model_dir=model_dir,
        served_model_names=[SERVED_MODEL_NAME],
        max_model_len=MAX_MODEL_LEN,
    )
    return {"trimming": server}


TRIMMING = early_vllm(__name__, "trimming-model", _trimming_server)


@pytest.fixture(scope="module")
def trimming_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedModel]:
    """Real vLLM serving the tiny model with a content-trimming chat template."""
    with vllm_servers(tmp_path_factory, TRIMMING) as servers:
        yield ServedModel(
            kind="vllm",
            base_url=servers["trimming"].base_url,
            model=SERVED_MODEL_NAME,
            block_size=128,
            max_model_len=MAX_MODEL_LEN,
        )


@pytest.fixture
async def replica(
    temporal_client: Client, trimming_server: ServedModel, tmp_path: Path
) -> AsyncIterator[GpuWorker]:
    binding = ReplicaBinding(
        pool=_pool(trimming_server.model), index=0, base_url=trimming_server.base_url
    )
    worker = GpuWorker(temporal_client, binding, heartbeat_interval_s=0.2, spool_dir=None)
    async with Worker(temporal_client, task_queue=QUEUE, workflows=[CallOnce]), worker:
        yield worker


@pytest.mark.vllm
@pytest.mark.timeout(300)
async def test_chat_resume_returns_what_the_model_saw_plus_what_it_generated(
    temporal_client: Client, trimming_server: ServedModel, replica: GpuWorker
) -> None:
    server = trimming_server
    partial = "Once upon a time "
    request = _chat(server, "Tell a story.", 12).model_copy(
        update={"checkpoint": Checkpoint(text=partial, completion_tokens=4)}
    )
    messages = [{"role": "user", "content": "Tell a story."}]
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
        # The template trims: with or without the trailing space, the model sees the same.
        seen = []
        for text in (partial, partial.rstrip()):
            answer = await http.post(
                "/tokenize",
                json={
                    "model": server.model,
                    "messages": [*messages, {"role": "assistant", "content": text}],
                    "continue_final_message": True,
                    "add_generation_prompt": False,
                },
            )
            seen.append(answer.json()["tokens"])
        assert seen[0] == seen[1]
        # What the model generates after the trimmed partial (greedy, so the same each time).
        direct = await http.post(
            "/v1/chat/completions",
            json={
                "model": server.model,
                "messages": [*messages, {"role": "assistant", "content": partial.rstrip()}],
                "continue_final_message": True,
                "add_generation_prompt": False,
                "max_tokens": 12 - 4,
                "ignore_eos": True,
                "temperature": 0.0,
                "top_p": 1.0,
                "seed": 7,
            },
        )
        generated = direct.json()["choices"][0]["message"]["content"]

    outcome = await asyncio.wait_for(
        temporal_client.execute_workflow(
            CallOnce.run,
            Call(request=request, task_queue=replica.task_queue),
            id=f"resume-{uuid.uuid4()}",
            task_queue=QUEUE,
        ),
        120,
    )
    assert outcome.result is not None, outcome
    assert outcome.result.text == partial.rstrip() + generated
    assert outcome.result.reused_tokens == 4

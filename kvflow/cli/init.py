"""`kvflow init`: a new project in the current directory, ready to run against `kvflow dev`.

It writes three files:

- `fleet.toml`: kvflow's commented example fleet (the Temporal connection, models, GPU pools,
  tenants), to edit into the real one; `kvflow fleet check` validates it;
- `workflows.py`: one agent workflow, importing only from `kvflow` (and Temporal, pydantic);
- `starter.py`: a workflow worker with `KvflowPlugin(fleet)` that runs one task and prints
  its answer and what it cost.

It refuses to overwrite a file that exists (exit 2, naming them) unless given `--force`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvflow.workers.config import EXAMPLE_FLEET
from kvflow.workers.console import fail, out

WORKFLOWS_PY = '''\
"""Your agent workflows: each task is one Temporal workflow, each model call one step.

Written by `kvflow init`; make it yours. Import only from `kvflow` (its public API), Temporal
and pydantic. Run it with `python starter.py` while `kvflow dev` runs in this directory.
"""

from pydantic import BaseModel
from temporalio import workflow

# Workflow code runs in Temporal's sandbox; kvflow's workflow-side API is safe to pass through.
with workflow.unsafe.imports_passed_through():
    from kvflow import Agent, ChatMessage, TaskSpec

MODEL = "llama-3.1-8b"
"""A model of fleet.toml's [[models]]; the scheduler picks the replica that serves it."""


class Outline(BaseModel):
    """The first step's answer, parsed and validated: a title and the sections to write."""

    title: str
    sections: list[str]


class ArticleRequest(BaseModel):
    """A task's input: who it is for (tenant, latency budget) and what to write about."""

    spec: TaskSpec
    topic: str


class Article(BaseModel):
    """A task's result."""

    title: str
    text: str


@workflow.defn
class WriteArticle:
    """Outline an article, then write it: two model calls, placed and metered by kvflow."""

    @workflow.run
    async def run(self, request: ArticleRequest) -> Article:
        agent = Agent(request.spec)
        async with agent:  # records the task's outcome and spend when it ends
            outline = await agent.infer(
                [ChatMessage(role="user", content=f"Outline an article on {request.topic}.")],
                model=MODEL,
                max_tokens=200,
                output=Outline,
                step="outline",
            )
            draft = await agent.infer(
                [ChatMessage(role="user", content=f"Write '{outline.title}'.")],
                model=MODEL,
                max_tokens=400,
                step="draft",
            )
            return Article(title=outline.title, text=draft.text)
'''

STARTER_PY = '''\
"""Run one WriteArticle task: a workflow worker with KvflowPlugin, the task, what it cost.

Start the local stack first, in this directory, in another terminal:

    kvflow dev

then `python starter.py` (with the `export TEMPORAL_ADDRESS=...` it printed, if any).
KvflowPlugin(fleet) given no endpoints= finds the simulated replicas `kvflow dev` started
in .kvflow/dev.toml; against real vLLM servers, list their URLs in fleet.toml instead.
"""

import asyncio
import os
import sys
import uuid

from temporalio.client import Client
from temporalio.worker import Worker
from workflows import ArticleRequest, WriteArticle

from kvflow import SPEND_QUERY, KvflowPlugin, SpendBreakdown, TaskSpec, format_usd, load_fleet

TASK_QUEUE = "my-agents"


async def main() -> int:
    fleet = load_fleet("fleet.toml")
    # The workflow worker's plugin: the scheduler, the ledger and the context store.
    plugin = KvflowPlugin(fleet)
    try:
        client = await Client.connect(**fleet.temporal.connect_config(), plugins=[plugin])
    except RuntimeError as exc:
        print(f"cannot reach Temporal ({exc}): is `kvflow dev` running?", file=sys.stderr)
        return 1
    try:
        worker = Worker(client, task_queue=TASK_QUEUE, workflows=[WriteArticle])
    except ValueError as exc:  # e.g. no URL for a simulated replica
        print(f"the worker cannot start: {exc}", file=sys.stderr)
        return 1
    async with worker:
        spec = TaskSpec(tenant=fleet.tenants[0].name, latency_budget_s=120, expected_steps=2)
        handle = await client.start_workflow(
            WriteArticle.run,
            ArticleRequest(spec=spec, topic="KV caches"),
            id=f"article-{uuid.uuid4()}",
            task_queue=TASK_QUEUE,
        )
        article = await handle.result()
        spend = await handle.query(SPEND_QUERY, result_type=SpendBreakdown)
    print(f"{article.title}\\n{article.text[:300]}")
    print(f"{len(spend.steps)} steps, ${format_usd(spend.spend_micros)}, workflow id {handle.id}")
    return 0


if __name__ == "__main__":
    code = asyncio.run(main())
    sys.stdout.flush()
    sys.stderr.flush()
    # The Temporal SDK's native runtime can crash while Python exits (sdk-python issue 300).
    os._exit(code)
'''


def _project_files() -> dict[str, str]:
    """What `kvflow init` writes, by file name: the text of each."""
    return {
        "fleet.toml": EXAMPLE_FLEET.read_text(encoding="utf-8"),
        "workflows.py": WORKFLOWS_PY,
        "starter.py": STARTER_PY,
    }


def init(
    directory: Annotated[
        Path, typer.Argument(help="where to write the project (default: here)")
    ] = Path("."),
    force: Annotated[
        bool, typer.Option("--force", help="overwrite fleet.toml, workflows.py, starter.py")
    ] = False,
) -> None:
    """Write fleet.toml, workflows.py and starter.py: a project to run against `kvflow dev`."""
    if directory.exists() and not directory.is_dir():
        fail(f"{directory} is a file; give a directory to write the project into")
    files = _project_files()
    existing = [name for name in files if (directory / name).exists()]
    if existing and not force:
        fail(
            f"{', '.join(str(directory / n) for n in existing)} already "
            f"{'exists' if len(existing) == 1 else 'exist'}; kvflow init writes nothing over "
            "a file: move them away, or run `kvflow init --force` to replace them"
        )
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text, encoding="utf-8")
        out.print(f"wrote {directory / name}", highlight=False)
    here = "" if directory.resolve() == Path.cwd().resolve() else f"cd {directory} && "
    out.print(
        "Next, in this directory: `kvflow fleet check` validates fleet.toml; `kvflow dev` "
        "starts Temporal and the simulated fleet; then, in another terminal, "
        f"`{here}python starter.py` runs a task on them.",
        highlight=False,
        soft_wrap=True,
    )

"""Code review over a long diff: one model call per file, then a summary, under a tight deadline.

Every call opens with the whole diff as its system message, so all the steps share one long
prefix: after the first step the replica that holds it in its KV cache prefills only the new
question. The task has a latency budget; before each step the scheduler splits what is left of
it across the steps still to come and places the call where it can finish in its share. When
no replica can run llama-3.1-8b in time, it degrades the call to the model's fallback
(llama-3.2-1b, from the fleet file); `InferenceResult.model` says which model answered.
"""

from __future__ import annotations

from pydantic import BaseModel, Field
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from kvflow import Agent, ChatMessage, TaskSpec

MODEL = "llama-3.1-8b"


class ReviewTask(BaseModel):
    """A pull request to review."""

    spec: TaskSpec
    repository: str
    diff: str = Field(min_length=1, description="the unified diff of the whole change")
    files: list[str] = Field(min_length=1, description="the files the diff touches")


class FileReview(BaseModel):
    """The review of one file, and what served it."""

    file: str
    comments: str
    model: str
    replica: str


class ReviewReport(BaseModel):
    """The whole review."""

    repository: str
    files: list[FileReview]
    summary: str
    summary_model: str

    @property
    def models(self) -> set[str]:
        """Every model that answered a step of this review."""
        return {f.model for f in self.files} | {self.summary_model}


@workflow.defn
class CodeReview:
    """Review each file of a diff, then summarise, within the task's latency budget."""

    @workflow.run
    async def run(self, task: ReviewTask) -> ReviewReport:
        """Review the change; a step that cannot finish in time fails the task fast."""
        agent = Agent(task.spec)
        diff = ChatMessage(
            role="system",
            content=f"You review pull requests to {task.repository}. The diff:\n\n{task.diff}",
        )
        reviews: list[FileReview] = []
        async with agent:
            # One step per file, in order: each sees the same diff, so each is a cache hit.
            for file in task.files:
                result = await agent.infer(
                    [diff, ChatMessage(role="user", content=f"Review the changes to {file}.")],
                    model=MODEL,
                    max_tokens=120,
                    step=f"review {file}",
                )
                reviews.append(
                    FileReview(
                        file=file, comments=result.text, model=result.model, replica=result.replica
                    )
                )
            notes = "\n".join(f"{r.file}: {r.comments}" for r in reviews)
            summary = await agent.infer(
                [diff, ChatMessage(role="user", content=f"Summarise the review:\n{notes}")],
                model=MODEL,
                max_tokens=160,
                step="summary",
            )
        return ReviewReport(
            repository=task.repository,
            files=reviews,
            summary=summary.text,
            summary_model=summary.model,
        )

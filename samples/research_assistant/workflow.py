"""Research assistant: plan → parallel sub-questions → draft → bounded critique loop → answer.

Every model call opens with the same long source document as its system message. The step API
stores it once in the context store (history carries a reference) and the scheduler keeps the
task on the replica whose KV cache already holds it, so each step after the first prefills only
its own question.
"""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, Field
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from kvflow import Agent, ChatMessage, TaskSpec

MODEL = "llama-3.1-8b"
INSTRUCTIONS = (
    "You are a research assistant. Answer only from the source document below, and say so "
    "when it does not contain the answer.\n\n# Source document\n\n"
)


class ResearchTask(BaseModel):
    """A question about one long source document."""

    spec: TaskSpec
    question: str = Field(min_length=1)
    source: str = Field(min_length=1, description="the document every step reads")
    max_critique_rounds: int = Field(default=2, ge=0, le=5)


class Plan(BaseModel):
    """The plan step's structured output."""

    sub_questions: list[str] = Field(min_length=3, max_length=5)


class Critique(BaseModel):
    """A critique round's structured output: revise the draft, or keep it."""

    revise: bool
    issues: list[str] = Field(max_length=3)


class ResearchAnswer(BaseModel):
    """What the assistant found, and how it got there."""

    question: str
    sub_questions: list[str]
    findings: list[str]
    critique_rounds: int
    answer: str


@workflow.defn
class ResearchAssistant:
    """Plan, research the sub-questions in parallel, draft, critique (bounded), answer."""

    @workflow.run
    async def run(self, task: ResearchTask) -> ResearchAnswer:
        """Run the research task; the `kvflow_spend` query shows every step's cost."""
        agent = Agent(task.spec)
        # The same first message in every call: the prefix the replica keeps cached.
        source = ChatMessage(role="system", content=INSTRUCTIONS + task.source)

        def ask(text: str) -> list[ChatMessage]:
            return [source, ChatMessage(role="user", content=text)]

        async with agent:
            plan = await agent.infer(
                ask(f"Split this question into 3 to 5 sub-questions: {task.question}"),
                model=MODEL,
                max_tokens=200,
                output=Plan,
                step="plan",
            )
            # Fan out: the sub-questions are independent, so they run at the same time.
            results = await asyncio.gather(
                *(
                    agent.infer(
                        ask(f"Answer briefly: {sub}"),
                        model=MODEL,
                        max_tokens=96,
                        step=f"sub-question {i}",
                    )
                    for i, sub in enumerate(plan.sub_questions, start=1)
                )
            )
            findings = [r.text for r in results]
            notes = "\n".join(
                f"- {q}: {a}" for q, a in zip(plan.sub_questions, findings, strict=True)
            )
            draft = await agent.infer(
                ask(f"Question: {task.question}\nFindings:\n{notes}\nWrite a draft answer."),
                model=MODEL,
                max_tokens=200,
                step="draft",
            )
            rounds = 0
            # Bounded: a critic that always asks for more cannot keep the task running.
            while rounds < task.max_critique_rounds:
                rounds += 1
                critique = await agent.infer(
                    ask(f"Critique this draft answer to '{task.question}':\n{draft.text}"),
                    model=MODEL,
                    max_tokens=200,
                    output=Critique,
                    step=f"critique {rounds}",
                )
                if not critique.revise:
                    break
                draft = await agent.infer(
                    ask(f"Revise the draft, fixing: {'; '.join(critique.issues)}\n{draft.text}"),
                    model=MODEL,
                    max_tokens=200,
                    step=f"revise {rounds}",
                )
            # max_tokens keeps the answer under the 2 KB inline limit; a longer answer would
            # come back as a preview in `text` and the whole of it in the context store
            # (`text_ref`).
            answer = await agent.infer(
                ask(f"Give the final answer to '{task.question}' from this draft:\n{draft.text}"),
                model=MODEL,
                max_tokens=160,
                step="answer",
            )
        return ResearchAnswer(
            question=task.question,
            sub_questions=plan.sub_questions,
            findings=findings,
            critique_rounds=rounds,
            answer=answer.text,
        )

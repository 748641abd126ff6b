"""A user's agent workflow, written against kvflow's public API only."""

from __future__ import annotations

from datetime import timedelta

from activities import count_words
from pydantic import BaseModel
from temporalio import workflow

from kvflow import Agent, ChatMessage, TaskSpec


class Question(BaseModel):
    spec: TaskSpec
    text: str


class Answer(BaseModel):
    text: str
    words: int


@workflow.defn
class AnswerQuestion:
    @workflow.run
    async def run(self, question: Question) -> Answer:
        agent = Agent(question.spec)
        async with agent:
            draft = await agent.infer(
                [ChatMessage(role="user", content=question.text)],
                model="llama-3.2-1b",
                max_tokens=24,
                step="draft",
            )
            answer = await agent.infer(
                [
                    ChatMessage(role="user", content=question.text),
                    ChatMessage(role="assistant", content=draft.text),
                    ChatMessage(role="user", content="Say it in one sentence."),
                ],
                model="llama-3.2-1b",
                max_tokens=16,
                step="answer",
            )
            words = await agent.tool(count_words, answer.text, start_to_close=timedelta(seconds=10))
        return Answer(text=answer.text, words=words)

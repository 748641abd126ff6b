"""Support triage: classify → look up the account → refund → draft the reply → send it.

The refund is a saga step: `agent.tool(..., compensation=reverse_refund)` remembers how to undo
it, and if anything after it fails (here: the mail service rejects the reply) the step API
reverses the refund before the task ends, and records the task as `compensated`.

The model classifies and writes; code decides the money. The refund policy below is plain
Python over the account data, never a model's output.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from kvflow import Agent, ChatMessage, TaskSpec

    from .activities import (
        Account,
        Refund,
        RefundRequest,
        Reply,
        issue_refund,
        lookup_account,
        reverse_refund,
        send_reply,
    )

MODEL = "llama-3.1-8b"
SYSTEM = "You are a support agent for a software company. Be brief, friendly and exact."


class Ticket(BaseModel):
    """A customer's support ticket."""

    ticket_id: str
    account_id: str
    subject: str
    body: str
    disputed_charge_cents: int = Field(default=0, ge=0, description="0: no refund asked")


class SupportTask(BaseModel):
    """The workflow's input."""

    spec: TaskSpec
    ticket: Ticket


class Triage(BaseModel):
    """The classify step's structured output."""

    category: Literal["billing", "technical", "account", "other"]
    urgency: int = Field(ge=1, le=5)
    summary: str = Field(max_length=200)


class TriageResult(BaseModel):
    """What happened to the ticket."""

    ticket_id: str
    triage: Triage
    refund: Refund | None
    reply: str
    delivery: str


def refund_policy(ticket: Ticket, account: Account) -> int:
    """Cents to refund: the disputed charge, if the account was really charged that amount."""
    if ticket.disputed_charge_cents in account.recent_charges_cents:
        return ticket.disputed_charge_cents
    return 0


@workflow.defn
class SupportTriage:
    """Triage one ticket, refund a disputed charge, reply; undo the refund if the reply fails."""

    @workflow.run
    async def run(self, task: SupportTask) -> TriageResult:
        """Handle the ticket; the `kvflow_spend` query shows every step, compensations included."""
        ticket = task.ticket
        agent = Agent(task.spec)
        ticket_text = f"Subject: {ticket.subject}\n\n{ticket.body}"
        async with agent:
            triage = await agent.infer(
                [
                    ChatMessage(role="system", content=SYSTEM),
                    ChatMessage(role="user", content=f"Classify this ticket:\n{ticket_text}"),
                ],
                model=MODEL,
                max_tokens=200,
                output=Triage,
                step="classify",
            )
            account: Account = await agent.tool(
                lookup_account, ticket.account_id, step="look up account", result_type=Account
            )
            refund: Refund | None = None
            amount = refund_policy(ticket, account)
            if amount:
                request = RefundRequest(
                    # The workflow id makes the key stable across activity retries.
                    refund_id=f"{workflow.info().workflow_id}/refund",
                    account_id=account.id,
                    amount_cents=amount,
                    reason=triage.summary,
                )
                refund = await agent.tool(
                    issue_refund,
                    request,
                    compensation=reverse_refund,
                    step="issue refund",
                    result_type=Refund,
                )
            done = f"We refunded ${amount // 100}.{amount % 100:02d} as credit." if refund else ""
            draft = await agent.infer(
                [
                    ChatMessage(role="system", content=SYSTEM),
                    ChatMessage(
                        role="user",
                        content=f"Write the reply to {account.name} ({account.plan} plan) about "
                        f"this {triage.category} ticket. {done}\n{ticket_text}",
                    ),
                ],
                model=MODEL,
                max_tokens=160,
                step="draft reply",
            )
            # If the mail service rejects the reply, this raises, and the refund is reversed.
            delivery: str = await agent.tool(
                send_reply,
                Reply(ticket_id=ticket.ticket_id, to=account.email, body=draft.text),
                step="send reply",
                result_type=str,
            )
        return TriageResult(
            ticket_id=ticket.ticket_id,
            triage=triage,
            refund=refund,
            reply=draft.text,
            delivery=delivery,
        )

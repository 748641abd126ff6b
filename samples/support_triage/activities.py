"""The support desk's tools: account lookup, refunds (and their reversal), sending the reply.

They work on a small in-process store so that the sample runs anywhere; a real deployment calls
its own billing and helpdesk services here. Two habits carry over to real services:

- every tool that moves money is idempotent on a key the workflow chooses (Temporal may run an
  activity again after a timeout), so a retried refund is not paid twice;
- a failure that retrying cannot fix raises a non-retryable `ApplicationError`, so the task
  fails (and its saga unwinds) at once instead of retrying forever.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field
from temporalio import activity
from temporalio.exceptions import ApplicationError


class Account(BaseModel):
    """A customer account, as the billing service returns it."""

    id: str
    name: str
    email: str
    plan: str
    recent_charges_cents: list[int] = Field(default_factory=list)
    credit_cents: int = 0
    """Refunds are paid as account credit."""


class RefundRequest(BaseModel):
    """A refund; `refund_id` is the idempotency key."""

    refund_id: str
    account_id: str
    amount_cents: int = Field(gt=0)
    reason: str


class Refund(BaseModel):
    """A refund as the billing service recorded it."""

    request: RefundRequest
    reversed: bool = False


class Reply(BaseModel):
    """The message sent to the customer."""

    ticket_id: str
    to: str
    body: str


def example_accounts() -> list[Account]:
    """The accounts `example_input` draws tickets for."""
    people = [
        ("Ada Byron", "pro"),
        ("Grace Hopper", "team"),
        ("Alan Turing", "free"),
        ("Edsger Dijkstra", "pro"),
        ("Barbara Liskov", "enterprise"),
        ("Ken Thompson", "team"),
    ]
    return [
        Account(
            id=f"ACC-{1001 + i}",
            name=name,
            email=f"{name.split()[0].lower()}@example.com",
            plan=plan,
            recent_charges_cents=[1_900 + 500 * i, 4_900, 990],
        )
        for i, (name, plan) in enumerate(people)
    ]


ACCOUNTS: dict[str, Account] = {a.id: a for a in example_accounts()}
"""The billing service's accounts, by id."""
REFUNDS: dict[str, Refund] = {}
"""Refunds by `refund_id`."""
OUTBOX: list[Reply] = []
"""Replies the mail service accepted."""
REJECTED_ADDRESSES: set[str] = {"ken@example.com"}
"""Addresses the mail service refuses (a full mailbox): replies to them fail, the saga unwinds."""


@activity.defn(name="support_triage.lookup_account")
async def lookup_account(account_id: str) -> Account:
    """The account, from the billing service."""
    account = ACCOUNTS.get(account_id)
    if account is None:
        raise ApplicationError(
            f"no account {account_id!r}", type="UnknownAccount", non_retryable=True
        )
    return account


@activity.defn(name="support_triage.issue_refund")
async def issue_refund(request: RefundRequest) -> Refund:
    """Credit the account; a second call with the same `refund_id` changes nothing."""
    if request.refund_id in REFUNDS:
        return REFUNDS[request.refund_id]
    ACCOUNTS[request.account_id].credit_cents += request.amount_cents
    REFUNDS[request.refund_id] = refund = Refund(request=request)
    activity.logger.info("refunded %d cents to %s", request.amount_cents, request.account_id)
    return refund


@activity.defn(name="support_triage.reverse_refund")
async def reverse_refund(request: RefundRequest) -> None:
    """The compensation of `issue_refund`: take the credit back (once)."""
    refund = REFUNDS.get(request.refund_id)
    if refund is None or refund.reversed:
        return
    ACCOUNTS[request.account_id].credit_cents -= request.amount_cents
    refund.reversed = True
    activity.logger.info("reversed refund %s", request.refund_id)


@activity.defn(name="support_triage.send_reply")
async def send_reply(reply: Reply) -> str:
    """Hand the reply to the mail service; a rejected address is a permanent failure."""
    if reply.to in REJECTED_ADDRESSES:
        raise ApplicationError(
            f"the mail server rejected {reply.to} (mailbox full)",
            type="MailboxRejected",
            non_retryable=True,
        )
    OUTBOX.append(reply)
    return f"queued for {reply.to}"


ALL: list[Callable[..., Any]] = [lookup_account, issue_refund, reverse_refund, send_reply]
"""The activities to register on the workflow worker."""

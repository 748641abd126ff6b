"""Support triage sample: a model classifies and writes, tools refund, a saga undoes the refund."""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from typing import Any

from temporalio.workflow import unsafe

from .workflow import SupportTask, SupportTriage, Ticket

with unsafe.imports_passed_through():
    # The workflow's sandbox imports this package too: share these modules with it.
    from kvflow import TaskSpec

    from . import activities

WORKFLOW = SupportTriage
"""The workflow class to register on the workflow worker."""
ACTIVITIES: list[Callable[..., Any]] = list(activities.ALL)
"""The tools (and the refund's compensation) to register on the workflow worker."""

_COMPLAINTS = [
    ("Charged twice this month", "I see the same charge twice on my card. Please refund one."),
    ("Refund for unused seats", "We removed seats last week but were still billed for them."),
    ("Cancelled but still billed", "I cancelled before renewal and was charged anyway."),
]
_QUESTIONS = [
    ("Export fails", "The CSV export stops at 10,000 rows with an error. Is there a limit?"),
    ("Cannot log in", "Password reset emails never arrive. Can you check my account?"),
]


def example_input(rng: random.Random, tenant: str) -> SupportTask:
    """A realistic ticket for `tenant`, the same for the same `rng` state.

    Two tickets in three dispute a real charge (a refund follows); one account's mailbox
    rejects replies, so some tasks end `compensated`.
    """
    account = rng.choice(activities.example_accounts())
    if rng.random() < 2 / 3:
        subject, body = rng.choice(_COMPLAINTS)
        disputed = rng.choice(account.recent_charges_cents)
    else:
        subject, body = rng.choice(_QUESTIONS)
        disputed = 0
    return SupportTask(
        # classify, look up, refund, draft, send: two of them model calls.
        spec=TaskSpec(tenant=tenant, latency_budget_s=60.0, retry_budget=2, expected_steps=2),
        ticket=Ticket(
            ticket_id=f"T-{uuid.UUID(int=rng.getrandbits(128)).hex[:8]}",
            account_id=account.id,
            subject=subject,
            body=body,
            disputed_charge_cents=disputed,
        ),
    )


__all__ = ["ACTIVITIES", "WORKFLOW", "SupportTask", "SupportTriage", "Ticket", "example_input"]

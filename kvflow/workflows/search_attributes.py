"""The search attributes kvflow workflows set, so operators can filter tasks in the Temporal UI.

They are registered when the embedded dev server starts and checked when a worker starts:
upserting an attribute the namespace does not know fails the workflow task over and over.
The dev server's SQLite visibility store allows at most three custom attributes of each type,
so kvflow uses three Int and two Keyword attributes. The `Kvflow` prefix keeps them apart
from other applications' attributes in a shared namespace.
Example filter: `KvflowTenant = 'acme' AND KvflowOutcome = 'failed'`.
"""

from __future__ import annotations

from temporalio.common import SearchAttributeKey

TENANT = SearchAttributeKey.for_keyword("KvflowTenant")
"""The tenant that owns the task."""
OUTCOME = SearchAttributeKey.for_keyword("KvflowOutcome")
"""`running`, then the task's outcome: `succeeded`, `failed`, `compensated`, `cancelled`."""
SPEND_MICROS = SearchAttributeKey.for_int("KvflowSpendMicros")
"""Everything the task has spent so far, failed attempts included, in micro-dollars."""
STEPS = SearchAttributeKey.for_int("KvflowSteps")
"""Model calls and tool calls completed so far."""
RETRIES = SearchAttributeKey.for_int("KvflowRetries")
"""Re-placements the task has used from its retry budget."""

ALL: tuple[SearchAttributeKey[str] | SearchAttributeKey[int], ...] = (
    TENANT,
    OUTCOME,
    SPEND_MICROS,
    STEPS,
    RETRIES,
)
"""Every kvflow search attribute, for registration."""

"""Code review sample: many steps over one long diff, a tight deadline, a fallback model."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from temporalio.workflow import unsafe

from .workflow import CodeReview, ReviewReport, ReviewTask

with unsafe.imports_passed_through():
    # The workflow's sandbox imports this package too: share these modules with it.
    from kvflow import TaskSpec

WORKFLOW = CodeReview
"""The workflow class to register on the workflow worker."""
ACTIVITIES: list[Callable[..., Any]] = []
"""No tools: every step is a model call."""

_MODULES = ["billing", "accounts", "search", "export", "auth", "notifications"]
_NAMES = ["total", "amount", "user_id", "page", "limit", "retries", "timeout_s", "region"]


def _hunk(rng: random.Random, path: str) -> str:
    """One file's part of a unified diff: a function changed in a few plausible ways."""
    func = f"{rng.choice(['load', 'compute', 'render', 'sync', 'validate'])}_{rng.choice(_NAMES)}"
    start = rng.randint(10, 400)
    lines = [f"diff --git a/{path} b/{path}", f"--- a/{path}", f"+++ b/{path}"]
    lines.append(f"@@ -{start},14 +{start},16 @@ def {func}(request, {rng.choice(_NAMES)}):")
    for _ in range(rng.randint(6, 10)):
        old, new = rng.sample(_NAMES, 2)
        lines += [
            f"     {old} = request.get({old!r})",
            f"-    if {old} is None:",
            f"-        return {rng.randint(0, 9)}",
            f"+    if {old} is None or {new} < {rng.randint(1, 500)}:",
            f"+        raise ValueError(f'{old} is missing or {new} is too small: {{{new}}}')",
        ]
    return "\n".join(lines)


def example_input(rng: random.Random, tenant: str) -> ReviewTask:
    """A pull request of 4-6 files (a 4-9 KB diff) for `tenant`, the same for the same `rng`.

    The deadline is tight on purpose: 2.5 seconds per step, so that when the fleet is busy the
    scheduler must degrade steps to the fallback model (or fail the task fast).
    """
    modules = rng.sample(_MODULES, rng.randint(4, 6))
    files = [f"src/{m}/{rng.choice(['service', 'models', 'views'])}.py" for m in modules]
    return ReviewTask(
        spec=TaskSpec(
            tenant=tenant,
            latency_budget_s=2.5 * (len(files) + 1),
            retry_budget=2,
            expected_steps=len(files) + 1,
        ),
        repository=f"{tenant}/{rng.choice(['platform', 'webapp', 'api'])}",
        diff="\n".join(_hunk(rng, path) for path in files),
        files=files,
    )


__all__ = ["ACTIVITIES", "WORKFLOW", "CodeReview", "ReviewReport", "ReviewTask", "example_input"]

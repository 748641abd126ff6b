"""Research assistant sample: plan, parallel sub-questions, draft, bounded critique, answer."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from temporalio.workflow import unsafe

from .workflow import ResearchAssistant, ResearchTask

with unsafe.imports_passed_through():
    # The workflow's sandbox imports this package too: share these modules with it.
    from kvflow import TaskSpec

WORKFLOW = ResearchAssistant
"""The workflow class to register on the workflow worker."""
ACTIVITIES: list[Callable[..., Any]] = []
"""No tools: every step is a model call."""

_TOPICS = [
    ("heat pump adoption in northern Europe", "installers", "grid operators", "subsidies"),
    ("battery recycling capacity", "smelters", "automakers", "regulators"),
    ("remote work and commercial real estate", "landlords", "employers", "city planners"),
    ("antibiotic resistance in hospitals", "clinicians", "pharmacists", "health agencies"),
    ("open-source maintainers' funding", "foundations", "companies", "maintainers"),
]


def source_document(rng: random.Random, topic: str, actors: tuple[str, ...]) -> str:
    """A synthetic report of about 4-6 KB on `topic` (longer than the 2 KB inline limit)."""
    sections = []
    for year in range(2019, 2019 + rng.randint(5, 7)):
        share = rng.randint(5, 60)
        change = rng.randint(-15, 25)
        lines = [f"## {year}", ""]
        for actor in actors:
            lines.append(
                f"In {year}, {actor} reported that {share}% of surveyed organisations were "
                f"active in {topic}, a change of {change:+d} points on the year before. "
                f"The main obstacle they named was {rng.choice(_OBSTACLES)}, and the main "
                f"driver was {rng.choice(_DRIVERS)}."
            )
        sections.append("\n".join(lines))
    return f"# A report on {topic}\n\n" + "\n\n".join(sections)


_OBSTACLES = ["cost", "skills shortages", "unclear rules", "supply delays", "public trust"]
_DRIVERS = ["falling prices", "new regulation", "customer demand", "public funding", "competition"]


def example_input(rng: random.Random, tenant: str) -> ResearchTask:
    """A realistic research task for `tenant`, the same for the same `rng` state."""
    topic, *actors = rng.choice(_TOPICS)
    question = rng.choice(
        [
            f"What held back {topic}, and what changed over the years?",
            f"Which group drove {topic} most, and why?",
            f"Is {topic} on track, judging by the last three years?",
        ]
    )
    return ResearchTask(
        # plan + 3 sub-questions + draft + 2 critiques + 1 revision + answer
        spec=TaskSpec(tenant=tenant, latency_budget_s=180.0, retry_budget=3, expected_steps=9),
        question=question,
        source=source_document(rng, topic, tuple(actors)),
    )


__all__ = ["ACTIVITIES", "WORKFLOW", "ResearchAssistant", "ResearchTask", "example_input"]

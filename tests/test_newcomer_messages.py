"""What a first-time user reads when they get something wrong or watch a task run.

A budget out of range names the field, its unit and its range; the example fleet file explains
each setting once.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvflow import TaskSpec

ROOT = Path(__file__).parent.parent

# ---- TaskSpec budgets: the refusal says what the field counts and what it takes ----------------


def _refusal(**budget: object) -> str:
    with pytest.raises(ValidationError) as refused:
        TaskSpec(tenant="acme", **budget)
    [error] = refused.value.errors()
    assert error["loc"] == (next(iter(budget)),)
    return str(error["msg"])


def test_a_40_day_latency_budget_is_refused_in_seconds_and_days():
    message = _refusal(latency_budget_s=40 * 86_400)
    assert message == (
        "latency_budget_s must be more than 0 s and at most 30 days (2,592,000 s), in seconds "
        "(2 minutes is 120), or None for no deadline; got 3,456,000 s (40 days)"
    )


def test_a_negative_latency_budget_is_refused_with_the_range_not_a_generic_message():
    message = _refusal(latency_budget_s=-5)
    assert message.startswith("latency_budget_s must be more than 0 s and at most 30 days")
    assert message.endswith("got -5 s")
    assert "greater than" not in message


@pytest.mark.parametrize(
    ("budget", "says"),
    [
        ({"step_slo_s": 0}, ["step_slo_s must be more than 0 s", "30 days", "got 0 s"]),
        ({"step_slo_s": float("nan")}, ["step_slo_s must be", "got nan"]),
        ({"expected_tool_s": -1.5}, ["expected_tool_s must be at least 0 s", "got -1.5 s"]),
        ({"retry_budget": -1}, ["retry_budget must be between 0 and 100 re-placements; got -1"]),
        (
            {"expected_steps": 10**9},
            ["expected_steps must be between 1 and 10,000 model calls; got 1,000,000,000"],
        ),
        ({"schema_repairs": 500}, ["schema_repairs must be between 0 and 10 re-asks; got 500"]),
        (
            {"budget_micros": -1},
            ["budget_micros must be between $0 and $1,000,000", "micro-dollars", "(-$0.000001)"],
        ),
        (
            {"budget_micros": 2_000_000 * 1_000_000},
            ["$2.50 is 2,500,000", "got 2,000,000,000,000 micro-dollars ($2,000,000)"],
        ),
    ],
)
def test_every_budget_refusal_names_its_field_unit_and_range(
    budget: dict[str, object], says: list[str]
):
    message = _refusal(**budget)
    for part in says:
        assert part in message


def test_budgets_at_the_edges_of_their_ranges_are_taken():
    spec = TaskSpec(
        tenant="acme",
        latency_budget_s=30 * 86_400,
        step_slo_s=0.001,
        expected_tool_s=0,
        retry_budget=0,
        expected_steps=10_000,
        schema_repairs=10,
        budget_micros=0,
    )
    assert spec.latency_budget_s == 2_592_000 and spec.budget_micros == 0


# ---- the example fleet file ------------------------------------------------------------------


def test_the_example_fleet_file_explains_each_commented_setting_once():
    text = (ROOT / "fleet.toml").read_text()
    settings = re.findall(r"^# ?([a-z_]+) = ", text, flags=re.MULTILINE)
    assert settings, "the example fleet file lost its commented settings"
    repeated = sorted({name for name in settings if settings.count(name) > 1})
    assert repeated == []

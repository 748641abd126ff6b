"""The figures each fault scenario reports, and the summary table of a `make chaos` run.

A scenario records its figures before it asserts, so a failing run still says what it saw.
Each scenario's figures go to `.kvflow/chaos/<scenario>.json`; at the end of the session the
table of the scenarios that ran is printed and written to `.kvflow/chaos-summary.md`, in the
form the reliability page (docs/operators/reliability.md) quotes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from tests.chaos.cluster import ROOT

OUT_DIR = ROOT / ".kvflow" / "chaos"
SUMMARY = ROOT / ".kvflow" / "chaos-summary.md"


@dataclass
class ScenarioFigures:
    """What one scenario did and saw."""

    scenario: str
    """Short name, e.g. `a. GPU worker killed mid-stream`."""
    faults: str
    """The faults injected, in words."""
    faults_injected: int = 0
    tasks_run: int = 0
    tasks_completed: int = 0
    attempts: int = 0
    """Inference attempts a GPU worker took."""
    attempts_billed_once: int = 0
    estimates: int = 0
    """Attempt rows that are the workflow's estimate of a lost attempt (its worker died)."""
    spend_micros: int = 0
    spend_multiplier: float | None = None
    """Spend against a fault-free run of the same tasks (None where none was run)."""
    bad_inputs_tried: int = 0
    secrets_found: int | None = None
    """Occurrences of a planted secret in logs and histories (None: not scanned)."""
    duration_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    outcomes: dict[str, str] = field(default_factory=dict)
    """Test name → passed, failed, xfailed or xpassed, from the tests' reports."""
    recorded_at: str = field(
        default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds")
    )

    @property
    def result(self) -> str:
        """`passed` when every test of the scenario passed, else what did not, by test."""
        if not self.outcomes:
            return "not checked"
        if all(o == "passed" for o in self.outcomes.values()):
            return f"{len(self.outcomes)} passed"
        passed = sum(o == "passed" for o in self.outcomes.values())
        others = [
            f"{o}: {name.removeprefix('test_').replace('_', ' ')}"
            for name, o in self.outcomes.items()
            if o != "passed"
        ]
        return "; ".join([f"{passed} passed", *others])

    @property
    def success_rate(self) -> float:
        """Completed / run (0 when nothing ran)."""
        return self.tasks_completed / self.tasks_run if self.tasks_run else 0.0


SESSION: dict[str, ScenarioFigures] = {}
"""The figures recorded in this pytest session, by the node id of the scenario's module."""


def record(node_id: str, figures: ScenarioFigures) -> None:
    """Keep `figures` for the summary and write them to `.kvflow/chaos/`; print them."""
    SESSION[node_id] = figures
    save(figures)
    print(f"\n[chaos] {figures.scenario}: {json.dumps(asdict(figures))}")


def save(figures: ScenarioFigures) -> Path:
    """Write `figures` to `.kvflow/chaos/<letter>.json` (again once the outcome is known)."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    name = figures.scenario.split(".", 1)[0].strip() or "scenario"
    path = OUT_DIR / f"{name}.json"
    path.write_text(json.dumps(asdict(figures), indent=1) + "\n")
    return path


def _multiplier(figures: ScenarioFigures) -> str:
    return "—" if figures.spend_multiplier is None else f"{figures.spend_multiplier:.2f}×"


def summary_table(figures: list[ScenarioFigures]) -> str:
    """The Markdown table of `figures`, one row per scenario."""
    lines = [
        "| scenario | faults injected | tasks run | completed | attempts billed once "
        "| spend multiplier | bad inputs tried | secrets found | result |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f in sorted(figures, key=lambda f: f.scenario):
        secrets = "—" if f.secrets_found is None else str(f.secrets_found)
        lines.append(
            f"| {f.scenario} | {f.faults} | {f.tasks_run} | {f.tasks_completed} "
            f"| {f.attempts_billed_once} of {f.attempts} | {_multiplier(f)} "
            f"| {f.bad_inputs_tried} | {secrets} | {f.result} |"
        )
    return "\n".join(lines)


def write_summary(figures: list[ScenarioFigures], command: str) -> Path:
    """Write `.kvflow/chaos-summary.md`: the table, each scenario's notes, the command."""
    total_s = sum(f.duration_s for f in figures)
    notes = [
        f"- **{f.scenario}** ({f.duration_s:.0f} s): " + "; ".join(f.notes)
        for f in sorted(figures, key=lambda f: f.scenario)
        if f.notes
    ]
    text = (
        f"# Fault suite: `{command}`\n\n"
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {len(figures)} scenarios, "
        f"{total_s / 60:.1f} minutes of scenarios.\n\n"
        f"{summary_table(figures)}\n\n" + "\n".join(notes) + "\n"
    )
    SUMMARY.parent.mkdir(parents=True, exist_ok=True)
    SUMMARY.write_text(text)
    return SUMMARY

"""(f) Recorded histories replay against the current workflow code.

Each history under tests/data/histories was recorded from a real run (the three samples, and
tasks of a fault run: a call cut by a killed GPU worker and resumed elsewhere, a call failed by
a replica's 503 and re-placed). A workflow change that would make a running task take another
path on replay (a command added, dropped or reordered) makes `Replayer` fail here. Record them
again only when such a change is meant, with `scripts/record_histories.py`.

Fast and serverless, so it runs with every `make test`, not only with `make chaos`.
"""

from __future__ import annotations

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from tests.chaos.recorded import HISTORIES, REPLAYED_WORKFLOWS, SAMPLES

RECORDED = sorted(HISTORIES.glob("*.json"))
TEXTS = {path.stem: path.read_text() for path in RECORDED}


def test_every_sample_and_a_fault_run_have_a_recorded_history():
    names = {path.stem for path in RECORDED}
    assert {f"sample_{name}" for name in SAMPLES} <= names
    assert any(name.startswith("chaos_") for name in names), names


@pytest.mark.parametrize("name", sorted(TEXTS))
async def test_recorded_history_replays_on_the_current_workflow_code(name: str):
    history = WorkflowHistory.from_json(name, TEXTS[name])
    replayer = Replayer(workflows=REPLAYED_WORKFLOWS, data_converter=pydantic_data_converter)
    # Raises on nondeterminism, or if the run failed in a way it did not when recorded.
    result = await replayer.replay_workflow(history, raise_on_replay_failure=True)
    assert result.replay_failure is None

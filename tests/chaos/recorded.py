"""Recorded workflow histories: the samples' and a fault run's, kept under tests/data/histories.

`tests/chaos/test_replay.py` replays every one against the current workflow code, so a change
that would break a task already running (a command added, removed or reordered) fails the
suite, as sdk-python's contrib tests do with their recorded histories.
`scripts/record_histories.py` records them again, deliberately.

Payloads kvflow's claim-check codec moved to the context store are put back inline before a
history is written (`portable_json`): a recorded history must replay without that store.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowHandle

import samples.code_review
import samples.research_assistant
import samples.support_triage
from kvflow.activities.claim_check import is_claim_check
from tests import agent_workflows as wf
from tests.chaos.cluster import ROOT
from tests.history import payloads_in

HISTORIES = ROOT / "tests" / "data" / "histories"
"""One `<name>.json` per recorded history; the name is also its workflow id on replay."""

SAMPLES = {
    "research_assistant": samples.research_assistant,
    "support_triage": samples.support_triage,
    "code_review": samples.code_review,
}
REPLAYED_WORKFLOWS: list[type] = [
    *(sample.WORKFLOW for sample in SAMPLES.values()),
    *wf.ALL_WORKFLOWS,
]
"""Every workflow a recorded history may belong to."""


async def portable_json(client: Client, handle: WorkflowHandle[Any, Any]) -> str:
    """`handle`'s history as JSON, claim-checked payloads restored from the context store."""
    history = await handle.fetch_history()
    codec = client.data_converter.payload_codec
    assert codec is not None, "the client has no claim-check codec (connect with KvflowPlugin)"
    for event in history.events:
        for payload in payloads_in(event):
            if is_claim_check(payload):
                [original] = await codec.decode([payload])
                payload.CopyFrom(original)
    return json.dumps(json.loads(history.to_json()), indent=1) + "\n"


def save(name: str, text: str, folder: Path = HISTORIES) -> Path:
    """Write one recorded history as `<folder>/<name>.json`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(text)
    return path

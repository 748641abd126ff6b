"""During a rollout, workers of the previous release and of this one share a task queue.

The previous release (commit 42a0b97, recorded as a wheel in `tests/data/previous_release/`)
runs in a subprocess with that wheel's `kvflow` on its `PYTHONPATH`: its control-plane
activities (`kvflow.record_task` among them) on one task queue and a workflow that sends a
task row built by its own code on another. This release's control plane serves a third queue,
all on the session's real Temporal dev server and one SQLite ledger.

A task row is the ledger's book of record for a task: one lost on the way (refused ten times,
then dropped until a reconcile) is a task finance cannot see. Each direction must record it,
and a row carrying a field the reader does not know (as the next release will send) must be
recorded by this release, while the previous release (with `extra="forbid"`) refuses it: that
refusal is the very failure this release's wire types no longer have.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
import zipfile
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from temporalio import workflow
from temporalio.client import Client, WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.worker import Worker

with workflow.unsafe.imports_passed_through():
    from kvflow.activities.control_plane import RECORD_TASK_ACTIVITY, ControlPlaneActivities
    from kvflow.ledger.records import TaskRecord
    from kvflow.ledger.store import AsyncLedger, open_ledger
    from kvflow.scheduler.core import Scheduler
    from tests.fixtures_ledger import task_record
    from tests.stacks import PoolPlan, fleet_for

PREVIOUS_RELEASE = Path(__file__).parent / "data" / "previous_release"
PREVIOUS_WHEEL = PREVIOUS_RELEASE / "kvflow-42a0b97-py3-none-any.whl"

NEXT_RELEASE_FIELD = "field_of_the_next_release"
"""A field no released kvflow knows, as a later release adds one to a row."""

OLD_WORKER = '''
"""The previous release's control plane on `ACTIVITY_QUEUE`, and a row sender on `WORKFLOW_QUEUE`."""
import asyncio, sys
from datetime import timedelta
from decimal import Decimal

import kvflow
from temporalio import workflow
from temporalio.client import Client
from temporalio.common import RetryPolicy
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from kvflow.activities.control_plane import RECORD_TASK_ACTIVITY, ControlPlaneActivities
from kvflow.ledger.records import TaskRecord
from kvflow.ledger.store import AsyncLedger, open_ledger
from kvflow.scheduler.core import Scheduler
from kvflow.scheduler.fleet import Fleet, Pool, Tenant, TokenPrices
from kvflow.simulator import BUILTIN_MODELS

ADDRESS, LEDGER, ACTIVITY_QUEUE, WORKFLOW_QUEUE, EXPECTED_ROOT = sys.argv[1:6]


@workflow.defn(name="PreviousReleaseSendsRow")
class PreviousReleaseSendsRow:
    @workflow.run
    async def run(self, row: dict, task_queue: str) -> bool:
        record = TaskRecord.model_validate(row)  # built by this release's code
        return await workflow.execute_activity(
            RECORD_TASK_ACTIVITY,
            record,
            task_queue=task_queue,
            start_to_close_timeout=timedelta(seconds=20),
            retry_policy=RetryPolicy(maximum_attempts=1),
        )


async def main() -> None:
    assert kvflow.__file__.startswith(EXPECTED_ROOT), kvflow.__file__
    fleet = Fleet(
        models=[BUILTIN_MODELS["llama-3.2-1b"]],
        pools=[
            Pool(
                name="h100",
                gpu="H100",
                replicas=1,
                price_per_gpu_hour_usd=Decimal("2.00"),
                token_prices=TokenPrices(
                    input_per_mtok_usd=Decimal("0.2"),
                    cached_input_per_mtok_usd=Decimal("0.02"),
                    output_per_mtok_usd=Decimal("0.6"),
                ),
                warm_models=["llama-3.2-1b"],
            )
        ],
        tenants=[Tenant(name="acme", tier=1)],
    )
    ledger = AsyncLedger(open_ledger(LEDGER, migrate=True))
    activities = ControlPlaneActivities(Scheduler(fleet), fleet=fleet, block_size=16, ledger=ledger)
    client = await Client.connect(ADDRESS, data_converter=pydantic_data_converter)
    serving = Worker(client, task_queue=ACTIVITY_QUEUE, activities=activities.all())
    sending = Worker(
        client,
        task_queue=WORKFLOW_QUEUE,
        workflows=[PreviousReleaseSendsRow],
        workflow_runner=UnsandboxedWorkflowRunner(),
    )
    async with serving, sending:
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


asyncio.run(main())
'''
"""The previous release's worker process; it runs until its stdin closes."""


class SendRow(BaseModel):
    """A task row as JSON, and the queue whose `kvflow.record_task` should record it."""

    row: dict[str, Any]
    task_queue: str


@workflow.defn
class ThisReleaseSendsRow:
    """Sends a task row to `kvflow.record_task` once, as the spend meter does at a close."""

    @workflow.run
    async def run(self, send: SendRow) -> bool:
        result: bool = await workflow.execute_activity(
            RECORD_TASK_ACTIVITY,
            send.row,
            task_queue=send.task_queue,
            start_to_close_timeout=timedelta(seconds=20),
            retry_policy=RetryPolicy(maximum_attempts=1),
        )
        return result


class Rollout:
    """Both releases' control planes on one server and one ledger; their queues by release."""

    def __init__(self, client: Client, ledger_url: str, tag: str) -> None:
        self.client = client
        self.ledger = AsyncLedger(open_ledger(ledger_url, migrate=True))
        self.new_activities = f"rollout-new-activities-{tag}"
        self.new_workflows = f"rollout-new-workflows-{tag}"
        self.old_activities = f"rollout-old-activities-{tag}"
        self.old_workflows = f"rollout-old-workflows-{tag}"

    async def send_from_this_release(self, row: dict[str, Any], task_queue: str) -> bool:
        """Send `row` from this release's workflow to `task_queue`'s `kvflow.record_task`."""
        return await self.client.execute_workflow(
            ThisReleaseSendsRow.run,
            SendRow(row=row, task_queue=task_queue),
            id=f"rollout-new-{uuid.uuid4()}",
            task_queue=self.new_workflows,
        )

    async def send_from_previous_release(self, row: dict[str, Any], task_queue: str) -> bool:
        """Send `row`, rebuilt as the previous release's `TaskRecord`, to `task_queue`."""
        result: bool = await self.client.execute_workflow(
            "PreviousReleaseSendsRow",
            args=[row, task_queue],
            id=f"rollout-old-{uuid.uuid4()}",
            task_queue=self.old_workflows,
            result_type=bool,
        )
        return result

    async def recorded(self, record: TaskRecord) -> TaskRecord | None:
        """The row the ledger holds under `record`'s key, as written; None when there is none."""
        book = await self.ledger.task(record.workflow_id, record.run_id)
        return None if book is None else book.as_written()


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The previous release's wheel, unpacked (its `kvflow` package at the top)."""
    root = tmp_path_factory.mktemp("previous-release")
    with zipfile.ZipFile(PREVIOUS_WHEEL) as wheel:
        wheel.extractall(root)
    yield root


@pytest.fixture
async def rollout(
    temporal_client: Client, previous_release: Path, tmp_path: Path
) -> AsyncIterator[Rollout]:
    """The previous release's worker process and this release's workers, started; stopped after."""
    ledger_url = f"sqlite:///{tmp_path / 'ledger.db'}"
    stack = Rollout(temporal_client, ledger_url, uuid.uuid4().hex[:8])
    script = tmp_path / "previous_release_worker.py"
    script.write_text(OLD_WORKER, encoding="utf-8")
    log = tmp_path / "previous_release_worker.log"
    with log.open("wb") as log_file:
        old = await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            temporal_client.service_client.config.target_host,
            ledger_url,
            stack.old_activities,
            stack.old_workflows,
            str(previous_release),
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(previous_release)},
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=log_file,
        )
    assert old.stdin is not None and old.stdout is not None
    try:
        line = await asyncio.wait_for(old.stdout.readline(), timeout=60)
        if line.strip() != b"ready":
            await old.wait()
            pytest.fail(f"the previous release's worker did not start:\n{log.read_text()}")
        fleet = fleet_for([PoolPlan("h100")])
        activities = ControlPlaneActivities(
            Scheduler(fleet), fleet=fleet, block_size=16, ledger=stack.ledger
        )
        serving = Worker(
            temporal_client, task_queue=stack.new_activities, activities=activities.all()
        )
        sending = Worker(
            temporal_client, task_queue=stack.new_workflows, workflows=[ThisReleaseSendsRow]
        )
        async with serving, sending:
            yield stack
    finally:
        old.stdin.close()  # the worker's signal to stop
        try:
            await asyncio.wait_for(old.wait(), timeout=30)
        except TimeoutError:
            old.kill()
            await old.wait()


def _messages(error: BaseException | None) -> str:
    """The messages of `error` and of every cause under it, one a line."""
    lines = []
    while error is not None:
        lines.append(str(error))
        error = error.__cause__
    return "\n".join(lines)


def _row(record: TaskRecord, **extra: Any) -> dict[str, Any]:
    """`record` as JSON, exactly as this release's converter sends it, plus `extra` fields."""
    return {**record.model_dump(mode="json"), **extra}


@pytest.mark.timeout(120)
async def test_a_task_row_of_this_release_is_recorded_by_the_previous_releases_worker(
    rollout: Rollout,
) -> None:
    record = task_record(f"rollout-{uuid.uuid4()}", spend_micros=1_234)
    assert await rollout.send_from_this_release(_row(record), rollout.old_activities)
    assert await rollout.recorded(record) == record


@pytest.mark.timeout(120)
async def test_a_task_row_of_the_previous_release_is_recorded_by_this_releases_worker(
    rollout: Rollout,
) -> None:
    record = task_record(f"rollout-{uuid.uuid4()}", spend_micros=2_345, chain_run_id="run-0")
    assert await rollout.send_from_previous_release(_row(record), rollout.new_activities)
    assert await rollout.recorded(record) == record


@pytest.mark.timeout(120)
async def test_a_row_with_a_field_of_the_next_release_is_recorded_by_this_release(
    rollout: Rollout,
) -> None:
    record = task_record(f"rollout-{uuid.uuid4()}", spend_micros=3_456)
    row = _row(record, **{NEXT_RELEASE_FIELD: "a later release's figure"})
    assert await rollout.send_from_this_release(row, rollout.new_activities)
    assert await rollout.recorded(record) == record


@pytest.mark.timeout(120)
async def test_the_previous_release_refuses_a_row_with_a_field_it_does_not_know(
    rollout: Rollout,
) -> None:
    # The failure this release's wire types remove: why this release sends no field that
    # holds nothing (a first run's `chain_run_id`), and why its readers ignore unknown ones.
    record = task_record(f"rollout-{uuid.uuid4()}", spend_micros=4_567)
    row = _row(record, **{NEXT_RELEASE_FIELD: 1})
    with pytest.raises(WorkflowFailureError) as failed:
        await rollout.send_from_this_release(row, rollout.old_activities)
    assert "Extra inputs are not permitted" in _messages(failed.value)
    assert await rollout.recorded(record) is None

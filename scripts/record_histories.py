"""Record the workflow histories that tests/chaos/test_replay.py replays.

    .venv/bin/python scripts/record_histories.py [--out tests/data/histories] [--ledger URL]

It runs kvflow's real processes (the Temporal dev server, simulators, GPU and workflow
workers, as the fault suite does) and keeps, as JSON with every payload inline:

- `sample_<name>.json`: each sample's example task (seed 7), on two simulated replicas;
- `chaos_gpu_worker_killed.json`: a task whose call was cut when its GPU worker was killed
  with SIGKILL mid-stream, and resumed on another replica;
- `chaos_replica_503.json`: a task whose call a replica failed with 503, re-placed elsewhere.

Record them again only when a change to workflow code is meant to change what running tasks
record (and say so in the commit): the replay test exists to catch the changes that are not.
About a minute on a 2-core machine. The ledger defaults to a SQLite file in a temporary
folder; nothing of the run is kept but the histories.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from pathlib import Path

# Run as a file (`python scripts/record_histories.py`): the harness lives in the repository's
# `tests` package, which only the repository root puts on the import path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.chaos.cluster import TENANT, ChaosCluster, PoolSpec
from tests.chaos.recorded import HISTORIES, SAMPLES, portable_json, save
from tests.chaos.traces import TaskTrace
from tests.chaos.workload import Workload

SAMPLE_SEED = 7
RESULT_TIMEOUT_S = 120


async def record_samples(workdir: Path, ledger_url: str, out: Path) -> list[Path]:
    """Run each sample's example task once; write its history."""
    cluster = ChaosCluster(
        workdir / "samples",
        ledger_url=ledger_url,
        pools=(PoolSpec(replicas=2),),
        workflow_workers=1,
        modules=[f"kvflow.samples.{name}" for name in SAMPLES],
        # The samples' latency budgets are sized for the demo's pace (20 simulated s per s).
        time_scale=20.0,
        extra_models=True,
    )
    written: list[Path] = []
    try:
        client = await cluster.start()
        for name, sample in SAMPLES.items():
            task = sample.example_input(random.Random(SAMPLE_SEED), TENANT)
            handle = await client.start_workflow(
                sample.WORKFLOW.run, task, id=f"sample_{name}", task_queue=cluster.task_queue
            )
            await asyncio.wait_for(handle.result(), RESULT_TIMEOUT_S)
            written.append(save(f"sample_{name}", await portable_json(client, handle), out))
    finally:
        await cluster.stop()
    return written


def _first(traces: dict[str, TaskTrace], wanted: str) -> str:
    """The first task (by workflow id) whose only failed attempts ended as `wanted` says."""
    for workflow_id in sorted(traces):
        ends = {
            attempt.timeout or attempt.error_type
            for attempt in traces[workflow_id].attempts
            if attempt.outcome != "ok"
        }
        if ends == {wanted}:
            return workflow_id
    raise RuntimeError(f"no task of the fault run failed only with {wanted}")


async def record_fault_run(workdir: Path, ledger_url: str, out: Path) -> list[Path]:
    """A fault run: one GPU worker killed mid-stream, one replica answering 503."""
    broken = ["--fault-error-rate", "1.0", "--fault-error-code", "503"]
    cluster = ChaosCluster(workdir / "chaos", ledger_url=ledger_url, fault_flags={"sim/3": broken})
    written: list[Path] = []
    try:
        client = await cluster.start()
        work = Workload(client, cluster.task_queue, "chaos", tasks=24)
        starting = asyncio.create_task(work.start(rate_per_s=8))
        await cluster.kill_gpu_worker_while_streaming()
        await starting
        await work.wait(RESULT_TIMEOUT_S)
        traces = await work.traces()
        for name, wanted in (
            ("chaos_gpu_worker_killed", "HEARTBEAT"),
            ("chaos_replica_503", "ReplicaServerError"),
        ):
            handle = client.get_workflow_handle(_first(traces, wanted))
            await asyncio.wait_for(handle.result(), RESULT_TIMEOUT_S)
            written.append(save(name, await portable_json(client, handle), out))
    finally:
        await cluster.stop()
    return written


async def main(out: Path, ledger_url: str | None) -> None:
    """Record every history into `out`."""
    with tempfile.TemporaryDirectory(prefix="kvflow-record-") as folder:
        workdir = Path(folder)
        url = ledger_url or f"sqlite:///{workdir}/ledger.db"
        written = await record_samples(workdir, url, out)
        written += await record_fault_run(workdir, url, out)
    for path in written:
        print(f"recorded {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HISTORIES, help="folder of the histories")
    parser.add_argument("--ledger", default=None, help="ledger URL (default: a SQLite file)")
    options = parser.parse_args()
    asyncio.run(main(options.out, options.ledger))

"""`kvflow demo` as a newcomer runs it: a real process, the embedded stack, a small workload."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from workers.devserver import free_port, port_is_free

KVFLOW = Path(sys.executable).parent / "kvflow"
ROOT = Path(__file__).resolve().parent.parent


def test_demo_runs_tasks_and_ends_with_the_finance_report(tmp_path: Path):
    port, ui_port = free_port(), free_port()
    done = subprocess.run(
        [
            str(KVFLOW),
            "demo",
            "--tasks",
            "9",
            "--seed",
            "3",
            "--port",
            str(port),
            "--ui-port",
            str(ui_port),
            "--state-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    # The finance report, the placement summary and where to look in the UI.
    assert "Cost per successful task" in out
    assert "Where the model calls ran" in out
    assert f"http://127.0.0.1:{ui_port}/namespaces/default/workflows?query=" in out
    assert "tasks succeeded" in out
    for tenant in ("acme", "globex", "initech"):
        assert tenant in out
    assert "Traceback" not in out + done.stderr
    # It wrote a ledger that `kvflow report` reads, and left nothing running.
    [ledger] = tmp_path.glob("demo-*.db")
    report = subprocess.run(
        [str(KVFLOW), "report", "--db", f"sqlite:///{ledger}", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert report.returncode == 0, report.stderr
    rows = json.loads(report.stdout)["rows"]
    assert sum(row["tasks"] for row in rows) == 9
    assert port_is_free(port) and port_is_free(ui_port)

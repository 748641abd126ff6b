"""kvflow's imports point one way: cli → bench → workers → samples → contrib → workflows →
activities → ledger / simulator → scheduler, and production code never uses the simulator.

The contracts live in pyproject.toml (`[tool.importlinter]`); this runs them as `lint-imports`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_module_imports_a_layer_above_it():
    done = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "2 kept, 0 broken" in done.stdout


def test_the_contracts_name_every_subpackage():
    # A new subpackage must be placed in the layers, or it escapes the check.
    layered = {"cli", "bench", "workers", "samples", "contrib", "workflows", "activities", "ledger"}
    layered.add("simulator")
    layered.add("scheduler")
    packages = {p.parent.name for p in (ROOT / "kvflow").glob("*/__init__.py")}
    assert packages == layered, packages ^ layered

"""The scheduler compiled with mypyc, as a deployment installs it, passes the scheduler's tests.

`make compiled` builds kvflow's wheel with the mypyc build hook on (see pyproject.toml) and
unpacks it under .kvflow/compiled/site. The scheduler's test files then run against that build,
copied out of the repository (with pytest's settings) so that only the unpacked wheel can
provide `scheduler`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from kvflow.scheduler.build import scheduler_build

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / ".kvflow" / "compiled" / "site"
COMPILED_MODULES = [
    "axes",
    "core",
    "decision",
    "policy",
    "prefix_index",
    "reasons",
    "reliability",
    "rendezvous",
    "search",
    "state",
    "tenancy",
]


def test_compiled_build_runs_the_scheduler_tests(tmp_path: Path) -> None:
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    assert shutil.which("cc") and headers.exists(), (
        "make test builds the scheduler compiled with mypyc: install a C compiler and the "
        f"Python headers ({headers} is {'there' if headers.exists() else 'missing'}; on "
        "Debian: apt install gcc python3-dev)"
    )
    build = subprocess.run(
        ["make", "compiled"], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    built = sorted(path.name.split(".")[0] for path in (SITE / "kvflow" / "scheduler").glob("*.so"))
    assert built == COMPILED_MODULES
    # The build leaves nothing compiled in the source tree, where it would shadow the source.
    assert not list((ROOT / "kvflow" / "scheduler").glob("*.so"))

    shutil.copytree(
        ROOT / "tests", tmp_path / "tests", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path)  # pytest's settings (asyncio mode, markers)
    env = os.environ | {"PYTHONPATH": str(SITE)}
    # The development environment runs the source; the unpacked build runs compiled code.
    assert scheduler_build() == "python"
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import kvflow.scheduler.core, kvflow.scheduler.build;"
            "print(kvflow.scheduler.core.__file__, kvflow.scheduler.build.scheduler_build())",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode == 0, probe.stderr
    module_file, probed_build = probe.stdout.split()
    assert module_file.endswith(".so") and probed_build == "mypyc", probe.stdout

    files = sorted(
        f"tests/{path.name}" for path in (tmp_path / "tests").glob("test_scheduler_*.py")
    )
    files.remove("tests/test_scheduler_compiled.py")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout, result.stdout[-2000:]

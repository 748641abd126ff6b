"""`kvflow init` and `kvflow fleet check` as a newcomer runs them, in an empty directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.public_api import internal_imports

KVFLOW = Path(sys.executable).parent / "kvflow"


def kvflow(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`kvflow ARGS` run in `cwd`, as a user's shell would."""
    return subprocess.run(
        [str(KVFLOW), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env={**os.environ, "COLUMNS": "200"},
    )


@pytest.mark.timeout(120)
def test_init_writes_a_project_whose_fleet_check_passes_without_naming_the_file(tmp_path: Path):
    init = kvflow(tmp_path, "init")
    assert init.returncode == 0, init.stdout + init.stderr
    assert {p.name for p in tmp_path.iterdir()} == {"fleet.toml", "workflows.py", "starter.py"}
    assert "kvflow dev" in init.stdout
    check = kvflow(tmp_path, "fleet", "check")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "fleet.toml is valid: 3 pools, 6 replicas" in check.stdout
    # The fleet file is the commented one, to edit into the user's own.
    assert (tmp_path / "fleet.toml").read_text().startswith("# kvflow fleet")


@pytest.mark.timeout(60)
def test_the_project_init_writes_imports_only_kvflows_public_api(tmp_path: Path):
    assert kvflow(tmp_path, "init").returncode == 0
    for name in ("workflows.py", "starter.py"):
        assert not internal_imports(tmp_path / name)
    starter = (tmp_path / "starter.py").read_text()
    assert "KvflowPlugin(fleet)" in starter and "from kvflow import" in starter


@pytest.mark.timeout(120)
def test_init_refuses_to_overwrite_a_users_file_unless_forced(tmp_path: Path):
    (tmp_path / "workflows.py").write_text("# mine\n")
    refused = kvflow(tmp_path, "init")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    message = " ".join(refused.stderr.split())
    assert "workflows.py already exists" in message and "--force" in message
    assert "Traceback" not in refused.stderr
    # Nothing was written: not the file that exists, nor the others.
    assert (tmp_path / "workflows.py").read_text() == "# mine\n"
    assert not (tmp_path / "fleet.toml").exists() and not (tmp_path / "starter.py").exists()
    forced = kvflow(tmp_path, "init", "--force")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert "from kvflow import" in (tmp_path / "workflows.py").read_text()


@pytest.mark.timeout(60)
def test_fleet_check_without_a_file_says_what_it_looked_for_and_suggests_init(tmp_path: Path):
    done = kvflow(tmp_path, "fleet", "check")
    assert done.returncode == 2, done.stdout + done.stderr
    message = " ".join(done.stderr.split())
    assert str(tmp_path / "fleet.toml") in message and "kvflow init" in message
    assert "Traceback" not in done.stderr
    missing = kvflow(tmp_path, "fleet", "check", "elsewhere.toml")
    assert missing.returncode == 2
    assert "kvflow init" in " ".join(missing.stderr.split())

"""Which build of the scheduler's decision path this process runs.

A deployment installs the decision path compiled with mypyc (`HATCH_BUILD_HOOK_ENABLE_MYPYC=true`
at install time, see pyproject.toml); the development environment runs the source. Workers
print which one they got, and the benchmark records which one it measured.
"""

from __future__ import annotations

from kvflow.scheduler import core


def scheduler_build() -> str:
    """`mypyc` when the decision path runs compiled, `python` when it runs from source."""
    return "python" if (core.__file__ or "").endswith(".py") else "mypyc"

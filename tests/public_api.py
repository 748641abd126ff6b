"""What a project copied from kvflow may import: `kvflow` itself and the framework adapters.

The README's promise is that a project imports only from `kvflow` (its `__all__`), and from
the adapter of the agent framework it uses (`kvflow.contrib.openai_agents`,
`kvflow.contrib.pydantic_ai`). Anything else below `kvflow` is kvflow's own layout, which may
move: a sample or a generated project that imports it teaches its readers to depend on it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvflow

ADAPTERS = frozenset({"kvflow.contrib.openai_agents", "kvflow.contrib.pydantic_ai"})
"""The modules below `kvflow` a user imports by name: one per agent framework."""


def internal_imports(path: Path) -> list[str]:
    """`file:line module` for every import in `path` of a module below `kvflow` (not public)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[str] = []
    for node in ast.walk(tree):
        names: list[str] = []
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif node.level == 0 and node.module:
            names = [node.module]
            if node.module == "kvflow":
                # `from kvflow import activities` reaches below kvflow just as well.
                names += [f"kvflow.{a.name}" for a in node.names if a.name not in kvflow.__all__]
        for name in names:
            if name.startswith("kvflow.") and name not in ADAPTERS:
                found.append(f"{path}:{node.lineno} {name}")
    return found

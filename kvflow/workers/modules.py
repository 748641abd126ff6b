"""The user's modules a workflow worker runs: every workflow and activity they define.

`kvflow worker workflow --module workflows --module activities` imports each module (the
current directory first on the import path, as `python -m` has it) and collects every class
decorated with `@workflow.defn` and every function decorated with `@activity.defn` found at
its top level, plus the entries of an optional `ACTIVITIES` list (activities that are methods
of an object, or that live in a submodule). A module may hold any number of workflows.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from temporalio import activity, workflow


class WorkerModuleError(Exception):
    """A module given to the workflow worker cannot be imported or holds no workflow."""


def load_worker_modules(names: Sequence[str]) -> tuple[list[type], list[Callable[..., Any]]]:
    """Import `names` and return (workflows, activities) in the order found, without repeats."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)  # a user's `workflows.py` beside them, as `python -m` finds it
    workflows: list[type] = []
    activities: list[Callable[..., Any]] = []
    for name in names:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            raise WorkerModuleError(
                f"--module {name}: {exc}. Name it as you would import it (a file "
                f"workflows.py is `--module workflows`), and run the worker from the directory "
                f"that holds it or add that directory to PYTHONPATH (now: {cwd})"
            ) from None
        except Exception as exc:
            raise WorkerModuleError(
                f"--module {name} failed to import: {type(exc).__name__}: {exc}"
            ) from None
        found = False
        for value in [*vars(module).values(), *getattr(module, "ACTIVITIES", [])]:
            if inspect.isclass(value) and workflow._Definition.from_class(value) is not None:
                if value not in workflows:
                    workflows.append(value)
                found = True
            elif callable(value) and activity._Definition.from_callable(value) is not None:
                if value not in activities:
                    activities.append(value)
                found = True
        if not found:
            raise WorkerModuleError(
                f"--module {name} defines no @workflow.defn class and no @activity.defn "
                "function; point it at the module that does"
            )
    if not workflows:
        raise WorkerModuleError(
            f"none of {', '.join(names)} defines a @workflow.defn class: a workflow worker "
            "needs at least one workflow"
        )
    return workflows, activities

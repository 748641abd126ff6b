"""Every type that crosses a task queue reads a payload with a field it does not know.

During a rollout a worker of one release takes tasks another release sent: activity inputs
and results, workflow inputs and results, queries, heartbeat and failure details. A type that
forbids unknown fields fails the task (`Extra inputs are not permitted`) the moment the other
release adds one, and Temporal retries it until it gives up: a task row lost, a call failed.

The wire types are found, not listed: every `@activity.defn` and `@workflow.defn` in kvflow
(its samples and bench included), their parameters and results, and the types inside them,
so a new activity or field cannot bring a type that forbids. Files read from disk (the fleet,
the scheduler's settings) keep refusing unknown keys: there an unknown key is a typo.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

import kvflow
from kvflow.activities.wire import AttemptProgress
from kvflow.ledger.records import TaskRecord
from kvflow.scheduler.config import SchedulerConfig
from kvflow.scheduler.fleet import Fleet
from kvflow.workers.config import EXAMPLE_FLEET, FleetConfigError, load_fleet
from kvflow.workflows.agent import SpendBreakdown
from tests.fixtures_ledger import attempt_record, task_record

CROSSING_WITHOUT_A_SIGNATURE: dict[str, type] = {
    "heartbeat and failure details of kvflow.infer": AttemptProgress,
    "the kvflow_spend query's result": SpendBreakdown,
}
"""Wire types no activity or workflow signature names: set at run time, read back by type."""

WIRE_MODULES = ("kvflow.activities.wire", "kvflow.scheduler.placement", "kvflow.ledger.records")
"""Modules of wire types: each model in them, or in `kvflow.workflows`, is one (continue-as-new
carries and headers, memos: what no signature names)."""


def _kvflow_modules() -> Iterator[types.ModuleType]:
    for info in pkgutil.walk_packages(kvflow.__path__, "kvflow."):
        yield importlib.import_module(info.name)


def _temporal_entry_points() -> dict[str, Callable[..., Any]]:
    """Every activity and workflow method (run, signals, queries, updates) kvflow defines."""
    found: dict[str, Callable[..., Any]] = {}
    for module in _kvflow_modules():
        for name, value in vars(module).items():
            if getattr(value, "__module__", None) != module.__name__:
                continue  # imported from elsewhere: found in its own module
            if inspect.isclass(value):
                definition = getattr(value, "__temporal_workflow_definition", None)
                if definition is not None:
                    handlers = [
                        definition.run_fn,
                        *(s.fn for s in definition.signals.values()),
                        *(q.fn for q in definition.queries.values()),
                        *(u.fn for u in definition.updates.values()),
                    ]
                    for handler in handlers:
                        found[f"{module.__name__}.{name}.{handler.__name__}"] = handler
                for attribute, member in vars(value).items():
                    if hasattr(member, "__temporal_activity_definition"):
                        found[f"{module.__name__}.{name}.{attribute}"] = member
            elif callable(value) and hasattr(value, "__temporal_activity_definition"):
                found[f"{module.__name__}.{name}"] = value
    return found


def _types_inside(annotation: Any, path: str, found: dict[type, str]) -> None:
    """Add every model and dataclass `annotation` names, however nested, to `found`."""
    if typing.get_origin(annotation) is not None or isinstance(annotation, types.UnionType):
        for argument in typing.get_args(annotation):
            _types_inside(argument, path, found)
        return
    if not isinstance(annotation, type) or annotation in found:
        return
    if issubclass(annotation, BaseModel):
        found[annotation] = path
        for name, field in annotation.model_fields.items():
            _types_inside(field.annotation, f"{path}.{name}", found)
    elif dataclasses.is_dataclass(annotation):
        found[annotation] = path
        hints = typing.get_type_hints(annotation, include_extras=True)
        for member in dataclasses.fields(annotation):
            _types_inside(hints[member.name], f"{path}.{member.name}", found)


def wire_types() -> dict[type, str]:
    """Each type that crosses a task queue, and one way it does (for the failure message)."""
    found: dict[type, str] = {}
    for where, entry in _temporal_entry_points().items():
        function = getattr(entry, "__func__", entry)
        for annotation in typing.get_type_hints(function, include_extras=True).values():
            _types_inside(annotation, where, found)
    for where, crossing in CROSSING_WITHOUT_A_SIGNATURE.items():
        _types_inside(crossing, where, found)
    for module in _kvflow_modules():
        if module.__name__ in WIRE_MODULES or module.__name__.startswith("kvflow.workflows."):
            for name, value in vars(module).items():
                # The module's own models, not what they hold: a ledger row's prices are the
                # fleet file's (read from disk), and no signature sends an attempt row.
                if (
                    inspect.isclass(value)
                    and issubclass(value, BaseModel)
                    and value.__module__ == module.__name__
                ):
                    found.setdefault(value, f"{module.__name__}.{name}")
    return found


def _extra(cls: type) -> str:
    """What `cls` does with an unknown field: pydantic's `extra` ("ignore" by default)."""
    config = (
        cls.model_config if issubclass(cls, BaseModel) else getattr(cls, "__pydantic_config__", {})
    )
    return str(config.get("extra") or "ignore")


@pytest.mark.timeout(60)
def test_every_type_that_crosses_a_task_queue_ignores_fields_it_does_not_know() -> None:
    found = wire_types()
    names = {cls.__name__ for cls in found}
    # The search reaches the types of each kind of crossing, so an empty result cannot pass.
    assert {"TaskRecord", "InferenceRequest", "InferenceResult", "PlacementRequest"} <= names
    assert {"Observation", "Placement", "AttemptProgress", "TaskSpec", "LostAttempt"} <= names
    refusing = {
        f"{cls.__module__}.{cls.__qualname__} (via {path}): extra={_extra(cls)!r}"
        for cls, path in found.items()
        if _extra(cls) != "ignore"
    }
    assert not refusing, "wire types that refuse a newer release's fields:\n" + "\n".join(
        sorted(refusing)
    )


@pytest.mark.timeout(10)
def test_ledger_rows_from_a_newer_release_are_read() -> None:
    task = task_record("wf-newer", spend_micros=10)
    newer_task = {**task.model_dump(mode="json"), "field_of_the_next_release": [1, 2]}
    assert TaskRecord.model_validate(newer_task) == task
    attempt = attempt_record()
    newer_attempt = {**attempt.model_dump(mode="json"), "field_of_the_next_release": "x"}
    assert type(attempt).model_validate(newer_attempt) == attempt


@pytest.mark.timeout(10)
def test_a_row_leaves_out_optional_fields_that_hold_nothing() -> None:
    # A first run has no chain to name: a worker of a release before `chain_run_id` (which
    # forbids unknown fields) takes the row only if the field is not there at all.
    first_run = task_record("wf-first", run_id="run-1")
    assert "chain_run_id" not in first_run.model_dump(mode="json")
    assert TaskRecord.model_validate_json(first_run.model_dump_json()) == first_run
    later_run = task_record("wf-first", run_id="run-2", chain_run_id="run-1")
    assert later_run.model_dump(mode="json")["chain_run_id"] == "run-1"
    assert "error_type" not in attempt_record().model_dump(mode="json")


@pytest.mark.timeout(10)
def test_files_read_from_disk_still_refuse_an_unknown_key(tmp_path: Path) -> None:
    assert Fleet.model_config.get("extra") == "forbid"
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        SchedulerConfig.model_validate({"wieghts": {}})
    fleet = tmp_path / "fleet.toml"
    example = EXAMPLE_FLEET.read_text(encoding="utf-8")
    fleet.write_text(example + "\n[typo_section]\nreplicas = 3\n", encoding="utf-8")
    with pytest.raises(FleetConfigError, match="typo_section"):
        load_fleet(fleet)

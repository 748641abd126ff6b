"""The endpoints file: where `kvflow dev` tells `KvflowPlugin` the URLs of its simulated replicas.

A pool whose `endpoints` is "simulated" has no URLs in the fleet file: they are chosen when a
simulator starts. `kvflow dev` writes them, with the Temporal address it serves, to
`.kvflow/dev.toml` in the directory it runs in, and removes the file when it stops. A
`KvflowPlugin(fleet)` given no `endpoints=` reads that file, as Temporal's clients read their
environment configuration, so a user's own program runs against the dev stack unchanged.
`KVFLOW_ENDPOINTS_FILE` names another file (`kvflow dev --state-dir DIR` writes `DIR/dev.toml`
and says so).

The file is TOML::

    pid = 12345                       # the kvflow dev process that serves these URLs
    [temporal]
    address = "127.0.0.1:7233"
    ui = "http://127.0.0.1:8233"
    [endpoints]
    "h200/0" = "http://127.0.0.1:40123"
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

ENDPOINTS_FILE_ENV = "KVFLOW_ENDPOINTS_FILE"
"""Environment variable naming the endpoints file, when it is not `DEV_FILE`."""
DEV_FILE = Path(".kvflow") / "dev.toml"
"""The endpoints file `kvflow dev` writes by default, relative to the directory it runs in."""


class EndpointsFileError(ValueError):
    """The endpoints file exists but cannot be used; the message names it and the fix."""


@dataclass(frozen=True)
class DevEndpoints:
    """What an endpoints file says: replica URLs, the Temporal address, who wrote it."""

    path: Path
    endpoints: dict[str, str] = field(default_factory=dict)
    temporal_address: str | None = None
    ui_url: str | None = None
    pid: int | None = None

    def writer_runs(self) -> bool:
        """Whether the process that wrote the file still runs (True when it is not known)."""
        if self.pid is None:
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # another user's process: it exists
        return True


def endpoints_file() -> Path:
    """The endpoints file `KvflowPlugin` reads: `$KVFLOW_ENDPOINTS_FILE`, else `DEV_FILE`."""
    return Path(os.environ.get(ENDPOINTS_FILE_ENV) or DEV_FILE)


def read_endpoints_file(path: Path | None = None) -> DevEndpoints | None:
    """The endpoints file at `path` (default `endpoints_file()`), or None if there is none."""
    path = path if path is not None else endpoints_file()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise EndpointsFileError(f"cannot read the endpoints file {path}: {exc}") from None
    try:
        data = tomllib.loads(text)
        endpoints = data.get("endpoints", {})
        temporal = data.get("temporal", {})
        pid = data.get("pid")
        if not isinstance(endpoints, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in endpoints.items()
        ):
            raise ValueError("[endpoints] must map replica names to URLs")
        if not isinstance(temporal, dict) or (pid is not None and not isinstance(pid, int)):
            raise ValueError("[temporal] must be a table and pid a number")
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        raise EndpointsFileError(
            f"the endpoints file {path} is not one `kvflow dev` wrote ({exc}); "
            "delete it and start `kvflow dev` again"
        ) from None
    return DevEndpoints(
        path=path,
        endpoints=dict(endpoints),
        temporal_address=temporal.get("address"),
        ui_url=temporal.get("ui"),
        pid=pid,
    )


def write_endpoints_file(
    path: Path,
    endpoints: Mapping[str, str],
    *,
    temporal_address: str,
    ui_url: str | None,
    pid: int | None = None,
) -> None:
    """Write the endpoints file at `path`, whole or not at all (a reader never sees half)."""
    # JSON strings are TOML basic strings for these values (ASCII URLs and names).
    lines = [
        "# Written by `kvflow dev`, removed when it stops: the URLs of its simulated replicas,",
        "# which KvflowPlugin(fleet) reads when it is given no endpoints=.",
        f"pid = {pid if pid is not None else os.getpid()}",
        "",
        "[temporal]",
        f"address = {json.dumps(temporal_address)}",
        *([f"ui = {json.dumps(ui_url)}"] if ui_url else []),
        "",
        "[endpoints]",
        *(f"{json.dumps(name)} = {json.dumps(url)}" for name, url in endpoints.items()),
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text("\n".join(lines), encoding="utf-8")
    partial.replace(path)

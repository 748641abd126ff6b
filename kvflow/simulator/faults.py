"""Faults on demand: per server (`kvflow sim serve --fault-...`) and per request (a header).

Header grammar (`x-kvflow-fault`), `key=value` pairs separated by commas or semicolons::

    x-kvflow-fault: error=503
    x-kvflow-fault: latency_ms=200, stall_after=10, stall_ms=5000
    x-kvflow-fault: disconnect_after=20
    x-kvflow-fault: crash_after=5

Keys (value: effect):

- `error` (429, 500, 502, 503 or 504): answer with that status and vLLM's error body, no work.
- `error_rate` (0..1): fail that share of requests (the server's seeded draws).
- `error_code` (as `error`, default 503): the status `error_rate` uses.
- `latency_ms` (≥ 0): wait that long (real time) before the request enters the engine.
- `stall_after` (tokens ≥ 0): after that many output tokens, stop sending for `stall_ms`.
- `stall_ms` (≥ 0, default forever): how long a stall lasts; the engine keeps generating.
- `disconnect_after` (tokens ≥ 0): after that many output tokens, drop the connection.
- `crash_after` (tokens ≥ 0): after that many output tokens, the server process exits.
- `slowdown` (≥ 1, server only): every engine step takes that many times longer.

A header value overrides the server's value of the same key for that request. Token counts
are output tokens sent to the client; `disconnect_after=0` drops the connection before the
first token. A non-streaming request that is dropped gets its status line and then a cut
body, which HTTP clients report as a protocol error (peer closed the connection). A crash
exits the `kvflow sim serve` process with status 70; an in-process `SimServer` instead drops
every connection and stops listening, which a client cannot tell apart.

`error_rate` is deterministic for the server's `seed`: the n-th request gets the n-th draw.
"""

from __future__ import annotations

import random
import threading

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

FAULT_HEADER = "x-kvflow-fault"
ERROR_CODES = frozenset({429, 500, 502, 503, 504})
CRASH_EXIT_CODE = 70
"""Exit status of a `kvflow sim serve` process that crashed on purpose (EX_SOFTWARE)."""


class FaultSpec(BaseModel):
    """Faults of one server, or of one request (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    error: int | None = Field(default=None, description="fail with this HTTP status")
    error_rate: float = Field(default=0.0, ge=0, le=1)
    error_code: int = 503
    latency_ms: float = Field(default=0.0, ge=0)
    stall_after: int | None = Field(default=None, ge=0)
    stall_ms: float | None = Field(default=None, ge=0)
    disconnect_after: int | None = Field(default=None, ge=0)
    crash_after: int | None = Field(default=None, ge=0)
    slowdown: float = Field(default=1.0, ge=1)

    @field_validator("error", "error_code")
    @classmethod
    def _known_status(cls, value: int | None) -> int | None:
        if value is not None and value not in ERROR_CODES:
            codes = ", ".join(str(c) for c in sorted(ERROR_CODES))
            raise ValueError(f"must be one of {codes}, got {value}")
        return value

    def merged(self, override: FaultSpec | None) -> FaultSpec:
        """The spec with the keys that `override` sets replaced by its values."""
        if override is None:
            return self
        return self.model_copy(update=override.model_dump(exclude_unset=True))

    @property
    def any_stream_fault(self) -> bool:
        """Whether a fault acts while tokens are sent (stall, disconnect, crash)."""
        return (
            self.stall_after is not None
            or self.disconnect_after is not None
            or self.crash_after is not None
        )


class FaultHeaderError(ValueError):
    """The fault header does not follow the grammar; the message says what is wrong."""


def parse_fault_header(value: str) -> FaultSpec:
    """Parse an `x-kvflow-fault` value; `FaultHeaderError` names the bad part."""
    fields: dict[str, str] = {}
    for part in value.replace(";", ",").split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, raw = part.partition("=")
        key = key.strip().lower().replace("-", "_")
        if not sep or not raw.strip():
            raise FaultHeaderError(f"{FAULT_HEADER}: {part!r} is not key=value")
        if key == "slowdown":
            raise FaultHeaderError(
                f"{FAULT_HEADER}: slowdown applies to a whole server; set it with --fault-slowdown"
            )
        if key not in FaultSpec.model_fields:
            keys = ", ".join(k for k in FaultSpec.model_fields if k != "slowdown")
            raise FaultHeaderError(f"{FAULT_HEADER}: unknown key {key!r}; known keys: {keys}")
        fields[key] = raw.strip()
    try:
        return FaultSpec.model_validate(fields)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'value'}: "
            f"{e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors()
        )
        raise FaultHeaderError(f"{FAULT_HEADER}: {problems}") from None


class FaultDice:
    """The server's seeded draws for `error_rate` (thread-safe, in request order)."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def fails(self, rate: float) -> bool:
        """Whether the next request fails at `rate` (always draws, so order alone decides)."""
        with self._lock:
            draw = self._rng.random()
        return draw < rate

"""Fuzzed inputs at kvflow's edges: fleet files, requests to the simulator, report arguments.

Each input a user or a client can get wrong is either refused cleanly (a typed error naming
what is wrong, exit code 2, a 400 with an OpenAI error body) or accepted and valid; never a
traceback or a 500. The examples are derandomized, so CI runs the same ones every time.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvflow.cli.main import app
from kvflow.scheduler.fleet import Fleet, ModelSpec, Pool, Tenant, TokenPrices
from kvflow.scheduler.gpus import GpuGeneration
from kvflow.workers.config import (
    FleetConfig,
    FleetConfigError,
    TemporalConnection,
    TemporalTls,
    load_fleet,
)

KVFLOW = Path(sys.executable).parent / "kvflow"

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
"""In-process fuzzing: many examples, the same ones on every run."""

# ---- TOML, written by hand (the standard library only reads it) ------------------------------

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def toml_string(text: str) -> str:
    """A TOML basic string: JSON's escapes, plus DEL, which TOML also wants escaped."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007F")


def toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else toml_string(key)


def toml_value(value: Any) -> str:
    """`value` as a TOML value; tables and arrays inline, so any nesting fits on one line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML for {value!r}")


def toml_document(document: dict[str, Any]) -> str:
    return "".join(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in document.items())


# ---- valid fleet documents, from the models' fields ------------------------------------------

FLEET_KEYS: dict[type[Any], set[str]] = {
    FleetConfig: {"models", "pools", "tenants", "temporal"},
    ModelSpec: {
        "name",
        "parameters_b",
        "layers",
        "kv_heads",
        "head_dim",
        "context_length",
        "fallback",
        "tokenizer",
    },
    Pool: {
        "name",
        "gpu",
        "replicas",
        "gpus_per_replica",
        "endpoints",
        "price_per_gpu_hour_usd",
        "token_prices",
        "warm_models",
        "max_concurrency",
        "kv_events",
        "kv_events_topic",
    },
    TokenPrices: {"input_per_mtok_usd", "cached_input_per_mtok_usd", "output_per_mtok_usd"},
    Tenant: {"name", "tier", "fairness_weight", "daily_budget_usd"},
    TemporalConnection: {"address", "namespace", "api_key_env", "tls"},
    TemporalTls: {
        "disabled",
        "server_name",
        "server_ca_cert_path",
        "client_cert_path",
        "client_key_path",
    },
}
"""The keys the generator writes, per model; a test keeps it equal to the models' fields."""

NAME = st.from_regex(r"[a-z0-9][a-z0-9-]{0,12}", fullmatch=True)
USD = st.decimals(min_value=0, max_value=100, places=3).map(str)
COUNT = st.integers(min_value=1, max_value=64)


def _some(
    draw: st.DrawFn, table: dict[str, Any], optional: dict[str, st.SearchStrategy[Any]]
) -> dict[str, Any]:
    """`table` with each optional key added or left out."""
    for key, strategy in optional.items():
        if draw(st.booleans()):
            table[key] = draw(strategy)
    return table


@st.composite
def valid_fleets(draw: st.DrawFn) -> dict[str, Any]:
    """A fleet document `load_fleet` must accept, with every optional key sometimes written."""
    model_names = draw(st.lists(NAME, min_size=1, max_size=3, unique=True))
    models = []
    for index, name in enumerate(model_names):
        model = {
            "name": name,
            "parameters_b": draw(st.floats(min_value=0.1, max_value=1000)),
            "layers": draw(COUNT),
            "kv_heads": draw(COUNT),
            "head_dim": draw(st.sampled_from([64, 128, 256])),
            "context_length": draw(st.integers(min_value=256, max_value=1 << 20)),
        }
        # A fallback to an earlier model only, so chains never loop.
        earlier = st.sampled_from(model_names[:index]) if index else st.nothing()
        models.append(_some(draw, model, {"fallback": earlier, "tokenizer": st.just("builtin")}))
    pools = []
    for name in draw(st.lists(NAME, min_size=1, max_size=3, unique=True)):
        replicas = draw(st.integers(min_value=1, max_value=4))
        warm = draw(st.lists(st.sampled_from(model_names), min_size=1, max_size=2, unique=True))
        urls = [f"http://10.0.0.{i + 1}:8000" for i in range(replicas)]
        optional: dict[str, st.SearchStrategy[Any]] = {
            "gpus_per_replica": st.integers(min_value=1, max_value=8),
            "endpoints": st.sampled_from(["simulated", urls]),
            "max_concurrency": st.integers(min_value=1, max_value=4096),
            "kv_events_topic": st.text(max_size=8),
        }
        if len(warm) == 1:
            optional["kv_events"] = st.just([f"ipc:///tmp/kv-{i}.sock" for i in range(replicas)])
        pool = {
            "name": name,
            "gpu": draw(st.sampled_from([g.value for g in GpuGeneration])),
            "replicas": replicas,
            "price_per_gpu_hour_usd": draw(USD),
            "token_prices": {key: draw(USD) for key in sorted(FLEET_KEYS[TokenPrices])},
            "warm_models": warm,
        }
        pools.append(_some(draw, pool, optional))
    tenants = []
    for name in draw(st.lists(NAME, min_size=1, max_size=3, unique=True)):
        tenant = {"name": name, "tier": draw(st.integers(min_value=1, max_value=5))}
        optional = {
            "fairness_weight": st.floats(min_value=0.01, max_value=1000),
            "daily_budget_usd": USD,
        }
        tenants.append(_some(draw, tenant, optional))
    document: dict[str, Any] = {"models": models, "pools": pools, "tenants": tenants}
    tls = _some(
        draw,
        {},
        {
            "disabled": st.booleans(),
            "server_name": NAME,
            "server_ca_cert_path": st.just("/etc/ssl/ca.pem"),
            "client_cert_path": st.just("/etc/ssl/client.pem"),
            "client_key_path": st.just("/etc/ssl/client.key"),
        },
    )
    temporal = _some(
        draw,
        {},
        {
            "address": st.builds("{}:{}".format, NAME, st.integers(min_value=1, max_value=65535)),
            "namespace": NAME,
            "api_key_env": st.from_regex(r"[A-Z_][A-Z0-9_]{0,12}", fullmatch=True),
            "tls": st.just(tls),
        },
    )
    return _some(draw, document, {"temporal": st.just(temporal)})


# ---- mutations: what a hand-edited file gets wrong ------------------------------------------

Path_ = tuple[str | int, ...]


def _locations(value: Any, at: Path_ = ()) -> list[Path_]:
    """Every key and list item under `value`, parents before children."""
    found: list[Path_] = [at] if at else []
    if isinstance(value, dict):
        for key, child in value.items():
            found += _locations(child, (*at, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += _locations(child, (*at, index))
    return found


def _get(document: Any, at: Path_) -> Any:
    for part in at:
        document = document[part]
    return document


WRONG_TYPES = st.one_of(
    st.text(max_size=12),
    st.integers(min_value=-(10**6), max_value=10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.dates(),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(NAME, st.integers(), max_size=2),
)
UNICODE = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=0, max_size=40)
HUGE = st.one_of(
    st.integers(min_value=10**10, max_value=10**40),
    st.sampled_from([1e308, -1e308, 1e-320]),
    st.sampled_from(["1e400", "9" * 60, "0." + "0" * 40 + "1", "x" * 5000]),
)


def _negative(value: Any) -> Any:
    if isinstance(value, bool):
        return -1
    if isinstance(value, int | float):
        return -value if value else -1
    if isinstance(value, str) and re.fullmatch(r"[0-9.]+", value):
        return "-" + value
    return -1


@st.composite
def mutated_fleets(draw: st.DrawFn) -> tuple[dict[str, Any], list[Path_]]:
    """A valid fleet document with one to three mistakes, and where each one was made."""
    document = draw(valid_fleets())
    made: list[Path_] = []
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        at = draw(st.sampled_from(_locations(document)))
        parent, key = _get(document, at[:-1]), at[-1]
        kind = draw(
            st.sampled_from(["missing", "wrong_type", "unknown_key", "negative", "huge", "unicode"])
        )
        if kind == "missing":
            del parent[key]
        elif kind == "unknown_key":
            table = parent[key] if isinstance(parent[key], dict) else parent
            if not isinstance(table, dict):
                continue
            unknown = draw(UNICODE)
            if unknown in table:
                continue
            table[unknown] = draw(WRONG_TYPES)
            at = (*at, unknown) if table is parent[key] else (*at[:-1], unknown)
        elif kind == "negative":
            parent[key] = _negative(parent[key])
        else:
            parent[key] = draw({"wrong_type": WRONG_TYPES, "huge": HUGE, "unicode": UNICODE}[kind])
        made.append(at)
        # Deleting a list item moves the items after it: stop before a location goes stale.
        if kind == "missing" and isinstance(key, int):
            break
    return document, made


def _key_path(at: Path_) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in at).lstrip(".")


def _related(a: str, b: str) -> bool:
    """Whether key paths `a` and `b` are the same key, or one is inside the other."""
    inner, outer = (a, b) if len(a) >= len(b) else (b, a)
    return inner == outer or (outer != "" and inner.startswith((outer + ".", outer + "[")))


def _identity_of_a_model(at: Path_) -> bool:
    """Whether a mistake at `at` renames or removes a model (others refer to models by name)."""
    return at == ("models",) or (
        at[0] == "models" and (len(at) == 2 or (len(at) == 3 and at[2] == "name"))
    )


def _accepted_and_valid(fleet: FleetConfig) -> None:
    """What kvflow relies on in a loaded fleet: it round-trips, prices compute, names resolve."""
    again = FleetConfig.model_validate(fleet.model_dump())
    assert again == fleet
    for pool in fleet.pools:
        assert pool.token_prices.cost_micros(1000, 10, 100) >= 0
        assert all(fleet.model(m) for m in pool.warm_models)
    for model in fleet.models:
        assert model.fallback is None or fleet.model(model.fallback)


# ---- fleet files -----------------------------------------------------------------------------


def test_the_fuzzed_fleet_writes_every_key_of_the_models():
    for model, keys in FLEET_KEYS.items():
        assert set(model.model_fields) == keys, f"update FLEET_KEYS[{model.__name__}]"
    assert set(Fleet.model_fields) <= FLEET_KEYS[FleetConfig]


@FUZZ
@given(document=valid_fleets())
def test_generated_valid_fleets_load(document: dict[str, Any], tmp_path_factory: Any):
    path = tmp_path_factory.getbasetemp() / "valid-fleet.toml"
    path.write_text(toml_document(document), encoding="utf-8")
    _accepted_and_valid(load_fleet(path))


@FUZZ
@given(mutation=mutated_fleets())
def test_mutated_fleet_is_refused_naming_the_key_or_accepted_valid(
    mutation: tuple[dict[str, Any], list[Path_]], tmp_path_factory: Any
):
    document, made = mutation
    path = tmp_path_factory.getbasetemp() / "mutated-fleet.toml"
    path.write_text(toml_document(document), encoding="utf-8")
    try:
        fleet = load_fleet(path)
    except FleetConfigError as refused:
        assert refused.problems
        for problem in refused.problems:
            assert problem.file == path and problem.message.strip()
        # A mistake is named, at its key or the table holding it. (A model renamed or removed
        # may show up only where other tables refer to it by name.)
        named = [p.key_path for p in refused.problems]
        mistakes = [_key_path(at) for at in made]
        assert any(_identity_of_a_model(at) for at in made) or any(
            _related(p, m) for p in named for m in mistakes
        ), (mistakes, [str(p) for p in refused.problems])
    else:
        _accepted_and_valid(fleet)


@FUZZ
@given(text=st.text(max_size=300))
def test_any_text_as_a_fleet_file_is_refused_cleanly(text: str, tmp_path_factory: Any):
    path = tmp_path_factory.getbasetemp() / "text-fleet.toml"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    try:
        _accepted_and_valid(load_fleet(path))
    except FleetConfigError as refused:
        assert refused.problems


@settings(FUZZ, max_examples=25)
@given(mutation=mutated_fleets())
def test_fleet_check_exits_0_or_2_with_the_problems_and_no_traceback(
    mutation: tuple[dict[str, Any], list[Path_]], tmp_path_factory: Any
):
    document, _ = mutation
    path = tmp_path_factory.getbasetemp() / "cli-fleet.toml"
    path.write_text(toml_document(document), encoding="utf-8")
    result = CliRunner().invoke(app, ["fleet", "check", str(path)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    try:
        load_fleet(path)
    except FleetConfigError as refused:
        assert result.exit_code == 2, result.output
        assert f"{len(refused.problems)} problem" in result.output
    else:
        assert result.exit_code == 0 and "is valid" in result.output


@pytest.mark.timeout(300)
@settings(FUZZ, max_examples=4)
@given(mutation=mutated_fleets())
def test_fleet_check_process_exits_2_naming_the_key_without_traceback(
    mutation: tuple[dict[str, Any], list[Path_]], tmp_path_factory: Any
):
    # A real process (slow, so a few examples): the exit code and output a shell sees.
    document, _ = mutation
    path = tmp_path_factory.getbasetemp() / "process-fleet.toml"
    path.write_text(toml_document(document), encoding="utf-8")
    done = subprocess.run(
        [str(KVFLOW), "fleet", "check", str(path)], capture_output=True, text=True, timeout=120
    )
    assert "Traceback" not in done.stdout + done.stderr
    try:
        load_fleet(path)
    except FleetConfigError as refused:
        assert done.returncode == 2, done.stderr
        for problem in refused.problems:
            assert problem.key_path in done.stderr
    else:
        assert done.returncode == 0, done.stderr


# Found while fuzzing the fleet file; each is refused only once `kvflow/scheduler` checks it.
FLEET_GAPS = {
    # The filesystem's ENAMETOOLONG (an OSError) escapes the tokenizer check: a traceback.
    "tokenizer_path_too_long": ("tokenizer", "x" * 5000, "models[0].tokenizer"),
    # Accepted, then every cost computed from it takes minutes (a million-digit integer).
    "price_with_a_huge_exponent": ("input_per_mtok_usd", "1e999999", "input_per_mtok_usd"),
    # Accepted, then the cost raises decimal.InvalidOperation where an attempt is billed.
    "price_with_a_tiny_exponent": ("input_per_mtok_usd", "1e-99999999", "input_per_mtok_usd"),
}


@pytest.mark.xfail(strict=True, reason="kvflow/scheduler does not refuse these values yet")
@pytest.mark.parametrize("case", sorted(FLEET_GAPS))
def test_fleet_value_the_fuzzer_found_is_refused_naming_its_key(case: str, tmp_path: Path):
    key, value, named = FLEET_GAPS[case]
    document = _smallest_valid_fleet()
    tables = [document["models"][0], document["pools"][0]["token_prices"]]
    next(t for t in tables if key in t)[key] = value
    path = tmp_path / "fleet.toml"
    path.write_text(toml_document(document), encoding="utf-8")
    with pytest.raises(FleetConfigError) as refused:
        load_fleet(path)
    assert any(named in p.key_path for p in refused.value.problems)


def _smallest_valid_fleet() -> dict[str, Any]:
    return {
        "models": [
            {
                "name": "m",
                "parameters_b": 1.0,
                "layers": 1,
                "kv_heads": 1,
                "head_dim": 64,
                "context_length": 1024,
                "tokenizer": "builtin",
            }
        ],
        "pools": [
            {
                "name": "p",
                "gpu": "H100",
                "replicas": 1,
                "price_per_gpu_hour_usd": "1",
                "token_prices": {
                    "input_per_mtok_usd": "1",
                    "cached_input_per_mtok_usd": "0.1",
                    "output_per_mtok_usd": "2",
                },
                "warm_models": ["m"],
            }
        ],
        "tenants": [{"name": "t", "tier": 1}],
    }

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvflow.cli.main import app
from kvflow.ledger.store import connect_ledger
from kvflow.scheduler.fleet import CacheConfig, Fleet, ModelSpec, Pool, Tenant, TokenPrices
from kvflow.scheduler.gpus import GpuGeneration
from kvflow.simulator import SimServer
from kvflow.workers.config import (
    FleetConfig,
    FleetConfigError,
    TemporalConnection,
    TemporalTls,
    load_fleet,
)
from tests.fixtures_sim import SIM_MODEL, sim_settings

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
    FleetConfig: {"models", "pools", "tenants", "temporal", "cache"},
    CacheConfig: {"shared_prefixes"},
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
        "endpoint_kind",
        "priority_scheduling",
        "deadline_pause",
        "task_end_release",
        "inference_objectives",
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
            "task_end_release": st.booleans(),  # the default endpoint kind, vllm, takes it
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
    cache = _some(
        draw,
        {},
        {
            "shared_prefixes": st.lists(
                st.from_regex(r"sha256:[0-9a-f]{64}", fullmatch=True), max_size=2
            )
        },
    )
    return _some(draw, document, {"temporal": st.just(temporal), "cache": st.just(cache)})


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
    """The key path as kvflow names it: a key a terminal would not show in Python's escapes."""
    return "".join(
        f"[{p}]" if isinstance(p, int) else f".{p if p.isprintable() else repr(p)}" for p in at
    ).lstrip(".")


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


@pytest.mark.timeout(300)
@FUZZ
@given(document=valid_fleets())
def test_generated_valid_fleets_load(document: dict[str, Any], tmp_path_factory: Any):
    path = tmp_path_factory.getbasetemp() / "valid-fleet.toml"
    path.write_text(toml_document(document), encoding="utf-8")
    _accepted_and_valid(load_fleet(path))


@pytest.mark.timeout(300)
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


@pytest.mark.timeout(300)
@FUZZ
@given(text=st.text(max_size=300))
def test_any_text_as_a_fleet_file_is_refused_cleanly(text: str, tmp_path_factory: Any):
    path = tmp_path_factory.getbasetemp() / "text-fleet.toml"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    try:
        _accepted_and_valid(load_fleet(path))
    except FleetConfigError as refused:
        assert refused.problems


@pytest.mark.timeout(300)
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


# Found while fuzzing the fleet file; each must be refused, naming its key.
FLEET_GAPS = {
    # The filesystem's ENAMETOOLONG (an OSError) escapes the tokenizer check: a traceback.
    "tokenizer_path_too_long": ("tokenizer", "x" * 5000, "models[0].tokenizer"),
    # Accepted, then every cost computed from it takes minutes (a million-digit integer).
    "price_with_a_huge_exponent": ("input_per_mtok_usd", "1e999999", "input_per_mtok_usd"),
    # Accepted, then the cost raises decimal.InvalidOperation where an attempt is billed.
    "price_with_a_tiny_exponent": ("input_per_mtok_usd", "1e-99999999", "input_per_mtok_usd"),
}


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


@pytest.mark.parametrize("where", ["value", "path"])
def test_fleet_check_prints_brackets_as_text(where: str, tmp_path: Path):
    # Rich reads "[/x]" as a closing tag and raises MarkupError: a traceback, exit 1.
    document = _smallest_valid_fleet()
    path = tmp_path / "fleet.toml"
    if where == "value":
        document["models"][0]["tokenizer"] = "models/[/x]"
    else:
        path = tmp_path / "[" / "x]" / "fleet.toml"  # a folder path that reads "[/x]"
        path.parent.mkdir(parents=True)
        document["tenants"][0]["tier"] = 9
    path.write_text(toml_document(document), encoding="utf-8")
    result = CliRunner().invoke(app, ["fleet", "check", str(path)])
    assert result.exit_code == 2 and "[/x]" in result.output, result.output


# ---- requests to the simulator ---------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Plan a three step task."}]


@pytest.fixture(scope="module")
def simulator() -> Iterator[SimServer]:
    """A simulated vLLM server of its own, so fuzzing leaves the shared one's cache alone."""
    with SimServer(sim_settings()) as server:
        yield server


def _post(server: SimServer, path: str, body: Any) -> httpx.Response:
    # Bytes go as they are; anything else as JSON (NaN and Infinity included, as Python
    # writes them: a client can send them).
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        return client.post(path, content=content, headers={"content-type": "application/json"})


def _assert_openai_answer(response: httpx.Response, *, stream: bool) -> None:
    """A result (200) or vLLM's error body with a client-error status; never a 5xx."""
    assert response.status_code in (200, 400, 404), response.text
    if response.status_code != 200:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str) and error["code"] == response.status_code
        return
    if stream:
        assert response.text.rstrip().endswith("data: [DONE]"), response.text[-200:]
    else:
        assert response.json()["choices"]


def _chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": SIM_MODEL, "messages": HELLO, "max_tokens": 4, **fields}


BAD_REQUESTS: dict[str, tuple[str, Any, int, str]] = {
    # case: (path, body, status, words in the message)
    "not_json": (CHAT, b"{not json", 400, "JSON decode error"),
    "empty_body": (CHAT, b"", 400, "JSON decode error"),
    "json_nested_too_deeply": (CHAT, b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
    "array_body": (CHAT, [1, 2], 400, "valid dictionary"),
    "messages_not_a_list": (CHAT, _chat_body(messages="hello"), 400, "body.messages"),
    "message_without_role": (CHAT, _chat_body(messages=[{"content": "hi"}]), 400, "role"),
    "role_not_a_string": (CHAT, _chat_body(messages=[{"role": 3, "content": "x"}]), 400, "role"),
    "content_not_text": (CHAT, _chat_body(messages=[{"role": "user", "content": 5}]), 400, "str"),
    "negative_max_tokens": (CHAT, _chat_body(max_tokens=-5), 400, "at least 1"),
    "zero_max_completion_tokens": (CHAT, _chat_body(max_completion_tokens=0), 400, "at least 1"),
    "max_tokens_as_float": (CHAT, _chat_body(max_tokens=5.5), 400, "body.max_tokens"),
    "huge_max_tokens": (CHAT, _chat_body(max_tokens=10**30), 400, "max_model_len"),
    "unknown_model": (CHAT, _chat_body(model="gpt-17"), 404, "does not exist"),
    "model_not_a_string": (CHAT, _chat_body(model=5), 400, "body.model"),
    "huge_n": (CHAT, _chat_body(n=10**9), 400, "n=1"),
    "nan_temperature": (CHAT, _chat_body(temperature=math.nan), 400, "finite"),
    "infinite_temperature": (CHAT, _chat_body(temperature=math.inf), 400, "finite"),
    "negative_temperature": (CHAT, _chat_body(temperature=-1), 400, "non-negative"),
    "top_p_above_one": (CHAT, _chat_body(top_p=7), 400, "top_p"),
    "seed_beyond_64_bits": (CHAT, _chat_body(seed=2**64), 400, "64-bit"),
    "negative_min_tokens": (CHAT, _chat_body(min_tokens=-1), 400, "min_tokens"),
    "min_tokens_over_max": (CHAT, _chat_body(min_tokens=9), 400, "min_tokens"),
    "stop_not_text": (CHAT, _chat_body(stop=5), 400, "body.stop"),
    "schema_with_huge_min_length": (
        CHAT,
        _chat_body(guided_json={"type": "string", "minLength": 10**9}),
        400,
        "smallest document",
    ),
    "schema_sizes_that_multiply_through_refs": (
        CHAT,
        _chat_body(
            guided_json={
                "$defs": {
                    "row": {"type": "array", "minItems": 100, "items": {"$ref": "#/$defs/cell"}},
                    "cell": {"type": "array", "minItems": 100, "items": {"type": "integer"}},
                },
                "type": "array",
                "minItems": 100,
                "items": {"$ref": "#/$defs/row"},
            }
        ),
        400,
        "smallest document",
    ),
    "schema_size_not_a_number": (
        CHAT,
        _chat_body(guided_json={"type": "array", "minItems": "x"}),
        400,
        "minItems must be a whole number",
    ),
    "schema_integer_multiple_of_a_fraction": (
        CHAT,
        _chat_body(guided_json={"type": "integer", "multipleOf": 0.5}),
        400,
        "ZeroDivisionError",
    ),
    "schema_ref_loop": (
        CHAT,
        _chat_body(guided_json={"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
        400,
        "loops",
    ),
    "prompt_not_text": (COMPLETIONS, {"model": SIM_MODEL, "prompt": 5}, 400, "body.prompt"),
    "token_id_out_of_vocabulary": (
        COMPLETIONS,
        {"model": SIM_MODEL, "prompt": [10**30]},
        400,
        "out of vocabulary",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_to_the_simulator_gets_an_openai_error(case: str, simulator: SimServer):
    path, body, status, words = BAD_REQUESTS[case]
    response = _post(simulator, path, body)
    assert response.status_code == status, response.text
    _assert_openai_answer(response, stream=False)
    assert words in response.json()["error"]["message"]


def test_simulator_still_serves_after_the_bad_requests(simulator: SimServer):
    response = _post(simulator, CHAT, _chat_body())
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 4


JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**20), max_value=10**20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.integers(min_value=-5, max_value=100), max_size=3),
    st.dictionaries(st.text(max_size=6), st.integers(), max_size=2),
)
SIZES = st.one_of(st.integers(min_value=-2, max_value=40), st.just(10**9), JSON_VALUES)
SCHEMA_LEAF = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(
            ["string", "integer", "number", "boolean", "array", "object", "null", "bogus"]
        )
        | JSON_VALUES,
        "minLength": SIZES,
        "maxLength": SIZES,
        "minItems": SIZES,
        "maxItems": SIZES,
        "minProperties": SIZES,
        "minimum": SIZES,
        "maximum": SIZES,
        "multipleOf": st.sampled_from([0.5, 1e-300, 3]) | SIZES,
        "enum": st.lists(JSON_VALUES, max_size=3),
        "format": st.sampled_from(["date", "uuid", "email", "nonsense"]),
        "$ref": st.sampled_from(["#", "#/$defs/a", "#/nope", "http://example.com/s"]),
    },
)
SCHEMAS = st.recursive(
    SCHEMA_LEAF,
    lambda inner: st.builds(
        lambda leaf, nested: {**leaf, **nested},
        SCHEMA_LEAF,
        st.fixed_dictionaries(
            {},
            optional={
                "items": inner,
                "properties": st.dictionaries(st.text(max_size=4), inner, max_size=3),
                "required": st.lists(st.text(max_size=4), max_size=2),
                "anyOf": st.lists(inner, max_size=2),
                "$defs": st.fixed_dictionaries({"a": inner}),
            },
        ),
    ),
    max_leaves=6,
)
CHAT_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from([SIM_MODEL, "gpt-17", ""]) | JSON_VALUES,
    "messages": st.lists(
        st.fixed_dictionaries(
            {},
            optional={
                "role": st.sampled_from(["system", "user", "assistant", "tool"]) | JSON_VALUES,
                "content": st.text(max_size=40) | JSON_VALUES,
            },
        ),
        max_size=3,
    )
    | JSON_VALUES,
    "max_tokens": st.integers(min_value=-3, max_value=1100) | SIZES,
    "max_completion_tokens": st.integers(min_value=-3, max_value=64) | SIZES,
    "n": st.integers(min_value=-3, max_value=10**9) | JSON_VALUES,
    "temperature": JSON_VALUES,
    "top_p": JSON_VALUES,
    "seed": st.integers(min_value=-(2**70), max_value=2**70) | JSON_VALUES,
    "stop": st.lists(st.text(max_size=3), max_size=3) | JSON_VALUES,
    "stream": st.booleans() | JSON_VALUES,
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": JSON_VALUES, "continuous_usage_stats": JSON_VALUES}
    )
    | JSON_VALUES,
    "min_tokens": SIZES,
    "ignore_eos": JSON_VALUES,
    "add_generation_prompt": JSON_VALUES,
    "continue_final_message": JSON_VALUES,
    "guided_json": SCHEMAS | JSON_VALUES,
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "yaml"])},
        optional={"json_schema": st.fixed_dictionaries({"schema": SCHEMAS | JSON_VALUES})},
    )
    | JSON_VALUES,
}
"""For each field of a chat request: good values, wrong values and values of the wrong type."""


@st.composite
def chat_requests(draw: st.DrawFn) -> dict[str, Any]:
    """A valid chat request with one to four fields changed or removed."""
    body = _chat_body()
    for name in draw(st.sets(st.sampled_from(sorted(CHAT_FIELDS)), min_size=1, max_size=4)):
        if name in body and draw(st.integers(min_value=0, max_value=5)) == 0:
            del body[name]
        else:
            body[name] = draw(CHAT_FIELDS[name])
    return body


@pytest.mark.timeout(300)
@settings(FUZZ, max_examples=150)
@given(body=chat_requests())
def test_simulator_answers_any_chat_request_or_refuses_it_with_a_400(
    body: dict[str, Any], simulator: SimServer
):
    response = _post(simulator, CHAT, body)
    stream = body.get("stream") is True and response.status_code == 200
    _assert_openai_answer(response, stream=stream)


@pytest.mark.timeout(300)
@settings(FUZZ, max_examples=40)
@given(
    body=st.one_of(
        st.binary(max_size=60),
        st.fixed_dictionaries(
            {"model": st.just(SIM_MODEL)},
            optional={
                "prompt": st.text(max_size=30)
                | st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=4)
                | st.lists(st.text(max_size=5), max_size=3)
                | st.lists(st.lists(st.integers(min_value=-5, max_value=70_000), max_size=3))
                | JSON_VALUES,
                "max_tokens": SIZES,
                "echo": JSON_VALUES,
            },
        ),
    )
)
def test_simulator_answers_any_completion_request_or_refuses_it_with_a_400(
    body: Any, simulator: SimServer
):
    _assert_openai_answer(_post(simulator, COMPLETIONS, body), stream=False)


# ---- `kvflow report` arguments ---------------------------------------------------------------


@pytest.fixture(scope="module")
def empty_ledger(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A migrated SQLite ledger with no rows: every valid report is empty and exits 0."""
    url = f"sqlite:///{tmp_path_factory.mktemp('ledger') / 'ledger.db'}"
    with connect_ledger(url, create=True) as ledger:
        ledger.migrate()
    return url


REPORT_MISTAKES: dict[str, tuple[list[str], str]] = {
    # case: (arguments, words in the message)
    "empty_since": (["--since", ""], "--since is empty"),
    "blank_until": (["--until", "  "], "--until is empty"),
    # An unset shell variable must not widen a report to every tenant.
    "empty_tenant": (["--tenant", ""], "--tenant is empty"),
    "since_not_a_date": (["--since", "last tuesday"], "not an ISO date"),
    "until_not_a_date": (["--until", "2025-13-01"], "not an ISO date"),
    "empty_range": (["--since", "2025-03-05", "--until", "2025-03-04"], "empty range"),
    "until_past_the_calendar": (["--until", "9999-12-31"], "reaches past 9999-12-31"),
    "until_past_the_calendar_in_utc": (
        ["--until", "9999-12-31T23:00-05:00"],
        "reaches past 9999-12-31",
    ),
    "since_before_the_calendar_in_utc": (
        ["--since", "0001-01-01T00:00+05:00"],
        "outside the years 1 to 9999",
    ),
    "brackets_in_a_date": (["--since", "[/x]"], "'[/x]' is not an ISO date"),
    "unknown_format": (["--format", "xml"], "xml"),
    "unknown_group_by": (["--group-by", "tenant,colour"], "unknown group-by field 'colour'"),
}


@pytest.mark.parametrize("case", sorted(REPORT_MISTAKES))
def test_report_argument_mistake_exits_2_with_a_message(case: str, empty_ledger: str):
    arguments, words = REPORT_MISTAKES[case]
    result = CliRunner().invoke(app, ["report", "--db", empty_ledger, *arguments])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert words in " ".join(result.output.split()), result.output


def test_report_on_a_path_with_brackets_names_it_as_typed(tmp_path: Path):
    missing = tmp_path / "[/x]" / "ledger.db"
    result = CliRunner().invoke(app, ["report", "--db", f"sqlite:///{missing}"])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert "[/x]" in result.output


REPORT_TEXT = st.one_of(
    st.text(max_size=30),
    st.dates().map(str),
    st.datetimes(timezones=st.none() | st.timezones()).map(lambda t: t.isoformat()),
    st.sampled_from(["0001-01-01", "9999-12-31", "9999-12-31T23:59:59-12:00", "[/x]", "[bold]"]),
)


@pytest.mark.timeout(300)
@settings(FUZZ, max_examples=100)
@given(
    since=st.none() | REPORT_TEXT,
    until=st.none() | REPORT_TEXT,
    tenant=st.none() | st.text(max_size=12),
    output_format=st.none() | st.sampled_from(["table", "csv", "json", "html", "JSON", "pdf", ""]),
)
def test_report_arguments_either_report_or_exit_2_without_a_traceback(
    since: str | None,
    until: str | None,
    tenant: str | None,
    output_format: str | None,
    empty_ledger: str,
):
    arguments = ["report", "--db", empty_ledger]
    for option, value in (
        ("--since", since),
        ("--until", until),
        ("--tenant", tenant),
        ("--format", output_format),
    ):
        if value is not None:
            arguments += [option, value]
    result = CliRunner().invoke(app, arguments)
    assert result.exit_code in (0, 2), (arguments, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        arguments,
        result.exception,
    )
    if result.exit_code == 2:
        assert "error" in result.output.lower() or "invalid value" in result.output.lower()

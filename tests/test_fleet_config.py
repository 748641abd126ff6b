"""`fleet.toml` validation and `kvflow fleet check`."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from decimal import Decimal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvflow.cli.main import app
from kvflow.scheduler.fleet import TokenPrices, task_queue_for
from kvflow.workers.config import FleetConfigError, load_fleet

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "fleet.toml"
KVFLOW = Path(sys.executable).parent / "kvflow"


def _example_with(edit: str) -> str:
    """The example fleet file with one textual edit applied (`old => new`)."""
    old, new = edit.split(" => ")
    text = EXAMPLE.read_text()
    assert old in text, f"{old!r} not in the example"
    return text.replace(old, new, 1)


BROKEN: dict[str, tuple[str, str, str]] = {
    # case: (edit of the example, key path named, words in the message)
    "unknown_gpu": ('gpu = "L4" => gpu = "V100"', "pools[2].gpu", "'L4'"),
    "duplicate_pool": ('name = "h100" => name = "h200"', "pools[1].name", "duplicate name 'h200'"),
    "tier_out_of_range": ("tier = 5 => tier = 7", "tenants[2].tier", "less than or equal to 5"),
    "negative_price": (
        'input_per_mtok_usd = "0.10" => input_per_mtok_usd = "-0.10"',
        "pools[2].token_prices.input_per_mtok_usd",
        "greater than or equal to 0",
    ),
    "endpoint_not_url": (
        'endpoints = "simulated" => endpoints = ["not a url", "http://10.0.0.2:8000"]',
        "pools[0].endpoints[0]",
        "URL",
    ),
    "endpoints_count": (
        'endpoints = "simulated" => endpoints = ["http://10.0.0.1:8000"]',
        "pools[0]",
        "endpoints lists 1 URL(s) but replicas is 2",
    ),
    "unknown_warm_model": (
        'warm_models = ["llama-3.2-1b"] => warm_models = ["mistral-7b"]',
        "pools[2].warm_models[0]",
        "unknown model 'mistral-7b'",
    ),
    "unknown_fallback": (
        'fallback = "llama-3.2-1b" => fallback = "tiny"',
        "models[0].fallback",
        "unknown model 'tiny'",
    ),
    "misspelled_key": (
        "max_concurrency = 6 => max_concurency = 6",
        "pools[2].max_concurency",
        "unknown key",
    ),
    # A key with a character the terminal would not show is named in Python's escapes.
    "invisible_character_in_key": (
        'max_concurrency = 6 => "max_concurrency\\f" = 6',
        "pools[2].'max_concurrency\\x0c'",
        "unknown key",
    ),
    "missing_prices": (
        '[pools.token_prices]\ninput_per_mtok_usd = "0.10" => [pools.token_price]\n'
        'input_per_mtok_usd = "0.10"',
        "pools[2].token_prices",
        "missing",
    ),
    "kv_events_count": (
        'warm_models = ["llama-3.2-1b"] => warm_models = ["llama-3.2-1b"]\nkv_events = ["ipc:///k"]',
        "pools[2]",
        "kv_events lists 1 endpoint(s) but replicas is 2",
    ),
    "zero_replicas": (
        "replicas = 2 => replicas = 0",
        "pools[0].replicas",
        "greater than or equal to 1",
    ),
    "bad_pool_name": ('name = "l4" => name = "L4 pool"', "pools[2].name", "should match pattern"),
    "bad_address": (
        'address = "127.0.0.1:7233" => address = "http://127.0.0.1"',
        "temporal.address",
        "should match pattern",
    ),
    "zero_weight": (
        "fairness_weight = 1.0 => fairness_weight = 0",
        "tenants[2].fairness_weight",
        "greater than 0",
    ),
}


def test_example_fleet_is_valid_and_names_its_task_queues():
    fleet = load_fleet(EXAMPLE)
    assert [p.name for p in fleet.pools] == ["h200", "h100", "l4"]
    assert {p.gpu.value for p in fleet.pools} == {"H200", "H100", "L4"}
    assert fleet.pool("h200").replica_names() == ["h200/0", "h200/1"]
    assert task_queue_for("h200", 1) == "kvflow.gpu.h200.1"
    assert fleet.tenant("acme").tier == 1
    assert fleet.pool("l4").price_per_gpu_hour_usd == Decimal("0.80")


def test_attempt_cost_is_exact_integer_micro_dollars():
    prices = TokenPrices(
        input_per_mtok_usd=Decimal("0.20"),
        cached_input_per_mtok_usd=Decimal("0.02"),
        output_per_mtok_usd=Decimal("0.60"),
    )
    # 3,000 uncached x 0.20 + 1,000 cached x 0.02 + 500 out x 0.60 = 600 + 20 + 300 micro-dollars
    assert prices.cost_micros(4_000, 1_000, 500) == 920
    with pytest.raises(ValueError, match="cached_tokens"):
        prices.cost_micros(10, 11, 0)


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_fleet_file_names_the_key_and_the_problem(case: str, tmp_path: Path):
    edit, key_path, words = BROKEN[case]
    path = tmp_path / f"{case}.toml"
    path.write_text(_example_with(edit))
    with pytest.raises(FleetConfigError) as caught:
        load_fleet(path)
    problems = caught.value.problems
    matching = [p for p in problems if p.key_path == key_path]
    assert matching, f"no problem at {key_path}: {[str(p) for p in problems]}"
    assert any(words in p.message for p in matching), [str(p) for p in matching]
    assert all(p.file == path for p in problems)


def test_every_problem_is_reported_at_once(tmp_path: Path):
    text = EXAMPLE.read_text().replace("tier = 5", "tier = 0").replace('gpu = "L4"', 'gpu = "X"')
    path = tmp_path / "two.toml"
    path.write_text(text)
    with pytest.raises(FleetConfigError) as caught:
        load_fleet(path)
    assert {p.key_path for p in caught.value.problems} == {"tenants[2].tier", "pools[2].gpu"}


def test_fallback_loop_is_refused(tmp_path: Path):
    text = EXAMPLE.read_text().replace(
        "context_length = 32768\n\n[[pools]]",
        'context_length = 32768\nfallback = "llama-3.1-8b"\n\n[[pools]]',
    )
    path = tmp_path / "loop.toml"
    path.write_text(text)
    with pytest.raises(FleetConfigError, match="fallback chain loops"):
        load_fleet(path)


def test_fleet_check_prints_the_fleet_and_exits_0():
    result = CliRunner().invoke(app, ["fleet", "check", str(EXAMPLE)])
    assert result.exit_code == 0, result.output
    for word in ("h200", "H100", "L4", "llama-3.1-8b", "acme", "is valid", "6 replicas"):
        assert word in result.output


def test_fleet_check_masks_credentials_in_endpoint_urls(tmp_path: Path):
    text = EXAMPLE.read_text()
    first = 'endpoints = "simulated"'
    assert first in text
    path = tmp_path / "credentials.toml"
    path.write_text(
        text.replace(
            first,
            'endpoints = ["http://ops:s3cret-pw@10.0.0.5:8000", "http://10.0.0.6:8000"]',
            1,
        )
    )
    result = CliRunner().invoke(app, ["fleet", "check", str(path)])
    assert result.exit_code == 0, result.output
    # The operator sees which endpoint, never its password.
    assert "http://ops:***@10.0.0.5" in result.output and "10.0.0.6:8000" in result.output
    assert "s3cret" not in result.output


def test_fleet_check_exits_2_listing_every_error_without_traceback(tmp_path: Path):
    path = tmp_path / "bad.toml"
    path.write_text(_example_with("tier = 5 => tier = 9").replace('gpu = "L4"', 'gpu = "T4"'))
    # A real process, so the exit code is the one a shell sees.
    done = subprocess.run(
        [str(KVFLOW), "fleet", "check", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "tenants[2].tier" in done.stderr
    assert "pools[2].gpu" in done.stderr
    assert "2 problems" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


@pytest.mark.parametrize(
    ("content", "words"),
    [(None, "no such file"), ("[[pools]\nname=", "not valid TOML")],
)
def test_fleet_check_on_missing_or_unparsable_file(content: str | None, words: str, tmp_path: Path):
    path = tmp_path / "fleet.toml"
    if content is not None:
        path.write_text(content)
    result = CliRunner().invoke(app, ["fleet", "check", str(path)])
    assert result.exit_code == 2
    assert words in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_example_is_plain_toml():
    # The example parses with the standard library alone, so other tools can read it.
    assert "pools" in tomllib.loads(EXAMPLE.read_text())

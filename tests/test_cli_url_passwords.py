"""A password in a ledger or endpoint URL never reaches the output of a `kvflow` command.

Users paste passwords as they are, not percent-encoded: `S3cr%t!pw`, `my secret`, quotes,
`päss`, and `@`, `/` or `#`, which cut a URL in the wrong place. Drivers then refuse the URL
and quote the password in their error (psycopg: `invalid percent-encoded token: "S3cr%t!pw"`),
or connect elsewhere and quote a piece of it as a host. Each kind of password here goes to
every command that takes a URL, against the real Temporal dev server and PostgreSQL; the
command must fail with a message, exit non-zero without a traceback, and print no part of
the password in any form, nor log one.

Each password is two random tokens around its special characters, and the output is searched
for each token: a password quoted whole, percent-encoded, or cut into a host and a path is
found. So that the search is proven able to find a token, each URL also carries a control
token where kvflow rightly prints it (the database name, the endpoint's path).
"""

from __future__ import annotations

import logging
import secrets
import uuid
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict
from temporalio.testing import WorkflowEnvironment
from typer.testing import CliRunner

from kvflow.cli.main import app
from kvflow.ledger import open_ledger
from kvflow.scheduler.redact import encode_password, redact_url, scrub_secrets
from kvflow.workers.config import EXAMPLE_FLEET

runner = CliRunner()

PASSWORD_KINDS = {
    "percent and bang": "{a}%t!{b}",
    "spaces": "{a} with spaces {b}",
    "quotes": "{a}'\"{b}",
    "non-ASCII": "{a}pässwört€{b}",
    "at sign": "{a}@{b}",
    "slash": "{a}/{b}",
    "hash": "{a}#{b}",
    "at then query mark": "{a}@{b}?more{b}",
}
"""Passwords as users write them; `{a}` and `{b}` are the tokens searched for."""

AMBIGUOUS_PASSWORD_KINDS = {
    "at then query mark": "{a}@{b}?more{b}",
    "at, query mark and key=value": "{a}@{b}?k{b}=v",
}
"""Passwords that read as a user-info, a host and a query: `{b}` may be taken for a host."""


def _token() -> str:
    return f"tok{secrets.token_hex(5)}"


class Canary:
    """A password of one kind, and the tokens that betray it in any form."""

    def __init__(self, kind: str, kinds: dict[str, str] = PASSWORD_KINDS) -> None:
        self.a, self.b = _token(), _token()
        self.password = kinds[kind].format(a=self.a, b=self.b)

    def found_in(self, text: str) -> list[str]:
        """The tokens of the password that `text` holds."""
        return [token for token in (self.a, self.b) if token in text]


def _fleet_file(tmp_path: Path, address: str) -> Path:
    text = EXAMPLE_FLEET.read_text(encoding="utf-8")
    old = 'address = "127.0.0.1:7233"'
    assert old in text
    path = tmp_path / "fleet.toml"
    path.write_text(text.replace(old, f'address = "{address}"', 1), encoding="utf-8")
    return path


def _output(result: Any) -> str:
    return str(result.stdout) + str(result.stderr)


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in `tmp_path` (workers write spools and state there) with no Temporal overrides."""
    monkeypatch.chdir(tmp_path)
    for variable in ("TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE", "KVFLOW_LEDGER_URL"):
        monkeypatch.delenv(variable, raising=False)
    return tmp_path


@pytest.mark.timeout(10)
def test_psycopg_quotes_a_password_it_cannot_parse() -> None:
    """The control: the driver's own message holds the password, so the search can fail."""
    canary = Canary("percent and bang")
    with pytest.raises(psycopg.ProgrammingError) as refused:
        psycopg.connect(f"postgresql://postgres:{canary.password}@127.0.0.1:5432/test")
    assert canary.found_in(str(refused.value)) == [canary.a, canary.b]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind", list(PASSWORD_KINDS))
def test_drivers_read_the_password_as_written_and_messages_lose_it(kind: str) -> None:
    canary = Canary(kind)
    url = f"postgresql://postgres:{canary.password}@127.0.0.1:5432/db?sslmode=disable"
    # libpq's own parser finds the password, host and database the user meant.
    parsed = conninfo_to_dict(encode_password(url))
    assert (parsed["password"], parsed["host"], parsed["dbname"]) == (
        canary.password,
        "127.0.0.1",
        "db",
    )
    endpoint = encode_password(f"http://kvflow:{canary.password}@10.0.0.5:8000")
    assert (httpx.URL(endpoint).password, httpx.URL(endpoint).host) == (canary.password, "10.0.0.5")
    assert redact_url(url) == "postgresql://postgres:***@127.0.0.1:5432/db?sslmode=disable"
    quoted = f'invalid token: "{canary.password}" in {url} ({encode_password(url)})'
    assert canary.found_in(scrub_secrets(quoted, url)) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", list(AMBIGUOUS_PASSWORD_KINDS))
def test_report_prints_no_part_of_a_password_holding_at_then_a_query_mark(
    kind: str, in_tmp: Path
) -> None:
    canary = Canary(kind, AMBIGUOUS_PASSWORD_KINDS)
    control = f"ctl{uuid.uuid4().hex[:10]}"
    url = f"postgresql://postgres:{canary.password}@127.0.0.1:1/{control}"  # nothing listens
    result = runner.invoke(app, ["report", "--db", url])
    output = _output(result)
    assert result.exit_code != 0, output
    assert "postgres:***@127.0.0.1:1/" + control in output, output
    assert canary.found_in(output) == [], output
    assert "Traceback" not in output, output


@pytest.mark.timeout(10)
def test_a_driver_quoting_a_piece_of_the_url_loses_the_password_in_it() -> None:
    url = "postgresql://postgres:secret@part?more@127.0.0.1:1/test"
    message = 'invalid URI query parameter: "more@127.0.0.1:1/test"; host "part"; port "1"'
    assert scrub_secrets(message, url) == 'invalid URI query parameter: "***"; host "***"; port "1"'


@pytest.mark.postgres
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["percent and bang", "slash", "hash", "at then query mark"])
def test_ledger_migrate_connects_with_a_password_written_unencoded(
    kind: str, in_tmp: Path, postgres_server_url: str, postgres_schema_prefix: str
) -> None:
    canary = Canary(kind)
    user, server = postgres_server_url.removeprefix("postgresql://").split("@", 1)
    schema = f"{postgres_schema_prefix}_pw_{uuid.uuid4().hex[:8]}"
    url = f"postgresql://{user}:{canary.password}@{server}?schema={schema}"
    result = runner.invoke(app, ["ledger", "migrate", "--db", url])
    assert result.exit_code == 0, _output(result)
    assert "postgres:***@" in result.stdout
    assert canary.found_in(_output(result)) == []
    # In the schema the URL names: the password did not swallow the rest of the URL.
    with psycopg.connect(postgres_server_url) as conn:
        [(found,)] = conn.execute("SELECT to_regclass(%s)", (f"{schema}.schema_version",))
    assert found is not None


@pytest.mark.postgres
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", list(PASSWORD_KINDS))
def test_password_in_a_url_is_in_no_command_output_or_log(
    kind: str,
    in_tmp: Path,
    temporal_env: WorkflowEnvironment,
    postgres_server_url: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.DEBUG)
    canary = Canary(kind)
    fleet = str(_fleet_file(in_tmp, temporal_env.client.service_client.config.target_host))
    server = postgres_server_url.rsplit("@", 1)[1].split("/", 1)[0]

    def ledger(control: str) -> str:
        # A database that does not exist: the command fails after the driver read the URL.
        return f"postgresql://postgres:{canary.password}@{server}/kvflow_absent_{control}"

    def endpoint(control: str) -> str:
        return f"http://kvflow:{canary.password}@127.0.0.1:9/{control}"  # nothing listens

    sqlite = f"sqlite:///{in_tmp}/ledger.db"
    open_ledger(sqlite, migrate=True).close()
    worker = ("--fleet", fleet, "--context-dir", str(in_tmp / "context"))
    gpu = ("worker", "gpu", "--replica", "h100/0", *worker)
    c = [f"ctl{uuid.uuid4().hex[:10]}" for _ in range(9)]
    invocations: list[tuple[str, list[str], dict[str, str], str]] = [
        ("report --db", ["report", "--db", ledger(c[0])], {}, c[0]),
        ("report", ["report"], {"KVFLOW_LEDGER_URL": ledger(c[1])}, c[1]),
        ("ledger migrate", ["ledger", "migrate", "--db", ledger(c[2])], {}, c[2]),
        (
            "ledger reconcile",
            ["ledger", "reconcile", "--fleet", fleet, "--db", ledger(c[3])],
            {},
            c[3],
        ),
        (
            "worker gpu --ledger",
            [*gpu, "--endpoint", "http://127.0.0.1:9", "--ledger", ledger(c[4])],
            {},
            c[4],
        ),
        (
            "worker gpu --endpoint",
            [*gpu, "--endpoint", endpoint(c[5]), "--ledger", sqlite],
            {},
            c[5],
        ),
        (
            "worker workflow --ledger",
            ["worker", "workflow", *worker, "--ledger", ledger(c[6])],
            {},
            c[6],
        ),
        (
            "worker workflow --endpoint",  # a replica the fleet does not have
            ["worker", "workflow", *worker, "--endpoint", f"nosuch/0={endpoint(c[7])}"],
            {},
            c[7],
        ),
        ("demo --endpoints", ["demo", "--endpoints", endpoint(c[8])], {}, c[8]),
    ]
    for name, args, env, control in invocations:
        with monkeypatch.context() as patch:
            for variable, value in env.items():
                patch.setenv(variable, value)
            result = runner.invoke(app, args)
        output = _output(result)
        assert result.exit_code != 0, f"{name} did not fail\n{output}"
        assert control in output, f"{name}: the output lacks the URL's control token\n{output}"
        assert canary.found_in(output) == [], f"{name} printed the password\n{output}"
        assert isinstance(result.exception, SystemExit), f"{name}: {result.exception!r}"
        assert "Traceback" not in output, f"{name}\n{output}"
        assert result.stderr.startswith("error:"), f"{name}\n{output}"
    assert canary.found_in(caplog.text) == []

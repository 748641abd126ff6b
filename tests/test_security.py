"""Security: what kvflow keeps secret, and what keeps one tenant's work from another's.

- The Temporal API key, read from the variable that `[temporal] api_key_env` names, only
  authenticates the client: it is in no log line, workflow history, search attribute, ledger
  row or context-store file, and the CLI names the variable, never its value. (kvflow sends no
  key to vLLM servers: a pool's endpoints are plain URLs, so there is no second key to plant.)
- A report for one tenant holds that tenant's rows only, on SQLite and PostgreSQL, through the
  API and `kvflow report --tenant`; a tenant name made of SQL is data, stored and reported
  verbatim. fleet.toml refuses such a name, since tenants become parts of task queue names.
- The context store opens content hashes only (no `../`, no absolute path), and a tenant's
  content only for that tenant, through `Agent.read` and through a GPU worker's model call.
- The Temporal UI's filters (visibility queries on kvflow's search attributes) list a tenant's
  tasks only.

That a prompt above the claim-check threshold never enters history in full is proven by
`tests/test_claim_check.py::test_large_prompt_and_structured_answer_stay_out_of_history`; that
an engine's error cannot bring it back, by `tests/test_engine_error_text_capped.py`; that a
ledger or endpoint password, whatever characters it holds, shows in no command's output or
log, by `tests/test_cli_url_passwords.py`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import sqlite3
import tomllib
import uuid
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from temporalio.client import Client, WorkflowExecution, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.service import TLSConfig
from typer.testing import CliRunner

from kvflow.activities.context_store import (
    TENANTS_DIR,
    ContextKeyInvalid,
    ContextNotFound,
    DirectoryContextStore,
    tenant_folder,
)
from kvflow.activities.wire import INLINE_LIMIT_BYTES, ContextGet, ContextRef
from kvflow.cli.main import app
from kvflow.ledger import Ledger, ReportQuery, TaskOutcome, open_ledger
from kvflow.ledger.export import report_json
from kvflow.workers.config import (
    EXAMPLE_FLEET,
    FleetConfigError,
    TemporalConnection,
    load_fleet,
)
from kvflow.workers.gpu_worker import connect
from kvflow.workflows import errors, search_attributes
from tests import agent_workflows as wf
from tests.fixtures_ledger import attempt_record, task_record
from tests.stacks import MODEL, PoolPlan, cheap_pool_that_crashes, fleet_stack, task_spec

runner = CliRunner()

SECRET_VAR = "KVFLOW_TEST_TEMPORAL_API_KEY"
"""The variable the test fleet's `[temporal] api_key_env` names."""
SQL_TENANT = "x'; DROP TABLE attempts; --"
LONG_SYSTEM_PROMPT = "You are a careful research agent who cites every source. " * 60
VISIBILITY_WAIT_S = 30.0
"""How long the dev server's visibility store may lag behind a workflow's last upsert."""


@pytest.fixture
def canary(monkeypatch: pytest.MonkeyPatch) -> str:
    """A unique API key in `SECRET_VAR`; the Temporal variables that would override the file are
    cleared so that the test fleet's [temporal] table is what connects."""
    value = f"kvflow-canary-{secrets.token_hex(12)}"
    monkeypatch.setenv(SECRET_VAR, value)
    for overriding in ("TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE"):
        monkeypatch.delenv(overriding, raising=False)
    return value


def _fleet_file(tmp_path: Path, address: str, *, tenant: str = "acme") -> Path:
    """The example fleet with a [temporal] table that reads its key from `SECRET_VAR`.

    TLS is off because the dev server speaks plain gRPC (and ignores the key it is sent); a
    Temporal Cloud fleet leaves `tls` out or sets `[temporal.tls]`.
    """
    text = EXAMPLE_FLEET.read_text(encoding="utf-8")
    for old, new in (
        ('address = "127.0.0.1:7233"', f'address = "{address}"'),
        (
            'api_key_env = "TEMPORAL_API_KEY"',
            f'api_key_env = "{SECRET_VAR}"\ntls = {{ disabled = true }}',
        ),
        ('name = "acme"', f"name = {json.dumps(tenant)}"),
    ):
        assert old in text, old
        text = text.replace(old, new, 1)
    path = tmp_path / f"fleet-{uuid.uuid4().hex[:8]}.toml"
    path.write_text(text, encoding="utf-8")
    return path


def _cli_output(result: Any) -> str:
    return str(result.stdout) + str(result.stderr)


def _files_holding(root: Path, secret: str) -> tuple[list[Path], list[Path]]:
    """Every file under `root`, and those whose bytes hold `secret`."""
    files = [p for p in root.rglob("*") if p.is_file()]
    return files, [p for p in files if secret.encode() in p.read_bytes()]


def _sqlite_rows_holding(path: Path, secret: str) -> tuple[list[str], list[str]]:
    """The tables of the SQLite file at `path`, and those with a row that holds `secret`."""
    with sqlite3.connect(path) as db:
        tables = [n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        holding = [
            t for t in tables if secret in repr(db.execute(f'SELECT * FROM "{t}"').fetchall())
        ]
    return tables, holding


# ---- the Temporal API key -----------------------------------------------------------------------


def test_cli_names_the_api_key_variable_never_its_value(
    canary: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    fleet = _fleet_file(tmp_path, "127.0.0.1:1")  # nothing listens there
    # The key is read: it is what the client authenticates with.
    assert load_fleet(fleet).temporal.connect_config()["api_key"] == canary

    checked = runner.invoke(app, ["fleet", "check", str(fleet)])
    assert checked.exit_code == 0, _cli_output(checked)
    assert f"API key from ${SECRET_VAR}" in checked.stdout

    # Commands that connect with the key say where they could not connect, without the key.
    ledger_url = f"sqlite:///{tmp_path}/ledger.db"
    open_ledger(ledger_url, migrate=True).close()
    reconcile = runner.invoke(
        app, ["ledger", "reconcile", "--fleet", str(fleet), "--db", ledger_url]
    )
    assert reconcile.exit_code == 1, _cli_output(reconcile)
    assert "cannot reach Temporal at 127.0.0.1:1" in reconcile.stderr
    gpu = runner.invoke(
        app,
        [
            *("worker", "gpu", "--replica", "h100/0", "--fleet", str(fleet)),
            *("--ledger", ledger_url, "--endpoint", "http://127.0.0.1:9"),
            *("--context-dir", str(tmp_path / "context")),
        ],
    )
    assert gpu.exit_code == 1, _cli_output(gpu)
    assert "cannot reach Temporal at 127.0.0.1:1" in gpu.stderr

    for result in (checked, reconcile, gpu):
        assert canary not in _cli_output(result)
    assert canary not in caplog.text


def test_documented_security_example_connects_with_tls_and_the_named_key(canary: str) -> None:
    page = Path(__file__).resolve().parent.parent / "docs" / "operators" / "security.md"
    # The security page's one fleet-file example with a [temporal] table.
    [table] = [
        parsed["temporal"]
        for block in re.findall(r"```toml\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)
        if "temporal" in (parsed := tomllib.loads(block))
    ]
    connection = TemporalConnection.model_validate({**table, "api_key_env": SECRET_VAR})
    assert table["api_key_env"] == "TEMPORAL_API_KEY" and connection.tls is not None
    config = connection.connect_config()
    assert config["api_key"] == canary
    assert isinstance(config["tls"], TLSConfig)
    assert config["tls"].domain == table["tls"]["server_name"]


@pytest.mark.timeout(240)
async def test_api_key_stays_out_of_logs_histories_attributes_and_the_ledger(
    canary: str,
    temporal_client: Client,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG)
    target = temporal_client.service_client.config.target_host
    config = load_fleet(_fleet_file(tmp_path, target))
    # Connected as a GPU worker connects: the fleet's [temporal] table, the key from the env.
    client = await connect(config, tmp_path / "context")
    assert client.service_client.config.api_key == canary
    assert client.namespace == temporal_client.namespace

    async with fleet_stack(client, tmp_path, cheap_pool_that_crashes()) as s:
        handles = [
            # A stream cut by a crash and resumed elsewhere (the code that logs warnings and
            # errors runs too), with a system prompt large enough for the context store.
            await s.start(
                wf.MultiStepAgent.run,
                wf.StepsInput(spec=task_spec(), model=MODEL, steps=2, context=LONG_SYSTEM_PROMPT),
            ),
            await s.start(
                wf.StructuredVerdict.run,
                wf.VerdictInput(spec=task_spec(tenant="globex", expected_steps=1), model=MODEL),
            ),
        ]
        for handle in handles:
            await handle.result()
        histories = [(await h.fetch_history()).to_json() for h in handles]
        descriptions = [await h.describe() for h in handles]
        rows = []
        for handle, description in zip(handles, descriptions, strict=True):
            run_id = description.run_id or ""
            attempts = await s.ledger.attempts_for(handle.id, run_id)
            task = await s.ledger.task(handle.id, run_id)
            assert attempts and task is not None  # there was something to leak into
            rows.append((attempts, task))

    for history in histories:
        assert canary not in history
    for description in descriptions:
        assert description.typed_search_attributes.get(search_attributes.TENANT)
        raw = description.raw_description.workflow_execution_info.search_attributes
        assert canary not in str(raw) and canary not in repr(description.typed_search_attributes)
    assert canary not in repr(rows)

    # The ledger database, every table; then every byte of every file the stack wrote (the
    # ledger and its write-ahead log, the context store's claim-checked payloads and answers).
    tables, holding = _sqlite_rows_holding(tmp_path / "ledger.db", canary)
    assert {"attempts", "tasks"} <= set(tables) and holding == []
    files, holding_files = _files_holding(tmp_path, canary)
    assert {"ledger.db"} <= {p.name for p in files}
    assert any("context" in p.parts for p in files)
    assert holding_files == []

    # Every log line: Python's (workflow and activity loggers, kvflow's) and the native core's.
    assert caplog.records
    assert canary not in caplog.text
    captured = capfd.readouterr()
    assert canary not in captured.out and canary not in captured.err


# ---- tenant isolation in the ledger -------------------------------------------------------------

TENANTS = ["acme", "globex", SQL_TENANT, "acme%", 'o\'brien "quoted" \\ ;']
"""Plain names, one made of SQL, one that a LIKE filter would widen, quotes and a backslash."""


def _fill_one_task_per_tenant(ledger: Ledger) -> dict[str, int]:
    """One succeeded task with one attempt per tenant; returns each tenant's spend."""
    spend: dict[str, int] = {}
    for i, tenant in enumerate(TENANTS):
        attempt = attempt_record(f"wf-{i}", tenant=tenant, completion_tokens=100 * (i + 1))
        assert ledger.record_attempt(attempt)
        ledger.record_task(task_record(f"wf-{i}", tenant=tenant, spend_micros=attempt.cost_micros))
        spend[tenant] = attempt.cost_micros
    return spend


def _report_rows(ledger: Ledger, tenant: str | None = None) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = json.loads(
        report_json(ledger.report(ReportQuery.parse("tenant", tenant=tenant)))
    )["rows"]
    return rows


def test_report_for_a_tenant_holds_its_rows_only_and_sql_in_a_name_is_data(
    ledger: Ledger,
) -> None:
    spend = _fill_one_task_per_tenant(ledger)
    for tenant in TENANTS:
        by_api = _report_rows(ledger, tenant)
        cli = runner.invoke(
            app,
            [
                *("report", "--db", ledger.url, "--group-by", "tenant"),
                *("--tenant", tenant, "--format", "json"),
            ],
        )
        assert cli.exit_code == 0, _cli_output(cli)
        assert json.loads(cli.stdout)["rows"] == by_api
        [row] = by_api
        assert row["tenant"] == tenant and row["tasks"] == 1
        assert row["total_spend_usd"] == f"{spend[tenant] / 1_000_000:.6f}"

    # Nothing was dropped or widened: every tenant is still there, verbatim, with its rows.
    assert sorted(r["tenant"] for r in _report_rows(ledger)) == sorted(TENANTS)
    for i, tenant in enumerate(TENANTS):
        [attempt] = ledger.attempts_for(f"wf-{i}", "run-1")
        task = ledger.task(f"wf-{i}", "run-1")
        assert attempt.tenant == tenant and task is not None and task.tenant == tenant
    assert _report_rows(ledger, "nobody") == []


def test_fleet_refuses_a_tenant_name_made_of_sql(tmp_path: Path) -> None:
    fleet = _fleet_file(tmp_path, "127.0.0.1:7233", tenant=SQL_TENANT)
    with pytest.raises(FleetConfigError) as refused:
        load_fleet(fleet)
    [problem] = refused.value.problems
    assert problem.key_path == "tenants[0].name"
    assert "^[a-z0-9][a-z0-9-]*$" in problem.message  # the rule it breaks

    checked = runner.invoke(app, ["fleet", "check", str(fleet)])
    assert checked.exit_code == 2
    assert "tenants[0].name" in checked.stderr
    assert "Traceback" not in _cli_output(checked)


# ---- the context store --------------------------------------------------------------------------


def test_context_store_opens_content_hashes_only(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = DirectoryContextStore(root)
    store.put("warm the store up " * 200, tenant="acme")
    outside = tmp_path / "outside.txt"
    outside.write_text("not the store's", encoding="utf-8")
    before = outside.stat().st_mtime_ns
    forged = [
        "../outside.txt",
        "../../" + "0" * 58,
        str(outside),  # an absolute path
        "/" + "0" * 63,
        "A" * 64,  # a digest is lower-case hex
        "g" * 64,
        "0" * 63,
        "",
    ]
    for key in forged:
        with pytest.raises(ContextKeyInvalid, match="is not a SHA-256 digest"):
            store.get_bytes(key)
        for tenant in (None, "acme"):
            ref = ContextRef.model_construct(digest=key, size=1, preview="", tenant=tenant)
            with pytest.raises(ContextKeyInvalid, match="is not a SHA-256 digest"):
                store.get(ref, tenant)
        # The wire types refuse it before any store sees it (an activity's input is validated).
        with pytest.raises(ValidationError, match="digest"):
            ContextGet.model_validate({"ref": {"digest": key, "size": 1}, "tenant": "acme"})
    # Callers that handle missing content (the control plane: a permanent error) refuse it too.
    assert issubclass(ContextKeyInvalid, ContextNotFound)
    assert outside.read_text(encoding="utf-8") == "not the store's"
    assert outside.stat().st_mtime_ns == before

    # Tenant names are not paths: whatever the name, its content lands in a folder of its own.
    odd = ["../..", "/etc", "..", SQL_TENANT]
    for tenant in odd:
        ref = store.put(f"{tenant}'s notes " * 200, tenant=tenant)
        assert store.get(ref, tenant).startswith(f"{tenant}'s notes")
    assert {p.name for p in tmp_path.iterdir()} == {"store", "outside.txt"}
    for path in root.rglob("*"):
        parts = path.relative_to(root).parts
        assert ".." not in parts and (len(parts) <= 2 or parts[0] == TENANTS_DIR), parts
    folders = {p.name for p in (root / TENANTS_DIR).iterdir()}
    assert folders == {tenant_folder(t) for t in ["acme", *odd]}


def _cause(failure: WorkflowFailureError) -> ApplicationError:
    cause = failure.cause
    assert isinstance(cause, ApplicationError), cause
    return cause


async def _failure_of(handle: WorkflowHandle[Any, Any]) -> WorkflowFailureError:
    try:
        await handle.result()
    except WorkflowFailureError as failure:
        return failure
    raise AssertionError(f"{handle.id} did not fail")


@pytest.mark.timeout(180)
async def test_a_tenants_context_does_not_open_in_another_tenants_task(
    temporal_client: Client, tmp_path: Path
) -> None:
    marker = f"acme-private-{secrets.token_hex(8)}"
    text = f"{marker} quarterly figures " * 200
    assert len(text.encode()) > INLINE_LIMIT_BYTES
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("solo")]) as s:
        ref = DirectoryContextStore(tmp_path / "context").put(text, tenant="acme")

        async def read(
            tenant: str, ref: ContextRef, model: str | None = None
        ) -> WorkflowHandle[Any, Any]:
            spec = task_spec(tenant=tenant, expected_steps=1)
            return await s.start(wf.ReadContext.run, wf.ReadInput(spec=spec, ref=ref, model=model))

        own = await read("acme", ref)
        assert await own.result() == text

        strangers = [
            await read("globex", ref),  # the reference as acme's history holds it
            await read("globex", ref.model_copy(update={"tenant": None})),  # its digest alone
            await read("globex", ref.model_copy(update={"tenant": "globex"})),  # claimed as own
        ]
        causes = [_cause(await _failure_of(handle)) for handle in strangers]
        assert all(c.type == errors.TaskErrorType.CONTEXT_NOT_FOUND for c in causes), causes
        assert "belongs to another tenant than 'globex'" in causes[0].message

        # Passed to a model call, placement refuses it for the task's tenant: not even its
        # token count is read, and no replica is asked (nothing is spent).
        in_a_call = await read("globex", ref, model=MODEL)
        call_failure = await _failure_of(in_a_call)
        histories = [(await h.fetch_history()).to_json() for h in [*strangers, in_a_call]]
        billed = await s.ledger.attempts_for(in_a_call.id, in_a_call.result_run_id or "")

    refused = _cause(call_failure)
    assert refused.type == errors.TaskErrorType.CONTEXT_NOT_FOUND, refused
    assert "belongs to another tenant than 'globex'" in refused.message
    assert billed == []
    for history in histories:
        assert marker not in history


# ---- what an operator's filter sees -------------------------------------------------------------


async def _listed(client: Client, query: str, want: set[str]) -> list[WorkflowExecution]:
    """The closed runs `query` lists, once they include `want` (visibility lags the close)."""
    closed = f"({query}) AND ExecutionStatus != 'Running'"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + VISIBILITY_WAIT_S
    while True:
        found = [w async for w in client.list_workflows(closed)]
        if {w.id for w in found} >= want or loop.time() > deadline:
            return found
        await asyncio.sleep(0.2)


@pytest.mark.timeout(180)
async def test_ui_filter_on_kvflow_tenant_lists_that_tenants_tasks_only(
    temporal_client: Client, tmp_path: Path
) -> None:
    handles: dict[str, list[WorkflowHandle[Any, Any]]] = {t: [] for t in ("acme", "globex")}
    handles[SQL_TENANT] = []
    async with fleet_stack(temporal_client, tmp_path, [PoolPlan("solo")]) as s:
        for tenant in ["acme", "acme", "globex", SQL_TENANT]:
            task = wf.StepsInput(
                spec=task_spec(tenant=tenant, expected_steps=1), model=MODEL, steps=1
            )
            handle = await s.start(wf.MultiStepAgent.run, task)
            handles[tenant].append(handle)
            if tenant != SQL_TENANT:
                await handle.result()
        # A tenant the fleet does not know is refused before any model call.
        [refused] = handles[SQL_TENANT]
        failure = _cause(await _failure_of(refused))
        assert failure.type == errors.TaskErrorType.INVALID_TASK, failure
        refused_row = await s.ledger.task(refused.id, (await refused.describe()).run_id or "")

        mine = f'TaskQueue = "{s.task_queue}"'
        for tenant, started in handles.items():
            ids = {h.id for h in started}
            # As the Temporal UI sends it; the name goes in double quotes (it holds a ').
            query = f'{mine} AND {search_attributes.TENANT.name} = "{tenant}"'
            listed = await _listed(s.client, query, ids)
            assert {w.id for w in listed} == ids, (tenant, [w.id for w in listed])
            for execution in listed:
                attributes = execution.typed_search_attributes
                assert attributes.get(search_attributes.TENANT) == tenant
                outcome = attributes.get(search_attributes.OUTCOME)
                assert outcome == ("failed" if tenant == SQL_TENANT else "succeeded"), outcome
        paid = {h.id for h in handles["acme"] + handles["globex"]}
        query = (
            f"{mine} AND {search_attributes.OUTCOME.name} = 'succeeded' "
            f"AND {search_attributes.SPEND_MICROS.name} > 0"
        )
        assert {w.id for w in await _listed(s.client, query, paid)} == paid

    # The refused task's row keeps its tenant verbatim.
    assert refused_row is not None and refused_row.tenant == SQL_TENANT
    assert refused_row.outcome is TaskOutcome.FAILED

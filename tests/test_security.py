"""Security: what keeps one tenant's work from another's.

- The context store opens content hashes only (no `../`, no absolute path), and a tenant's
  content only for that tenant, through `Agent.read` and through a GPU worker's model call.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError

from kvflow.activities.context_store import (
    TENANTS_DIR,
    ContextKeyInvalid,
    ContextNotFound,
    DirectoryContextStore,
    tenant_folder,
)
from kvflow.activities.wire import INLINE_LIMIT_BYTES, ContextGet, ContextRef
from kvflow.workflows import errors
from tests import agent_workflows as wf
from tests.test_workflows import MODEL, PoolPlan, _spec, stack

SQL_TENANT = "x'; DROP TABLE attempts; --"


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
    async with stack(temporal_client, tmp_path, [PoolPlan("solo")]) as s:
        ref = DirectoryContextStore(tmp_path / "context").put(text, tenant="acme")

        async def read(
            tenant: str, ref: ContextRef, model: str | None = None
        ) -> WorkflowHandle[Any, Any]:
            spec = _spec(tenant=tenant, expected_steps=1)
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

        # Passed to a model call, the GPU worker refuses it for the task's tenant too.
        in_a_call = await read("globex", ref, model=MODEL)
        call_failure = await _failure_of(in_a_call)
        histories = [(await h.fetch_history()).to_json() for h in [*strangers, in_a_call]]

    refused = _cause(call_failure)
    assert refused.type == errors.TaskErrorType.STEP_FAILED, refused
    assert "ContextNotFound on solo/0" in refused.message
    assert "belongs to another tenant than 'globex'" in refused.message
    for history in histories:
        assert marker not in history

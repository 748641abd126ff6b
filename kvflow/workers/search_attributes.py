"""Make sure kvflow's search attributes exist before any workflow upserts them.

Upserting an attribute the namespace does not know fails the workflow task over and over: the
workflow hangs instead of failing. So the workflow worker checks at start, registers what is
missing, and refuses to start with a clear message when it cannot.
"""

from __future__ import annotations

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import (
    AddSearchAttributesRequest,
    ListSearchAttributesRequest,
)
from temporalio.client import Client
from temporalio.service import RPCError

from kvflow.workflows.search_attributes import ALL as SEARCH_ATTRIBUTES


class SearchAttributesMissing(Exception):
    """kvflow's search attributes are not registered and could not be registered."""


async def ensure_search_attributes(client: Client) -> list[str]:
    """Register the missing kvflow search attributes; return the names that were added."""
    namespace = client.namespace
    try:
        # A read, so safe to retry: the SDK retries only transient codes (a server busy under
        # load), and a worker must not refuse to start over one dropped call.
        listed = await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=namespace), retry=True
        )
    except RPCError as exc:
        raise SearchAttributesMissing(
            f"cannot list the search attributes of namespace {namespace!r}: {exc.message}"
        ) from None
    known = {**listed.system_attributes, **listed.custom_attributes}
    missing: dict[str, IndexedValueType.ValueType] = {}
    for key in SEARCH_ATTRIBUTES:
        wanted = IndexedValueType.ValueType(int(key.indexed_value_type))
        have = known.get(key.name)
        if have is None:
            missing[key.name] = wanted
        elif have != wanted:
            raise SearchAttributesMissing(
                f"search attribute {key.name} exists in namespace {namespace!r} with type "
                f"{IndexedValueType.Name(have)}, kvflow needs {IndexedValueType.Name(wanted)}; "
                "rename or remove the existing attribute"
            )
    if not missing:
        return []
    try:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(namespace=namespace, search_attributes=missing)
        )
    except RPCError as exc:
        names = ", ".join(f"{n}={IndexedValueType.Name(t)}" for n, t in missing.items())
        raise SearchAttributesMissing(
            f"kvflow's search attributes are missing in namespace {namespace!r} ({names}) and "
            f"registering them failed: {exc.message}. Register them with `temporal operator "
            "search-attribute create` (Temporal Cloud: `tcld namespace search-attributes add`)"
        ) from None
    return sorted(missing)

"""Adapters for agent frameworks that already run on Temporal.

Each submodule lets agents written for one framework's Temporal integration run on kvflow
unchanged but for the worker's plugins: their model calls are placed, resumed and billed by
`kvflow.Agent`. A submodule imports its framework, so it is imported only by name (and needs
that framework's extra, e.g. `pip install 'kvflow[openai-agents]'`); `import kvflow` imports
none of them.
"""

from __future__ import annotations

from temporalio.worker import WorkerConfig

KVFLOW_PLUGIN_NAME = "kvflow"
"""`KvflowPlugin().name()`: how an adapter finds kvflow's plugin without importing the layer
of processes above it."""


def require_kvflow_worker(config: WorkerConfig, plugin: str) -> None:
    """Refuse a workflow worker without `KvflowPlugin(fleet)`, naming the plugin to add.

    A framework plugin (`plugin`, as the user writes it) runs the model calls of its agents
    through `kvflow.Agent`, whose control-plane activities (placement, the ledger's task row)
    only `KvflowPlugin(fleet)` registers: without it every task would wait forever on them.
    It may sit on the worker or on its client.
    """
    if not config.get("workflows"):
        return  # an activity worker (e.g. for activity tools) runs no kvflow task
    plugins = [*config["client"].config()["plugins"], *(config.get("plugins") or ())]
    if any(_is_kvflow_worker_plugin(p) for p in plugins):
        return
    raise ValueError(
        f"{plugin} needs KvflowPlugin(fleet) on this worker, which runs kvflow's placement "
        f"and ledger activities: add it to the Worker's plugins or before {plugin} in its "
        "client's"
    )


def _is_kvflow_worker_plugin(plugin: object) -> bool:
    """Whether `plugin` is a `KvflowPlugin` that runs the control plane (fleet given)."""
    name = getattr(plugin, "name", None)
    return (
        callable(name)
        and name() == KVFLOW_PLUGIN_NAME
        and getattr(plugin, "control_plane", None) is not None
    )

"""Adapters for agent frameworks that already run on Temporal.

Each submodule lets agents written for one framework's Temporal integration run on kvflow
unchanged but for the worker's plugins: their model calls are placed, resumed and billed by
`kvflow.Agent`. A submodule imports its framework, so it is imported only by name (and needs
that framework's extra, e.g. `pip install 'kvflow[openai-agents]'`); `import kvflow` imports
none of them.
"""

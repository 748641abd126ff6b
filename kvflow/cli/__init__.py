"""The `kvflow` command: one module per command group, `main` puts them together."""

"""Deterministic, sandbox-safe workflow code: the step API, sagas, budgets and search attributes.

Nothing here does I/O; it is imported inside Temporal's workflow sandbox.
"""

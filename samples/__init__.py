"""Agent workflows to copy from: a research assistant, support triage with a saga, code review."""

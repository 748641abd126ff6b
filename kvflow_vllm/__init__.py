"""kvflow's extensions that run inside a vLLM server process.

This package is separate from `kvflow`: vLLM runs in its own environment, which has none of
kvflow's dependencies, and importing anything under `kvflow` runs `kvflow/__init__.py`, which
needs them. Modules here import only vLLM and the standard library, and this file imports
nothing, so finding the package (e.g. with `importlib.util.find_spec`) is safe anywhere.

- `kvflow_vllm.scheduler.TaskEndScheduler`: a vLLM V1 scheduler that reuses an ended task's
  own KV-cache blocks before any other cached block (`--scheduler-cls
  kvflow_vllm.scheduler.TaskEndScheduler`).
- `kvflow_vllm.scheduler.DeadlinePauseScheduler`: the same, and it pauses the requests of less
  urgent priority bands while a request with a deadline would miss it (`--scheduler-cls
  kvflow_vllm.scheduler.DeadlinePauseScheduler --scheduling-policy priority`).
"""

"""kvflow's processes: the `kvflow` CLI, the workers, the embedded dev stack, configuration."""

"""`python -m kvflow.simulator ...`: the `kvflow sim` commands without the rest of kvflow's CLI."""

from kvflow.cli.sim import main

main()

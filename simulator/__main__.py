"""`python -m simulator ...`: the `kvflow sim` commands without the rest of kvflow's CLI."""

from simulator.cli import main

main()

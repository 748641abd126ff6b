"""Benchmarks of kvflow's policies and overheads; each prints a table and can write JSON."""

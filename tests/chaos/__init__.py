"""The fault suite: kvflow's real processes, killed, stopped and broken while tasks run."""

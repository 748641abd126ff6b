"""`python -m tests.chaos.cli ARGS`: the `kvflow` command, with timestamped logs.

The fault suite runs every worker as its own process through this entry point. It is the CLI
unchanged (`kvflow.cli.main.main`); only logging is configured first, so that each process's
log says when its scheduler opened a circuit or its ledger reconnected, next to the output
the CLI prints.
"""

from __future__ import annotations

import logging

from kvflow.cli.main import main

if __name__ == "__main__":
    logging.basicConfig(
        level=logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Circuit transitions are logged at INFO (half-open) and WARNING (opened).
    logging.getLogger("kvflow").setLevel(logging.INFO)
    main()

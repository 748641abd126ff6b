"""The travel agent's activity tool: a flight search, run as a Temporal activity.

It answers from a small deterministic timetable so that the sample runs anywhere; a real
deployment calls its flight-search service here. As an activity it runs on the worker, outside
the workflow, with Temporal's timeouts and retries: the workflow gives it to the agent with
`activity_as_tool`, and the worker registers it like any activity.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from temporalio import activity

_CARRIERS = ["Aurora Air", "Blue Meridian", "Coastline", "Northwind"]


@activity.defn
async def find_flights(origin: str, destination: str, day: str) -> str:
    """Find flights from `origin` to `destination` on `day`: carrier, departure time and fare.

    Args:
        origin: the city the traveller leaves from.
        destination: the city the traveller flies to.
        day: the day of travel, e.g. "Friday" or "2026-03-14".

    """
    seed = hashlib.sha256(f"{origin}|{destination}|{day}".lower().encode()).digest()
    flights = [
        {
            "carrier": _CARRIERS[seed[i] % len(_CARRIERS)],
            "departs": f"{6 + seed[i + 3] % 14:02d}:{seed[i + 6] % 4 * 15:02d}",
            "fare_eur": 60 + seed[i + 9] % 240,
        }
        for i in range(3)
    ]
    return json.dumps(
        {"from": origin, "to": destination, "day": day, "flights": flights}, sort_keys=True
    )


ALL: list[Callable[..., Any]] = [find_flights]
"""The activities to register on the workflow worker."""

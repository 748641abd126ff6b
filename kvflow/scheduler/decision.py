"""The records of one placement decision: its constants, one replica's estimate, the filters.

`Decision` holds what one request asks, computed once per decision; `Estimate` is one replica
scored for it, filled in by the axes in pipeline order; `Filter` says why a replica was turned
down instead.

Both records are plain classes with their own `__init__`, not dataclasses or named tuples: in
the compiled build (`make compiled`) their constructors become C, where a dataclass's generated
`__init__` would still run as interpreted Python, and uncompiled they cost the same.
"""

from __future__ import annotations

import math
from enum import StrEnum

from kvflow.scheduler.fleet import ModelSpec
from kvflow.scheduler.placement import PlacementRequest


class Filter(StrEnum):
    """Why a replica was filtered out, in pipeline order.

    When nothing fits, the refusal reports the furthest filter any replica reached: "3 replicas
    too slow, 1 excluded" is a deadline problem, not an exclusion.
    """

    EXCLUDED = "excluded"
    """The request excludes the replica (e.g. it just failed)."""
    NOT_WARM = "not_warm"
    """The replica neither holds the model's weights nor may load them."""
    DOWN = "down"
    """The replica does not answer."""
    CIRCUIT_OPEN = "circuit_open"
    """Its circuit breaker is open, or its half-open probe slot is taken."""
    TOO_SMALL = "too_small"
    """The request does not fit the replica's whole KV cache."""
    MEMORY = "memory"
    """The replica's KV cache is too full: the request would preempt running calls."""
    DEADLINE = "deadline"
    """The call cannot finish within the step's share of the deadline."""
    SPEND = "spend"
    """The call would take the task over its spend cap."""


FILTER_ORDER: tuple[Filter, ...] = tuple(Filter)
"""The filters in pipeline order (definition order)."""


def cost_per_success(cost: float, at_risk: float, p_success: float) -> float:
    """(cost + at risk) / P(success): the expected price of one success; inf when p is 0."""
    if p_success <= 0.0:
        return math.inf
    return (cost + at_risk) / p_success


class Decision:
    """Per-request constants, computed once per decision."""

    __slots__ = (
        "admission_threshold",
        "block_hashes",
        "budget_micros",
        "budget_s",
        "excluded",
        "levels",
        "max_output",
        "model",
        "most_cached",
        "now",
        "output",
        "output_model",
        "previous",
        "prompt",
        "request",
        "spec",
        "spent",
        "tenant",
        "workflow_id",
    )

    def __init__(
        self,
        request: PlacementRequest,
        now: float,
        excluded: frozenset[int],
        previous: int,
        prompt: int,
        output: int,
        spent: int,
        budget_micros: int | None,
        block_hashes: list[int],
        workflow_id: str,
        tenant: str,
    ) -> None:
        self.request = request
        self.now = now
        self.admission_threshold = math.inf
        """The load fraction below which the call's tier is admitted (`Axis.accepts`)."""
        self.budget_s: float | None = None
        """The step's share of the task deadline; None without a deadline (`Axis.prepare`)."""
        self.excluded = excluded
        self.previous = previous
        """The replica id of the workflow's previous call, or -1."""
        self.prompt = prompt
        self.output = output
        """The output estimate for time and cost; `request.max_output_tokens` is the bound."""
        self.max_output = output
        """The request's `max_output_tokens`: the bound memory and context checks hold to."""
        self.output_model = ""
        """The model `output` was estimated for (`GpuGenerationAxis.expected_output`)."""
        self.spent = spent
        self.budget_micros = budget_micros
        self.block_hashes = block_hashes
        self.workflow_id = workflow_id
        self.tenant = tenant
        # Set by `Scheduler._for_model`, for the model being placed:
        self.spec: ModelSpec
        self.model: str
        """`spec.name`."""
        self.levels: list[tuple[int, int]]
        """The prompt's prefix holders: (depth in index entries, replica bit mask), deepest
        first."""
        self.most_cached: int
        """The most prompt tokens any replica has cached: the deepest holder's."""


class Estimate:
    """One replica scored for one decision; each axis fills in the fields it owns."""

    __slots__ = (
        "at_risk",
        "cached_tokens",
        "cold_load_s",
        "cost",
        "depth",
        "duration_s",
        "objective",
        "p_success",
        "queue_wait_s",
        "rid",
        "schedule_to_start_s",
        "ttft_s",
        "warm",
    )

    def __init__(self, rid: int, p_success: float) -> None:
        self.rid = rid
        self.p_success = p_success
        """P(success): the replica's static one (breaker), times P(on time)."""
        self.depth = 0
        """Prefix-index entries of the prompt the replica holds."""
        self.cached_tokens = 0
        self.warm = True
        self.cold_load_s = 0.0
        self.queue_wait_s = 0.0
        self.ttft_s = 0.0
        self.duration_s = 0.0
        self.cost = 0.0
        """Expected price of the call in µ$ (floats rank; the placement prices exactly)."""
        self.at_risk = 0.0
        """µ$ a failure would waste beyond the call itself (the task's sunk cost)."""
        self.objective = math.inf
        """Expected cost per successful call × the axes' factors: lower wins."""
        self.schedule_to_start_s = 0.0
        """Set on the chosen replica's estimate only (`Axis.finish`)."""

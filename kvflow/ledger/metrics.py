"""OpenTelemetry metrics for spend and tasks, recorded as the ledger writes rows.

A counter is increased only when a row is newly written, so a retried write does not count
twice. Point a `MeterProvider` with an OTLP (or Prometheus) exporter at them to chart spend in
the tool a team already uses. Instruments:

- `kvflow.ledger.spend` (`{micro_usd}`): attempt cost in micro-dollars, by `tenant`, `pool`
  and attempt `outcome` (ok, failed, cancelled, resumed_elsewhere).
- `kvflow.ledger.tasks` (`{task}`): closed tasks, by `tenant` and task `outcome`.
- `kvflow.ledger.task_spend` (`{micro_usd}`): the spend a closing task reports, by `tenant`
  and task `outcome`; its `failed` part is the wasted spend of failed tasks.
"""

from __future__ import annotations

from opentelemetry import metrics
from opentelemetry.metrics import Meter

from kvflow.ledger.records import AttemptRecord, TaskRecord

METER_NAME = "kvflow.ledger"
"""The instrumentation scope the ledger's instruments belong to."""


class LedgerMetrics:
    """The ledger's counters on one `Meter` (the global provider's by default)."""

    def __init__(self, meter: Meter | None = None) -> None:
        meter = meter or metrics.get_meter(METER_NAME)
        self._spend = meter.create_counter(
            "kvflow.ledger.spend",
            unit="{micro_usd}",
            description="Cost of model call attempts in micro-dollars, failed ones included",
        )
        self._tasks = meter.create_counter(
            "kvflow.ledger.tasks", unit="{task}", description="Closed tasks by outcome"
        )
        self._task_spend = meter.create_counter(
            "kvflow.ledger.task_spend",
            unit="{micro_usd}",
            description="Spend of closed tasks in micro-dollars, by task outcome",
        )

    def attempt_written(self, record: AttemptRecord) -> None:
        """Count a newly written attempt row."""
        self._spend.add(
            record.cost_micros,
            {"tenant": record.tenant, "pool": record.pool, "outcome": record.outcome.value},
        )

    def attempt_superseded(self, record: AttemptRecord, *, estimate_micros: int) -> None:
        """Count the exact row that replaced a provisional one of `estimate_micros`.

        A counter cannot go down, so only what the exact bill adds to the estimate is counted
        (under the exact row's labels); an estimate above the bill stays counted.
        """
        extra = record.cost_micros - estimate_micros
        if extra > 0:
            self._spend.add(
                extra,
                {"tenant": record.tenant, "pool": record.pool, "outcome": record.outcome.value},
            )

    def task_written(self, record: TaskRecord) -> None:
        """Count a newly written task row."""
        attributes = {"tenant": record.tenant, "outcome": record.outcome.value}
        self._tasks.add(1, attributes)
        self._task_spend.add(record.spend_micros, attributes)

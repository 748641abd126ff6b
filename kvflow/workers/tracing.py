"""Where the processes' OpenTelemetry spans and metrics go: nowhere (default), console, or OTLP.

Clients and workers use `temporalio.contrib.opentelemetry.TracingInterceptor`, so one trace
covers a task: the workflow, each placement, and each model call. A model call's span is a
child of its activity's span and follows OpenTelemetry's GenAI semantic conventions
(`kvflow.activities.gen_ai_telemetry`): it is named `chat <model>` or `text_completion <model>`
and carries `gen_ai.*` attributes (provider `vllm`, request and response model, input, cached
and output tokens, finish reasons) beside kvflow's own (replica, pool, tenant, cost, outcome).
The same exporter choice also sends metrics: the GenAI client histograms
(`gen_ai.client.token.usage`, `gen_ai.client.operation.duration`) and the ledger's counters.

`KVFLOW_TRACES` (`console`, `otlp`, `off`) or a command's `--traces` chooses the exporter; OTLP
reads the standard `OTEL_EXPORTER_OTLP_*` variables and needs the `otlp` extra. Metrics are
exported every `OTEL_METRIC_EXPORT_INTERVAL` milliseconds (60 000 by default).
"""

from __future__ import annotations

import os
import sys
from enum import StrEnum

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricExporter,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

TRACES_ENV = "KVFLOW_TRACES"


class TraceExport(StrEnum):
    """Where spans and metrics are exported."""

    CONSOLE = "console"
    OTLP = "otlp"
    OFF = "off"


class TracingError(Exception):
    """Tracing cannot be set up as asked (e.g. OTLP without the `otlp` extra)."""


def _one_line(span: ReadableSpan) -> str:
    # One line per span: a worker's stderr stays readable under load.
    duration_ms = ((span.end_time or 0) - (span.start_time or 0)) / 1e6
    attributes = " ".join(k + "=" + str(v) for k, v in (span.attributes or {}).items())
    trace_id = f"{span.context.trace_id:032x}"[:12] if span.context else "-"
    return f"span {span.name} {duration_ms:.1f} ms trace={trace_id} {attributes}\n"


def _metric_lines(data: MetricsData) -> str:
    # One line per data point, like spans: `metric <name> <attributes> count=… sum=…`.
    lines = []
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    attributes = " ".join(
                        k + "=" + str(v) for k, v in (point.attributes or {}).items()
                    )
                    figures = " ".join(
                        f"{name}={getattr(point, name)}"
                        for name in ("count", "sum", "value")
                        if hasattr(point, name)
                    )
                    lines.append(f"metric {metric.name} {attributes} {figures}\n")
    return "".join(lines)


def _exporters(choice: TraceExport) -> tuple[SpanExporter, MetricExporter]:
    if choice == TraceExport.OTLP:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                OTLPMetricExporter,
            )
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise TracingError(
                "OTLP export needs the otlp extra: pip install 'kvflow[otlp]'"
            ) from None
        return OTLPSpanExporter(), OTLPMetricExporter()
    return (
        ConsoleSpanExporter(out=sys.stderr, formatter=_one_line),
        ConsoleMetricExporter(out=sys.stderr, formatter=_metric_lines),
    )


def configure_tracing(export: TraceExport | None = None, *, service: str = "kvflow") -> None:
    """Install the global tracer and meter providers with the chosen exporter (once a process)."""
    choice = export or TraceExport(os.environ.get(TRACES_ENV, TraceExport.OFF.value))
    if choice == TraceExport.OFF:
        return
    span_exporter, metric_exporter = _exporters(choice)
    resource = Resource.create({"service.name": service})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(span_exporter))
    trace.set_tracer_provider(provider)
    metrics.set_meter_provider(
        MeterProvider(
            resource=resource, metric_readers=[PeriodicExportingMetricReader(metric_exporter)]
        )
    )

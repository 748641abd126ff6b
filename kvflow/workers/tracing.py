"""Where the processes' OpenTelemetry spans go: nowhere (default), the console, or OTLP.

Clients and workers use `temporalio.contrib.opentelemetry.TracingInterceptor`, so one trace
covers a task: the workflow, each placement, and each model call, whose `kvflow.infer` span
(model, replica, tokens, cached tokens, TTFT, cost) is a child of the activity's span.
`KVFLOW_TRACES` (`console`, `otlp`, `off`) or a command's `--traces` chooses the exporter; OTLP
reads the standard `OTEL_EXPORTER_OTLP_*` variables and needs the `otlp` extra.
"""

from __future__ import annotations

import os
import sys
from enum import StrEnum

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

TRACES_ENV = "KVFLOW_TRACES"


class TraceExport(StrEnum):
    """Where spans are exported."""

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


def configure_tracing(export: TraceExport | None = None, *, service: str = "kvflow") -> None:
    """Install the global tracer provider with the chosen exporter (once per process)."""
    choice = export or TraceExport(os.environ.get(TRACES_ENV, TraceExport.OFF.value))
    if choice == TraceExport.OFF:
        return
    exporter: SpanExporter
    if choice == TraceExport.OTLP:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise TracingError(
                "OTLP export needs the otlp extra: pip install 'kvflow[otlp]'"
            ) from None
        exporter = OTLPSpanExporter()
    else:
        exporter = ConsoleSpanExporter(out=sys.stderr, formatter=_one_line)
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)

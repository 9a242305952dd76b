"""Telemetry kept in memory: both sinks as production attaches them, with spans exported to a list.

For the bench and tests that want real metrics and real spans on our client without a collector: a
Prometheus sink on a fresh registry and an OpenTelemetry tracing observer whose spans land in an
in-memory exporter. Only ``metrics/`` imports ``prometheus_client`` and ``opentelemetry``, so the tools
get them from here.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from mooncake_lookout.connector.events import BackgroundObserver, LookupObserver
from mooncake_lookout.metrics.prometheus_sink import PrometheusSink
from mooncake_lookout.metrics.tracing import TracingObserver


def observers_with_telemetry(registry: Any = None, *, metrics: bool = True,
                             spans: bool = True) -> tuple[list[LookupObserver], Any]:
    """A Prometheus sink (fresh registry unless given) and an OTel tracing observer exporting to memory.

    Each runs behind a :class:`BackgroundObserver`, as in production: the scheduler's thread only enqueues.
    Returns the observers and the span exporter (so callers can count spans). The tracer provider is
    private: it never replaces a global one. ``metrics`` / ``spans`` pick the parts.
    """
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    observers: list[LookupObserver] = []
    if metrics:
        observers.append(BackgroundObserver(
            PrometheusSink(registry=registry if registry is not None else CollectorRegistry())))
    if spans:
        observers.append(BackgroundObserver(TracingObserver(provider.get_tracer("mooncake_lookout.bench"), provider)))
    return observers, exporter


__all__ = ["observers_with_telemetry"]

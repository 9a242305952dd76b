"""mooncake-lookout's telemetry: one catalogue of metric names, and the sinks that fill it.

* :mod:`.catalogue`: every metric name, help text, label and bucket, spelled once (outcomes come from
  :class:`mooncake_lookout.connector.events.Outcome`); everything else reads it;
* :mod:`.deployed`: what a deployment runs beside the scheduler: vLLM's stats from the client's step log once a
  step, spans for the lookups ``OTEL_TRACES_SAMPLER`` keeps (the adapter and the bench share it);
* :mod:`.vllm_stats`: the scheduler's figures through vLLM's own stats pipeline, on vLLM's ``/metrics``;
* :mod:`.prometheus_sink` and :mod:`.server_sink`: a plain ``prometheus_client`` registry for standalone
  processes (the lookup server, demo, bench), served by :mod:`.exporter`;
* :mod:`.tracing`: OpenTelemetry spans, configured by the standard ``OTEL_*`` variables;
* :mod:`.in_memory`: both sinks with spans kept in memory, for the bench and tests;
* :mod:`.sink_cost`: what each sink costs per lookup.

Inside vLLM, telemetry reads the client's step log once a step (:mod:`mooncake_lookout.connector.step_log`);
standalone sinks are observers of the lookup's events (:mod:`mooncake_lookout.connector.events`). Telemetry
never raises into the scheduler. Only this package imports ``prometheus_client`` and ``opentelemetry``.
Modules are imported on use (:mod:`.vllm_stats` imports vLLM).
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {"CATALOGUE": "catalogue", "DeployedTelemetry": "deployed", "LookupStatsCollector": "vllm_stats",
          "MetricsEndpoint": "exporter", "PrometheusSink": "prometheus_sink", "ServerMetrics": "server_sink",
          "TracingObserver": "tracing", "serve_metrics": "exporter", "tracing_observer_from_env": "tracing"}


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use (PEP 562), so importing the package stays cheap."""
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


__all__ = sorted(_HOMES)

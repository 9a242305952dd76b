"""The telemetry a deployment runs beside the scheduler: one definition, for vLLM's adapter and for the bench.

* vLLM's stats: :class:`~.vllm_stats.LookupStatsCollector` wraps the client's step log into vLLM's stats record
  at most every ``RECORD_EVERY_S`` and when the engine is about to go idle (vLLM serves it on its own
  ``/metrics``);
* spans, when ``OTEL_*`` turns them on: the client samples each lookup when it starts
  (:func:`~.tracing.sampler_from_env`: ``OTEL_TRACES_SAMPLER``, the request's own trace flags), and each
  step's sampled lookups go to a thread of their own at once, which builds their spans and exports them.

What it costs the scheduler's thread: an append per lookup that ends (the step log), a clock read a step, and
a raw record and one queue put for spans per ``RECORD_EVERY_S``. Nothing runs per event.
"""

from __future__ import annotations

import sys
from typing import Any

from mooncake_lookout.connector.events import BackgroundObserver
from mooncake_lookout.metrics.tracing import TracingObserver, sampler_from_env, tracing_observer_from_env
from mooncake_lookout.metrics.vllm_stats import LookoutLookupStats, LookupStatsCollector


class DeployedTelemetry:
    """vLLM's stats from ``client``'s step log and, with ``tracer``, spans for the lookups the sampler keeps."""

    def __init__(self, client: Any, tracer: TracingObserver | None = None) -> None:
        self.stats = LookupStatsCollector(client)
        self.tracer = tracer
        self._spans: BackgroundObserver | None = None
        if tracer is not None:
            self._spans = BackgroundObserver(tracer, name="lookout-tracing")
            client.sampler = sampler_from_env()

    @classmethod
    def from_env(cls, client: Any) -> DeployedTelemetry:
        """Spans as ``OTEL_*`` sets them (off when it does not ask for them)."""
        return cls(client, tracing_observer_from_env())

    def take(self, flush: bool = False) -> LookoutLookupStats | None:
        """vLLM's stats record, or ``None`` (called once a step; a record at most every ``RECORD_EVERY_S``, or
        at once with ``flush``); the lookups it ends that were sampled go to the tracing thread."""
        stats = self.stats.take(flush)
        if self._spans is not None and self.stats.sampled:
            self._spans.call(self.tracer.record_many, self.stats.sampled)  # type: ignore[union-attr]
        return stats

    def close(self) -> None:
        """Take what the step log still holds (its sampled lookups' spans would be lost), build what is queued,
        then flush and stop the span pipeline. Not at interpreter exit, when module globals are gone."""
        if self._spans is not None and self.tracer is not None:
            if not sys.is_finalizing():
                self.take(flush=True)
            self._spans.close()
            self.tracer.shutdown()


__all__ = ["DeployedTelemetry"]

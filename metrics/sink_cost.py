"""What telemetry costs per lookup: the same lifecycle through each sink, on vs off.

One lifecycle is what the client emits for a lookup that defers once: ``submitted``, ``started``,
``answered``, ``deferred``, ``consumed`` and one ``scheduler_call``, through an :class:`ObserverSet`
(as the client fans out). Every configuration runs the same loop, so the differences are the
sinks' own cost. Run: ``python -m mooncake_lookout.metrics.sink_cost [--lifecycles N] [--json]``.

Tracing "off" means the observer is not attached (``OTEL_TRACES_EXPORTER`` unset), i.e. the ``none``
row; ``tracing_unsampled`` is tracing on with a sampler that drops the lookup; ``tracing_sampled``
records every span into a ``BatchSpanProcessor`` whose exporter discards them (no network in the loop).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON
from prometheus_client import CollectorRegistry

from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.events import LookupObserver, LookupRecord, ObserverSet, Outcome
from mooncake_lookout.metrics.prometheus_sink import PrometheusSink
from mooncake_lookout.metrics.tracing import TracingObserver
from mooncake_lookout.metrics.vllm_stats import LookupStatsCollector

STEP_EVERY = 16  # lifecycles per scheduler step: the vLLM collector hands its record over this often


class _DiscardingExporter(SpanExporter):
    """Accepts spans and drops them: the cost measured is the SDK's, not a network's."""

    def export(self, spans: Sequence[object]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def _tracer(sampled: bool) -> TracingObserver:
    provider = TracerProvider(sampler=ALWAYS_ON if sampled else ALWAYS_OFF)
    provider.add_span_processor(BatchSpanProcessor(_DiscardingExporter()))  # SDK defaults, as OTEL_BSP_* leaves them
    return TracingObserver(provider.get_tracer("bench"), provider)


def configurations() -> dict[str, Callable[[], list[LookupObserver]]]:
    """Name -> a factory of the observers attached in that configuration."""
    config = LookupConfig(lookup_async=True)
    return {
        "none": lambda: [],
        "prometheus": lambda: [PrometheusSink(config, registry=CollectorRegistry())],
        "vllm_stats": lambda: [LookupStatsCollector()],
        "tracing_unsampled": lambda: [_tracer(sampled=False)],
        "tracing_sampled": lambda: [_tracer(sampled=True)],
        "all": lambda: [PrometheusSink(config, registry=CollectorRegistry()), LookupStatsCollector(),
                        _tracer(sampled=True)],
    }


def _run(observers: list[LookupObserver], lifecycles: int) -> float:
    """Seconds for ``lifecycles`` lookup lifecycles through ``observers``."""
    obs = ObserverSet(observers)
    collectors = [o for o in observers if isinstance(o, LookupStatsCollector)]
    perf = time.perf_counter
    hashes = [bytes(32)] * 8
    t0 = perf()
    for i in range(lifecycles):
        now = perf()
        rec = LookupRecord(f"req-{i}", 128, hashes, "pipelined", 0, now)
        obs.submitted(rec)
        rec.t_start = now
        obs.started(rec)
        rec.t_answer = now
        obs.answered(rec)
        rec.deferrals = 1
        obs.deferred(rec)
        rec.outcome, rec.hit_tokens, rec.t_consume = Outcome.HIT, 64, now
        obs.consumed(rec)
        obs.scheduler_call("async", 1e-5)
        if collectors and i % STEP_EVERY == 0:
            for c in collectors:
                c.take()
    return perf() - t0


def measure(lifecycles: int = 10_000, repeats: int = 3) -> dict[str, float]:
    """Median nanoseconds per lifecycle for each configuration (each repeat on fresh observers)."""
    out: dict[str, float] = {}
    for name, factory in configurations().items():
        samples = []
        for _ in range(repeats):
            observers = factory()
            samples.append(_run(observers, lifecycles) / lifecycles * 1e9)
            for o in observers:
                if isinstance(o, TracingObserver):
                    o.shutdown()
        out[name] = statistics.median(samples)
    return out


def render(results: dict[str, float]) -> str:
    """A Markdown table: configuration, ns per lifecycle, extra over ``none``."""
    base = results["none"]
    rows = ["| configuration | ns per lookup | added vs none |", "| --- | ---: | ---: |"]
    rows += [f"| {name} | {ns:,.0f} | {ns - base:+,.0f} |" for name, ns in results.items()]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Print the overhead table (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lifecycles", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    results = measure(args.lifecycles, args.repeats)
    print(json.dumps(results, indent=2) if args.json else render(results))
    return 0


__all__ = ["configurations", "main", "measure", "render"]

if __name__ == "__main__":
    raise SystemExit(main())

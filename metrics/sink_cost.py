"""What telemetry costs per lookup: the same lifecycle through each sink, on vs off.

One lifecycle is what the client does for a lookup that defers once and is answered: it counts the deferral,
adds the ended lookup to its step log, notes one scheduler call, and (with spans on) asks the sampler; every
``STEP_EVERY`` lifecycles a step ends and vLLM's stats record is taken from the log. ``prometheus`` is the
standalone processes' sink (``serve``, ``demo``), an event observer. Every configuration runs the same loop,
so the differences are the sinks' own cost. Run: ``python -m mooncake_lookout.metrics.sink_cost [--json]``.

Tracing "off" is the ``none`` row (no sampler, no spans); ``tracing_unsampled`` asks the sampler, which drops the
lookup (nothing more is done for it); ``tracing_sampled`` keeps every lookup and builds its spans (on the tracing
thread in a deployment, inline here, so their CPU is counted) into a ``BatchSpanProcessor`` whose exporter
discards them (no network in the loop).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from prometheus_client import CollectorRegistry

from mooncake_lookout.connector.client import LookupClient
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.events import LookupRecord, ObserverSet, Outcome
from mooncake_lookout.connector.transport.pipelined import PipelinedTransport
from mooncake_lookout.metrics.prometheus_sink import PrometheusSink
from mooncake_lookout.metrics.tracing import TracingObserver
from mooncake_lookout.metrics.vllm_stats import LookupStatsCollector

STEP_EVERY = 16  # lifecycles per scheduler step: vLLM takes its stats record this often


class _DiscardingExporter(SpanExporter):
    """Accepts spans and drops them: the cost measured is the SDK's, not a network's."""

    def export(self, spans: Sequence[object]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def _tracer() -> TracingObserver:
    provider = TracerProvider(sampler=ALWAYS_ON)
    provider.add_span_processor(BatchSpanProcessor(_DiscardingExporter()))  # SDK defaults, as OTEL_BSP_* leaves them
    return TracingObserver(provider.get_tracer("bench"), provider)


class _Setup:
    """One configuration: what the client carries, and what runs once a step."""

    def __init__(self, *, prometheus: bool = False, stats: bool = False, spans: bool | None = None) -> None:
        config = LookupConfig(lookup_async=True)
        # A client whose transport is never used (its socket is built on first send): the telemetry is what runs.
        self.client = LookupClient(config, PipelinedTransport("ipc:///nonexistent/sink-cost", timeout_s=0.1))
        if prometheus:
            self.client.observers.add(PrometheusSink(config, registry=CollectorRegistry()))
        self.stats = LookupStatsCollector(self.client) if stats else None
        self.tracer = _tracer() if spans else None
        if spans is not None:
            self.client.sampler = (lambda headers: True) if spans else (lambda headers: False)

    def step(self) -> None:
        if self.stats is not None:
            self.stats.take()
            if self.tracer is not None and self.stats.sampled:
                self.tracer.record_many(self.stats.sampled)
        elif self.tracer is not None and self.client.log is not None:
            self.tracer.record_many(self.client.take_log().sampled)

    def close(self) -> None:
        self.client.close()
        if self.tracer is not None:
            self.tracer.shutdown()


def configurations() -> dict[str, Callable[[], _Setup]]:
    """Name -> a factory of that configuration."""
    return {
        "none": _Setup,
        "prometheus": lambda: _Setup(prometheus=True),
        "vllm_stats": lambda: _Setup(stats=True),
        "tracing_unsampled": lambda: _Setup(spans=False),
        "tracing_sampled": lambda: _Setup(spans=True),
        "all": lambda: _Setup(prometheus=True, stats=True, spans=True),
    }


def _run(setup: _Setup, lifecycles: int) -> float:
    """Seconds for ``lifecycles`` lookup lifecycles through ``setup``."""
    client: Any = setup.client
    if setup.tracer is not None and setup.stats is None:
        client.take_log()  # spans alone still read the step's log
    ev: ObserverSet | None = client._ev
    perf = time.perf_counter
    hashes = [bytes(32)] * 8
    t0 = perf()
    for i in range(lifecycles):
        now = perf()
        rec = LookupRecord(f"req-{i}", 128, hashes, "pipelined", 0, now)
        if client.sampler is not None:
            rec.sampled = client.sampler(None)
        if ev is not None:
            ev.submitted(rec)
        rec.t_start = now
        rec.t_answer = now
        client._defer(rec)
        rec.outcome, rec.hit_length, rec.t_consume = Outcome.HIT, 64, now
        client._ended(rec)
        if ev is not None:
            ev.consumed(rec)
        client.scheduler_call("async", 1e-5)
        if i % STEP_EVERY == 0:
            setup.step()
    return perf() - t0


def measure(lifecycles: int = 10_000, repeats: int = 3) -> dict[str, float]:
    """Median nanoseconds per lifecycle for each configuration (each repeat on a fresh one)."""
    out: dict[str, float] = {}
    for name, factory in configurations().items():
        samples = []
        for _ in range(repeats):
            setup = factory()
            try:
                samples.append(_run(setup, lifecycles) / lifecycles * 1e9)
            finally:
                setup.close()
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

"""How the bench wires telemetry to our client: as production does, with every span recorded, or none.

Why: a cost measured with telemetry a deployment does not run (or without what it does run) is not the cost a
deployment pays. Inside vLLM, the scheduler adapter (``connector/scheduler_adapter.py``) attaches two things to
the client: vLLM's stats collector, inline (vLLM takes its step record once per step, through
``get_kv_connector_stats``), and, when ``OTEL_*`` asks for it, spans, built on a thread of their own and
exported over OTLP/HTTP. The Helm chart turns tracing on with a sampler (:data:`CHART_SAMPLER`, the chart's
``engine.tracing`` values; a test keeps the two equal). The bench's three wirings:

* :data:`PRODUCTION`: the stats collector inline, taken once per step, and spans sampled as the chart samples
  them, exported over OTLP/HTTP to a local endpoint (:mod:`.otlp_sink`), built by the same function the adapter
  calls (``tracing_observer_from_env``);
* :data:`ALWAYS_ON`: the same with every lookup's spans recorded (``parentbased_always_on``);
* :data:`NONE`: the bare client.

:class:`Wired` gives a client the step hook vLLM adds: its ``end_step`` also takes the stats collector's record.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

PRODUCTION = "production"
ALWAYS_ON = "always-on spans"
NONE = "no telemetry"
WIRINGS = (PRODUCTION, ALWAYS_ON, NONE)
# helm/mooncake-lookout/values.yaml, engine.tracing.sampler / samplerArg (tests/test_bench_wiring.py keeps them equal)
CHART_SAMPLER = ("parentbased_traceidratio", "0.1")
ALWAYS_ON_SAMPLER = ("parentbased_always_on", "")
_env_lock = threading.Lock()


def label(name: str, wiring: str) -> str:
    """A row's name: the client's, with the wiring after a comma unless it is production's."""
    return name if wiring == PRODUCTION else f"{name}, {wiring}"


def sampler_of(wiring: str) -> tuple[str, str]:
    """``(OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG)`` of a wiring with spans."""
    return ALWAYS_ON_SAMPLER if wiring == ALWAYS_ON else CHART_SAMPLER


def tracing_env(wiring: str, endpoint: str) -> dict[str, str]:
    """The ``OTEL_*`` variables the chart sets for tracing, with ``wiring``'s sampler and ``endpoint``."""
    sampler, arg = sampler_of(wiring)
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint, "OTEL_TRACES_SAMPLER": sampler}
    if arg:
        env["OTEL_TRACES_SAMPLER_ARG"] = arg
    return env


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` for the block (the OTel SDK reads its settings from there when built)."""
    with _env_lock:
        saved = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@dataclass
class Telemetry:
    """What one wiring attaches: the observers, the step hook vLLM runs, and what to close."""

    wiring: str
    observers: list[Any] = field(default_factory=list)
    per_step: Callable[[], Any] | None = None
    closers: list[Callable[[], Any]] = field(default_factory=list)

    def close(self) -> None:
        """Flush and stop the span pipeline (as the adapter's ``close`` does)."""
        for close in self.closers:
            close()


def telemetry(wiring: str) -> Telemetry:
    """The observers of ``wiring`` (see the module docstring); spans go to this process's :func:`.otlp_sink.shared`."""
    if wiring not in WIRINGS:
        raise ValueError(f"telemetry wiring must be one of {WIRINGS}, got {wiring!r}")
    if wiring == NONE:
        return Telemetry(wiring)
    from mooncake_lookout.connector.bench.otlp_sink import shared
    from mooncake_lookout.connector.events import BackgroundObserver
    from mooncake_lookout.metrics.tracing import tracing_observer_from_env
    from mooncake_lookout.metrics.vllm_stats import LookupStatsCollector

    stats = LookupStatsCollector()
    with _environment(tracing_env(wiring, shared().endpoint)):
        tracer = tracing_observer_from_env()
    if tracer is None:
        raise RuntimeError("tracing did not start with the chart's OTEL_* settings: see the log above")
    spans = BackgroundObserver(tracer, name="lookout-tracing")
    return Telemetry(wiring, [stats, spans], stats.take, [spans.close, tracer.shutdown])


class Wired:
    """Our client as vLLM drives it with telemetry on: the calls of the client, and an ``end_step`` that also
    takes the stats collector's step record (what vLLM's ``get_kv_connector_stats`` does once per step)."""

    def __init__(self, client: Any, tele: Telemetry) -> None:
        self.client = client
        self.telemetry = tele
        self.lookup = client.lookup
        self.start = client.start
        self.discard = client.discard
        end_step, take = client.end_step, tele.per_step

        def step() -> None:
            end_step()
            if take is not None:
                take()

        self.end_step = step

    def close(self) -> None:
        """Close the client, then the telemetry."""
        self.client.close()
        self.telemetry.close()

    def __getattr__(self, name: str) -> Any:  # anything else the client has (pending, observers, budget, ...)
        return getattr(self.client, name)


__all__ = ["ALWAYS_ON", "ALWAYS_ON_SAMPLER", "CHART_SAMPLER", "NONE", "PRODUCTION", "Telemetry", "WIRINGS", "Wired",
           "label", "sampler_of", "telemetry", "tracing_env"]

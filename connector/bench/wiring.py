"""How the bench wires telemetry to our client: as production does, with every span recorded, or none.

Why: a cost measured with telemetry a deployment does not run (or without what it does run) is not the cost a
deployment pays. Inside vLLM, the scheduler adapter (``connector/scheduler_adapter.py``) attaches two things to
the client: vLLM's stats collector, inline (vLLM takes its step record once per step, through
``get_kv_connector_stats``), and, when ``OTEL_*`` asks for it, spans, built on a thread of their own and
exported over OTLP/HTTP. The Helm chart turns tracing on with a sampler (:data:`CHART_SAMPLER`, the chart's
``engine.tracing`` values; a test keeps the two equal). The bench's three wirings:

* :data:`PRODUCTION`: vLLM's stats record made from the client's step log once per step, and spans for the
  lookups sampled as the chart samples them, exported over OTLP/HTTP to a local endpoint (:mod:`.otlp_sink`);
* :data:`ALWAYS_ON`: the same with every lookup's spans recorded (``parentbased_always_on``);
* :data:`NONE`: the bare client.

:class:`Wired` gives a client the step hook vLLM adds: its ``end_step`` also takes the step's stats record. The
telemetry itself is the adapter's (``metrics/deployed.py``), so the bench measures what vLLM runs.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
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


def attach(client: Any, wiring: str) -> Any:
    """``wiring``'s telemetry on ``client`` (the adapter's own :class:`~mooncake_lookout.metrics.deployed.
    DeployedTelemetry`), spans to this process's :func:`.otlp_sink.shared`; None for :data:`NONE`."""
    if wiring not in WIRINGS:
        raise ValueError(f"telemetry wiring must be one of {WIRINGS}, got {wiring!r}")
    if wiring == NONE:
        return None
    from mooncake_lookout.connector.bench.otlp_sink import shared
    from mooncake_lookout.metrics.deployed import DeployedTelemetry

    with _environment(tracing_env(wiring, shared().endpoint)):
        tele = DeployedTelemetry.from_env(client)
    if tele.tracer is None:
        raise RuntimeError("tracing did not start with the chart's OTEL_* settings: see the log above")
    return tele


class Wired:
    """Our client as vLLM drives it with ``wiring``'s telemetry: the calls of the client, and an ``end_step`` that
    also takes the step's stats record (what vLLM's ``get_kv_connector_stats`` does once per step)."""

    def __init__(self, client: Any, wiring: str) -> None:
        self.client = client
        self.telemetry = tele = attach(client, wiring)
        self.lookup = client.lookup
        self.start = client.start
        self.discard = client.discard
        end_step = client.end_step
        take = tele.take if tele is not None else None

        def step() -> None:
            end_step()
            if take is not None:
                take()

        self.end_step = step

    def close(self) -> None:
        """Close the client, then the telemetry."""
        self.client.close()
        if self.telemetry is not None:
            self.telemetry.close()

    def __getattr__(self, name: str) -> Any:  # anything else the client has (pending, observers, budget, ...)
        return getattr(self.client, name)


__all__ = ["ALWAYS_ON", "ALWAYS_ON_SAMPLER", "CHART_SAMPLER", "NONE", "PRODUCTION", "WIRINGS", "Wired", "attach",
           "label", "sampler_of", "tracing_env"]

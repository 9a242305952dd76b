"""The bench's telemetry wiring is production's: what vLLM's connector attaches, sampled as the Helm chart samples.

* the chart's sampler, which the bench copies, is the one ``values.yaml`` sets (a chart change shows here);
* the production wiring attaches what our scheduler adapter attaches inside vLLM (built for real, through
  vLLM's scheduler and connector factory, with the chart's ``OTEL_*`` variables): the same observer types, the
  same sampler;
* spans of the bench's wirings really leave over OTLP/HTTP, to the bench's local endpoint; with no telemetry
  nothing is attached.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from mooncake_lookout.connector.bench import otlp_sink, wiring
from mooncake_lookout.connector.events import LookupRecord, ObserverSet, Outcome

ROOT = Path(__file__).resolve().parents[1]


def _observer_kinds(observers: list) -> list[str]:
    """Each observer's class, with what a BackgroundObserver wraps."""
    return sorted(type(getattr(o, "observer", o)).__name__ + ("@background" if hasattr(o, "observer") else "")
                  for o in observers)


def _sampler(observers: list) -> str:
    tracer = next(getattr(o, "observer", o) for o in observers if hasattr(o, "observer"))
    return tracer.provider.sampler.get_description()


def test_the_chart_sampler_the_bench_copies_is_the_charts() -> None:
    values = yaml.safe_load((ROOT / "helm" / "mooncake-lookout" / "values.yaml").read_text())
    tracing = values["engine"]["tracing"]
    assert wiring.CHART_SAMPLER == (tracing["sampler"], str(tracing["samplerArg"]))


def test_the_production_wiring_attaches_what_the_adapter_attaches_inside_vllm(monkeypatch: pytest.MonkeyPatch,
                                                                               rpc_base_path: str) -> None:
    from mooncake_lookout.connector.rigs.scheduler_driver import SchedulerDriver, make_vllm_config

    for name, value in wiring.tracing_env(wiring.PRODUCTION, otlp_sink.shared().endpoint).items():
        monkeypatch.setenv(name, value)
    driver = SchedulerDriver(make_vllm_config({"lookup_async": True, "lookup_transport": "pipelined",
                                               "lookup_server_address": "ipc:///nonexistent/lookout.sock",
                                               "load_async": False}))
    try:
        adapter = driver.connector.connector_scheduler
        inside_vllm = list(adapter.observers.observers)
    finally:
        driver.close()
    tele = wiring.telemetry(wiring.PRODUCTION)
    try:
        assert _observer_kinds(tele.observers) == _observer_kinds(inside_vllm)
        assert _sampler(tele.observers) == _sampler(inside_vllm)
        assert "TraceIdRatioBased{0.1}" in _sampler(tele.observers)
        assert tele.per_step is not None and tele.per_step().is_empty()  # vLLM's step record, nothing yet
    finally:
        tele.close()


def _lookups(observers: ObserverSet, n: int) -> None:
    """``n`` lookups' events, as the client and its transport send them."""
    for i in range(n):
        rec = LookupRecord(f"req-{i}", 64, [b"h" * 32] * 4, "pipelined", 0, time.perf_counter())
        observers.submitted(rec)
        rec.t_start = time.perf_counter()
        observers.started(rec)
        rec.t_answer = time.perf_counter()
        observers.answered(rec)
        rec.outcome, rec.hit_tokens, rec.t_consume = Outcome.HIT, 48, time.perf_counter()
        observers.consumed(rec)


def test_spans_leave_over_otlp_http_and_no_telemetry_attaches_nothing() -> None:
    sink = otlp_sink.shared()
    before = sink.posts
    tele = wiring.telemetry(wiring.ALWAYS_ON)
    assert "AlwaysOn" in _sampler(tele.observers)
    _lookups(ObserverSet(tele.observers), 5)
    assert not tele.per_step().is_empty()  # the stats collector saw the step's lookups
    tele.close()  # flushes the background thread and the span processor
    assert sink.posts > before and sink.bytes > 0
    none = wiring.telemetry(wiring.NONE)
    assert none.observers == [] and none.per_step is None
    with pytest.raises(ValueError, match="telemetry wiring"):
        wiring.telemetry("some")

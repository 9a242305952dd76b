"""The bench's telemetry wiring is production's: what vLLM's connector attaches, sampled as the Helm chart samples.

* the chart's sampler, which the bench copies, is the one ``values.yaml`` sets (a chart change shows here);
* the production wiring is what our scheduler adapter runs inside vLLM (built for real, through vLLM's
  scheduler and connector factory, with the chart's ``OTEL_*`` variables): the same telemetry, the same sampler;
* spans of the bench's wirings really leave over OTLP/HTTP, to the bench's local endpoint; with no telemetry
  nothing is attached.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from mooncake_lookout.connector.bench import otlp_sink, wiring

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

ROOT = Path(__file__).resolve().parents[1]


def test_the_chart_sampler_the_bench_copies_is_the_charts() -> None:
    values = yaml.safe_load((ROOT / "helm" / "mooncake-lookout" / "values.yaml").read_text())
    tracing = values["engine"]["tracing"]
    assert wiring.CHART_SAMPLER == (tracing["sampler"], str(tracing["samplerArg"]))


FLAGGED = {flag: {"traceparent": f"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-{flag}"}
           for flag in ("00", "01")}


def test_the_production_wiring_is_what_the_adapter_runs_inside_vllm(monkeypatch: pytest.MonkeyPatch,
                                                                     rpc_base_path: str) -> None:
    """Built for real through vLLM's scheduler and connector factory, with the chart's OTEL_* variables: the
    adapter runs the deployed telemetry, spans on, and samples as the chart says; the bench's production wiring
    is the same class, built the same way."""
    from mooncake_lookout.connector.rigs.scheduler_driver import SchedulerDriver, make_vllm_config
    from mooncake_lookout.metrics.deployed import DeployedTelemetry

    for name, value in wiring.tracing_env(wiring.PRODUCTION, otlp_sink.shared().endpoint).items():
        monkeypatch.setenv(name, value)
    driver = SchedulerDriver(make_vllm_config({"lookup_async": True, "lookup_transport": "pipelined",
                                               "lookup_server_address": "ipc:///nonexistent/lookout.sock",
                                               "load_async": False}))
    try:
        adapter = driver.connector.connector_scheduler
        assert type(adapter.telemetry) is DeployedTelemetry and adapter.telemetry.tracer is not None
        inside = adapter.client.sampler
        assert inside(FLAGGED["00"]) is False and inside(FLAGGED["01"]) is True  # the request's own flag
        roots = sum(inside(None) for _ in range(5000))
        assert 300 < roots < 700  # the chart's 10% of requests with no trace of their own
    finally:
        driver.close()
    from mooncake_lookout.connector.client import LookupClient
    from mooncake_lookout.connector.config import LookupConfig
    from mooncake_lookout.connector.transport.pipelined import PipelinedTransport

    client = LookupClient(LookupConfig(lookup_async=True), PipelinedTransport("ipc:///nonexistent/b", timeout_s=1))
    wired = wiring.Wired(client, wiring.PRODUCTION)
    try:
        assert type(wired.telemetry) is DeployedTelemetry and wired.telemetry.tracer is not None
        assert client.sampler(FLAGGED["00"]) is False and client.sampler(FLAGGED["01"]) is True
        assert 300 < sum(client.sampler(None) for _ in range(5000)) < 700
    finally:
        wired.close()


def test_spans_leave_over_otlp_http_and_no_telemetry_attaches_nothing(prefix_index: Any, make_hashes: Any) -> None:
    from mooncake_lookout.connector.client import LookupClient
    from mooncake_lookout.connector.config import LookupConfig
    from mooncake_lookout.connector.server import LookupServer
    from mooncake_lookout.connector.transport import make_transport

    sink = otlp_sink.shared()
    before = sink.posts
    config = LookupConfig(lookup_async=True, lookup_timeout_ms=5000)
    with LookupServer(prefix_index) as server:
        wired = wiring.Wired(LookupClient(config, make_transport(config, server.address)), wiring.ALWAYS_ON)
        try:
            for i in range(5):
                hashes = make_hashes(2, seed=800 + i)
                end = time.monotonic() + 10
                while wired.lookup(f"r{i}", 33, hashes, True) is None:
                    assert time.monotonic() < end
                    wired.end_step()
                    time.sleep(0.001)
            wired.end_step()  # vLLM's step hook: the stats record, and the sampled lookups to the tracing thread
        finally:
            wired.close()  # flushes the tracing thread and the span processor
    assert sink.posts > before and sink.bytes > 0
    bare = LookupClient(config, make_transport(config, "ipc:///nonexistent/c"))
    try:
        assert wiring.attach(bare, wiring.NONE) is None and bare.log is None and bare.sampler is None
    finally:
        bare.close()
    with pytest.raises(ValueError, match="telemetry wiring"):
        wiring.attach(bare, "some")

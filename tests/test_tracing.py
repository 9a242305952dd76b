"""Lookup spans: parentage across the transport thread, attributes, hashed ids, OTEL_* set-up, OTLP/HTTP export."""

from __future__ import annotations

import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from mooncake_lookout.connector.events import LookupRecord, ObserverSet, Outcome
from mooncake_lookout.metrics import tracing
from mooncake_lookout.metrics.tracing import (
    ATTR_DEFERRED_STEPS, ATTR_HIT_TOKENS, ATTR_OUTCOME, ATTR_REQUEST_ID, ATTR_TOKENS, ATTR_TRANSPORT,
    SPAN_LOOKUP, SPAN_RPC, TracingObserver, hash_request_id,
)

PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"
OTEL_VARS = ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
             "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_SAMPLER",
             "OTEL_TRACES_SAMPLER_ARG", "OTEL_SERVICE_NAME", "OTEL_BSP_SCHEDULE_DELAY")


@pytest.fixture
def spans() -> Iterator[tuple[TracingObserver, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observer = TracingObserver(provider.get_tracer("test"), provider)
    yield observer, exporter
    observer.shutdown()


@pytest.fixture
def clean_otel_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _on_transport_thread(fn, *args) -> None:  # type: ignore[no-untyped-def]
    """Run ``fn`` on a separate real thread, as the transport does."""
    t = threading.Thread(target=fn, args=args)
    t.start()
    t.join(10)
    assert not t.is_alive()


def _by_name(exported: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in exported if s.name == name]


def _all_text(span: ReadableSpan) -> str:
    return repr((span.name, dict(span.attributes or {}), [(e.name, dict(e.attributes or {})) for e in span.events]))


def test_lookup_span_parents_rpc_span_across_threads(spans) -> None:  # type: ignore[no-untyped-def]
    observer, exporter = spans
    obs = ObserverSet([observer])
    req_id = "cmpl-7d1e-private-request-id"
    observer.set_parent_headers(req_id, {"traceparent": TRACEPARENT})
    rec = LookupRecord(req_id, 96, 6, "pipelined", 0, time.perf_counter())
    obs.submitted(rec)

    def transport() -> None:
        rec.t_start = time.perf_counter()
        obs.started(rec)
        rec.t_answer = time.perf_counter()
        obs.answered(rec)

    _on_transport_thread(transport)
    rec.deferrals = 2
    rec.outcome, rec.hit_tokens, rec.t_consume = Outcome.HIT, 80, time.perf_counter()
    obs.consumed(rec)

    exported = exporter.get_finished_spans()
    [lookup] = _by_name(exported, SPAN_LOOKUP)
    [rpc] = _by_name(exported, SPAN_RPC)
    # Parent of the lookup: the request's trace from its headers; parent of the rpc: the lookup.
    assert format(lookup.context.trace_id, "032x") == PARENT_TRACE
    assert lookup.parent is not None and format(lookup.parent.span_id, "016x") == PARENT_SPAN
    assert rpc.context.trace_id == lookup.context.trace_id
    assert rpc.parent is not None and rpc.parent.span_id == lookup.context.span_id
    assert lookup.start_time <= rpc.start_time <= rpc.end_time <= lookup.end_time
    attrs = dict(lookup.attributes or {})
    assert attrs[ATTR_REQUEST_ID] == hash_request_id(req_id) != req_id
    assert attrs[ATTR_TOKENS] == 96
    assert attrs[ATTR_HIT_TOKENS] == 80
    assert attrs[ATTR_OUTCOME] == "hit"
    assert attrs[ATTR_DEFERRED_STEPS] == 2
    assert attrs[ATTR_TRANSPORT] == "pipelined"
    assert lookup.status.status_code is not StatusCode.ERROR
    for span in exported:
        assert req_id not in _all_text(span)


def test_headers_are_used_once_and_bounded(spans) -> None:  # type: ignore[no-untyped-def]
    observer, exporter = spans
    observer.set_parent_headers("r1", {"traceparent": TRACEPARENT})
    for i in range(tracing.MAX_PARENT_HEADERS):  # requests whose lookup never comes push r1 out
        observer.set_parent_headers(f"never-{i}", {"traceparent": TRACEPARENT})
    observer.set_parent_headers("r2", {"traceparent": TRACEPARENT})
    for req_id in ("r1", "r2", "r2"):  # the second lookup of r2 (a re-query) starts its own trace
        rec = LookupRecord(req_id, 16, 1, "upstream", 0, time.perf_counter())
        observer.submitted(rec)
        rec.outcome = Outcome.MISS
        observer.consumed(rec)
    evicted, first, second = exporter.get_finished_spans()
    assert evicted.parent is None
    assert format(first.context.trace_id, "032x") == PARENT_TRACE
    assert second.parent is None and format(second.context.trace_id, "032x") != PARENT_TRACE


def test_timeout_and_discard_end_the_span(spans) -> None:  # type: ignore[no-untyped-def]
    observer, exporter = spans
    timed_out = LookupRecord("a", 32, 2, "upstream", 0, time.perf_counter())
    observer.submitted(timed_out)
    timed_out.outcome, timed_out.error = Outcome.TIMEOUT, "no answer before the deadline"
    observer.consumed(timed_out)
    gone = LookupRecord("b", 32, 2, "upstream", 0, time.perf_counter())
    observer.submitted(gone)
    _on_transport_thread(observer.started, gone)
    gone.outcome = Outcome.DISCARDED
    observer.discarded(gone)  # discarded while its round trip is still out
    _on_transport_thread(observer.answered, gone)
    exported = exporter.get_finished_spans()
    lookups = {s.attributes[ATTR_REQUEST_ID]: s for s in _by_name(exported, SPAN_LOOKUP)}
    t = lookups[hash_request_id("a")]
    assert t.attributes[ATTR_OUTCOME] == "timeout"
    assert t.status.status_code is StatusCode.ERROR
    assert t.status.description == "no answer before the deadline"
    d = lookups[hash_request_id("b")]
    assert d.attributes[ATTR_OUTCOME] == "discarded"
    [rpc] = _by_name(exported, SPAN_RPC)
    assert rpc.parent is not None and rpc.parent.span_id == d.context.span_id


def test_unsampled_lookups_record_nothing(clean_otel_env: pytest.MonkeyPatch) -> None:
    clean_otel_env.setenv("OTEL_TRACES_SAMPLER", "always_off")
    exporter = InMemorySpanExporter()
    provider = tracing.provider_from_env([exporter])
    assert provider is not None
    observer = TracingObserver(provider.get_tracer("test"), provider)
    rec = LookupRecord("x", 16, 1, "upstream", 0, time.perf_counter())
    observer.submitted(rec)
    observer.started(rec)
    observer.answered(rec)
    rec.outcome = Outcome.MISS
    observer.consumed(rec)
    observer.shutdown()
    assert exporter.get_finished_spans() == ()


def test_off_unless_otel_traces_exporter_is_set(clean_otel_env: pytest.MonkeyPatch) -> None:
    assert tracing.tracing_observer_from_env() is None
    clean_otel_env.setenv("OTEL_TRACES_EXPORTER", "none")
    assert tracing.tracing_observer_from_env() is None


def test_grpc_without_its_exporter_turns_tracing_off_with_a_message(
        clean_otel_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    try:
        import opentelemetry.exporter.otlp.proto.grpc  # noqa: F401
        pytest.skip("the grpc exporter is installed here, so grpc works")
    except ImportError:
        pass
    clean_otel_env.setenv("OTEL_TRACES_EXPORTER", "otlp")  # the SDK's default protocol is grpc
    with caplog.at_level(logging.ERROR, logger=tracing.__name__):
        assert tracing.tracing_observer_from_env() is None
    assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" in caplog.text


class _OtlpReceiver:
    """A tiny OTLP/HTTP trace receiver on 127.0.0.1: decodes each POSTed ExportTraceServiceRequest."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.paths: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                msg = ExportTraceServiceRequest()
                msg.ParseFromString(body)
                receiver.paths.append(self.path)
                receiver.requests.append(msg)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def spans(self) -> list[tuple[str, object]]:
        """(service name, span) for every span received so far."""
        out = []
        for req in list(self.requests):
            for rs in req.resource_spans:
                service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                out.extend((service, span) for ss in rs.scope_spans for span in ss.spans)
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def test_spans_reach_an_otlp_http_receiver(clean_otel_env: pytest.MonkeyPatch) -> None:
    receiver = _OtlpReceiver()
    try:
        clean_otel_env.setenv("OTEL_TRACES_EXPORTER", "otlp")
        clean_otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        clean_otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{receiver.port}/v1/traces")
        clean_otel_env.setenv("OTEL_TRACES_SAMPLER", "parentbased_always_on")
        observer = tracing.tracing_observer_from_env()
        assert observer is not None
        obs = ObserverSet([observer])
        req_ids = [f"cmpl-secret-{i}" for i in range(3)]
        observer.set_parent_headers(req_ids[0], {"traceparent": TRACEPARENT})
        recs = [LookupRecord(r, 64, 4, "pipelined", 0, time.perf_counter()) for r in req_ids]
        for rec in recs:
            obs.submitted(rec)

        def transport() -> None:
            for rec in recs:
                obs.started(rec)
                obs.answered(rec)

        _on_transport_thread(transport)
        for rec in recs:
            rec.outcome, rec.hit_tokens = Outcome.HIT, 48
            obs.consumed(rec)
        observer.shutdown()  # flushes the batch processor
        deadline = time.monotonic() + 10
        while len(receiver.spans()) < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        received = receiver.spans()
        assert len(received) == 6
        assert set(receiver.paths) == {"/v1/traces"}
        assert {service for service, _ in received} == {tracing.DEFAULT_SERVICE_NAME}
        lookups = [s for _, s in received if s.name == SPAN_LOOKUP]
        rpcs = [s for _, s in received if s.name == SPAN_RPC]
        assert len(lookups) == len(rpcs) == 3
        by_id = {bytes(s.span_id): s for s in lookups}
        for rpc in rpcs:
            assert bytes(rpc.parent_span_id) in by_id
            assert bytes(rpc.trace_id) == bytes(by_id[bytes(rpc.parent_span_id)].trace_id)
        assert sum(1 for s in lookups if s.trace_id.hex() == PARENT_TRACE
                   and s.parent_span_id.hex() == PARENT_SPAN) == 1
        hashed = {a.value.string_value for s in lookups for a in s.attributes if a.key == ATTR_REQUEST_ID}
        assert hashed == {hash_request_id(r) for r in req_ids}
        wire = b"".join(r.SerializeToString() for r in receiver.requests)
        for req_id in req_ids:
            assert req_id.encode() not in wire
    finally:
        receiver.close()

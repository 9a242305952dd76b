"""Lookup spans: parentage across the transport thread, attributes, hashed ids, OTEL_* set-up, OTLP/HTTP export."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from mooncake_lookout.connector.events import LookupRecord, ObserverSet, Outcome
from mooncake_lookout.metrics import tracing
from mooncake_lookout.metrics.tracing import (
    ATTR_DEFERRED_STEPS,
    ATTR_HIT_TOKENS,
    ATTR_OUTCOME,
    ATTR_REQUEST_ID,
    ATTR_TOKENS,
    ATTR_TRANSPORT,
    SPAN_LOOKUP,
    SPAN_RPC,
    TracingObserver,
    hash_request_id,
)

from otlp_receiver import OtlpReceiver  # tests/ (conftest puts it on sys.path)

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

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
    rec = LookupRecord(req_id, 96, [b"h" * 32] * 6, "pipelined", 0, time.perf_counter(),
                       trace_headers={"traceparent": TRACEPARENT})
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


def test_trace_context_rides_on_the_record_and_no_state_is_shared_between_threads(
        spans, prefix_index, make_workload, caplog) -> None:  # type: ignore[no-untyped-def]
    """The scheduler's thread starts lookups with their requests' trace headers while the telemetry thread
    builds spans, far past the 4,096 requests an earlier design kept headers for: nothing is shared (the
    headers ride on each lookup's own record), nothing raises, every span has its own request's parent."""
    from mooncake_lookout.connector.client import LookupClient
    from mooncake_lookout.connector.config import LookupConfig
    from mooncake_lookout.connector.events import BackgroundObserver
    from mooncake_lookout.connector.server import LookupServer
    from mooncake_lookout.connector.transport.pipelined import PipelinedTransport

    observer, exporter = spans
    background = BackgroundObserver(observer, interval_s=0.001)
    requests = make_workload(6000, prefix_blocks=1, unique_blocks=1)
    parents = {r.req_id: f"{i + 1:032x}" for i, r in enumerate(requests)}
    config = LookupConfig(lookup_async=True, lookup_transport="pipelined", lookup_timeout_ms=5000,
                          lookup_max_pending=10_000)
    with LookupServer(prefix_index) as server:
        client = LookupClient(config, PipelinedTransport(server.address, timeout_s=5.0), observer=background)
        try:
            for req in requests:  # admissions with trace context, most of them never asked for
                client.start(req.req_id, req.num_tokens, req.block_hashes, admission=True,
                             trace_headers={"traceparent": f"00-{parents[req.req_id]}-{PARENT_SPAN}-01"})
            for req in requests[::10]:
                assert client.lookup(req.req_id, req.num_tokens, req.block_hashes) is not None
            for req in requests:
                client.discard(req.req_id)
        finally:
            client.close()
    assert background.flush(30)
    background.close()
    assert not [r for r in caplog.records if "failed" in r.getMessage()]
    lookups = _by_name(exporter.get_finished_spans(), SPAN_LOOKUP)
    assert len(lookups) == len(requests)
    by_hash = {hash_request_id(r): p for r, p in parents.items()}
    assert all(format(s.context.trace_id, "032x") == by_hash[s.attributes[ATTR_REQUEST_ID]] for s in lookups)


def test_timeout_and_discard_end_the_span(spans) -> None:  # type: ignore[no-untyped-def]
    observer, exporter = spans
    timed_out = LookupRecord("a", 32, [b"h" * 32] * 2, "upstream", 0, time.perf_counter())
    observer.submitted(timed_out)
    timed_out.outcome, timed_out.error = Outcome.TIMEOUT, "no answer before the deadline"
    observer.consumed(timed_out)
    gone = LookupRecord("b", 32, [b"h" * 32] * 2, "upstream", 0, time.perf_counter())
    observer.submitted(gone)

    def take() -> None:  # what a transport does when it sends
        gone.t_start = time.perf_counter()
        observer.started(gone)

    _on_transport_thread(take)
    gone.outcome, gone.t_consume = Outcome.DISCARDED, time.perf_counter()
    observer.discarded(gone)  # discarded while its round trip is still out
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
    assert rpc.status.status_code is StatusCode.ERROR  # cut short: no answer before the lookup ended
    assert rpc.end_time <= d.end_time


@pytest.mark.parametrize("env,headers,expected", [
    ({}, None, True),  # the SDK's default: parentbased_always_on
    ({}, {"traceparent": f"00-{PARENT_TRACE}-{PARENT_SPAN}-00"}, False),  # the request's own flag says no
    ({"OTEL_TRACES_SAMPLER": "always_off"}, {"traceparent": TRACEPARENT}, False),
    ({"OTEL_TRACES_SAMPLER": "always_on"}, {"traceparent": f"00-{PARENT_TRACE}-{PARENT_SPAN}-00"}, True),
    ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}, None, False),
    ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"},
     {"traceparent": TRACEPARENT}, True),  # a sampled parent wins over the root's ratio
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1"}, None, True),
    # traceidratio keeps a trace whose id's lower 64 bits fall under ratio * 2**64 (a3ce929d0e0e4736 ~ 0.64)
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.7"}, {"traceparent": TRACEPARENT}, True),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.6"}, {"traceparent": TRACEPARENT}, False),
    ({"OTEL_TRACES_SAMPLER": "no_such_sampler"}, None, True),  # as the SDK: falls back to parentbased_always_on
    ({}, {"traceparent": "garbage"}, True),  # a malformed header is no parent
], ids=lambda v: str(v)[:40])
def test_the_sampler_follows_otel_and_the_requests_own_flag(env: dict[str, str], headers: dict[str, str] | None,
                                                            expected: bool) -> None:
    assert tracing.sampler_from_env(env)(headers) is expected


def test_the_sampler_keeps_its_ratio_of_root_lookups() -> None:
    decide = tracing.sampler_from_env({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                                       "OTEL_TRACES_SAMPLER_ARG": "0.1"})
    kept = sum(decide(None) for _ in range(20_000))
    assert 1_500 < kept < 2_500  # 10% of 20,000 (the bound is 11 standard deviations wide)


def test_unsampled_lookups_build_no_span(prefix_index, make_hashes) -> None:  # type: ignore[no-untyped-def]
    """Deployed telemetry on a real client and server: a lookup the sampler drops is never handed to the tracing
    thread, so no span is built for it (before, every lookup's span was started, then dropped by the SDK)."""
    from mooncake_lookout.connector.client import LookupClient
    from mooncake_lookout.connector.config import LookupConfig
    from mooncake_lookout.connector.server import LookupServer
    from mooncake_lookout.connector.transport import make_transport
    from mooncake_lookout.metrics.deployed import DeployedTelemetry

    exporter = InMemorySpanExporter()
    provider = tracing.provider_from_env([exporter])
    assert provider is not None
    config = LookupConfig(lookup_async=True, lookup_timeout_ms=5000)
    built: list[int] = []
    with LookupServer(prefix_index) as server:
        client = LookupClient(config, make_transport(config, server.address))
        observer = TracingObserver(provider.get_tracer("test"), provider)
        record_many = observer.record_many
        observer.record_many = lambda lookups: (built.append(len(lookups)), record_many(lookups))  # type: ignore
        telemetry = DeployedTelemetry(client, observer)
        try:
            for seed, (name, flag) in enumerate((("kept", "01"), ("dropped", "00"))):
                hashes = make_hashes(2, seed=700 + seed)
                headers = {"traceparent": f"00-{PARENT_TRACE}-{PARENT_SPAN}-{flag}"}
                end = time.monotonic() + 10
                while client.lookup(name, 33, hashes, non_block=True, trace_headers=headers) is None:
                    assert time.monotonic() < end
                    client.end_step()
                    time.sleep(0.001)
            telemetry.take()
        finally:
            client.close()
            telemetry.close()
    lookups = _by_name(exporter.get_finished_spans(), SPAN_LOOKUP)
    assert built == [1]  # one hand-over, of the one sampled lookup
    assert [s.attributes[ATTR_REQUEST_ID] for s in lookups] == [hash_request_id("kept")]


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


def test_spans_reach_an_otlp_http_receiver(clean_otel_env: pytest.MonkeyPatch) -> None:
    receiver = OtlpReceiver()
    try:
        clean_otel_env.setenv("OTEL_TRACES_EXPORTER", "otlp")
        clean_otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        clean_otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{receiver.port}/v1/traces")
        clean_otel_env.setenv("OTEL_TRACES_SAMPLER", "parentbased_always_on")
        observer = tracing.tracing_observer_from_env()
        assert observer is not None
        obs = ObserverSet([observer])
        req_ids = [f"cmpl-secret-{i}" for i in range(3)]
        recs = [LookupRecord(r, 64, [b"h" * 32] * 4, "pipelined", 0, time.perf_counter(),
                             trace_headers={"traceparent": TRACEPARENT} if i == 0 else None)
                for i, r in enumerate(req_ids)]
        for rec in recs:
            obs.submitted(rec)

        def transport() -> None:  # what a transport does when it sends and answers
            for rec in recs:
                rec.t_start = time.perf_counter()
                obs.started(rec)
                rec.t_answer = time.perf_counter()
                obs.answered(rec)

        _on_transport_thread(transport)
        for rec in recs:
            rec.outcome, rec.hit_tokens, rec.t_consume = Outcome.HIT, 48, time.perf_counter()
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


def test_real_client_and_server_spans(spans, prefix_index, make_workload) -> None:  # type: ignore[no-untyped-def]
    """The real LookupClient, pipelined transport and LookupServer over a real Mooncake store."""
    from mooncake_lookout.connector.client import LookupClient
    from mooncake_lookout.connector.config import LookupConfig
    from mooncake_lookout.connector.server import LookupServer
    from mooncake_lookout.connector.transport.pipelined import PipelinedTransport

    observer, exporter = spans
    requests = make_workload(6, prefix_blocks=2, unique_blocks=1, num_prefixes=2)
    prefix_index.store_prefixes([requests[0].block_hashes[:2]])  # prefix 0 (requests 0, 2, 4) is warm
    config = LookupConfig(lookup_async=True, lookup_transport="pipelined", lookup_timeout_ms=5000)
    with LookupServer(prefix_index) as server:
        client = LookupClient(config, PipelinedTransport(server.address, timeout_s=config.timeout_s),
                              observer=observer)
        try:
            for req in requests:
                result = client.lookup(req.req_id, req.num_tokens, req.block_hashes, non_block=False,
                                       trace_headers={"traceparent": TRACEPARENT})
                assert result is not None
            client.discard(requests[-1].req_id)  # already used: no second end, no second span
        finally:
            client.close()
    exported = exporter.get_finished_spans()
    lookups = _by_name(exported, SPAN_LOOKUP)
    rpcs = _by_name(exported, SPAN_RPC)
    assert len(lookups) == len(rpcs) == len(requests)
    by_span = {s.context.span_id: s for s in lookups}
    for rpc in rpcs:
        parent = by_span[rpc.parent.span_id]
        assert parent.start_time <= rpc.start_time <= rpc.end_time <= parent.end_time
    outcomes = {s.attributes[ATTR_REQUEST_ID]: (s.attributes[ATTR_OUTCOME], s.attributes[ATTR_HIT_TOKENS])
                for s in lookups}
    for i, req in enumerate(requests):
        assert outcomes[hash_request_id(req.req_id)] == (("hit", 32) if i % 2 == 0 else ("miss", 0))
    assert all(format(s.context.trace_id, "032x") == PARENT_TRACE for s in exported)
    for span in exported:
        for req in requests:
            assert req.req_id not in _all_text(span)


def test_vllm_request_trace_headers_parent_the_lookup_span(clean_otel_env: pytest.MonkeyPatch, prefix_index,
                                                           rpc_base_path) -> None:  # type: ignore[no-untyped-def]
    """vLLM's real scheduler with the connector: a request's ``trace_headers`` become its lookup span's parent."""
    from mooncake_lookout.connector.rigs.scheduler_driver import SchedulerDriver, make_vllm_config
    from mooncake_lookout.connector.server import LookupServer

    receiver = OtlpReceiver()
    try:
        clean_otel_env.setenv("OTEL_TRACES_EXPORTER", "otlp")
        clean_otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        clean_otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{receiver.port}/v1/traces")
        with LookupServer(prefix_index, "tcp://127.0.0.1:0") as server:
            driver = SchedulerDriver(make_vllm_config({
                "lookup_async": True, "lookup_transport": "pipelined", "lookup_server_address": server.address,
                "load_async": False}))
            try:
                request = driver.make_request("cmpl-traced-1", list(range(1, 81)))
                request.trace_headers = {"traceparent": TRACEPARENT}
                driver.add(request)
                driver.run_until_idle(500)
            finally:
                driver.close()  # flushes spans
        deadline = time.monotonic() + 10
        while not any(s.name == SPAN_LOOKUP for _, s in receiver.spans()) and time.monotonic() < deadline:
            time.sleep(0.02)
        lookups = [s for _, s in receiver.spans() if s.name == SPAN_LOOKUP]
        assert len(lookups) == 1
        assert lookups[0].trace_id.hex() == PARENT_TRACE and lookups[0].parent_span_id.hex() == PARENT_SPAN
        assert b"cmpl-traced-1" not in b"".join(r.SerializeToString() for r in receiver.requests)
    finally:
        receiver.close()

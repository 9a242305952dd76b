"""The standalone sink, the server sink, the /metrics endpoint and the README table, on real registries."""

from __future__ import annotations

import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from mooncake_lookout.connector.cli.docs import end_marker, extract, render_metrics_table, splice, start_marker
from mooncake_lookout.connector.config import SYNC_BLOCK_MS, TIMEOUT_MS, LookupConfig
from mooncake_lookout.connector.events import LookupRecord, ObserverSet, Outcome
from mooncake_lookout.metrics import catalogue as cat
from mooncake_lookout.metrics.exporter import serve_metrics
from mooncake_lookout.metrics.prometheus_sink import PrometheusSink, info_labels
from mooncake_lookout.metrics.server_sink import ServerMetrics

ROOT = Path(__file__).resolve().parents[1]


def _record(req_id: str, *, tokens: int = 64, t0: float = 100.0) -> LookupRecord:
    return LookupRecord(req_id, tokens, [b"h" * 32] * (tokens // 16), "pipelined", 0, t0)


def _lifecycle(obs: ObserverSet, req_id: str, outcome: Outcome, *, tokens: int = 64, hit: int = 0,
               deferrals: int = 0, rpc: bool = True) -> LookupRecord:
    """Drive one lookup through the events in the order (and with the timings) the client produces."""
    rec = _record(req_id, tokens=tokens)
    obs.submitted(rec)
    if rpc:
        rec.t_start = rec.t_submit + 0.0002
        obs.started(rec)
        rec.t_answer = rec.t_start + 0.0005
        obs.answered(rec)
    for _ in range(deferrals):
        rec.deferrals += 1
        obs.deferred(rec)
    if outcome is Outcome.DISCARDED:
        rec.outcome = outcome
        rec.t_consume = rec.t_submit + 0.003
        obs.discarded(rec)
    else:
        rec.outcome, rec.hit_tokens = outcome, hit
        rec.t_consume = rec.t_submit + 0.001 + 0.001 * deferrals
        obs.consumed(rec)
    return rec


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def _value(registry: CollectorRegistry, spec: cat.MetricSpec, suffix: str = "", **labels: str) -> float | None:
    return registry.get_sample_value(spec.name + suffix, labels)


def test_every_event_lands_in_its_family(registry: CollectorRegistry) -> None:
    sink = PrometheusSink(LookupConfig(lookup_async=True, lookup_transport="pipelined"), registry=registry)
    obs = ObserverSet([sink])
    _lifecycle(obs, "req-hit", Outcome.HIT, tokens=64, hit=48, deferrals=2)
    _lifecycle(obs, "req-miss", Outcome.MISS, tokens=32)
    _lifecycle(obs, "req-timeout", Outcome.TIMEOUT, tokens=16, deferrals=1)
    _lifecycle(obs, "req-rejected", Outcome.REJECTED, tokens=16, rpc=False)
    _lifecycle(obs, "req-gone", Outcome.DISCARDED, tokens=16, deferrals=1)
    obs.scheduler_call("async", 2e-5)
    obs.scheduler_call("async", 3e-5)
    sink.late_reply()
    obs.breaker_changed(True)

    for outcome, n in {"hit": 1, "miss": 1, "timeout": 1, "rejected": 1, "discarded": 1, "error": 0,
                       "breaker_open": 0}.items():
        assert _value(registry, cat.REQUESTS, "_total", outcome=outcome) == n, outcome
    # Tokens count as queried only when the store answered for them (a hit or a miss): not for a timeout,
    # a refused or a discarded lookup, whose tokens the store never answered for.
    assert _value(registry, cat.QUERIED_TOKENS, "_total") == 64 + 32
    assert _value(registry, cat.HIT_TOKENS, "_total") == 48
    assert _value(registry, cat.PENDING) == 0
    assert _value(registry, cat.DEFERRALS, "_total") == 4
    assert _value(registry, cat.DEFERRED_STEPS, "_count") == 4
    assert _value(registry, cat.DEFERRED_STEPS, "_sum") == 2 + 0 + 1 + 0
    # The rejected lookup never reached the transport: no queue or rpc time for it.
    assert _value(registry, cat.QUEUE_SECONDS, "_count") == 3
    assert _value(registry, cat.RPC_SECONDS, "_count") == 3
    assert _value(registry, cat.RPC_SECONDS, "_sum") == pytest.approx(3 * 0.0005)
    # Submit-to-use time only for lookups that were sent: a refusal answered at once would pull the median
    # down exactly when the system is overloaded.
    assert _value(registry, cat.SECONDS, "_count") == 3
    assert _value(registry, cat.SECONDS, "_bucket", le="0.0025") == 2  # 1 ms, 2 ms; the hit took 3 ms
    assert _value(registry, cat.SCHEDULER_BLOCKED_SECONDS, "_count", mode="async") == 2
    assert _value(registry, cat.SCHEDULER_BLOCKED_SECONDS, "_count", mode="sync") == 0
    assert _value(registry, cat.LATE_REPLIES, "_total") == 1
    assert _value(registry, cat.BREAKER_OPEN) == 1
    obs.breaker_changed(False)
    assert _value(registry, cat.BREAKER_OPEN) == 0
    assert _value(registry, cat.INFO, transport="pipelined", lookup_async="true", mode="async", lookup_wait_us="0",
                  lookup_wait_auto_share="0.25", lookup_timeout_ms=f"{TIMEOUT_MS:g}",
                  lookup_block_ms=f"{SYNC_BLOCK_MS:g}", lookup_max_pending="1024") == 1
    assert _value(registry, cat.MAX_PENDING) == 1024
    assert _value(registry, cat.MAX_HELD) == 16384
    obs.step_ended(0.0004, 7, 120)  # the first step: no interval yet
    assert _value(registry, cat.WAIT_BUDGET_SECONDS) == 0.0004 and _value(registry, cat.HELD) == 7
    assert _value(registry, cat.PREFIX_CACHE_BLOCKS) == 120
    assert _value(registry, cat.STEP_INTERVAL_SECONDS, "_count") == 0
    obs.step_ended(0.0004, 7, 120, 0.003)
    assert _value(registry, cat.STEP_INTERVAL_SECONDS, "_count") == 1
    assert _value(registry, cat.STEP_INTERVAL_SECONDS, "_sum") == 0.003
    obs.cache_cleared("epoch", 120)
    assert _value(registry, cat.PREFIX_CACHE_CLEARS, "_total", reason="epoch") == 1
    obs.answer_dropped(_record("old"), "expired")
    assert _value(registry, cat.ANSWERS_DROPPED, "_total", reason="expired") == 1
    assert _value(registry, cat.ANSWERS_DROPPED, "_total", reason="evicted") == 0


def test_every_outcome_is_a_label_and_is_counted(registry: CollectorRegistry) -> None:
    # The catalogue's outcome labels are read from events.Outcome: an outcome added there is counted here
    # (and by vLLM's stats pipeline) without a second list to keep in step.
    assert cat.OUTCOMES == tuple(o.value for o in Outcome)
    obs = ObserverSet([PrometheusSink(registry=registry)])
    for outcome in Outcome:
        _lifecycle(obs, f"req-{outcome.value}", outcome)
    for outcome in Outcome:
        assert _value(registry, cat.REQUESTS, "_total", outcome=outcome.value) == 1, outcome


def test_pending_follows_submit_and_end(registry: CollectorRegistry) -> None:
    sink = PrometheusSink(registry=registry)
    recs = [_record(f"r{i}") for i in range(5)]
    for rec in recs:
        sink.submitted(rec)
    assert _value(registry, cat.PENDING) == 5
    for rec in recs[:3]:
        rec.outcome = Outcome.MISS
        sink.consumed(rec)
    sink.discarded(recs[3])
    assert _value(registry, cat.PENDING) == 1


def test_info_replaced_not_duplicated(registry: CollectorRegistry) -> None:
    sink = PrometheusSink(LookupConfig(), registry=registry)
    sink.set_config(LookupConfig(lookup_wait_us=50, lookup_async=True, lookup_timeout_ms=2.5))
    series = [s for m in registry.collect() if m.name == cat.INFO.name for s in m.samples]
    assert len(series) == 1
    assert series[0].labels == info_labels(LookupConfig(lookup_wait_us=50, lookup_async=True,
                                                        lookup_timeout_ms=2.5))
    assert series[0].labels["mode"] == "budget" and series[0].labels["lookup_timeout_ms"] == "2.5"


def test_max_pending_follows_the_configuration(registry: CollectorRegistry) -> None:
    sink = PrometheusSink(registry=registry)
    assert _value(registry, cat.MAX_PENDING) == 0  # no configuration yet: no bound to divide by
    sink.set_config(LookupConfig(lookup_max_pending=64))
    assert _value(registry, cat.MAX_PENDING) == 64
    sink.set_config(LookupConfig(lookup_max_pending=2048))
    assert _value(registry, cat.MAX_PENDING) == 2048


def test_concurrent_events_from_two_threads_are_not_lost(registry: CollectorRegistry) -> None:
    """Scheduler and transport threads record at once; prometheus_client's own locking keeps counts whole."""
    sink = PrometheusSink(registry=registry)
    n = 2000

    def scheduler() -> None:
        for i in range(n):
            rec = _record(f"s{i}")
            sink.submitted(rec)
            rec.outcome = Outcome.MISS
            sink.consumed(rec)

    def transport() -> None:
        for _ in range(n):
            sink.late_reply()

    threads = [threading.Thread(target=scheduler), threading.Thread(target=transport)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert _value(registry, cat.REQUESTS, "_total", outcome="miss") == n
    assert _value(registry, cat.LATE_REPLIES, "_total") == n
    assert _value(registry, cat.PENDING) == 0


def test_server_sink(registry: CollectorRegistry) -> None:
    metrics = ServerMetrics(registry=registry)
    metrics.queue_depth(3)
    metrics.inflight(2)
    assert _value(registry, cat.SERVER_QUEUE_DEPTH) == 3
    assert _value(registry, cat.SERVER_INFLIGHT) == 2
    metrics.store_call(3, 0.0004, failed=True)
    metrics.store_call(1, 0.0001, failed=False)
    for status in ("ok", "ok", "error", "bad_request"):
        metrics.answered(status)
    metrics.queue_depth(0)
    metrics.inflight(0)
    assert _value(registry, cat.SERVER_QUEUE_DEPTH) == 0
    assert _value(registry, cat.SERVER_INFLIGHT) == 0
    assert _value(registry, cat.SERVER_REQUESTS, "_total", status="ok") == 2
    assert _value(registry, cat.SERVER_REQUESTS, "_total", status="error") == 1
    assert _value(registry, cat.SERVER_REQUESTS, "_total", status="bad_request") == 1
    assert _value(registry, cat.SERVER_STORE_ERRORS, "_total") == 1
    assert _value(registry, cat.SERVER_BATCH_SIZE, "_sum") == 4
    assert _value(registry, cat.SERVER_BATCH_SIZE, "_count") == 2
    assert _value(registry, cat.SERVER_STORE_SECONDS, "_bucket", le="0.0005") == 2
    assert _value(registry, cat.SERVER_STORE_SECONDS, "_bucket", le="0.00025") == 1


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        return resp.read().decode()


def test_endpoint_serves_every_family_and_passes_promtool(registry: CollectorRegistry,
                                                          promtool: Any) -> None:
    sink = PrometheusSink(LookupConfig(), registry=registry)
    ServerMetrics(registry=registry)
    _lifecycle(ObserverSet([sink]), "cmpl-secret-request-0001", Outcome.HIT, hit=32, deferrals=1)
    with serve_metrics(0, registry=registry) as endpoint:
        assert endpoint.port > 0
        text = _scrape(endpoint.url)
    for spec in cat.CATALOGUE:
        family = spec.sample_names[0] if spec.kind == "counter" else spec.name  # text format: counters end _total
        assert f"# TYPE {family} {spec.kind}" in text, spec.name
        for series in spec.sample_names:
            assert series in text
    assert "cmpl-secret-request-0001" not in text
    assert text == generate_latest(registry).decode()
    # Stopped means the port no longer answers.
    with pytest.raises(OSError):
        _scrape(endpoint.url)
    promtool.assert_metrics_clean(text)



def test_endpoint_bind_error_names_the_address(registry: CollectorRegistry) -> None:
    with serve_metrics(0, registry=registry) as first, pytest.raises(OSError, match=f"port={first.port}"):
        serve_metrics(first.port, registry=registry)


def test_markdown_table_lists_every_family() -> None:
    table = render_metrics_table()
    for spec in cat.CATALOGUE:
        assert f"`{spec.sample_names[0] if spec.kind == 'counter' else spec.name}`" in table
    start, end = start_marker("metrics-table"), end_marker("metrics-table")
    doc = f"intro\n{start}\nold\n{end}\nrest\n"
    assert extract(splice(doc, "metrics-table", table), "metrics-table") == table
    assert splice(doc, "metrics-table", table).endswith(f"{end}\nrest\n")


def test_docs_table_matches_catalogue() -> None:
    block = extract((ROOT / "docs" / "metrics.md").read_text(), "metrics-table")
    assert block == render_metrics_table(), "run: python -m mooncake_lookout.connector.cli.docs"


def test_overhead_bench_runs_every_configuration() -> None:
    from mooncake_lookout.metrics.sink_cost import configurations, measure, render

    results = measure(lifecycles=200, repeats=1)
    assert set(results) == set(configurations())
    assert all(ns > 0 for ns in results.values())
    assert render(results).count("\n") == len(results) + 1


def test_the_metrics_page_table_matches_catalogue() -> None:
    page = (ROOT / "docs" / "metrics.md").read_text()
    block = extract(page, "metrics-table")
    assert block is not None, ("docs/metrics.md has no metrics-table block; add the markers, then fill it with: "
                               "python -m mooncake_lookout.connector.cli.docs")
    assert block == render_metrics_table(), "run: python -m mooncake_lookout.connector.cli.docs"

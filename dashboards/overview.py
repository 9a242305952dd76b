"""The "Mooncake lookups / Overview" dashboard: is the lookup path healthy, and if not, where does it hurt."""

from __future__ import annotations

from typing import Any

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.models import dashboard as dm

from mooncake_lookout.metrics import catalogue as c

import known_metrics as km
import queries as q
from alerts import PENDING_SHARE
from panels import Panels, Query, value_text
from variables import link_to, new_dashboard

UID = "mooncake-lookout-overview"
TITLE = "Mooncake lookups / Overview"
BY_INSTANCE = ("instance",)
FAILED = ("error", "timeout")


def _latency(spec: c.MetricSpec, labels: tuple[str, ...] = ()) -> list[Query]:
    """p50, p95, p99 and mean of a seconds histogram."""
    suffix = "".join(f" {{{{{lab}}}}}" for lab in labels)
    out = [Query(q.quantile(spec, p, labels), f"p{round(p * 100)}{suffix}") for p in (0.5, 0.95, 0.99)]
    return out + [Query(q.mean(spec, labels), f"mean{suffix}")]


def _outcome_rate(outcomes: tuple[str, ...], labels: tuple[str, ...] = ()) -> str:
    regex = "|".join(outcomes)
    return q.counter_rate(c.REQUESTS, labels, extra=[f'outcome=~"{regex}"'])


def _health(p: Panels) -> list[Any]:
    breaker = value_text({"0": ("closed", "green"), "1": ("open", "red")})
    return [
        p.stat("Lookups per second", "Lookups that ended, any outcome.",
               [Query(q.counter_rate(c.REQUESTS), "lookups/s")], "reqps"),
        p.stat("Token hit ratio", "Share of the prompt tokens asked about that the store had.",
               [Query(q.ratio(q.counter_rate(c.HIT_TOKENS), q.counter_rate(c.QUERIED_TOKENS)), "hit ratio")],
               "percentunit", thresholds=[(None, "text")]),
        p.stat("Lookup p99 (submit to use)", "99th percentile of the time from submitting a lookup to the "
               "scheduler using its answer.", [Query(q.quantile(c.SECONDS, 0.99), "p99")], "s",
               thresholds=[(None, "green"), (0.01, "orange"), (0.1, "red")]),
        p.stat("Errors + timeouts", "Share of lookups that ended in a store error or missed their deadline "
               "(both answer a miss: the request recomputes).",
               [Query(q.ratio(_outcome_rate(FAILED), q.counter_rate(c.REQUESTS)), "failed")], "percentunit",
               thresholds=[(None, "green"), (0.01, "orange"), (0.05, "red")]),
        p.stat("Pending lookups", "Lookups submitted and not yet used or discarded, and the configured bound "
               "(lookup_max_pending), each summed over instances.",
               [Query(q.gauge(c.PENDING.name), "pending"), Query(q.gauge(c.MAX_PENDING.name), "bound")], "none"),
        p.stat("Circuit breaker", "Open on any selected instance: lookups answer a miss at once.",
               [Query(q.gauge(c.BREAKER_OPEN.name, "max"), "breaker")], "none",
               thresholds=[(None, "green"), (1, "red")], mappings=[breaker]),
    ]


def _traffic(p: Panels) -> list[Any]:
    return [
        p.timeseries("Lookup rate by outcome", "Lookups that ended per second, stacked by how they ended.",
                     [Query(q.counter_rate(c.REQUESTS, ("outcome",)), "{{outcome}}")], "reqps", stacked=True),
        p.timeseries("Hit ratio", "Tokens found over tokens asked about; lookups that hit over all lookups; "
                     "and vLLM's own external prefix-cache ratio for comparison (empty outside vLLM).",
                     [Query(q.ratio(q.counter_rate(c.HIT_TOKENS), q.counter_rate(c.QUERIED_TOKENS)), "tokens"),
                      Query(q.ratio(_outcome_rate(("hit",)), q.counter_rate(c.REQUESTS)), "lookups"),
                      Query(q.ratio(q.rate_sum(km.EXTERNAL_PREFIX_HITS), q.rate_sum(km.EXTERNAL_PREFIX_QUERIES)),
                            "vLLM external prefix cache (tokens)")],
                     "percentunit"),
    ]


def _latency_row(p: Panels) -> list[Any]:
    return [
        p.timeseries("Queue wait", "Time a lookup waited for the transport before it was sent.",
                     _latency(c.QUEUE_SECONDS), "s", width=8),
        p.timeseries("Round trip", "One lookup's round trip to the lookup server.",
                     _latency(c.RPC_SECONDS), "s", width=8),
        p.timeseries("Submit to answer used", "From submitting a lookup to the scheduler using its answer; "
                     "includes the steps it was deferred.", _latency(c.SECONDS), "s", width=8),
    ]


def _bound_dashed(panel: Any) -> Any:
    """Draw the series whose legend starts with "bound" as dashed lines without fill: limits, not load."""
    matcher = dm.MatcherConfig(id_val="byRegexp", options="^bound .*")
    return panel.with_override(matcher, [
        dm.DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}),
        dm.DynamicConfigValue(id_val="custom.fillOpacity", value=0),
    ])


def _scheduler(p: Panels) -> list[Any]:
    return [
        _bound_dashed(p.timeseries(
            "Pending lookups", "Lookups in flight or waiting, per instance, and each instance's bound "
            "(lookup_max_pending, dashed). Past the bound new lookups are rejected (answered as a miss); the "
            f"alert fires at {PENDING_SHARE:.0%} of it.",
            [Query(q.gauge(c.PENDING.name, "sum", BY_INSTANCE), "pending {{instance}}"),
             Query(q.gauge(c.MAX_PENDING.name, "sum", BY_INSTANCE), "bound {{instance}}")], "none", width=8)),
        p.timeseries("Deferrals per second", "Times the scheduler got 'not ready' and retried the request on a "
                     "later step.", [Query(q.counter_rate(c.DEFERRALS, BY_INSTANCE), "{{instance}}")],
                     "ops", width=8),
        p.timeseries("Deferred steps per lookup", "Scheduler steps a lookup was deferred before its answer was "
                     "used: 0 in sync mode, at least 1 in plain async mode.",
                     [Query(q.quantile(c.DEFERRED_STEPS, x), f"p{round(x * 100)}") for x in (0.5, 0.95, 0.99)]
                     + [Query(q.mean(c.DEFERRED_STEPS), "mean")], "none", width=8),
    ]


def _errors(p: Panels) -> list[Any]:
    breaker = value_text({"0": ("closed", "green"), "1": ("open", "red")})
    failed = ("error", "timeout", "rejected", "breaker_open")
    return [
        p.timeseries("Failed lookups per second", "Lookups answered as a miss because something went wrong: "
                     "store error, deadline passed, pending bound reached, breaker open; and replies that came "
                     "after their lookup had ended.",
                     [Query(_outcome_rate(failed, ("outcome",)), "{{outcome}}"),
                      Query(q.counter_rate(c.LATE_REPLIES), "late replies")], "ops", width=8),
        p.timeseries("Error and timeout ratio", "Lookups that ended in error or timeout over all lookups, "
                     "per instance.",
                     [Query(q.ratio(_outcome_rate(FAILED, BY_INSTANCE), q.counter_rate(c.REQUESTS, BY_INSTANCE)),
                            "{{instance}}")], "percentunit", width=8),
        p.state("Circuit breaker", "1 while an instance's breaker is open (lookups answer a miss at once, then "
                "one probe after the cool-down).",
                [Query(q.gauge(c.BREAKER_OPEN.name, "max", BY_INSTANCE), "{{instance}}")], width=8, height=8,
                mappings=[breaker], thresholds=[(None, "green"), (1, "red")]),
    ]


def _server(p: Panels) -> list[Any]:
    return [
        p.timeseries("Server frames by status", "Frames the lookup server answered per second, by status.",
                     [Query(q.counter_rate(c.SERVER_REQUESTS, ("status",)), "{{status}}")], "reqps", width=8),
        p.timeseries("Server queue and in-flight store calls", "Lookups received and not yet answered; store "
                     "calls running now.",
                     [Query(q.gauge(c.SERVER_QUEUE_DEPTH.name, "sum", BY_INSTANCE), "queued {{instance}}"),
                      Query(q.gauge(c.SERVER_INFLIGHT.name, "sum", BY_INSTANCE), "in flight {{instance}}")],
                     "none", width=8),
        p.timeseries("Store call latency", "One batch_is_exist call to the Mooncake store.",
                     _latency(c.SERVER_STORE_SECONDS), "s", width=8),
        p.timeseries("Lookups per store call", "How many lookups the server coalesced into one store call.",
                     [Query(q.quantile(c.SERVER_BATCH_SIZE, x), f"p{round(x * 100)}") for x in (0.5, 0.95)]
                     + [Query(q.mean(c.SERVER_BATCH_SIZE), "mean")], "none"),
        p.timeseries("Store errors per second", "Store calls that failed or returned error codes (the lookups "
                     "answer 'error', never a silent miss).",
                     [Query(q.counter_rate(c.SERVER_STORE_ERRORS, BY_INSTANCE), "{{instance}}")], "ops"),
        p.timeseries("Server memory waiting", "Bytes the lookup server holds for lookups not yet answered, and its "
                     "bounds (all peers, one peer): past one, frames are answered busy.",
                     [Query(q.gauge(c.SERVER_WAITING_BYTES.name, "sum", BY_INSTANCE), "waiting {{instance}}"),
                      *_bounds("bytes")], "bytes"),
        p.timeseries("Server keys waiting", "Store keys of the lookups the server has not answered yet, and its "
                     "bounds (all peers, one peer).",
                     [Query(q.gauge(c.SERVER_WAITING_KEYS.name, "sum", BY_INSTANCE), "waiting {{instance}}"),
                      *_bounds("keys")], "none"),
    ]


def _bounds(measure: str) -> list[Query]:
    """The server's bounds on ``measure`` (``server_bounds``), all peers and one peer, per instance."""
    return [Query(q.gauge(c.SERVER_BOUNDS.name, "max", BY_INSTANCE, extra=[f'scope="{scope}"', f'measure="{measure}"']),
                  f"bound, {who} {{{{instance}}}}") for scope, who in (("total", "all peers"), ("peer", "one peer"))]


def _store_ops(p: Panels) -> list[Any]:
    """vLLM's own Mooncake store-operation metrics (the worker's loads, saves and existence checks)."""
    by_op = ("operation", "status")
    return [
        p.timeseries("Store operations per second", "Mooncake store calls of vLLM's worker per second, by "
                     "operation (lookup_exists, save_exists, save_put, load_get) and status.",
                     [Query(q.rate_sum(km.STORE_OP_CALLS, by_op), "{{operation}} {{status}}")], "ops", width=8),
        p.timeseries("Store operation latency", "p50 and p95 of one store call of vLLM's worker, by operation.",
                     [Query(q.name_quantile(km.STORE_OP_SECONDS, x, ("operation",)),
                            f"p{round(x * 100)} {{{{operation}}}}") for x in (0.5, 0.95)], "s", width=8),
        p.timeseries("Bytes loaded and saved", "Bytes moved by store operations per second: load_get is "
                     "prefix reuse, save_put is the cache filling.",
                     [Query(q.rate_sum(km.STORE_OP_BYTES, ("operation",)), "{{operation}}")], "Bps", width=8),
        p.timeseries("Keys per second and failed keys", "Keys touched by store operations per second, and the "
                     "keys that failed (a failed load recomputes its blocks).",
                     [Query(q.rate_sum(km.STORE_OP_KEYS, ("operation",)), "{{operation}}"),
                      Query(q.rate_sum(km.STORE_OP_FAILED_KEYS, ("operation",)), "failed {{operation}}")], "ops"),
        p.timeseries("Failed store operations", "Store calls of vLLM's worker that ended with status error, per "
                     "second and operation.",
                     [Query(q.rate_sum(km.STORE_OP_CALLS, ("operation",), extra=['status="error"']),
                            "{{operation}}")], "ops"),
    ]


def _master(p: Panels) -> list[Any]:
    mv = dict(variables=q.MASTER_VARS)
    used = q.gauge(km.MASTER_ALLOCATED_BYTES, "sum", BY_INSTANCE, **mv)
    cap = q.gauge(km.MASTER_CAPACITY_BYTES, "sum", BY_INSTANCE, **mv)
    return [
        p.timeseries("BatchExistKey requests and keys", "Existence checks the master served per second, and "
                     "the keys they asked about.",
                     [Query(q.rate_sum(km.MASTER_BATCH_EXIST_REQUESTS, BY_INSTANCE, **mv), "requests {{instance}}"),
                      Query(q.rate_sum(km.MASTER_BATCH_EXIST_ITEMS, BY_INSTANCE, **mv), "keys {{instance}}")],
                     "ops", width=8),
        p.timeseries("BatchExistKey failures", "Failed existence-check requests and failed keys per second.",
                     [Query(q.rate_sum(km.MASTER_BATCH_EXIST_FAILURES, BY_INSTANCE, **mv), "requests {{instance}}"),
                      Query(q.rate_sum(km.MASTER_BATCH_EXIST_FAILED_ITEMS, BY_INSTANCE, **mv),
                            "keys {{instance}}")], "ops", width=8),
        p.timeseries("Keys and clients", "Keys the master holds and clients connected to it.",
                     [Query(q.gauge(km.MASTER_KEY_COUNT, "sum", BY_INSTANCE, **mv), "keys {{instance}}"),
                      Query(q.gauge(km.MASTER_ACTIVE_CLIENTS, "sum", BY_INSTANCE, **mv), "clients {{instance}}")],
                     "none", width=8),
        p.timeseries("Capacity used", "Allocated bytes over the capacity of all mounted segments (empty while "
                     "no segment is mounted).", [Query(q.ratio(used, cap), "{{instance}}")], "percentunit",
                     width=8),
        p.timeseries("Allocated and total bytes", "Bytes allocated and the capacity of all mounted segments.",
                     [Query(used, "allocated {{instance}}"), Query(cap, "capacity {{instance}}")], "bytes",
                     width=8),
        p.timeseries("Evictions", "Keys evicted per second and successful eviction runs per second: cached "
                     "prefixes lost to make room.",
                     [Query(q.rate_sum(km.MASTER_EVICTED_KEYS, BY_INSTANCE, **mv), "keys {{instance}}"),
                      Query(q.rate_sum(km.MASTER_SUCCESSFUL_EVICTIONS, BY_INSTANCE, **mv), "runs {{instance}}")],
                     "ops", width=8),
    ]


def build(tuning_uid: str) -> db.Dashboard:
    """The overview dashboard; ``tuning_uid`` is the uid of the tuning dashboard it links to."""
    p = Panels()
    d = new_dashboard(TITLE, UID, "Health of the Mooncake prefix-cache lookup path (mooncake-lookout). Generated "
                      "by dashboards/generate.py: do not edit by hand.",
                      link_to("Tuning lookup_async", tuning_uid, "Scheduler cost vs deferral vs delay, per mode"))
    for title, make in (("Health", _health), ("Traffic and hits", _traffic), ("Latency", _latency_row),
                        ("Scheduler", _scheduler), ("Errors and breaker", _errors), ("Lookup server", _server)):
        d = d.with_row(p.row(title))  # the row first, so ids follow the page from top to bottom
        for panel in make(p):
            d = d.with_panel(panel)
    store = p.row("Store operations (requires vLLM's worker metrics: the Mooncake store connector)")
    for panel in _store_ops(p):
        store = store.with_panel(panel)
    d = d.with_row(store)
    master = p.row("Mooncake master (requires a scrape of the master's /metrics)")
    for panel in _master(p):
        master = master.with_panel(panel)
    return d.with_row(master)


__all__ = ["TITLE", "UID", "build"]

"""The "Mooncake lookups / Tuning lookup_async" dashboard: what each lookup mode costs the scheduler.

Sync blocks the scheduler for a round trip; async never blocks but defers the request for at least one
step; a wait budget (``lookup_wait_us``) blocks a little to defer less. The panels put those three
figures side by side, per mode and instance, with notes on how to read them.
"""

from __future__ import annotations

from typing import Any

from grafana_foundation_sdk.builders import dashboard as db

from mooncake_lookout.connector.config import KEYS_BY_NAME, SYNC_BLOCK_MS, TIMEOUT_MS
from mooncake_lookout.metrics import catalogue as c

import known_metrics as km
import queries as q
from panels import Panels, Query
from variables import link_to, new_dashboard

UID = "mooncake-lookout-tuning"
TITLE = "Mooncake lookups / Tuning lookup_async"
BY_MODE = ("mode", "instance")
BY_INSTANCE = ("instance",)
QUANTILES = (0.5, 0.95, 0.99)

HOW_TO_READ = f"""\
**Three costs, one trade.** Each lookup mode pays for the prefix-cache answer somewhere:

| mode | `lookup_async` | `lookup_wait_us` | scheduler blocked per call | deferred steps | lookup delay |
| --- | --- | --- | --- | --- | --- |
| sync | false | - | about one round trip | 0 | one round trip |
| async | true | 0 | microseconds | at least 1 | one step or more |
| budget | true | > 0 | at most the budget | 0 when the answer comes in time | in between |

Read the rows below from left to right: **blocked time** is what every other request pays (the step is
longer), **deferred steps** is what this request pays (it waits a step even on a miss), **lookup delay** is
the whole wait from submit to use. Defaults: `lookup_async={KEYS_BY_NAME["lookup_async"].default}`,
`lookup_wait_us={KEYS_BY_NAME["lookup_wait_us"].default}`, \
`lookup_timeout_ms={KEYS_BY_NAME["lookup_timeout_ms"].default}` ({TIMEOUT_MS:g} ms), \
`lookup_block_ms={KEYS_BY_NAME["lookup_block_ms"].default}` ({SYNC_BLOCK_MS:g} ms: in sync mode a lookup unanswered \
by then is deferred, as in async mode).
"""

WHAT_TO_CHANGE = """\
* **Blocked share above a few percent in sync mode** - the scheduler spends that share of its time waiting
  on the store: switch to `lookup_async: true` (with a budget if deferrals then hurt).
* **Deferred steps p95 >= 2 in async mode** - answers come later than one step: look at the round trip and
  the server queue on the Overview; use the `pipelined` transport if lookups queue behind each other.
* **Round trip p95 below one step (~1 ms)** - set `lookup_wait_us: auto` (it follows the round trip's p90,
  capped by `lookup_wait_auto_share` of the step) or a fixed budget near the round-trip p95 (in us): most
  answers then arrive inside the budget and defer 0 steps, while blocked time stays bounded.
* **Delay minus round trip is large** - the answer was ready but the request waited for its next step.
"""


def _quantiles(spec: c.MetricSpec, labels: tuple[str, ...]) -> list[Query]:
    legend = " ".join(f"{{{{{lab}}}}}" for lab in labels)
    return [Query(q.quantile(spec, x, labels), f"p{round(x * 100)} {legend}") for x in QUANTILES]


def _panels(p: Panels) -> list[tuple[db.Row, list[Any]]]:
    """(row title, panels) pairs; each row id is taken before its panels' ids, in page order."""
    blocked = c.SCHEDULER_BLOCKED_SECONDS
    return [
        (p.row("How to read this dashboard"), [
            p.note("Lookup modes and what they cost", HOW_TO_READ, width=14, height=9),
            p.note("What to change", WHAT_TO_CHANGE, width=10, height=9)]),
        (p.row("Scheduler cost (what every request pays)"), [
            p.timeseries("Scheduler blocked per call, by mode", "Time one scheduler call spent inside the "
                         "lookup path: a round trip in sync mode, at most the wait budget in budget mode.",
                         _quantiles(blocked, BY_MODE), "s", width=8),
            p.timeseries("Share of scheduler time inside lookups", "Seconds per second the scheduler spent "
                         "inside the lookup path: the slice of every step lost to lookups.",
                         [Query(q.rate_sum(q.series(blocked, "_sum"), BY_MODE), "{{mode}} {{instance}}")],
                         "percentunit", width=8),
            p.timeseries("Step interval and lookup time per step", "Time between two scheduler steps (what "
                         "lookup_wait_us auto caps its wait by, a share of it) beside the time each step spent "
                         "inside the lookup path; mooncake-lookout advise reads the same figures.",
                         [*(Query(q.quantile(c.STEP_INTERVAL_SECONDS, x, BY_INSTANCE), f"step p{round(x * 100)} "
                                  "{{instance}}") for x in QUANTILES[:2]),
                          Query(q.ratio(q.rate_sum(q.series(blocked, "_sum"), BY_INSTANCE),
                                        q.rate_sum(q.series(c.STEP_INTERVAL_SECONDS, "_count"), BY_INSTANCE)),
                                "lookup time per step {{instance}}")], "s", width=8),
        ]),
        (p.row("Deferral (what the request pays)"), [
            p.timeseries("Deferred steps per lookup", "Scheduler steps a request was parked before its lookup "
                         "answer was used; 0 in sync mode.", _quantiles(c.DEFERRED_STEPS, BY_INSTANCE), "none",
                         width=8),
            p.timeseries("Deferrals per second", "Times the scheduler got 'not ready' and retried on a later "
                         "step.", [Query(q.counter_rate(c.DEFERRALS, BY_INSTANCE), "{{instance}}")], "ops",
                         width=8),
            p.timeseries("Waiting requests by reason (vLLM)", "vLLM's waiting queue: 'deferred' includes "
                         "requests parked for a lookup answer; empty outside vLLM.",
                         [Query(q.gauge(km.REQUESTS_WAITING_BY_REASON, "sum", ("reason",)), "{{reason}}")],
                         "none", width=8),
        ]),
        (p.row("Wait budget and held answers"), [
            p.timeseries("Wait budget in force vs round trip", "The per-step wait budget the client runs with "
                         "(lookup_wait_us, or what auto chose from the measured round trip) beside the round "
                         "trip's p90: a budget above the p90 uses most answers in the step they were asked for.",
                         [Query(q.gauge(c.WAIT_BUDGET_SECONDS.name, "max", BY_INSTANCE), "budget {{instance}}"),
                          Query(q.quantile(c.RPC_SECONDS, 0.9, BY_INSTANCE), "round trip p90 {{instance}}")], "s",
                         width=8),
            p.timeseries("Answers held for waiting requests", "Answers kept until their requests are allocated, "
                         "against lookup_max_held; forgotten ones per second by reason (expired: older than "
                         "lookup_answer_ttl_ms; evicted: over the bound) are asked again when needed.",
                         [Query(q.gauge(c.HELD.name, "sum", BY_INSTANCE), "held {{instance}}"),
                          Query(q.gauge(c.MAX_HELD.name, "max", BY_INSTANCE), "bound {{instance}}"),
                          Query(q.counter_rate(c.ANSWERS_DROPPED, ("reason", "instance")),
                                "dropped/s {{reason}} {{instance}}")], "none", width=8),
            p.timeseries("Lookups sent at arrival, never taken", "Lookups sent as their request arrived "
                         "(lookup_on_arrival) that the request never took over, per second by reason (each also "
                         "counts as discarded; its reply is no late reply): unclaimed (aborted before admission), "
                         "prompt_changed, reset, closed. A steady unclaimed rate is client disconnects, not the "
                         "server.", [Query(q.counter_rate(c.ARRIVALS_DROPPED, ("reason", "instance")),
                                           "{{reason}} {{instance}}")], "ops", width=8),
        ]),
        (p.row("Prefix cache (long prompts ask only for what is new)"), [
            p.timeseries("Blocks the prefix cache knew", "Of the blocks that could count toward a hit, the share "
                         "the prefix cache knew present (not asked of the store), and lookups it answered whole "
                         "with no round trip per second. Multi-turn chat and RAG approach 1 from the second turn.",
                         [Query(q.ratio(q.counter_rate(c.PREFIX_CACHE_KNOWN_BLOCKS, BY_INSTANCE),
                                        q.counter_rate(c.PREFIX_CACHE_QUERY_BLOCKS, BY_INSTANCE)),
                                "known share {{instance}}"),
                          Query(q.counter_rate(c.PREFIX_CACHE_ANSWERS, BY_INSTANCE),
                                "answered locally/s {{instance}}")], "percentunit"),
            p.timeseries("Prefix cache size and clears", "Blocks remembered (against lookup_prefix_cache_blocks) "
                         "and clears per second by reason: reset (this instance), epoch (the store was wiped by "
                         "any instance, or the master restarted), failure (a lookup failed); 1 while the cache is "
                         "unproven (no store epoch from the server: nothing cached, no hit held; "
                         "MooncakeLookupPrefixCacheOff), and a standalone server's reason (its lease probe: probing, "
                         "store_refused: no memory lent to the store yet, lease_too_short; off by configuration).",
                         [Query(q.gauge(c.PREFIX_CACHE_BLOCKS.name, "sum", BY_INSTANCE), "blocks {{instance}}"),
                          Query(q.counter_rate(c.PREFIX_CACHE_CLEARS, ("reason", "instance")),
                                "clears/s {{reason}} {{instance}}"),
                          Query(q.gauge(c.PREFIX_CACHE_STATE.name, "max", BY_INSTANCE, extra=['state="unproven"']),
                                "unproven {{instance}}"),
                          Query(q.gauge(c.SERVER_PREFIX_CACHE_STATE.name, "max", ("state", "instance"),
                                        extra=['state!="on"']), "server {{state}} {{instance}}")], "none"),
        ]),
        (p.row("Lookup delay (what the answer costs end to end)"), [
            p.timeseries("Submit to answer used", "From submitting a lookup to the scheduler using the answer.",
                         _quantiles(c.SECONDS, BY_INSTANCE), "s"),
            p.timeseries("Where the delay goes (means)", "Mean queue wait, round trip and submit-to-use time: "
                         "submit-to-use minus queue and round trip is time the ready answer waited for the "
                         "request's next step.",
                         [Query(q.mean(c.QUEUE_SECONDS, BY_INSTANCE), "queue {{instance}}"),
                          Query(q.mean(c.RPC_SECONDS, BY_INSTANCE), "round trip {{instance}}"),
                          Query(q.mean(c.SECONDS, BY_INSTANCE), "submit to use {{instance}}")], "s"),
        ]),
        (p.row("Configuration"), [
            p.table("Lookup configuration per instance", "The lookup settings each instance runs with (labels "
                    "of the info metric).", [Query(q.gauge(c.INFO.name, "max", ("job", "instance", "model_name",
                                                                               "engine", *c.INFO.labels)),
                                                   "", instant=True)]),
        ]),
    ]


def build(overview_uid: str) -> db.Dashboard:
    """The tuning dashboard; ``overview_uid`` is the uid of the overview dashboard it links to."""
    p = Panels()
    d = new_dashboard(TITLE, UID, "Choose lookup_async and lookup_wait_us: scheduler blocked time vs deferred steps "
                      "vs lookup delay. Generated by dashboards/generate.py: do not edit by hand.",
                      link_to("Overview", overview_uid, "Health of the lookup path"))
    for row, panels in _panels(p):
        d = d.with_row(row)
        for panel in panels:
            d = d.with_panel(panel)
    return d


__all__ = ["TITLE", "UID", "build"]

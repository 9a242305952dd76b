"""Lookup metrics through vLLM's own stats pipeline, so they appear on vLLM's ``/metrics``.

How the figures travel (vLLM 0.33):

1. The client keeps a log of the step (the lookups that ended, the deferrals: an append each); the
   connector's ``get_kv_connector_stats()`` calls :meth:`LookupStatsCollector.take` once per step, which at
   most every :data:`RECORD_EVERY_S` (and at once when the engine is about to go idle) wraps the log, raw, into
   one record (a row of :data:`LOOKUP_ROW` per lookup) and hands vLLM a :class:`LookoutLookupStats`. Nothing
   is counted or bucketed on the scheduler's thread.
2. vLLM's scheduler aggregates it with the workers' stats (upstream's ``MooncakeStoreConnectorStats``),
   calls ``to_dict()`` and ships the dict to the API server (msgpack or pickle, on vLLM's output thread). So
   ``data`` holds only ``dict``/``list``/``tuple``/``str``/``int``/``float``/``None`` (an outcome is a ``str``
   enum; tuples and enums arrive as lists and strings), and every value in it is a list: upstream's
   ``aggregate`` (``setdefault(key, []).extend(...)``) then merges ours without loss, and so does ours.
3. On the API server the connector's ``build_prom_metrics`` returns :class:`LookoutPromMetrics`, whose
   ``observe`` turns each raw record into the step's figures (:func:`step_figures`) and records them into
   families named by :mod:`.catalogue`, labelled with vLLM's
   ``model_name`` and ``engine``. Upstream's store-operation records in the same payload go on to
   upstream's ``MooncakeStorePromMetrics``, so replacing the connector loses none of its metrics.

The collector runs on the scheduler's thread; late replies are read as the transport's own counter (bumped by
its thread), never a shared structure. No lock anywhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from statistics import fmean
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.metrics import (
    MooncakeStoreConnectorStats,
    MooncakeStorePromMetrics,
)

from mooncake_lookout.connector.config import ConfigError, LookupConfig
from mooncake_lookout.connector.events import LookupRecord, Outcome
from mooncake_lookout.connector.step_log import StepLog
from mooncake_lookout.metrics import catalogue as cat
from mooncake_lookout.metrics.prometheus_sink import info_labels

logger = logging.getLogger(__name__)

# The payload key under which our per-step records travel; upstream's keys are operation names.
STATS_KEY = "mooncake_lookout"

# Step record fields are the catalogue's short keys, so no metric name is spelled here.
_REQUESTS = cat.REQUESTS.key
_QUERIED = cat.QUERIED_TOKENS.key
_HIT = cat.HIT_TOKENS.key
_DEFERRALS = cat.DEFERRALS.key
_LATE = cat.LATE_REPLIES.key
_PENDING = cat.PENDING.key
_MAX_PENDING = cat.MAX_PENDING.key
_HELD = cat.HELD.key
_MAX_HELD = cat.MAX_HELD.key
_DROPPED = cat.ANSWERS_DROPPED.key
_ARRIVALS_DROPPED = cat.ARRIVALS_DROPPED.key
_BUDGET = cat.WAIT_BUDGET_SECONDS.key
_CACHE_BLOCKS = cat.PREFIX_CACHE_BLOCKS.key
_CACHE_QUERY = cat.PREFIX_CACHE_QUERY_BLOCKS.key
_CACHE_KNOWN = cat.PREFIX_CACHE_KNOWN_BLOCKS.key
_CACHE_ANSWERS = cat.PREFIX_CACHE_ANSWERS.key
_CACHE_CLEARS = cat.PREFIX_CACHE_CLEARS.key
_CACHE_STATE = cat.PREFIX_CACHE_STATE.key
_BREAKER = cat.BREAKER_OPEN.key
_STEPS = cat.DEFERRED_STEPS.key
_QUEUE = cat.QUEUE_SECONDS.key
_RPC = cat.RPC_SECONDS.key
_SECONDS = cat.SECONDS.key
_BLOCKED = cat.SCHEDULER_BLOCKED_SECONDS.key
_INTERVAL = cat.STEP_INTERVAL_SECONDS.key
_COUNTERS = (_QUERIED, _HIT, _DEFERRALS, _LATE, _CACHE_QUERY, _CACHE_KNOWN, _CACHE_ANSWERS)
_DISCARDED, _ERROR = Outcome.DISCARDED.value, Outcome.ERROR.value
_HIT_OUTCOME, _MISS_OUTCOME = Outcome.HIT.value, Outcome.MISS.value
_HISTOGRAMS = (_STEPS, _QUEUE, _RPC, _SECONDS, _INTERVAL)
# A raw step record's lookups: one row each, these fields of the lookup in this order (step_figures reads them).
_LOOKUPS = "lookups"
LOOKUP_ROW = ("outcome", "num_tokens", "hit_length", "countable_blocks", "known_blocks", "from_cache", "deferrals",
              "t_submit", "t_start", "t_answer", "t_consume")
_row = attrgetter(*LOOKUP_ROW)
# How often the scheduler's thread wraps its log into a record for vLLM, at most (and when the engine goes idle).
RECORD_EVERY_S = 0.1
_clock = time.monotonic


@dataclass
class LookoutLookupStats(KVConnectorStats):
    """Serialisable lookup figures of one or more scheduler steps (plus upstream's, once aggregated).

    ``data[STATS_KEY]`` is a list of step records; other keys are upstream's store operations.
    """

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        """Forget everything collected."""
        self.data: dict[str, Any] = {}

    def is_empty(self) -> bool:
        """True when no step and no upstream operation is held."""
        return not any(self.data.values())

    def aggregate(self, other: KVConnectorStats) -> LookoutLookupStats:
        """Append ``other``'s step records and operation records to ours (lists concatenate)."""
        for key, records in other.data.items():
            if records:
                self.data.setdefault(key, []).extend(records)
        return self

    def lookup_steps(self) -> list[dict[str, Any]]:
        """Our steps' figures (:func:`step_figures` of each raw record), oldest first."""
        return [step_figures(raw) for raw in self.data.get(STATS_KEY, [])]

    def reduce(self) -> dict[str, int | float]:
        """One summary line per logging interval: lookups, outcomes, hit ratio, deferrals, mean latency."""
        reduced: dict[str, int | float] = {}
        steps = self.lookup_steps()
        if steps:
            outcomes: dict[str, int] = {}
            for step in steps:
                for outcome, n in step.get(_REQUESTS, {}).items():
                    outcomes[outcome] = outcomes.get(outcome, 0) + n
            queried = sum(s.get(_QUERIED, 0) for s in steps)
            hit = sum(s.get(_HIT, 0) for s in steps)
            seconds = [v for s in steps for v in s.get(_SECONDS, ())]
            reduced["lookups"] = sum(outcomes.values())
            for outcome in cat.OUTCOMES:
                if outcomes.get(outcome):
                    reduced[f"lookup_{outcome}"] = outcomes[outcome]
            reduced["lookup_hit_token_ratio"] = round(hit / queried, 4) if queried else 0.0
            reduced["lookup_deferrals"] = sum(s.get(_DEFERRALS, 0) for s in steps)
            reduced["lookup_pending"] = steps[-1].get(_PENDING, 0)
            if seconds:
                reduced["lookup_avg_ms"] = round(fmean(seconds) * 1e3, 3)
        upstream = {k: v for k, v in self.data.items() if k != STATS_KEY and v}
        if upstream:
            reduced.update(MooncakeStoreConnectorStats(data=upstream).reduce())
        return reduced


class LookupStatsCollector:
    """Turns the client's step log into vLLM's stats record (:meth:`take`, called once per step on the scheduler's
    thread), at most every ``every_s`` seconds: a record per step would cost the scheduler's thread more than the
    lookup itself at one lookup a step, for figures Prometheus scrapes every few seconds.

    The client keeps the log (connector/step_log.py: the lookups that ended, the deferrals, the calls' times);
    nothing is lost between records, only wrapped later. The lookups to trace (``sampled``) are kept from the
    last log taken, for the adapter to hand to the tracing thread.
    """

    def __init__(self, client: Any, every_s: float | None = None) -> None:
        self.client = client
        client.take_log()  # the client keeps its log from now on
        self.every_s = RECORD_EVERY_S if every_s is None else every_s
        self.sampled: Sequence[LookupRecord] = ()
        self._late_taken = 0
        self._mode = client.config.mode
        self.clock = _clock
        self.due = 0.0  # on ``clock``: no record before it unless flushed (the first step with news makes one)

    def take(self, flush: bool = False) -> LookoutLookupStats | None:
        """The figures since the last record, or ``None`` (vLLM's "nothing this step"): none to report, or the
        last record is younger than ``every_s`` and ``flush`` (the engine is about to go idle) was not asked.

        The record is raw (:data:`LOOKUP_ROW` per lookup, the log's lists as they are): counting, summing and
        bucketing happen where vLLM reads it (:func:`step_figures`, in the API server), not on this thread."""
        client = self.client
        log = client.log
        now = _clock()
        if log is None or not (flush or now >= self.due):
            self.sampled = ()
            return None
        late = client.transport.late_replies - self._late_taken
        if not (log or late):
            self.sampled = ()
            return None
        client.log = StepLog()
        self.due = now + self.every_s
        self.sampled = log.sampled
        self._late_taken += late
        return LookoutLookupStats(data={STATS_KEY: [{
            _LOOKUPS: list(map(_row, log.ended)), _PENDING: client.pending, _HELD: client.held,
            _BUDGET: client.budget.in_force_s, _CACHE_BLOCKS: len(client.cache or ()), _DEFERRALS: log.deferrals,
            _LATE: late, _DROPPED: log.dropped, _ARRIVALS_DROPPED: log.arrivals_dropped, _CACHE_CLEARS: log.clears,
            _INTERVAL: log.intervals, _BLOCKED: {self._mode: log.calls}, _BREAKER: log.breaker,
            _CACHE_STATE: client.store_view.state}]})


def step_figures(raw: dict[str, Any]) -> dict[str, Any]:
    """One step's figures from its raw record: outcomes counted, tokens summed, the lookups' times as the
    histograms' observations; the gauges as they were; a counter, list or change only when it has something."""
    step: dict[str, Any] = {key: raw[key] for key in (_PENDING, _HELD, _BUDGET, _CACHE_BLOCKS)}
    if (state := raw.get(_CACHE_STATE)) is not None:  # a gauge of one label value: on, off or unproven
        step[_CACHE_STATE] = state
    requests: dict[str, int] = {}
    step[_REQUESTS] = requests
    rows = raw[_LOOKUPS]
    if rows:
        steps: list[int] = []
        queue: list[float] = []
        rpc: list[float] = []
        seconds: list[float] = []
        queried = hit = cache_query = cache_known = cache_answers = 0
        for outcome, num_tokens, hit_length, countable, known, from_cache, deferrals, t_submit, t_start, t_answer, \
                t_consume in rows:
            # An Outcome before the wire, its value (a str) after it: the label is the value either way.
            outcome = _ERROR if outcome is None else getattr(outcome, "value", outcome)
            requests[outcome] = requests.get(outcome, 0) + 1
            if outcome == _DISCARDED:
                continue
            if outcome in (_HIT_OUTCOME, _MISS_OUTCOME):
                queried += num_tokens
            hit += hit_length
            if countable:
                cache_query += countable
                cache_known += known
                cache_answers += from_cache
            steps.append(deferrals)
            if t_start is not None:
                queue.append(t_start - t_submit)
                if t_answer is not None:
                    rpc.append(t_answer - t_start)
                if t_consume is not None:
                    seconds.append(t_consume - t_submit)
        step.update({_STEPS: steps, _QUEUE: queue, _RPC: rpc, _SECONDS: seconds, _QUERIED: queried, _HIT: hit})
        if cache_query:
            step.update({_CACHE_QUERY: cache_query, _CACHE_KNOWN: cache_known, _CACHE_ANSWERS: cache_answers})
    for key in (_DEFERRALS, _LATE, _DROPPED, _ARRIVALS_DROPPED, _CACHE_CLEARS, _INTERVAL):
        if raw.get(key):
            step[key] = raw[key]
    if any(raw[_BLOCKED].values()):
        step[_BLOCKED] = raw[_BLOCKED]
    if raw[_BREAKER] is not None:
        step[_BREAKER] = 1 if raw[_BREAKER] else 0
    return step


class LookoutPromMetrics(KVConnectorPromMetrics):
    """Records :class:`LookoutLookupStats` payloads into vLLM's Prometheus metrics, per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
                 *, include_store_metrics: bool = True) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._store = (MooncakeStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
                       if include_store_metrics else None)
        labelnames = list(labelnames)
        self._families: dict[str, Any] = {}
        for spec in cat.CATALOGUE:
            if spec.side != "client":
                continue
            kwargs: dict[str, Any] = dict(name=spec.name, documentation=spec.help,
                                          labelnames=labelnames + list(spec.labels))
            if spec.kind == "histogram":
                cls = self._histogram_cls
                kwargs["buckets"] = list(spec.buckets)
            elif spec.kind == "counter":
                cls = self._counter_cls
            else:
                cls = self._gauge_cls
                kwargs["multiprocess_mode"] = "mostrecent"
            self._families[spec.key] = cls(**kwargs)
        self._children: dict[tuple[int, str, str], Any] = {}
        for engine_idx in per_engine_labelvalues:
            for outcome in cat.OUTCOMES:  # every outcome series exists from the start
                self._child(engine_idx, _REQUESTS, outcome)
            for reason in cat.DROP_REASONS:
                self._child(engine_idx, _DROPPED, reason)
            for reason in cat.ARRIVAL_DROP_REASONS:
                self._child(engine_idx, _ARRIVALS_DROPPED, reason)
            for reason in cat.CACHE_CLEAR_REASONS:
                self._child(engine_idx, _CACHE_CLEARS, reason)
            for state in cat.PREFIX_CACHE_STATES:
                self._child(engine_idx, _CACHE_STATE, state)
            for key in (*_COUNTERS, _PENDING, _BREAKER, _HELD, _BUDGET, _CACHE_BLOCKS):
                self._child(engine_idx, key)
        self._publish_info(vllm_config)

    def _child(self, engine_idx: int, key: str, label: str = "") -> Any:
        """The labelled series of family ``key`` for one engine (and one extra label value)."""
        child = self._children.get((engine_idx, key, label))
        if child is None:
            values = list(self.per_engine_labelvalues[engine_idx]) + ([label] if label else [])
            child = self._children[(engine_idx, key, label)] = self._families[key].labels(*values)
        return child

    def _publish_info(self, vllm_config: Any) -> None:
        """Set the ``info`` series and the pending bound from the connector's extra config, for every engine."""
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        try:
            config = LookupConfig.from_extra_config(getattr(ktc, "kv_connector_extra_config", None) or {})
        except ConfigError as exc:  # the connector itself fails at start-up with this message
            logger.warning("mooncake-lookout info metrics not published: %s", exc)
            return
        values = list(info_labels(config).values())
        for engine_idx, labelvalues in self.per_engine_labelvalues.items():
            self._families[cat.INFO.key].labels(*labelvalues, *values).set(1)
            self._child(engine_idx, _MAX_PENDING).set(config.lookup_max_pending)
            self._child(engine_idx, _MAX_HELD).set(config.lookup_max_held)

    def observe(self, transfer_stats_data: dict[str, Any] | None, engine_idx: int = 0) -> None:
        """Record one stats payload (our steps and upstream's operations) for ``engine_idx``."""
        if not transfer_stats_data:
            return
        upstream: dict[str, Any] = {}
        for key, records in transfer_stats_data.items():
            if key == STATS_KEY:
                for raw in records:
                    self._observe_step(step_figures(raw), engine_idx)
            elif records:
                upstream[key] = records
        if upstream and self._store is not None:
            self._store.observe(upstream, engine_idx)

    def _observe_step(self, step: dict[str, Any], engine_idx: int) -> None:
        for outcome, n in step.get(_REQUESTS, {}).items():
            self._child(engine_idx, _REQUESTS, outcome).inc(n)
        for key in _COUNTERS:
            if n := step.get(key, 0):
                self._child(engine_idx, key).inc(n)
        for key in _HISTOGRAMS:
            child = None
            for value in step.get(key, ()):
                child = child or self._child(engine_idx, key)
                child.observe(value)
        for mode, values in step.get(_BLOCKED, {}).items():
            child = self._child(engine_idx, _BLOCKED, mode)
            for value in values:
                child.observe(value)
        for reason, n in step.get(_DROPPED, {}).items():
            self._child(engine_idx, _DROPPED, reason).inc(n)
        for reason, n in step.get(_ARRIVALS_DROPPED, {}).items():
            self._child(engine_idx, _ARRIVALS_DROPPED, reason).inc(n)
        for reason, n in step.get(_CACHE_CLEARS, {}).items():
            self._child(engine_idx, _CACHE_CLEARS, reason).inc(n)
        for key in (_PENDING, _HELD, _BUDGET, _CACHE_BLOCKS):
            if key in step:
                self._child(engine_idx, key).set(step[key])
        if _BREAKER in step:
            self._child(engine_idx, _BREAKER).set(step[_BREAKER])
        if (state := step.get(_CACHE_STATE)) is not None:
            for name in cat.PREFIX_CACHE_STATES:
                self._child(engine_idx, _CACHE_STATE, name).set(1 if name == state else 0)


def build_kv_connector_stats(data: dict[str, Any] | None = None) -> LookoutLookupStats:
    """What the connector's ``build_kv_connector_stats`` classmethod returns (the logger rebuilds stats with it)."""
    return LookoutLookupStats(data=data) if data is not None else LookoutLookupStats()


def build_prom_metrics(vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
                       labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                       ) -> LookoutPromMetrics:
    """What the connector's ``build_prom_metrics`` classmethod returns."""
    return LookoutPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


__all__ = [
    "LOOKUP_ROW", "RECORD_EVERY_S", "LookoutLookupStats", "LookoutPromMetrics", "LookupStatsCollector", "STATS_KEY",
    "build_kv_connector_stats", "build_prom_metrics", "step_figures",
]

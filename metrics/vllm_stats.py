"""Lookup metrics through vLLM's own stats pipeline, so they appear on vLLM's ``/metrics``.

How the figures travel (vLLM 0.33):

1. :class:`LookupStatsCollector` is a :class:`LookupObserver` on the scheduler's thread. It adds each
   event to the current step's record; the connector's ``get_kv_connector_stats()`` calls
   :meth:`LookupStatsCollector.take` once per step and hands vLLM a :class:`LookoutLookupStats`.
2. vLLM's scheduler aggregates it with the workers' stats (upstream's ``MooncakeStoreConnectorStats``),
   calls ``to_dict()`` and ships the dict to the API server (msgpack or pickle). So ``data`` holds only
   plain ``dict``/``list``/``str``/``int``/``float``, and every value in it is a list: upstream's
   ``aggregate`` (``setdefault(key, []).extend(...)``) then merges ours without loss, and so does ours.
3. On the API server the connector's ``build_prom_metrics`` returns :class:`LookoutPromMetrics`, whose
   ``observe`` records each step into families named by :mod:`.catalogue`, labelled with vLLM's
   ``model_name`` and ``engine``. Upstream's store-operation records in the same payload go on to
   upstream's ``MooncakeStorePromMetrics``, so replacing the connector loses none of its metrics.

The collector touches its step record only on the scheduler's thread; ``late_reply`` (on the ``upstream``
transport's thread) bumps a plain integer that the scheduler reads, never a shared structure. No lock anywhere.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
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
from mooncake_lookout.connector.events import LookupRecord, NullObserver, Outcome
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
_BUDGET = cat.WAIT_BUDGET_SECONDS.key
_CACHE_BLOCKS = cat.PREFIX_CACHE_BLOCKS.key
_CACHE_QUERY = cat.PREFIX_CACHE_QUERY_BLOCKS.key
_CACHE_KNOWN = cat.PREFIX_CACHE_KNOWN_BLOCKS.key
_CACHE_ANSWERS = cat.PREFIX_CACHE_ANSWERS.key
_CACHE_CLEARS = cat.PREFIX_CACHE_CLEARS.key
_BREAKER = cat.BREAKER_OPEN.key
_STEPS = cat.DEFERRED_STEPS.key
_QUEUE = cat.QUEUE_SECONDS.key
_RPC = cat.RPC_SECONDS.key
_SECONDS = cat.SECONDS.key
_BLOCKED = cat.SCHEDULER_BLOCKED_SECONDS.key
_INTERVAL = cat.STEP_INTERVAL_SECONDS.key
_COUNTERS = (_QUERIED, _HIT, _DEFERRALS, _LATE, _CACHE_QUERY, _CACHE_KNOWN, _CACHE_ANSWERS)
_HISTOGRAMS = (_STEPS, _QUEUE, _RPC, _SECONDS, _INTERVAL)


def _new_step(pending: int) -> dict[str, Any]:
    return {_REQUESTS: {}, _QUERIED: 0, _HIT: 0, _DEFERRALS: 0, _LATE: 0, _PENDING: pending,
            _CACHE_QUERY: 0, _CACHE_KNOWN: 0, _CACHE_ANSWERS: 0,
            _STEPS: [], _QUEUE: [], _RPC: [], _SECONDS: [], _INTERVAL: [], _BLOCKED: {}, _DROPPED: {},
            _CACHE_CLEARS: {}}


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
        """Our step records, oldest first."""
        return self.data.get(STATS_KEY, [])

    def reduce(self) -> dict[str, int | float]:
        """One summary line per logging interval: lookups, outcomes, hit ratio, deferrals, mean latency."""
        reduced: dict[str, int | float] = {}
        steps = self.lookup_steps()
        if steps:
            outcomes: dict[str, int] = {}
            for step in steps:
                for outcome, n in step[_REQUESTS].items():
                    outcomes[outcome] = outcomes.get(outcome, 0) + n
            queried = sum(s[_QUERIED] for s in steps)
            hit = sum(s[_HIT] for s in steps)
            seconds = [v for s in steps for v in s[_SECONDS]]
            reduced["lookups"] = sum(outcomes.values())
            for outcome in cat.OUTCOMES:
                if outcomes.get(outcome):
                    reduced[f"lookup_{outcome}"] = outcomes[outcome]
            reduced["lookup_hit_token_ratio"] = round(hit / queried, 4) if queried else 0.0
            reduced["lookup_deferrals"] = sum(s[_DEFERRALS] for s in steps)
            reduced["lookup_pending"] = steps[-1][_PENDING]
            if seconds:
                reduced["lookup_avg_ms"] = round(fmean(seconds) * 1e3, 3)
        upstream = {k: v for k, v in self.data.items() if k != STATS_KEY and v}
        if upstream:
            reduced.update(MooncakeStoreConnectorStats(data=upstream).reduce())
        return reduced


class LookupStatsCollector(NullObserver):
    """Scheduler-side observer that fills one step record; :meth:`take` hands it to vLLM each step."""

    def __init__(self) -> None:
        self._pending = 0
        self._step: dict[str, Any] | None = None
        self._late_replies = 0  # written by the transport thread only
        self._late_taken = 0  # read by the scheduler thread only

    def _current(self) -> dict[str, Any]:
        step = self._step
        if step is None:
            step = self._step = _new_step(self._pending)
        return step

    def submitted(self, rec: LookupRecord) -> None:
        self._pending += 1
        self._current()[_PENDING] = self._pending

    def deferred(self, rec: LookupRecord) -> None:
        self._current()[_DEFERRALS] += 1

    def consumed(self, rec: LookupRecord) -> None:
        step = self._current()
        outcome = rec.outcome.value if rec.outcome is not None else Outcome.ERROR.value
        step[_REQUESTS][outcome] = step[_REQUESTS].get(outcome, 0) + 1
        if rec.store_answered:
            step[_QUERIED] += rec.num_tokens
        step[_HIT] += rec.hit_tokens
        if rec.countable_blocks:
            step[_CACHE_QUERY] += rec.countable_blocks
            step[_CACHE_KNOWN] += rec.known_blocks
            step[_CACHE_ANSWERS] += rec.from_cache
        step[_STEPS].append(rec.deferrals)
        if (q := rec.queue_seconds) is not None:
            step[_QUEUE].append(q)
        if (r := rec.rpc_seconds) is not None:
            step[_RPC].append(r)
        if (t := rec.total_seconds) is not None:
            step[_SECONDS].append(t)
        self._pending -= 1
        step[_PENDING] = self._pending

    def discarded(self, rec: LookupRecord) -> None:
        step = self._current()
        discarded = Outcome.DISCARDED.value
        step[_REQUESTS][discarded] = step[_REQUESTS].get(discarded, 0) + 1
        self._pending -= 1
        step[_PENDING] = self._pending

    def breaker_changed(self, is_open: bool) -> None:
        self._current()[_BREAKER] = 1 if is_open else 0

    def answer_dropped(self, rec: LookupRecord, reason: str) -> None:
        dropped = self._current()[_DROPPED]
        dropped[reason] = dropped.get(reason, 0) + 1

    def step_ended(self, wait_budget_s: float, held: int, cached_blocks: int,
                   interval_s: float | None = None) -> None:
        step = self._current()
        step[_BUDGET] = wait_budget_s
        step[_HELD] = held
        step[_CACHE_BLOCKS] = cached_blocks
        if interval_s is not None:
            step[_INTERVAL].append(interval_s)

    def cache_cleared(self, reason: str, blocks: int) -> None:
        clears = self._current()[_CACHE_CLEARS]
        clears[reason] = clears.get(reason, 0) + 1

    def scheduler_call(self, mode: str, seconds: float) -> None:
        self._current()[_BLOCKED].setdefault(mode, []).append(seconds)

    def late_reply(self) -> None:
        """A reply came for a lookup that had ended (transport thread; only bumps an integer)."""
        self._late_replies += 1

    def take(self) -> LookoutLookupStats:
        """This step's figures (empty when nothing happened); the next event starts a new step."""
        late = self._late_replies
        if late != self._late_taken:
            self._current()[_LATE] = late - self._late_taken
            self._late_taken = late
        step, self._step = self._step, None
        return LookoutLookupStats(data={STATS_KEY: [step]} if step is not None else {})


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
            for reason in cat.CACHE_CLEAR_REASONS:
                self._child(engine_idx, _CACHE_CLEARS, reason)
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
                for step in records:
                    self._observe_step(step, engine_idx)
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
        for reason, n in step.get(_CACHE_CLEARS, {}).items():
            self._child(engine_idx, _CACHE_CLEARS, reason).inc(n)
        for key in (_PENDING, _HELD, _BUDGET, _CACHE_BLOCKS):
            if key in step:
                self._child(engine_idx, key).set(step[key])
        if _BREAKER in step:
            self._child(engine_idx, _BREAKER).set(step[_BREAKER])


def build_kv_connector_stats(data: dict[str, Any] | None = None) -> LookoutLookupStats:
    """What the connector's ``build_kv_connector_stats`` classmethod returns (the logger rebuilds stats with it)."""
    return LookoutLookupStats(data=data) if data is not None else LookoutLookupStats()


def build_prom_metrics(vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
                       labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                       ) -> LookoutPromMetrics:
    """What the connector's ``build_prom_metrics`` classmethod returns."""
    return LookoutPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


__all__ = [
    "LookoutLookupStats", "LookoutPromMetrics", "LookupStatsCollector", "STATS_KEY", "build_kv_connector_stats",
    "build_prom_metrics",
]

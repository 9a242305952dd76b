"""Lookup lifecycle events -> a plain ``prometheus_client`` registry, for standalone processes.

The lookup server, the demo and the bench have no vLLM stats pipeline; they serve this registry on
their own ``/metrics`` (see :mod:`mooncake_lookout.metrics.exporter`). Events arrive on the scheduler's
thread and on the transport's thread; ``prometheus_client`` values are thread-safe, so the sink adds no
lock of its own and never blocks the caller. Every name comes from :mod:`.catalogue`.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.events import LookupRecord, NullObserver, Outcome
from mooncake_lookout.metrics import catalogue as cat
from mooncake_lookout.metrics.catalogue import MetricSpec

_KINDS = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}


def make_metric(spec: MetricSpec, registry: CollectorRegistry | None = REGISTRY, **extra: Any) -> Any:
    """Create the ``prometheus_client`` family a catalogue spec describes, registered in ``registry``.

    A Counter, Gauge or Histogram as ``spec.kind`` says (typed ``Any``: the kind is known at run time only).
    """
    kwargs: dict[str, Any] = dict(name=spec.name, documentation=spec.help, labelnames=spec.labels,
                                  registry=registry, **extra)
    if spec.kind == "histogram":
        kwargs["buckets"] = spec.buckets
    return _KINDS[spec.kind](**kwargs)


def info_labels(config: LookupConfig) -> dict[str, str]:
    """The ``info`` metric's label values for ``config`` (label ``x`` reads ``config.x`` or ``config.lookup_x``)."""
    out: dict[str, str] = {}
    for name in cat.INFO.labels:
        value = getattr(config, name) if hasattr(config, name) else getattr(config, "lookup_" + name)
        if isinstance(value, bool):
            out[name] = "true" if value else "false"
        elif isinstance(value, float):
            out[name] = f"{value:g}"
        else:
            out[name] = str(value)
    return out


class PrometheusSink(NullObserver):
    """A :class:`LookupObserver` that records the client-side catalogue families in one registry."""

    def __init__(self, config: LookupConfig | None = None,
                 registry: CollectorRegistry | None = REGISTRY) -> None:
        self.registry = registry
        requests = make_metric(cat.REQUESTS, registry)
        # Bind every label child once: no label lookups on the scheduler's path, and every series
        # exists from the start (rate() over a series born mid-window under-counts).
        self._outcome = {o: requests.labels(o) for o in cat.OUTCOMES}
        self._queried = make_metric(cat.QUERIED_TOKENS, registry)
        self._hit = make_metric(cat.HIT_TOKENS, registry)
        self._pending = make_metric(cat.PENDING, registry)
        self._max_pending = make_metric(cat.MAX_PENDING, registry)
        self._held = make_metric(cat.HELD, registry)
        self._max_held = make_metric(cat.MAX_HELD, registry)
        dropped = make_metric(cat.ANSWERS_DROPPED, registry)
        self._dropped = {r: dropped.labels(r) for r in cat.DROP_REASONS}
        arrivals = make_metric(cat.ARRIVALS_DROPPED, registry)
        self._arrivals_dropped = {r: arrivals.labels(r) for r in cat.ARRIVAL_DROP_REASONS}
        self._budget = make_metric(cat.WAIT_BUDGET_SECONDS, registry)
        self._cache_blocks = make_metric(cat.PREFIX_CACHE_BLOCKS, registry)
        self._cache_query = make_metric(cat.PREFIX_CACHE_QUERY_BLOCKS, registry)
        self._cache_known = make_metric(cat.PREFIX_CACHE_KNOWN_BLOCKS, registry)
        self._cache_answers = make_metric(cat.PREFIX_CACHE_ANSWERS, registry)
        clears = make_metric(cat.PREFIX_CACHE_CLEARS, registry)
        self._cache_clears = {r: clears.labels(r) for r in cat.CACHE_CLEAR_REASONS}
        states = make_metric(cat.PREFIX_CACHE_STATE, registry)
        self._cache_state = {s: states.labels(s) for s in cat.PREFIX_CACHE_STATES}
        self.prefix_cache_state("off")  # until the client says otherwise (it tells only of changes)
        self._deferrals = make_metric(cat.DEFERRALS, registry)
        self._deferred_steps = make_metric(cat.DEFERRED_STEPS, registry)
        self._queue = make_metric(cat.QUEUE_SECONDS, registry)
        self._rpc = make_metric(cat.RPC_SECONDS, registry)
        self._seconds = make_metric(cat.SECONDS, registry)
        blocked = make_metric(cat.SCHEDULER_BLOCKED_SECONDS, registry)
        self._blocked = {m: blocked.labels(m) for m in cat.MODES}
        self._blocked_family = blocked
        self._step_interval = make_metric(cat.STEP_INTERVAL_SECONDS, registry)
        self._breaker = make_metric(cat.BREAKER_OPEN, registry)
        self._late = make_metric(cat.LATE_REPLIES, registry)
        self._info = make_metric(cat.INFO, registry)
        if config is not None:
            self.set_config(config)

    def set_config(self, config: LookupConfig) -> None:
        """Publish ``config``: the ``info`` series (value 1, replacing any earlier one) and the pending bound.

        The bound is a gauge of its own because PromQL cannot read a label as a number: alerts and
        panels divide ``pending`` by it.
        """
        self._info.clear()
        self._info.labels(**info_labels(config)).set(1)
        self._max_pending.set(config.lookup_max_pending)
        self._max_held.set(config.lookup_max_held)
        if config.wait_s is not None:
            self._budget.set(config.wait_s if config.lookup_async else 0.0)

    def submitted(self, rec: LookupRecord) -> None:
        self._pending.inc()

    def deferred(self, rec: LookupRecord) -> None:
        self._deferrals.inc()

    def consumed(self, rec: LookupRecord) -> None:
        outcome = rec.outcome.value if rec.outcome is not None else Outcome.ERROR.value
        self._outcome[outcome].inc()
        self._pending.dec()
        if rec.store_answered:
            self._queried.inc(rec.num_tokens)
        if rec.hit_tokens:
            self._hit.inc(rec.hit_tokens)
        if rec.countable_blocks:
            self._cache_query.inc(rec.countable_blocks)
            if rec.known_blocks:
                self._cache_known.inc(rec.known_blocks)
            if rec.from_cache:
                self._cache_answers.inc()
        self._deferred_steps.observe(rec.deferrals)
        if (q := rec.queue_seconds) is not None:
            self._queue.observe(q)
        if (r := rec.rpc_seconds) is not None:
            self._rpc.observe(r)
        if (t := rec.total_seconds) is not None:
            self._seconds.observe(t)

    def discarded(self, rec: LookupRecord) -> None:
        self._outcome[Outcome.DISCARDED.value].inc()
        self._pending.dec()

    def breaker_changed(self, is_open: bool) -> None:
        self._breaker.set(1 if is_open else 0)

    def answer_dropped(self, rec: LookupRecord, reason: str) -> None:
        self._dropped[reason].inc()

    def arrival_dropped(self, rec: LookupRecord, reason: str) -> None:
        self._arrivals_dropped[reason].inc()

    def step_ended(self, wait_budget_s: float, held: int, cached_blocks: int,
                   interval_s: float | None = None) -> None:
        self._budget.set(wait_budget_s)
        self._held.set(held)
        self._cache_blocks.set(cached_blocks)
        if interval_s is not None:
            self._step_interval.observe(interval_s)

    def cache_cleared(self, reason: str, blocks: int) -> None:
        self._cache_clears[reason].inc()

    def prefix_cache_state(self, state: str) -> None:
        for name, child in self._cache_state.items():
            child.set(1 if name == state else 0)

    def scheduler_call(self, mode: str, seconds: float) -> None:
        child = self._blocked.get(mode)
        if child is None:  # an unknown mode still gets recorded, under its own label
            child = self._blocked[mode] = self._blocked_family.labels(mode)
        child.observe(seconds)

    def late_reply(self) -> None:
        """A reply arrived for a lookup that had already ended or was unknown (transport thread)."""
        self._late.inc()


__all__ = ["PrometheusSink", "info_labels", "make_metric"]

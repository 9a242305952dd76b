"""The lookup server's own figures: frames answered, what waits (and its bounds), store calls and their latency.

A :class:`~mooncake_lookout.connector.server.observer.ServerObserver`: pass it to
``LookupServer(..., observers=[ServerMetrics(registry)])``. The server calls it on its IO thread;
``prometheus_client`` values are thread-safe, so nothing here locks. Names come from the ``SERVER_*``
specs of :mod:`.catalogue`.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import REGISTRY, CollectorRegistry

from mooncake_lookout.connector.server.observer import ServerObserver
from mooncake_lookout.metrics import catalogue as cat
from mooncake_lookout.metrics.prometheus_sink import make_metric


class ServerMetrics(ServerObserver):
    """Server figures in a ``prometheus_client`` registry (``registry=None``: create but do not register)."""

    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        self.registry = registry
        requests = make_metric(cat.SERVER_REQUESTS, registry)
        self._requests = requests
        self._status = {s: requests.labels(s) for s in cat.SERVER_STATUSES}  # every series from the start
        self._queue_depth = make_metric(cat.SERVER_QUEUE_DEPTH, registry)
        self._inflight = make_metric(cat.SERVER_INFLIGHT, registry)
        self._store_seconds = make_metric(cat.SERVER_STORE_SECONDS, registry)
        self._batch_size = make_metric(cat.SERVER_BATCH_SIZE, registry)
        self._store_errors = make_metric(cat.SERVER_STORE_ERRORS, registry)
        self._waiting_keys = make_metric(cat.SERVER_WAITING_KEYS, registry)
        self._waiting_bytes = make_metric(cat.SERVER_WAITING_BYTES, registry)
        self._bounds = make_metric(cat.SERVER_BOUNDS, registry)
        states = make_metric(cat.SERVER_PREFIX_CACHE_STATE, registry)
        self._cache_state = {s: states.labels(s) for s in cat.SERVER_PREFIX_CACHE_STATES}  # every series from the start

    def queue_depth(self, depth: int) -> None:
        self._queue_depth.set(depth)

    def waiting(self, keys: int, nbytes: int) -> None:
        self._waiting_keys.set(keys)
        self._waiting_bytes.set(nbytes)

    def bounds(self, values: Mapping[tuple[str, str], int]) -> None:
        for (scope, measure), value in values.items():
            self._bounds.labels(scope, measure).set(value)

    def inflight(self, calls: int) -> None:
        self._inflight.set(calls)

    def store_call(self, batch_size: int, seconds: float, failed: bool) -> None:
        self._store_seconds.observe(seconds)
        self._batch_size.observe(batch_size)
        if failed:
            self._store_errors.inc()

    def prefix_cache_state(self, state: str) -> None:
        for name, child in self._cache_state.items():
            child.set(1 if name == state else 0)

    def answered(self, status: str, count: int = 1) -> None:
        child = self._status.get(status)
        if child is None:
            child = self._status[status] = self._requests.labels(status)
        child.inc(count)


__all__ = ["ServerMetrics"]

"""What the lookup server reports about itself: observer hooks and the counters it always keeps.

Every hook runs on the server's loop thread; the server logs and skips an observer that raises, so
telemetry cannot stop serving. The Prometheus side lives in :mod:`mooncake_lookout.metrics.server_sink`.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mooncake_lookout.connector.events import FanOut


class ServerObserver:
    """Hooks for the server's telemetry, called on the loop's thread (but ``prefix_cache_state``); override what
    you need.

    ``status`` values are ``metrics.catalogue.SERVER_STATUSES``: ``ok`` (hits and misses), ``error``
    (the store failed), ``bad_request`` (the frame was refused as malformed, or past a bound on its own),
    ``busy`` (its peer, or all peers, at a bound of what may wait), ``refused`` (a reset from a peer that may
    not wipe the store).
    """

    def queue_depth(self, depth: int) -> None:
        """Lookups received and not yet answered."""

    def waiting(self, keys: int, nbytes: int) -> None:
        """Store keys and bytes of the lookups received and not yet answered (every peer's)."""

    def bounds(self, values: Mapping[tuple[str, str], int]) -> None:
        """The bounds on what may wait, by ``(scope, measure)`` (``metrics.catalogue.SERVER_BOUND_*``); at start."""

    def inflight(self, calls: int) -> None:
        """Store calls running right now (0 or 1: the loop makes one at a time)."""

    def store_call(self, batch_size: int, seconds: float, failed: bool) -> None:
        """One store call ended (``failed``: it raised or returned an error for some lookup)."""

    def answered(self, status: str, count: int = 1) -> None:
        """``count`` lookups (or a reset, or a malformed frame) were answered with ``status``."""

    def prefix_cache_state(self, state: str) -> None:
        """Whether the server keeps a store epoch (clients may cache found blocks and hold hits), or why not: a
        state of ``server/lease.py``'s ``STATES``. At start (start()'s thread), then at each change (the lease
        probe's thread)."""


@dataclass
class ServerStats(ServerObserver):
    """Plain counters of what the server did (tests, ``doctor``, logs); always kept."""

    answered_by_status: dict[str, int] = field(default_factory=lambda: collections.Counter())
    store_calls: int = 0
    store_errors: int = 0
    coalesced_lookups: int = 0
    max_batch: int = 0
    max_inflight: int = 0
    depth: int = 0

    def queue_depth(self, depth: int) -> None:
        self.depth = depth

    def inflight(self, calls: int) -> None:
        self.max_inflight = max(self.max_inflight, calls)

    def store_call(self, batch_size: int, seconds: float, failed: bool) -> None:
        self.store_calls += 1
        self.coalesced_lookups += batch_size
        self.max_batch = max(self.max_batch, batch_size)
        self.store_errors += failed

    def answered(self, status: str, count: int = 1) -> None:
        self.answered_by_status[status] += count


class ServerObserverSet(FanOut, ServerObserver):
    """Fans the server's events out to several :class:`ServerObserver` s (see :class:`FanOut`)."""

    def __init__(self, observers: Sequence[ServerObserver] = ()) -> None:
        super().__init__(observers, base=ServerObserver)


__all__ = ["ServerObserver", "ServerObserverSet", "ServerStats"]

"""The lookup server's store calls: its lookups in as few calls as its batch bound allows, and the wipe.

Why apart from the loop: the loop decides *when* to ask (what is read, queued, fenced, answered at once);
this decides *how*: batches of at most ``max_batch_hashes`` keys, the epoch marker asked in each call
(:mod:`.epoch`), a backend without ``lookup_many`` asked one lookup at a time, a failed call turned into every
lookup's error, and each call timed and told to the observers (``inflight``, ``store_call``). Loop thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, cast

from mooncake_lookout.connector.logs import RateLimit
from mooncake_lookout.connector.server.backend import LookupBackend, failed, failure_reason
from mooncake_lookout.connector.server.epoch import EpochMarker, MarkerStore, Query, ask_with_marker, chunks
from mooncake_lookout.connector.server.observer import ServerObserver

logger = logging.getLogger(__name__)


class StoreCalls:
    """How the server asks ``backend``; ``marker``: keep the store's epoch (a backend that can hold the key)."""

    def __init__(self, backend: LookupBackend, observe: ServerObserver, *, marker: bool, max_batch_hashes: int) -> None:
        self.backend = backend
        self.batching = callable(getattr(backend, "lookup_many", None))
        # A marker is asked in the batches' store calls: a backend without ``lookup_many`` never checks one.
        keeps_marker = marker and self.batching and callable(getattr(backend, "put_marker", None))
        self.marker = EpochMarker(cast(MarkerStore, backend)) if keeps_marker else None
        self.max_batch_hashes = max_batch_hashes
        self._observe = observe
        self._log_limit = RateLimit(10.0)

    @property
    def epoch(self) -> int:
        """The store's epoch as last seen (0: no marker kept, clients must not cache)."""
        return self.marker.epoch if self.marker is not None else 0

    def lookups(self, queries: list[Query]) -> tuple[list[Any], int | list[int]]:
        """Every query's result (an exception for its error), and the epoch the calls confirmed (0: none): one
        number when one call asked them all (the common case), else one per query."""
        batches = list(chunks(queries, self.max_batch_hashes))
        if len(batches) == 1:
            return self._call(queries)
        results: list[Any] = []
        epochs: list[int] = []
        for batch in batches:
            answers, epoch = self._call(batch)
            results.extend(answers)
            epochs.extend([epoch] * len(batch))
        return results, epochs

    def _call(self, queries: Sequence[Query]) -> tuple[list[Any], int]:
        """One store call for ``queries`` (or one per query, for a backend without ``lookup_many``), asking
        for the marker key in the same call; returns the results and the epoch the call confirmed (0: none)."""
        self._observe.inflight(1)
        t0 = time.perf_counter()
        results: list[Any]
        epoch = 0
        try:
            if self.batching:
                results, epoch = ask_with_marker(self.marker, self.backend.lookup_many,  # type: ignore[attr-defined]
                                                 queries)
            else:
                results = []
                for num_tokens, hashes, _, _ in queries:
                    try:
                        results.append(self.backend.lookup(num_tokens, hashes))
                    except Exception as e:  # that lookup's error; the others go on
                        results.append(e)
        except Exception as e:  # the store failed: every lookup in the call gets the error
            if self._log_limit.allow(time.perf_counter()):
                logger.warning("store call failed: %r", e)
            results = [e] * len(queries)
            epoch = 0
        seconds = time.perf_counter() - t0
        self._observe.inflight(0)
        self._observe.store_call(len(queries), seconds, any(map(failed, results)))
        return results, epoch

    def reset(self) -> str | None:
        """Wipe the store: None once done, else why it failed. A wipe takes the marker with it: a new epoch for
        every client."""
        self._observe.inflight(1)
        t0 = time.perf_counter()
        try:
            outcome: Any = self.backend.reset()
        except Exception as e:
            outcome = e
        self._observe.inflight(0)
        why = failure_reason(outcome) if isinstance(outcome, Exception) or outcome is False else None
        self._observe.store_call(1, time.perf_counter() - t0, why is not None)
        if why is None and self.marker is not None:
            self.marker.renew()
        return why


__all__ = ["StoreCalls"]

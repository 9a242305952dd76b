"""The store's epoch as a lookup server sees it: a marker key whose disappearance means the store was wiped.

Why: a client that remembers which blocks the store holds (its prefix cache) must forget them when the
store is wiped, whoever wipes it: its own ``reset``, another vLLM instance's ``reset_prefix_cache`` on a
shared master (both remove every key, leased or not), or a master restart (the index lives in memory).
The server keeps one key of its own in the store and asks for it in the same ``batch_is_exist`` as each
batch of lookups (one key more per batch). When it is gone, the server puts a new one under a new random
epoch; every reply carries the epoch, so clients learn of the wipe from their next reply. Epoch 0 means
the server keeps no marker (the store refused it), or a reply's store call could not check it (a store error):
either way the reply vouches for no epoch, and clients must not trust or cache blocks on its word.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

logger = logging.getLogger(__name__)

RETRY_S = 5.0  # how often a refused marker is tried again (an engine may lend the store memory later)


class MarkerStore(Protocol):
    """What a backend offers for the marker: a key name of its own and a way to put it."""

    def marker_key(self, name: str) -> str: ...

    def put_marker(self, key: str) -> bool: ...


class EpochMarker:
    """The marker key and the epoch it stands for; used from the server's loop thread, except :meth:`trust`.

    No epoch is kept until :meth:`trust` is called: the server calls it at once, or once the master's key
    lease is known to cover the clients' window (server/lease.py), so clients cache nothing before that.
    """

    def __init__(self, backend: MarkerStore) -> None:
        self._backend = backend
        self.epoch = 0
        self.key: str | None = None
        self.renewals = 0
        self._trusted = threading.Event()
        self._next_try = 0.0

    def trust(self) -> None:
        """Allow an epoch from now on (from any thread); the loop puts the marker at its next batch."""
        self._trusted.set()

    def ensure(self, now: float) -> None:
        """Put a marker if trusted and none is kept (at most every :data:`RETRY_S` after a refusal)."""
        if self.key is None and now >= self._next_try and self._trusted.is_set() and not self.renew():
            self._next_try = now + RETRY_S

    def renew(self) -> int:
        """Put a marker under a new epoch (after a wipe, or at start); returns it (0: the store refused)."""
        if not self._trusted.is_set():
            return 0
        epoch = secrets.randbits(62) + 1
        key = self._backend.marker_key(f"{epoch:016x}")
        if self._backend.put_marker(key):
            self.key, self.epoch = key, epoch
        else:
            if self.renewals == 0 or self.key is not None:
                logger.warning("the store refused the lookup server's marker key: clients cache nothing "
                               "until it takes one (tried again every %g s)", RETRY_S)
            self.key, self.epoch = None, 0
        self.renewals += 1
        return self.epoch

    def seen(self, code: Any) -> int:
        """The marker's code from a batch: 1 present, 0 gone (the store was wiped), else a store error (a negative
        code, or the exception the call met). Returns the epoch the batch's answers confirm: the kept one when
        the marker was there, a new one (or 0, if the store refused it) after a wipe, and 0 after an error: a
        check that failed says nothing of a wipe since, so it vouches for no epoch."""
        if code == 1:
            return self.epoch
        if code == 0:
            logger.info("the store was wiped (marker gone): new epoch for the clients' caches")
            return self.renew()
        logger.debug("the store could not check the marker (%r): this batch confirms no epoch", code)
        return 0


# One lookup as the server asks it: num_tokens, hashes, blocks the client knows present, the epoch they were found in
Query = tuple[int, Sequence[bytes], int, int]


def ask_with_marker(marker: EpochMarker | None, lookup_many: Callable[..., Sequence[Any]],
                    queries: Sequence[Query]) -> tuple[list[Any], int]:
    """A backend's ``lookup_many`` for ``queries`` with the marker asked in the same call; the results and the
    epoch they confirm (0: none).

    A client's known blocks count only if found in the epoch the marker stands for, and only if the marker is
    still there (no wipe since): else the batch is asked again from scratch. A marker found gone starts a new
    epoch (the answers are in it); a marker the store could not check (an error code) confirms nothing: epoch 0,
    so clients trust no block of the old epoch on this reply's word.
    """
    if marker is not None:
        marker.ensure(time.perf_counter())
    if marker is None or marker.key is None:  # no epoch kept: nothing a client knows can be trusted
        return list(lookup_many([(n, h, 0) for n, h, _, _ in queries])), 0
    epoch = marker.epoch
    results = list(lookup_many([(n, h, k if e == epoch else 0) for n, h, k, e in queries], [marker.key]))
    if len(results) != len(queries) + 1:
        raise RuntimeError(f"backend returned {len(results)} results for {len(queries)} lookups")
    code = results.pop()
    confirmed = marker.seen(code)
    if code != 1 and any(k and e == epoch for _, _, k, e in queries):
        # Wiped (the marker is gone) or unknown (the store failed): what the clients know cannot be trusted.
        results = list(lookup_many([(n, h, 0) for n, h, _, _ in queries]))
    return results, confirmed


def chunks(queries: Sequence[Query], max_hashes: int) -> Iterator[list[Query]]:
    """``queries`` split so no store call asks more than ``max_hashes`` keys (one lookup per call at least): each
    chunk is one :func:`ask_with_marker`, whose marker code vouches for that chunk alone."""
    chunk: list[Query] = []
    hashes = 0
    for q in queries:
        asked = len(q[1]) - q[2]
        if chunk and hashes + asked > max_hashes:
            yield chunk
            chunk, hashes = [], 0
        chunk.append(q)
        hashes += asked
    if chunk:
        yield chunk


__all__ = ["EpochMarker", "MarkerStore", "Query", "RETRY_S", "ask_with_marker", "chunks"]

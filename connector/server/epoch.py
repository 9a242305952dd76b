"""The store's epoch as a lookup server sees it: a marker key whose disappearance means the store was wiped.

Why: a client that remembers which blocks the store holds (its prefix cache) must forget them when the
store is wiped, whoever wipes it: its own ``reset``, another vLLM instance's ``reset_prefix_cache`` on a
shared master (both remove every key, leased or not), or a master restart (the index lives in memory).
The server keeps one key of its own in the store and asks for it in the same ``batch_is_exist`` as each
batch of lookups (one key more per batch). When it is gone, the server puts a new one under a new random
epoch; every reply carries the epoch, so clients learn of the wipe from their next reply. Epoch 0 means
the server keeps no marker (the store refused it): clients must not cache then.
"""

from __future__ import annotations

import logging
import secrets
import threading
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

    def seen(self, code: Any) -> None:
        """The marker's code from a batch: 1 present, 0 gone (the store was wiped), else a store error."""
        if code == 0:
            logger.info("the store was wiped (marker gone): new epoch for the clients' caches")
            self.renew()


__all__ = ["EpochMarker", "MarkerStore", "RETRY_S"]

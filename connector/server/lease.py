"""Refuse to start when the master's key lease is shorter than what clients will trust a found key for.

A found key is leased for the master's ``--default_kv_lease_ttl``: it cannot be evicted before that, so a
client may remember it as present for a shorter time (``lookup_answer_ttl_ms``). If the master's lease is
shorter than that window, a remembered block could be gone when it is loaded. The probe puts a key, finds
it (which leases it), waits the window and tries a plain (not forced) remove: the master refuses while the
lease holds (code -706), so a remove that succeeds means the lease ran out first. Takes ``window_s``, so
the server runs it on a thread of its own (:class:`LeaseProbe`) and keeps no epoch (clients cache nothing)
until it passes; when it fails, the cache stays off for good and the error says why.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

LEASED = -706  # Mooncake's answer to a plain remove of a leased key


class LeaseTooShort(RuntimeError):
    """The master's key lease is shorter than the window clients trust a found key for."""


def check_lease(store: Any, key_prefix: str, window_s: float, stop: threading.Event | None = None) -> bool:
    """Raise :class:`LeaseTooShort` if a found key's lease ends before ``window_s``; any store error raises too.

    Returns True once checked; False if ``stop`` was set during the wait (nothing learned, the key removed).
    """
    stop = stop if stop is not None else threading.Event()
    key = f"{key_prefix}lease-probe-{secrets.token_hex(8)}"
    if store.upsert_batch([key], [b"\x01"]) != 0:
        raise RuntimeError(f"the lease probe could not put its key {key}")
    try:
        found = time.perf_counter()
        if list(store.batch_is_exist([key])) != [1]:
            raise RuntimeError(f"the lease probe's key {key} was not found right after it was put")
        if stop.wait(max(0.0, found + window_s - time.perf_counter())):  # the probe itself: outlive the window
            return False
        code = store.remove(key, False)
        if code == 0:
            raise LeaseTooShort(
                f"the Mooncake master's key lease (--default_kv_lease_ttl) is shorter than "
                f"lookup_answer_ttl_ms ({window_s * 1000:g} ms): a block remembered as present could be "
                f"evicted before it loads. Lower lookup_answer_ttl_ms to at most half the master's lease, "
                f"or raise the lease.")
        if code != LEASED:
            raise RuntimeError(f"the lease probe's remove of {key} failed with code {code}")
        return True
    finally:
        store.remove(key, True)


class LeaseProbe:
    """:func:`check_lease` on a daemon thread: ``on_ok()`` if it passes, an ERROR log naming the cause if not.

    :meth:`close` ends the wait early and joins the thread, so the store can be closed after it.
    """

    def __init__(self, store: Any, key_prefix: str, window_s: float, on_ok: Callable[[], None]) -> None:
        self._args = (store, key_prefix, window_s)
        self._on_ok = on_ok
        self._stop = threading.Event()
        self.passed: bool | None = None  # None while running (or stopped)
        self._thread = threading.Thread(target=self._run, name="lookout-lease-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        store, key_prefix, window_s = self._args
        try:
            if not check_lease(store, key_prefix, window_s, self._stop):
                return
        except LeaseTooShort as e:
            self.passed = False
            logger.error("%s The prefix cache stays off.", e)
            return
        except Exception as e:  # noqa: BLE001 - any failure keeps the cache off, and says so
            self.passed = False
            logger.error("could not check the master's key lease (%r): the prefix cache stays off", e)
            return
        self.passed = True
        logger.info("the master's key lease covers %g ms: clients may cache found blocks", window_s * 1000)
        self._on_ok()

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the verdict (at most the window plus two store calls)."""
        self._thread.join(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop waiting and join the thread (bounded by one store call)."""
        self._stop.set()
        self._thread.join(timeout_s)


__all__ = ["LEASED", "LeaseProbe", "LeaseTooShort", "check_lease"]

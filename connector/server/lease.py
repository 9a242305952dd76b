"""Refuse to start when the master's key lease cannot cover the clients' trust window plus the load's margin.

A found key is leased for the master's ``--default_kv_lease_ttl``: it cannot be evicted before that. A client
serves a hit only while every block it counts was found within ``lookup_answer_ttl_ms`` (its trust window,
docs/reliability.md "No stale hit"), so the lease must outlast that window by the load's margin (the time
from serving a hit to loading its blocks). The probe puts a key, finds it (which leases it), waits the
window plus :data:`LOAD_MARGIN_SHARE` of it and tries a plain (not forced) remove: the master refuses while
the lease holds (code -706), so a remove that succeeds means the lease ran out first. Takes that long, so
the server runs it on a thread of its own (:class:`LeaseProbe`) and keeps no epoch (clients cache nothing)
until it passes; when it fails, the cache stays off for good and the error names both settings.
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
# The load's margin the lease must leave past the trust window, as a share of the window: with the defaults
# (window 5 s, Mooncake's 10 s lease) the load keeps 5 s; a window of 0.8 x the lease still passes (1 s of 10).
LOAD_MARGIN_SHARE = 0.2


def probe_window_s(ttl_s: float) -> float:
    """How long a found key must stay leased for a trust window of ``ttl_s``: the window and the load's margin."""
    return ttl_s * (1 + LOAD_MARGIN_SHARE)


class LeaseTooShort(RuntimeError):
    """The master's key lease is shorter than the window clients trust a found key for."""


def check_lease(store: Any, key_prefix: str, ttl_s: float, stop: threading.Event | None = None) -> bool:
    """Raise :class:`LeaseTooShort` if a found key's lease ends before a trust window of ``ttl_s`` and the load's
    margin (:func:`probe_window_s`); any store error raises too.

    Returns True once checked; False if ``stop`` was set during the wait (nothing learned, the key removed).
    """
    stop = stop if stop is not None else threading.Event()
    window_s = probe_window_s(ttl_s)
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
                f"the Mooncake master's key lease (--default_kv_lease_ttl) is shorter than {window_s * 1000:g} ms: "
                f"lookup_answer_ttl_ms ({ttl_s * 1000:g} ms, how long a found block is trusted) plus the load's "
                f"margin ({LOAD_MARGIN_SHARE:.0%} of it), so a served hit could be evicted before it loads. Set "
                f"lookup_answer_ttl_ms to at most half the master's lease (the rule the chart follows), or raise "
                f"the lease.")
        if code != LEASED:
            raise RuntimeError(f"the lease probe's remove of {key} failed with code {code}")
        return True
    finally:
        store.remove(key, True)


class LeaseProbe:
    """:func:`check_lease` on a daemon thread: ``on_ok()`` if it passes, an ERROR log naming the cause if not.

    :meth:`close` ends the wait early and joins the thread, so the store can be closed after it.
    """

    def __init__(self, store: Any, key_prefix: str, ttl_s: float, on_ok: Callable[[], None]) -> None:
        self._args = (store, key_prefix, ttl_s)
        self._on_ok = on_ok
        self._stop = threading.Event()
        self.passed: bool | None = None  # None while running (or stopped)
        self._thread = threading.Thread(target=self._run, name="lookout-lease-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        store, key_prefix, ttl_s = self._args
        try:
            if not check_lease(store, key_prefix, ttl_s, self._stop):
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
        logger.info("the master's key lease covers %g ms (lookup_answer_ttl_ms and the load's margin): clients may "
                    "cache found blocks", probe_window_s(ttl_s) * 1000)
        self._on_ok()

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the verdict (at most the window plus two store calls)."""
        self._thread.join(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop waiting and join the thread (bounded by one store call)."""
        self._stop.set()
        self._thread.join(timeout_s)


__all__ = ["LEASED", "LeaseProbe", "LeaseTooShort", "LOAD_MARGIN_SHARE", "check_lease", "probe_window_s"]

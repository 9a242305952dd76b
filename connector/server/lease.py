"""Refuse to trust the clients' window when the master's key lease cannot cover it plus the load's margin.

A found key is leased for the master's ``--default_kv_lease_ttl``: it cannot be evicted before that. A client
serves a hit only while every block it counts was found within ``lookup_answer_ttl_ms`` (its trust window,
docs/reliability.md "No stale hit"), so the lease must outlast that window by the load's margin (the time
from serving a hit to loading its blocks). The probe puts a key, finds it (which leases it), then tries a plain
(not forced) remove every :data:`POLL_SHARE` of the window and once past it: the master refuses while the lease
holds (code -706), so a remove that succeeds means the lease ran out, and when it did is the lease (named in
the refusal). Takes up to the window and its margin, so the server runs it on a thread of its own
(:class:`LeaseProbe`) and keeps no epoch (clients cache nothing, and hold no hit: client.py) until it passes.

A probe that cannot run (the store refuses its key: no memory lent to the store yet, as when an engine in
``standalone-store`` mode starts before the store pods; or the master is unreachable) says nothing of the lease:
it is tried again, backing off from :data:`RETRY_FIRST_S` to at most :data:`RETRY_MAX_S` apart, until it
passes, finds the lease too short (final: the lease is the master's flag), or the server closes. Its state
(:data:`STATES`) is what the server's ``server_prefix_cache_state`` gauge exports.
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
POLL_SHARE = 1 / 40  # how often, as a share of the probe's window, a plain remove asks whether the lease ran out
RETRY_FIRST_S = 1.0  # a probe that could not run is tried again after this, then twice as long each time...
RETRY_MAX_S = 30.0  # ...up to this apart

# The probe's states, the ``state`` label of server_prefix_cache_state (metrics/catalogue.py).
ON = "on"  # the lease covers the window: the server keeps an epoch
PROBING = "probing"  # the probe waits out the window
STORE_REFUSED = "store_refused"  # the probe could not run (no capacity yet, or the store failed): retrying
LEASE_TOO_SHORT = "lease_too_short"  # refused for good: no epoch, clients cache nothing and hold no hit
OFF = "off"  # the server keeps no epoch by its configuration (no marker)
STATES = (ON, PROBING, STORE_REFUSED, LEASE_TOO_SHORT, OFF)


def probe_window_s(ttl_s: float) -> float:
    """How long a found key must stay leased for a trust window of ``ttl_s``: the window and the load's margin."""
    return ttl_s * (1 + LOAD_MARGIN_SHARE)


def lease_rule(ttl_s: float, lease_s: float, *, measured: bool, key: str = "lookup_answer_ttl_ms") -> str:
    """The one-line refusal: the key (``key``, set to ``ttl_s``), the lease (``measured``: seen to end, so about),
    the rule."""
    about = "about " if measured else ""
    return (f"{key} {ttl_s * 1000:g} ms needs the Mooncake master's key lease (--default_kv_lease_ttl) "
            f"to be at least {probe_window_s(ttl_s) * 1000:g} ms (the ttl plus {LOAD_MARGIN_SHARE:.0%} of it for the "
            f"load), but the lease is {about}{lease_s * 1000:.0f} ms: set {key.split()[0]} to at most half the "
            f"lease ({lease_s * 500:.0f} ms, the rule the chart follows), or raise the lease")


class LeaseTooShort(RuntimeError):
    """The master's key lease is shorter than the window clients trust a found key for; ``lease_s``: about how
    long it is (when the probe saw it end)."""

    def __init__(self, message: str, lease_s: float | None = None) -> None:
        super().__init__(message)
        self.lease_s = lease_s


def check_lease(store: Any, key_prefix: str, ttl_s: float, stop: threading.Event | None = None) -> bool:
    """Raise :class:`LeaseTooShort` (naming about how long the lease is) if a found key's lease ends before a
    trust window of ``ttl_s`` and the load's margin (:func:`probe_window_s`); any store error raises too.

    Returns True once checked; False if ``stop`` was set during the wait (nothing learned, the key removed).
    """
    stop = stop if stop is not None else threading.Event()
    window_s = probe_window_s(ttl_s)
    poll_s = max(0.01, window_s * POLL_SHARE)
    key = f"{key_prefix}lease-probe-{secrets.token_hex(8)}"
    code = store.upsert_batch([key], [b"\x01"])
    if code != 0:
        raise RuntimeError(f"the lease probe could not put its key {key} (code {code}: no memory lent to the store "
                           f"yet, or the store failed)")
    try:
        found = time.perf_counter()
        if list(store.batch_is_exist([key])) != [1]:
            raise RuntimeError(f"the lease probe's key {key} was not found right after it was put")
        while True:
            left = found + window_s - time.perf_counter()
            if stop.wait(min(poll_s, max(0.0, left))):
                return False
            code = store.remove(key, False)
            if code == 0:  # the lease ran out before the window did: about this long after the check began
                lease_s = time.perf_counter() - found
                raise LeaseTooShort(lease_rule(ttl_s, lease_s, measured=True), lease_s)
            if code != LEASED:
                raise RuntimeError(f"the lease probe's remove of {key} failed with code {code}")
            if left <= 0:
                return True
    finally:
        store.remove(key, True)


class LeaseProbe:
    """:func:`check_lease` on a daemon thread, tried again with backoff while it cannot run: ``on_ok()`` once it
    passes; an ERROR log naming the lease and the rule if the lease is too short; ``on_state(state)`` at each
    change of :attr:`state` (called on the probe's thread).

    :meth:`close` ends a wait early and joins the thread, so the store can be closed after it.
    """

    def __init__(self, store: Any, key_prefix: str, ttl_s: float, on_ok: Callable[[], None],
                 on_state: Callable[[str], None] | None = None, *, retry_first_s: float = RETRY_FIRST_S,
                 retry_max_s: float = RETRY_MAX_S) -> None:
        self._args = (store, key_prefix, ttl_s)
        self._on_ok = on_ok
        self._on_state = on_state
        self._retry = (retry_first_s, retry_max_s)
        self._stop = threading.Event()
        self.passed: bool | None = None  # None while running, retrying (or stopped); False: the lease is too short
        self.state = PROBING
        self.attempts = 0
        self.refusal: str | None = None  # the one-line refusal, once the lease is found too short
        self._thread = threading.Thread(target=self._run, name="lookout-lease-probe", daemon=True)
        self._thread.start()

    def _set(self, state: str) -> None:
        if state != self.state:
            self.state = state
            if self._on_state is not None:
                try:
                    self._on_state(state)
                except Exception:  # telemetry never stops the probe
                    logger.exception("the lease probe's state callback failed")

    def _run(self) -> None:
        store, key_prefix, ttl_s = self._args
        delay, most = self._retry
        while True:
            self.attempts += 1
            self._set(PROBING)
            try:
                if not check_lease(store, key_prefix, ttl_s, self._stop):
                    return
            except LeaseTooShort as e:
                self.passed, self.refusal = False, str(e)
                logger.error("%s. The prefix cache stays off, and clients hold no hit (docs/reliability.md).", e)
                self._set(LEASE_TOO_SHORT)
                return
            except Exception as e:  # noqa: BLE001 - the probe could not run: it says nothing of the lease
                self._set(STORE_REFUSED)
                log = logger.warning if self.attempts == 1 else logger.debug
                log("could not check the master's key lease (%s): the prefix cache stays off until it can; tried "
                    "again in %g s, backing off to every %g s", e, delay, most)
                if self._stop.wait(delay):
                    return
                delay = min(delay * 2, most)
                continue
            break
        self.passed = True
        logger.info("the master's key lease covers %g ms (lookup_answer_ttl_ms and the load's margin)%s: clients may "
                    "cache found blocks", probe_window_s(ttl_s) * 1000,
                    f", after {self.attempts} attempts" if self.attempts > 1 else "")
        self._on_ok()
        self._set(ON)

    @property
    def running(self) -> bool:
        """True while the probe's thread runs (probing, or waiting to try again)."""
        return self._thread.is_alive()

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the verdict (at most the window plus a few store calls, once the probe can run)."""
        self._thread.join(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop waiting and join the thread (bounded by one store call)."""
        self._stop.set()
        self._thread.join(timeout_s)


__all__ = ["LEASED", "LEASE_TOO_SHORT", "LOAD_MARGIN_SHARE", "LeaseProbe", "LeaseTooShort", "OFF", "ON", "POLL_SHARE",
           "PROBING", "RETRY_FIRST_S", "RETRY_MAX_S", "STATES", "STORE_REFUSED", "check_lease", "lease_rule",
           "probe_window_s"]

"""A circuit breaker for lookups: after K consecutive failures, answer misses at once for a cool-down.

Used only from the caller's thread (the client settles answers there), so it needs no lock. Each
transition is logged at WARNING; it changes at most once per cool-down, which bounds the rate.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class CircuitBreaker:
    """closed -> (K failures) -> open -> (cool-down) -> half-open: one probe -> closed or open again."""

    def __init__(self, failures: int, cooldown_s: float, *, probe_timeout_s: float,
                 on_change: Callable[[bool], None] = lambda is_open: None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.failures = failures
        self.cooldown_s = cooldown_s
        self.probe_timeout_s = probe_timeout_s
        self._on_change = on_change
        self._clock = clock
        self._consecutive = 0
        self._open_until: float | None = None  # None while closed
        self._probe_since: float | None = None
        self.closed = True  # read on every lookup: a plain attribute, no call

    @property
    def is_open(self) -> bool:
        """True while the breaker answers misses instead of asking the server (half-open included)."""
        return self._open_until is not None

    def allow(self) -> bool:
        """May a lookup go to the server now? In half-open state, exactly one probe is let through at a time."""
        if self._open_until is None:
            return True
        now = self._clock()
        if now < self._open_until:
            return False
        if self._probe_since is not None and now - self._probe_since < self.probe_timeout_s:
            return False  # a probe is out; wait for it (or for it to be lost)
        self._probe_since = now
        return True

    def record(self, ok: bool) -> None:
        """Feed the outcome of one lookup that went to the server."""
        if ok:
            self._consecutive = 0
            if self._open_until is not None:
                self._open_until = self._probe_since = None
                self.closed = True
                logger.warning("lookup circuit breaker closed: a probe was answered, lookups go to the server again")
                self._on_change(False)
            return
        self._consecutive += 1
        was_open = self._open_until is not None
        if was_open or self._consecutive >= self.failures:
            self._open_until = self._clock() + self.cooldown_s
            self.closed = False
            self._probe_since = None
            if not was_open:
                logger.warning("lookup circuit breaker OPEN after %d consecutive failures (timeouts, errors): "
                               "lookups answer a miss at once for %.1f s, then one probe decides",
                               self.failures, self.cooldown_s)
                self._on_change(True)

    def probe_abandoned(self) -> None:
        """The probe's answer will never be read (its request went away): let another probe through."""
        self._probe_since = None


__all__ = ["CircuitBreaker"]

"""A circuit breaker for lookups that opens on evidence of failure, not on slowness.

Why this shape (issue 49, "slow is not dead"): a miss on a block the store holds is a recompute, so a breaker
that turns a slow but live server into seconds of all-miss costs more than the slowness did. So:

* **Events, not lookups.** Lookups that ended together are one event: the same send (a frame, or one send's
  frames, share their send instant ``t_start``) or the same poll (lookups timed out or failed by one
  ``collect`` share their end instant ``t_answer``). One slow frame of 16 lookups is one event, not 16.
* **Failure is an error or silence.** An error from the server or the store is a failure. A timeout is one only
  while nothing was heard from the server since its lookup was sent: an answer to a later lookup, or a late
  reply (an answer that came after its deadline), proves the server alive, and turns that timeout, and every
  earlier one still counted, into slowness (counted in the volume as a non-failure).
* **A rate over a window, with a minimum volume.** It opens when at least ``failures`` failure events fall
  within the last ``window_s`` seconds and make at least ``rate`` of the window's events, or when ``failures``
  failure events come in a row with nothing heard from the server between them (a dead server after a long
  healthy spell would otherwise need the healthy events to age out of the window first).
* **Half-open.** After ``cooldown_s`` one probe goes through: answered (even late, even timed out once the server
  was heard) closes it; an error or silence opens it again. Answers to lookups sent before it opened do not
  close it (an erroring store that answers half its lookups would flap).

Used only from the caller's thread (the client settles answers there), so it needs no lock; ``heard`` (a count
of late replies a transport's own thread may bump) is only read. Each transition is logged at WARNING; it
changes at most once per cool-down, which bounds the rate. The common path (an answer) costs a compare.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)
MARKS = 8  # snapshots of the answered-event count per window: its resolution (the window's start within 1/8)


class CircuitBreaker:
    """closed -> (failure rate over a window, or a silent run) -> open -> (cool-down) -> half-open: one probe."""

    def __init__(self, failures: int, cooldown_s: float, *, probe_timeout_s: float, rate: float = 0.5,
                 window_s: float = 10.0, heard: Callable[[], int] = lambda: 0,
                 on_change: Callable[[bool], None] = lambda is_open: None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.failures = failures
        self.cooldown_s = cooldown_s
        self.probe_timeout_s = probe_timeout_s
        self.rate = rate
        self.window_s = window_s
        self._heard = heard  # late replies so far (any thread may bump it; read only here)
        self._on_change = on_change
        self._clock = clock
        self._open_until: float | None = None  # None while closed
        self._opened_at = 0.0  # when it last opened: answers to lookups sent before then do not close it
        self._probe_since: float | None = None
        self.closed = True  # read on every lookup: a plain attribute, no call
        self._fresh()

    def _fresh(self) -> None:
        """Forget the window (on start and on closing): old failures never reopen a breaker just closed."""
        self._oks = 0  # answered events so far (slowness included)
        self._ok_sent = -1.0  # the send instant of the last answered event (its other lookups merge into it)
        self._heard_at = -1.0  # when the server was last heard from (an answer's end; a late reply: its noticing)
        self._late_seen = self._heard()
        self._marks: collections.deque[tuple[float, int]] = collections.deque([(-float("inf"), 0)])
        self._next_mark = -float("inf")
        # failure events in the window: [ended, sent, silent timeout (absolvable)]
        self._failed: collections.deque[list[Any]] = collections.deque()
        self._run = 0  # failure events in a row with nothing heard between them

    @property
    def is_open(self) -> bool:
        """True while the breaker answers misses instead of asking the server (half-open included)."""
        return self._open_until is not None

    def allow(self) -> bool:
        """May a lookup go to the server now? In half-open state, exactly one probe is let through at a time; a
        late reply heard since it opened proves the server alive and closes it."""
        if self._open_until is None:
            return True
        now = self._clock()
        if now < self._open_until:
            return False
        if self._heard() != self._late_seen:
            self._close("a late reply came: the server is alive, only slow")
            return True
        if self._probe_since is not None and now - self._probe_since < self.probe_timeout_s:
            return False  # a probe is out; wait for it (or for it to be lost)
        self._probe_since = now
        return True

    # -- outcomes ------------------------------------------------------------------------------------------------
    def answered(self, sent_at: float, ended_at: float) -> None:
        """A lookup sent at ``sent_at`` was answered at ``ended_at`` (a hit or a miss): the server is alive."""
        if sent_at == self._ok_sent:
            return  # another lookup of the same send: one event
        self._ok_sent = sent_at
        self._oks += 1
        self._run = 0
        if ended_at > self._heard_at:
            self._heard_at = ended_at
        if ended_at >= self._next_mark:
            self._marks.append((ended_at, self._oks - 1))
            self._next_mark = ended_at + self.window_s / MARKS
        if self._failed:
            self._absolve(ended_at)
        if self._open_until is not None and sent_at >= self._opened_at:  # the probe (sent since it opened)
            self._close("a probe was answered")

    def failed(self, sent_at: float, ended_at: float, *, timeout: bool) -> None:
        """A lookup sent at ``sent_at`` failed at ``ended_at``: an error (``timeout`` False) or no reply by its
        deadline (a failure only while the server stays unheard since ``sent_at``)."""
        late = self._heard()
        if late != self._late_seen:  # a late reply came since we last looked: heard from just now
            self._late_seen = late
            self._heard_at = max(self._heard_at, ended_at)
            self._absolve(ended_at)
        if timeout and self._heard_at > sent_at:  # heard from since it was sent: slow, not dead
            if self._open_until is None:
                self._count_ok(sent_at, ended_at)  # slowness: in the volume, as a non-failure
            elif self._probe_since is not None:
                self._close("a probe timed out but the server answered meanwhile: it is alive, only slow")
            return
        failed = self._failed
        for event in reversed(failed):  # lookups that failed together: one event
            if event[1] == sent_at or event[0] == ended_at:
                return
            if ended_at - event[0] > self.window_s:
                break
        failed.append([ended_at, sent_at, timeout])
        self._run += 1
        if self._open_until is not None:  # the probe (or a lookup sent before it opened) failed: open again
            self._open(ended_at, None)
            return
        if self._run >= self.failures:
            self._open(ended_at, f"{self._run} failure events in a row with no reply from the server between them")
            return
        start = ended_at - self.window_s
        while failed and failed[0][0] < start:
            failed.popleft()
        n = len(failed)
        if n < self.failures:
            return
        marks = self._marks
        while len(marks) > 1 and marks[1][0] <= start:
            marks.popleft()
        oks = self._oks - marks[0][1]
        if n >= self.rate * (n + oks):
            self._open(ended_at, f"{n} failure events of {n + oks} in the last {self.window_s:g} s "
                                 f"(>= {self.rate:.0%}, at least {self.failures})")

    def _count_ok(self, sent_at: float, ended_at: float) -> None:
        """One more non-failure event in the window (a lookup of the last one's send merges into it)."""
        if sent_at == self._ok_sent:
            return
        self._ok_sent = sent_at
        self._oks += 1
        if ended_at >= self._next_mark:
            self._marks.append((ended_at, self._oks - 1))
            self._next_mark = ended_at + self.window_s / MARKS

    def _absolve(self, heard_at: float) -> None:
        """The server was heard from at ``heard_at``: silent timeouts sent before then were slowness."""
        kept = collections.deque(e for e in self._failed if not (e[2] and e[1] < heard_at))
        self._oks += len(self._failed) - len(kept)
        self._failed = kept
        self._run = 0

    def probe_abandoned(self) -> None:
        """The probe's answer will never be read (its request went away): let another probe through."""
        self._probe_since = None

    # -- transitions ----------------------------------------------------------------------------------------------
    def _open(self, now: float, why: str | None) -> None:
        was_open = self._open_until is not None
        if not was_open:
            self._opened_at = now
        self._open_until = now + self.cooldown_s
        self._probe_since = None
        self.closed = False
        if not was_open:
            logger.warning("lookup circuit breaker OPEN: %s (errors, or timeouts with no reply at all): lookups "
                           "answer a miss at once for %.1f s, then one probe decides", why, self.cooldown_s)
            self._on_change(True)

    def _close(self, why: str) -> None:
        self._open_until = self._probe_since = None
        self.closed = True
        self._fresh()
        logger.warning("lookup circuit breaker closed: %s; lookups go to the server again", why)
        self._on_change(False)


__all__ = ["CircuitBreaker", "MARKS"]

"""Warnings that cannot flood a log: one line per interval for the same kind of event.

A sick store or server can repeat the same failure thousands of times a second; the first line says
what happened, the next says it again only after ``interval_s``.
"""

from __future__ import annotations


class RateLimit:
    """``allow(now)`` is True at most once per ``interval_s`` seconds; ``suppressed`` counts the rest."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.suppressed = 0
        self._next = float("-inf")

    def allow(self, now: float) -> bool:
        """True if a line may be written now (``now`` in ``time.perf_counter()`` seconds)."""
        if now >= self._next:
            self._next = now + self.interval_s
            return True
        self.suppressed += 1
        return False


__all__ = ["RateLimit"]

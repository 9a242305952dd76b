"""What a transport carries: one lookup job, its answer, and the result type the scheduler reads.

A job's answer is written once, by the transport's thread; the caller only reads it. The caller keeps
its own deadline and treats an answer that has not come by then as a timeout, so no lock is shared.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from mooncake_lookout.connector.events import LookupObserver, LookupRecord, Outcome


@dataclass(frozen=True)
class TailKeyBoundary:
    """A (group, tokens) boundary of the hit; same fields as vLLM's ``TailKeyBoundary``."""

    group_id: int
    num_tokens: int


@dataclass(frozen=True)
class LookupResult:
    """What the scheduler reads; same fields as vLLM's ``MooncakeLookupResult``, so it drops in."""

    hit_length: int
    tail_key_boundaries: tuple[TailKeyBoundary, ...] = ()


MISS = LookupResult(0)


@dataclass(frozen=True)
class Answer:
    """How a lookup ended on the wire: an outcome, the result (a miss unless ``HIT``) and an error text."""

    outcome: Outcome
    result: LookupResult = MISS
    error: str | None = None

    @classmethod
    def from_result(cls, result: LookupResult) -> Answer:
        """A successful answer: a hit if any token was found, else a miss."""
        return cls(Outcome.HIT if result.hit_length > 0 else Outcome.MISS, result)

    @property
    def failed(self) -> bool:
        """True for answers that count against the circuit breaker."""
        return self.outcome in (Outcome.ERROR, Outcome.TIMEOUT)


class DoneFlag:
    """A one-shot "answered" signal that costs ~0.1 us to create (``threading.Event`` costs ~3.5 us here).

    A lock held from creation; ``set`` releases it, ``wait`` takes and gives it back.
    """

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        """Signal; call once."""
        self._lock.release()

    def is_set(self) -> bool:
        """True once signalled."""
        return not self._lock.locked()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the signal; True if it came."""
        if self._lock.acquire(timeout=max(timeout, 0.0)):
            self._lock.release()
            return True
        return False


class LookupJob:
    """One lookup on its way through a transport."""

    __slots__ = ("rec", "num_tokens", "block_hashes", "deadline", "answer", "done", "cancelled", "_observer")

    def __init__(self, rec: LookupRecord, block_hashes: Sequence[bytes], deadline: float,
                 observer: LookupObserver) -> None:
        self.rec = rec
        self.num_tokens = rec.num_tokens
        self.block_hashes = block_hashes
        self.deadline = deadline  # time.perf_counter() seconds
        self.answer: Answer | None = None
        self.done = DoneFlag()
        # Set by the caller when nobody wants the answer any more; a transport skips a cancelled job it has
        # not sent yet (a plain attribute: written by one thread, read by another, no lock needed).
        self.cancelled = False
        self._observer = observer

    def remaining(self, now: float | None = None) -> float:
        """Seconds left before the deadline (negative once past it)."""
        return self.deadline - (time.perf_counter() if now is None else now)

    def start(self) -> None:
        """Mark the job taken off the queue (transport thread)."""
        self.rec.t_start = time.perf_counter()
        self._observer.started(self.rec)

    def finish(self, answer: Answer) -> None:
        """Record the answer (transport thread, exactly once per job)."""
        if self.answer is not None:
            return
        rec = self.rec
        rec.t_answer = time.perf_counter()
        if rec.t_start is None:
            rec.t_start = rec.t_answer
        self.answer = answer
        self._observer.answered(rec)
        self.done.set()


__all__ = ["Answer", "DoneFlag", "LookupJob", "LookupResult", "MISS", "TailKeyBoundary"]

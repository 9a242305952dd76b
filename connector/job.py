"""What a transport carries: one lookup job, its answer, and the result type the scheduler reads.

A job's answer is written once: by the caller's thread (the ``pipelined`` transport, which the caller
drives) or by the transport's own thread (``upstream``). The caller only reads it and keeps the
deadline, so no lock is shared; a threaded transport gives the job a :class:`DoneFlag` to wait on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

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
    # Made by the client without a word from the server (refused, or given up while still queued): never
    # evidence about the server's health, so never fed to the circuit breaker.
    local: bool = False
    # Turned away by the server without asking the store (``busy``: overload; ``bad_request``): the lookup
    # failed, but nothing is learnt of the store or of the server's health.
    refused: bool = False

    @classmethod
    def from_result(cls, result: LookupResult) -> Answer:
        """A successful answer: a hit if any token was found, else a miss."""
        return cls(Outcome.HIT if result.hit_length > 0 else Outcome.MISS, result)

    @property
    def failed(self) -> bool:
        """True for answers that count against the circuit breaker (the server was asked and failed)."""
        return not (self.local or self.refused) and self.outcome in (Outcome.ERROR, Outcome.TIMEOUT)

    @property
    def evidence(self) -> bool:
        """True when the answer says something of the store (its hit, miss or failure): not made up by the
        client, not a refusal."""
        return not (self.local or self.refused)

    @property
    def kept(self) -> bool:
        """True for answers worth holding until the request is allocated: the store's own hit or miss."""
        return self.outcome in (Outcome.HIT, Outcome.MISS)


class HashBlob(Sequence[bytes]):
    """Block hashes concatenated in one ``bytes`` (how both wire formats carry them), read as a sequence.

    Slicing and indexing copy only the hashes asked for; :meth:`hex` gives every hash's hex digits at
    the cost of one ``bytes.hex`` (store keys are built from them).
    """

    __slots__ = ("blob", "hash_len")

    def __init__(self, blob: bytes, hash_len: int) -> None:
        self.blob = blob
        self.hash_len = hash_len

    def __len__(self) -> int:
        return len(self.blob) // self.hash_len if self.hash_len else 0

    @overload
    def __getitem__(self, i: int) -> bytes: ...
    @overload
    def __getitem__(self, i: slice) -> list[bytes]: ...

    def __getitem__(self, i: int | slice) -> bytes | list[bytes]:
        n, size = len(self), self.hash_len
        if isinstance(i, slice):
            return [self.blob[k * size:(k + 1) * size] for k in range(*i.indices(n))]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        return self.blob[i * size:(i + 1) * size]

    def __iter__(self) -> Iterator[bytes]:
        size = self.hash_len
        return (self.blob[k * size:(k + 1) * size] for k in range(len(self)))

    def hex(self, count: int | None = None, start: int = 0) -> list[str]:
        """Hex digits of the hashes from ``start`` up to ``count`` (all by default)."""
        n = len(self) if count is None else min(count, len(self))
        start = min(max(start, 0), n)
        step = 2 * self.hash_len
        digits = self.blob[start * self.hash_len:n * self.hash_len].hex()
        return [digits[k:k + step] for k in range(0, (n - start) * step, step)]


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
    """One lookup on its way through a transport.

    ``deadline`` is set when the job is sent (``sent_at`` + the lookup timeout): time spent waiting in the
    client's own queue is not the server's fault, so it never counts against the deadline.
    """

    __slots__ = ("rec", "num_tokens", "block_hashes", "timeout_s", "latest", "sent_at", "deadline", "answer",
                 "done", "cancelled", "lookup_id", "known", "epoch", "known_until", "_observer")

    def __init__(self, rec: LookupRecord, block_hashes: Sequence[bytes], timeout_s: float,
                 observer: LookupObserver) -> None:
        self.rec = rec
        self.num_tokens = rec.num_tokens
        self.block_hashes = block_hashes
        self.timeout_s = timeout_s
        # The latest the deadline may be, whenever the job is sent (a blocking caller's own bound).
        self.latest: float | None = None
        self.sent_at: float | None = None
        self.deadline: float | None = None
        self.answer: Answer | None = None
        self.done: DoneFlag | None = None  # given by a transport that answers from its own thread
        # Set by the caller when nobody wants the answer any more; a transport skips a cancelled job it has
        # not sent yet (a plain attribute: written by one thread, read by another, no lock needed).
        self.cancelled = False
        self.lookup_id = 0
        self.known = 0  # leading blocks the client knows are present: the server asks the store only for the rest
        self.epoch = 0  # the store's epoch those blocks were found in (the server ignores them in another)
        # Until when the client may trust those blocks (prefix_cache.py): an answer counting them never outlives it.
        self.known_until = float("inf")
        self._observer = observer

    def expired(self, now: float) -> bool:
        """True once the job was sent and its deadline has passed without an answer."""
        return self.answer is None and self.deadline is not None and now >= self.deadline

    def sent(self, now: float | None = None) -> None:
        """Mark the job on the wire: its deadline starts now."""
        now = time.perf_counter() if now is None else now
        self.sent_at = now
        self.deadline = now + self.timeout_s if self.latest is None else min(now + self.timeout_s, self.latest)
        self.rec.t_start = now
        self._observer.started(self.rec)

    def finish(self, answer: Answer) -> None:
        """Record the answer (exactly once per job; later calls are ignored)."""
        if self.answer is not None:
            return
        rec = self.rec
        rec.t_answer = time.perf_counter()
        self.answer = answer
        self._observer.answered(rec)
        if self.done is not None:
            self.done.set()


__all__ = ["Answer", "DoneFlag", "HashBlob", "LookupJob", "LookupResult", "MISS", "TailKeyBoundary"]

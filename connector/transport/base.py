"""The contract between the lookup client and a wire: hand over lookups, take in their answers, bound every wait.

Every call comes from the client's (the scheduler's) thread. ``send`` never blocks. ``collect`` finishes
the lookups whose answers have arrived and may wait, up to a bound the caller gives, for one lookup's
answer. A sent lookup still unanswered at its deadline finishes as ``Outcome.TIMEOUT``. Answers are applied
to lookups on the caller's thread only (a transport with a thread of its own hands them over), so a lookup
has one writer. Whether a transport owns a thread is its own business (docs/architecture.md says which does).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any

from mooncake_lookout.connector.lookup import Lookup, Outcome


class TransportClosed(RuntimeError):
    """The transport was closed; no more lookups are taken."""


class Transport(abc.ABC):
    """Carries lookups to a lookup server and finishes each one, by its deadline at the latest."""

    name: str = "abstract"
    # Called for each reply that came after its lookup ended, or for none (the client sets it).
    on_late_reply: Callable[[], None] | None = None
    # Called with each answer's store epoch, when its request was sent and when it was received (a transport
    # whose server reports an epoch: see server/epoch.py), before the answer's lookups finish; never for a
    # refusal or a failure.
    on_epoch: Callable[[int, float, float], None] | None = None
    # Called with each lookup whose answer was taken in (the client sets it), on the caller's thread.
    on_answer: Callable[[Lookup], None] | None = None
    late_replies: int = 0
    rebuilds: int = 0
    # Answers a thread of the transport's own handed back and ``collect`` has not applied yet (falsy when none;
    # a transport whose socket ``collect`` reads itself has none between calls). Read on every call: no method.
    news: Any = ()
    hands_back = False  # a thread of the transport's own hands answers back (through ``news``)
    sends_from_any_thread = False  # ``send`` may be called from a thread other than the caller's (arrivals.py)

    @abc.abstractmethod
    def send(self, lookups: Sequence[Lookup], *, urgent: bool = False) -> None:
        """Put ``lookups`` on their way; never blocks. ``urgent``: a caller is about to wait for them.

        A lookup that cannot be sent finishes at once with an error; raises :class:`TransportClosed` after close.
        """

    @abc.abstractmethod
    def collect(self, wait_s: float = 0.0, until: Lookup | None = None) -> None:
        """Finish the lookups whose answers have come and those past their deadline.

        With ``until`` given, wait up to ``wait_s`` seconds for its answer (never past its deadline).
        """

    def overdue(self, now: float) -> bool:
        """True when a lookup the server was asked has outlived its deadline (lookups queued behind it then
        end at once instead of waiting their turn). A transport with no queue of its own never is."""
        return False

    def stuck(self, lk: Lookup, now: float) -> bool:
        """True when ``lk``, handed over but not sent, can no longer be sent in time: the caller ends it
        (a timeout of the client's own, not held against the server) instead of asking again."""
        return lk.t_start is None and self.overdue(now)

    def forget(self, lk: Lookup) -> None:
        """Nobody wants ``lk``'s answer any more: an unsent lookup is never sent. A reply for it that comes before its
        deadline is dropped quietly (the server was in time: it is no late reply, the "server slow" signal); one
        after it counts as late, as any reply past its deadline does."""
        lk.cancelled = True

    @abc.abstractmethod
    def reset(self, timeout_s: float) -> bool:
        """Ask the server to wipe the store, after lookups already sent; True on acknowledgement."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close sockets (and stop any thread); lookups still queued or in flight finish as errors."""

    def _epoch(self, epoch: int, sent_at: float, received: float) -> None:
        if self.on_epoch is not None:
            self.on_epoch(epoch, sent_at, received)

    def _finish(self, lk: Lookup, outcome: Outcome, now: float, hit_length: int = 0, tails: tuple[Any, ...] = (),
                error: str | None = None, *, local: bool = False, refused: bool = False) -> None:
        """Record ``lk``'s answer (caller's thread); a second answer for it counts as late (unless it was forgotten:
        nobody waited for it)."""
        if not lk.finish(outcome, now, hit_length, tails, error, local=local, refused=refused):
            if not lk.cancelled:
                self._count_late()
        elif self.on_answer is not None and lk.adopted:
            self.on_answer(lk)

    def _reply_late(self, lk: Lookup | None, received: float) -> bool:
        """Is a reply received at ``received`` for ``lk`` (``None``: unknown) a late reply? Yes, unless ``lk`` was
        forgotten and the reply came before its deadline (:meth:`forget`)."""
        return lk is None or not lk.cancelled or lk.deadline is None or received >= lk.deadline

    def _count_late(self) -> None:
        self.late_replies += 1
        if self.on_late_reply is not None:
            try:
                self.on_late_reply()
            except Exception:  # telemetry must never break the transport
                import logging

                logging.getLogger(__name__).exception("on_late_reply callback failed")


__all__ = ["Transport", "TransportClosed"]

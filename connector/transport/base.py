"""The contract between the lookup client and a wire: send jobs, collect their answers, bound every wait.

Every call comes from the client's (the scheduler's) thread. ``send`` never blocks. ``collect`` finishes
the jobs whose answers have arrived and may wait, up to a bound the caller gives, for one job's answer.
A sent job that is still unanswered at its deadline finishes as ``Outcome.TIMEOUT``. Whether a transport
owns a thread is its own business (``pipelined`` does not: the caller's thread drives its socket).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

from mooncake_lookout.connector.job import LookupJob


class TransportClosed(RuntimeError):
    """The transport was closed; no more lookups are taken."""


class Transport(abc.ABC):
    """Carries lookup jobs to a lookup server and finishes each one, by its deadline at the latest."""

    name: str = "abstract"
    # Called for each reply that came after its lookup ended, or for none (the client sets it).
    on_late_reply: Callable[[], None] | None = None
    # Called with each reply's store epoch and when its request was sent (a transport whose server reports
    # an epoch: see server/epoch.py), before the reply's lookups finish.
    on_epoch: Callable[[int, float], None] | None = None
    late_replies: int = 0
    rebuilds: int = 0

    @abc.abstractmethod
    def send(self, jobs: Sequence[LookupJob], *, urgent: bool = False) -> None:
        """Put ``jobs`` on their way; never blocks. ``urgent``: a caller is about to wait for them.

        A job that cannot be sent finishes at once with an error; raises :class:`TransportClosed` after close.
        """

    @abc.abstractmethod
    def collect(self, wait_s: float = 0.0, until: LookupJob | None = None) -> None:
        """Finish the jobs whose answers have come and those past their deadline.

        With ``until`` given, wait up to ``wait_s`` seconds for its answer (never past its deadline).
        """

    def overdue(self, now: float) -> bool:
        """True when a lookup the server was asked has outlived its deadline (lookups queued behind it then
        end at once instead of waiting their turn). A transport with no queue of its own never is."""
        return False

    def forget(self, job: LookupJob) -> None:
        """Nobody wants ``job``'s answer any more: an unsent job is never sent, a reply for it counts as late."""
        job.cancelled = True

    @abc.abstractmethod
    def reset(self, timeout_s: float) -> bool:
        """Ask the server to wipe the store, after lookups already sent; True on acknowledgement."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close sockets (and stop any thread); jobs still queued or in flight finish as errors."""

    def _epoch(self, epoch: int, sent_at: float) -> None:
        if self.on_epoch is not None:
            self.on_epoch(epoch, sent_at)

    def _count_late(self) -> None:
        self.late_replies += 1
        if self.on_late_reply is not None:
            try:
                self.on_late_reply()
            except Exception:  # telemetry must never break the transport
                import logging

                logging.getLogger(__name__).exception("on_late_reply callback failed")


__all__ = ["Transport", "TransportClosed"]

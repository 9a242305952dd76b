"""The contract between the lookup client and a wire: submit jobs, answer each by its deadline.

Transports own their sockets on their own thread(s). ``submit`` is called on the caller's thread and
must never block; every other socket operation happens on the transport's thread.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

from mooncake_lookout.connector.job import LookupJob


class TransportClosed(RuntimeError):
    """The transport was closed; no more lookups are taken."""


class Transport(abc.ABC):
    """Carries lookup jobs to a lookup server and finishes each one by its deadline."""

    name: str = "abstract"
    # Called on the transport's thread for each reply that came after its lookup ended (the client sets it).
    on_late_reply: Callable[[], None] | None = None

    @abc.abstractmethod
    def submit(self, job: LookupJob) -> None:
        """Queue ``job``; never blocks. The transport calls ``job.start()`` then ``job.finish(answer)``."""

    @abc.abstractmethod
    def reset(self, timeout_s: float) -> bool:
        """Ask the server to wipe the store, after lookups already sent; True on acknowledgement."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the transport's thread(s) and close its sockets; jobs still queued finish as errors."""


__all__ = ["Transport", "TransportClosed"]

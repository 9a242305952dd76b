"""Transports: how a lookup job travels from the client to a lookup server and back.

* :mod:`.base`: the :class:`Transport` contract (``submit`` never blocks; sockets live on the
  transport's own thread; every job is finished by its deadline) and :class:`TransportClosed`;
* :mod:`.names`: the transport names, spelled once;
* :mod:`.pipelined` and :mod:`.pipelined_thread`: many lookups in flight over DEALER/ROUTER to our lookup
  server, the socket on the caller's thread (blocking lookups) or on a thread of its own (async lookups);
  :mod:`.inflight` is the book both keep on the caller's thread, :mod:`.dealer` their socket and frames
  (CURVE over TCP, with :mod:`.handshake` explaining a refused handshake);
* :mod:`.upstream`: vLLM 0.33's REQ/REP channel, one lookup at a time, made deadline-bound.

:func:`make_transport` builds the one a configuration names; the transports themselves are imported
only when built (they need ``zmq``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mooncake_lookout.connector.transport.base import Transport, TransportClosed
from mooncake_lookout.connector.transport.names import PIPELINED, TRANSPORTS, UPSTREAM

if TYPE_CHECKING:  # config imports the names from this package: no import cycle at run time
    from mooncake_lookout.connector.config import LookupConfig


def make_transport(config: LookupConfig, address: str) -> Transport:
    """The transport ``config.lookup_transport`` names, connected to ``address``."""
    if config.lookup_transport == PIPELINED:
        # Where the socket lives is decided by measurement (docs/architecture.md, "Which thread owns the socket"):
        # async lookups that never wait, or that leave from vLLM's input thread as requests arrive, hand the
        # socket's work to a thread of its own; a blocking call, or a wait budget whose lookups leave at admission,
        # reads the socket itself, with no hand-off between threads.
        if config.lookup_async and (config.lookup_wait_us == 0 or config.lookup_on_arrival):
            from mooncake_lookout.connector.transport.pipelined_thread import ThreadedPipelinedTransport

            return ThreadedPipelinedTransport(address, timeout_s=config.timeout_s, curve=config.client_curve())
        from mooncake_lookout.connector.transport.pipelined import PipelinedTransport

        return PipelinedTransport(address, timeout_s=config.timeout_s, curve=config.client_curve())
    from mooncake_lookout.connector.transport.upstream import UpstreamTransport

    return UpstreamTransport(address)


__all__ = ["PIPELINED", "TRANSPORTS", "Transport", "TransportClosed", "UPSTREAM", "make_transport"]

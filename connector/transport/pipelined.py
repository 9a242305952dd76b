"""The ``pipelined`` transport with its socket on the caller's thread: many lookups in flight over one DEALER.

Where it is used: for blocking lookups (``lookup_async`` off), where a wait for the answer is the whole call
and a thread hop would add a wake-up to each; docs/architecture.md has the measurements behind the rule.
Async lookups go through :mod:`.pipelined_thread`, whose socket lives on a thread of its own.

``send`` puts a step's lookups in one frame (the client hands over a step's lookups together), ``collect``
reads every reply that has arrived (and stops once nothing is in flight: a step with nothing to read makes
no socket call), and a blocking wait is one read with a timeout in whole milliseconds (the GIL released
meanwhile; the last fraction of a millisecond, if any, a poll of the socket's descriptor). A step thus pays
one send and one read, however many lookups it holds.

Failure handling:

* a sent lookup past its deadline finishes as ``Outcome.TIMEOUT``; its reply, if it comes later, is
  dropped and counted in ``late_replies`` (and passed to ``on_late_reply``), like a reply nobody asked for;
* when a lookup times out and nothing at all came back from the server since it was sent, the server
  looks dead or wedged: the DEALER is closed and rebuilt ("lazy pirate"), which drops requests queued for
  the old connection, so a restarted server is reached again;
* a server ``error`` becomes ``Outcome.ERROR`` with its reason (a store error is not a miss); a frame the
  server refused (``bad_request``) or turned away (``busy``: this client is over its share of the server)
  fails each of its lookups with the server's reason, as a refusal (it says nothing of the store).

CURVE (``curve``, over TCP): the socket encrypts and authenticates with the keys given, set once when it
is built, so a lookup's path is the same with or without it. A server that refuses the handshake answers
nothing; then, on the slow path only (a silent server), :mod:`.handshake` reads why from the socket's
monitor and the warning says it (``diagnosis`` keeps it for ``doctor``).
"""

from __future__ import annotations

import logging
import select
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import zmq

from mooncake_lookout.connector.logs import RateLimit
from mooncake_lookout.connector.lookup import ERROR, Lookup
from mooncake_lookout.connector.transport.base import TransportClosed
from mooncake_lookout.connector.transport.dealer import NOBLOCK, DealerTransport, encode_frame, plan_frames, readable
from mooncake_lookout.connector.transport.inflight import InFlight
from mooncake_lookout.connector.transport.timer_slack import tight_slack
from mooncake_lookout.connector.wire import pipelined as protocol

if TYPE_CHECKING:
    from mooncake_lookout.connector.curve import ClientCurve

logger = logging.getLogger(__name__)
_FD_SETSIZE = 1024  # select() cannot watch a higher descriptor
_clock = time.perf_counter


class PipelinedTransport(DealerTransport):
    """Carries lookups to a :class:`~mooncake_lookout.connector.server.LookupServer` over DEALER/ROUTER.

    ``address``: a ZMQ endpoint (``ipc://...`` or ``tcp://127.0.0.1:PORT``). ``timeout_s``: how long the
    server may stay silent while a lookup waits before the socket is rebuilt (each lookup keeps its own
    deadline). ``curve``: CURVE keys for a server that requires them. ``watch_handshakes``: keep the socket's
    monitor to explain a refused handshake (default: with CURVE). Use from one thread only.
    """

    def __init__(self, address: str, *, timeout_s: float, on_late_reply: Callable[[], None] | None = None,
                 on_rebuild: Callable[[], None] | None = None, curve: ClientCurve | None = None,
                 watch_handshakes: bool | None = None) -> None:
        super().__init__(address, timeout_s=timeout_s, on_late_reply=on_late_reply, on_rebuild=on_rebuild,
                         curve=curve, watch_handshakes=watch_handshakes)
        self._book = InFlight(timeout_s, finish=self._finish, epoch=self._epoch, late=self._count_late)
        self._log_limit = RateLimit(10.0)

    @property
    def in_flight(self) -> int:
        """Lookups sent and not yet answered."""
        return len(self._book)

    # -- sending -------------------------------------------------------------------------------------------
    def send(self, lookups: Sequence[Lookup], *, urgent: bool = False) -> None:
        """Send ``lookups`` in as few frames as the protocol's limits allow (one, in the common case)."""
        if self._closed:
            raise TransportClosed("lookup transport is closed")
        book = self._book
        for frame_id, batch in plan_frames(lookups, book.ids):
            frames, refused = encode_frame(frame_id, batch)
            now = _clock()
            for lk, why in refused:
                self._finish(lk, ERROR, now, error=why)
                batch.remove(lk)
            if frames is None:
                continue
            try:
                self._dealer.send(frames)
            except zmq.ZMQError as e:  # the queue to the server is full (it is far behind): fail, never block
                for lk in batch:
                    self._finish(lk, ERROR, now, error=f"cannot send to the lookup server: {e}")
                continue
            book.sent(frame_id, batch, now)

    def forget(self, lk: Lookup) -> None:
        """Drop ``lk``: a reply for it before its deadline is dropped quietly, one after it counts as late."""
        lk.cancelled = True
        self._book.forget(lk)

    # -- receiving -----------------------------------------------------------------------------------------
    def collect(self, wait_s: float = 0.0, until: Lookup | None = None) -> None:
        """Read every reply that has arrived; with ``until``, wait up to ``wait_s`` for its answer."""
        sock = self._dealer.sock
        if sock is None:
            self._expire(_clock())
            return
        if until is not None and wait_s > 0 and until.outcome is None:
            # A blocking wait: read with a timeout (whole milliseconds), no look first; the last fraction of a
            # millisecond is a poll of the socket's descriptor.
            end = _clock() + wait_s
            if until.deadline is not None:
                end = min(end, until.deadline)
            dealer = self._dealer
            with tight_slack():  # the wait ends on time (timer_slack.py)
                while until.outcome is None and dealer.sock is sock:
                    left = end - _clock()
                    if left <= 0:
                        break
                    ms = int(left * 1000)  # whole milliseconds, rounded down: never past the end
                    if ms > 0:
                        frame = dealer.recv_within(sock, ms)
                        if frame is not None:
                            self._take(frame, _clock())
                    elif self._wait_readable(sock, left):  # the last fraction of a millisecond
                        self._drain(sock)
                    else:
                        break
        elif self._book.lookups or self._book.resets:
            self._drain(sock)
        self._expire(_clock())

    def _wait_readable(self, sock: zmq.Socket, seconds: float) -> bool:
        """Wait up to ``seconds`` until the socket has a reply; the GIL is released while waiting."""
        if readable(sock):
            return True
        fd = self._dealer.fd
        if fd < _FD_SETSIZE:
            # ZMQ's descriptor signals new socket events (edge-triggered): check EVENTS after each wake-up.
            end = _clock() + seconds
            while True:
                select.select([fd], [], [], seconds)
                if readable(sock):
                    return True
                seconds = end - _clock()
                if seconds <= 0:
                    return False
        # A descriptor select() cannot watch: libzmq's poll, whose whole-millisecond timeout is rounded down.
        return bool(sock.poll(int(seconds * 1000), zmq.POLLIN))

    def _drain(self, sock: zmq.Socket) -> None:
        """Read replies until none is left, or nothing is in flight any more (no read that must fail)."""
        book = self._book
        while True:
            try:
                frame = sock.recv(NOBLOCK)
            except zmq.Again:
                return
            self._take(frame, _clock())
            if not book.lookups and not book.resets:
                return

    def _take(self, frame: bytes, now: float) -> None:
        """Apply one reply; a malformed one fails its frame's lookups (when its frame id could be read)."""
        book = self._book
        try:
            reply = protocol.decode_reply(frame)
        except protocol.ProtocolError as e:
            if self._log_limit.allow(now):
                logger.warning("dropping a malformed reply from %s: %s", self.address, e.reason)
            book.last_reply = now
            book.fail_frame(e.frame_id, now, f"malformed reply: {e.reason}")
            return
        book.apply(reply, None, now)

    def _expire(self, now: float) -> None:
        """Time out every lookup past its deadline; rebuild the socket if the server stayed silent throughout."""
        book = self._book
        waited = book.expire(now)  # the longest wait in silence of a lookup that just timed out, or 0.0
        if waited and max(waited, now - book.last_reply) >= min(self.timeout_s, 1.0):
            diagnosis = self._dealer.diagnose()
            if self._log_limit.allow(now):
                logger.warning("lookup server at %s silent for %.3f s: rebuilding the socket (%d rebuilds so far)%s",
                               self.address, now - book.last_reply, self.rebuilds + 1,
                               f"; {diagnosis}" if diagnosis else "")
            self._rebuild()

    def _rebuild(self) -> None:
        """Drop the connection (and every request queued on it); the next send opens a new one."""
        self._dealer.close_socket()
        self._book.frames.clear()
        self.rebuilds += 1
        self._book.last_reply = _clock()
        if self._on_rebuild is not None:
            self._on_rebuild()

    # -- reset and close -----------------------------------------------------------------------------------
    def reset(self, timeout_s: float) -> bool:
        """Send a reset behind every lookup already sent (the server fences it) and wait for its reply."""
        if self._closed:
            return False
        book = self._book
        frame_id = next(book.ids)
        try:
            sock = self._dealer.socket()
            sock.send_multipart(protocol.encode_reset(frame_id), flags=NOBLOCK)
        except zmq.ZMQError:
            return False
        book.resets[frame_id] = None
        book.reset_sent[frame_id] = _clock()
        end = _clock() + timeout_s
        try:
            while book.resets[frame_id] is None:
                left = end - _clock()
                if left <= 0 or self._dealer.sock is not sock:
                    return False
                if self._wait_readable(sock, left):
                    self._drain(sock)
            ok = bool(book.resets[frame_id])
            if not ok:  # a wipe refused or failed: the caller only gets False, so say why here
                logger.warning("lookup server at %s did not reset the store: %s", self.address,
                               book.reset_refusals.get(frame_id))
            return ok
        finally:
            book.resets.pop(frame_id, None)
            book.reset_sent.pop(frame_id, None)
            book.reset_refusals.pop(frame_id, None)
            self._expire(_clock())

    def close(self) -> None:
        """Close the socket; lookups in flight finish as errors. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._book.fail_all(_clock(), "transport closed")
        self._dealer.close()


__all__ = ["PipelinedTransport"]

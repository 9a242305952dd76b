"""The ``pipelined`` transport with its socket on a thread of its own: the scheduler's thread makes no zmq call.

Where it is used: for async lookups (``lookup_async``), where the scheduler never waits for an answer and
every microsecond on its thread is one ``schedule()`` pays; docs/architecture.md has the measurements behind
the rule. Blocking lookups go through :mod:`.pipelined`, whose socket lives on the caller's thread.

Who does what:

* the caller's thread groups a step's lookups into frames (ids and sizes only), notes them in flight (their
  deadlines start at the hand-over) and hands them over: one ``deque.append`` and one eventfd write a step;
* the I/O thread (``lookout-io``) encodes each frame (joins the hashes, one msgpack body), sends it, reads
  every reply and decodes it into ready answers, which it hands back: one ``deque.append`` a reply; it
  wakes the caller's thread only while the caller waits (a blocking call, a wait budget, a reset);
* the caller's thread takes the answers in at its next call and applies them (:mod:`.inflight`): every
  lookup has one writer, and no lock is shared.

Deadlines, late replies, refusals (``busy``, ``bad_request``), the socket rebuilt after a silent server and
CURVE behave as in :mod:`.pipelined`: the same book of frames and lookups, the same socket (:mod:`.dealer`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import zmq

from mooncake_lookout.connector.logs import RateLimit
from mooncake_lookout.connector.lookup import ERROR, Lookup
from mooncake_lookout.connector.transport.base import Transport, TransportClosed
from mooncake_lookout.connector.transport.dealer import NOBLOCK, Dealer, encode_frame, plan_frames
from mooncake_lookout.connector.transport.inflight import InFlight
from mooncake_lookout.connector.waker import Waker
from mooncake_lookout.connector.wire import pipelined as protocol

if TYPE_CHECKING:
    from mooncake_lookout.connector.curve import ClientCurve

logger = logging.getLogger(__name__)
_clock = time.perf_counter

# What the caller's thread hands the I/O thread (besides a step's frames: a list of (frame id, lookups)).
_RESET, _REBUILD, _STOP = "reset", "rebuild", "stop"
# What the I/O thread hands back.
_REPLY, _MALFORMED, _UNSENT, _UNENCODED = range(4)


class ThreadedPipelinedTransport(Transport):
    """Carries lookups to a :class:`~mooncake_lookout.connector.server.LookupServer`; the socket on ``lookout-io``.

    Same arguments as :class:`~.pipelined.PipelinedTransport`. ``send``, ``collect``, ``reset`` and ``close``
    come from one caller thread.
    """

    name = "pipelined"

    def __init__(self, address: str, *, timeout_s: float, on_late_reply: Callable[[], None] | None = None,
                 on_rebuild: Callable[[], None] | None = None, curve: ClientCurve | None = None,
                 watch_handshakes: bool | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.late_replies = 0
        self.rebuilds = 0
        self.on_late_reply = on_late_reply
        self._on_rebuild = on_rebuild
        self._closed = False
        self._book = InFlight(timeout_s, finish=self._finish, epoch=self._epoch, late=self._count_late)
        self._dealer = Dealer(address, curve=curve, watch_handshakes=watch_handshakes)
        self._outbox: collections.deque[Any] = collections.deque()  # caller -> I/O thread
        self._inbox: collections.deque[tuple[Any, ...]] = collections.deque()  # I/O thread -> caller
        self._waker = Waker()
        self._arrived = threading.Event()
        self._waiting = False  # the caller waits on _arrived: the I/O thread sets it after each hand-back
        self._log_limit = RateLimit(10.0)  # used on the I/O thread only
        self._thread = threading.Thread(target=self._loop, name="lookout-io", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> int:
        """Lookups handed over and not yet answered."""
        return len(self._book)

    @property
    def diagnosis(self) -> str | None:
        """Why the server answered nothing, when a refused CURVE handshake said so."""
        return self._dealer.diagnosis

    @property
    def has_news(self) -> bool:
        """True when the I/O thread handed answers back that are not applied yet."""
        return bool(self._inbox)

    # -- the caller's thread -------------------------------------------------------------------------------
    def send(self, lookups: Sequence[Lookup], *, urgent: bool = False) -> None:
        """Hand ``lookups`` to the I/O thread in as few frames as the protocol's limits allow; their deadlines
        start now."""
        if self._closed:
            raise TransportClosed("lookup transport is closed")
        book = self._book
        frames = plan_frames(lookups, book.ids)
        if not frames:
            return
        now = _clock()
        for frame_id, batch in frames:
            book.sent(frame_id, batch, now)
        self._outbox.append(frames)
        self._waker.wake()

    def forget(self, lk: Lookup) -> None:
        """Drop ``lk``: a reply for it will count as late."""
        lk.cancelled = True
        self._book.forget(lk)

    def collect(self, wait_s: float = 0.0, until: Lookup | None = None) -> None:
        """Take in every answer handed back; with ``until``, wait up to ``wait_s`` for its answer."""
        inbox = self._inbox
        if inbox:
            self._take(inbox)
        if until is not None and wait_s > 0 and until.outcome is None:
            end = _clock() + wait_s
            if until.deadline is not None:
                end = min(end, until.deadline)
            while until.outcome is None:
                left = end - _clock()
                if left <= 0:
                    break
                self._wait(left)
                self._take(inbox)
        if self._book.lookups or self._book.frames:
            self._expire(_clock())

    def _wait(self, seconds: float) -> None:
        """Sleep until the I/O thread hands something back, or ``seconds`` pass (the GIL released)."""
        self._waiting = True
        self._arrived.clear()
        if not self._inbox:
            self._arrived.wait(seconds)
        self._waiting = False

    def _take(self, inbox: collections.deque[tuple[Any, ...]]) -> None:
        book = self._book
        while inbox:
            item = inbox.popleft()
            kind = item[0]
            if kind == _REPLY:
                book.apply(item[1], item[2], item[3])
            elif kind == _MALFORMED:
                book.last_reply = item[3]
                book.fail_frame(item[1], item[3], f"malformed reply: {item[2]}")
            elif kind == _UNSENT:
                book.fail_frame(item[1], item[3], f"cannot send to the lookup server: {item[2]}")
            else:  # _UNENCODED
                for lk, why in item[1]:
                    book.forget(lk)
                    self._finish(lk, ERROR, item[2], error=why)

    def _expire(self, now: float) -> None:
        """Time out lookups past their deadline; have the socket rebuilt if the server stayed silent throughout."""
        book = self._book
        if book.expire(now) and now - book.last_reply >= min(self.timeout_s, 1.0):
            self._outbox.append((_REBUILD, now - book.last_reply, self.rebuilds + 1))
            self._waker.wake()
            book.frames.clear()
            self.rebuilds += 1
            book.last_reply = now
            if self._on_rebuild is not None:
                self._on_rebuild()

    def reset(self, timeout_s: float) -> bool:
        """Send a reset behind every lookup already handed over (the server fences it) and wait for its reply."""
        if self._closed:
            return False
        book = self._book
        frame_id = next(book.ids)
        book.resets[frame_id] = None
        book.reset_sent[frame_id] = _clock()
        self._outbox.append((_RESET, frame_id))
        self._waker.wake()
        end = _clock() + timeout_s
        try:
            while book.resets[frame_id] is None:
                left = end - _clock()
                if left <= 0:
                    return False
                self._wait(left)
                self._take(self._inbox)
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
        """Stop the I/O thread and close the socket; lookups in flight finish as errors. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._outbox.append((_STOP,))
        self._waker.wake()
        self._thread.join(5.0)
        self._book.fail_all(_clock(), "transport closed")
        if not self._thread.is_alive():
            self._dealer.close()
            self._waker.close()

    # -- the I/O thread ------------------------------------------------------------------------------------
    def _loop(self) -> None:
        dealer, waker = self._dealer, self._waker
        poller = zmq.Poller()
        poller.register(waker.fd, zmq.POLLIN)
        watched: zmq.Socket | None = None
        try:
            while True:
                if dealer.sock is not watched:  # built or rebuilt: watch the new one
                    if watched is not None:
                        poller.unregister(watched)
                    watched = dealer.sock
                    if watched is not None:
                        poller.register(watched, zmq.POLLIN)
                events = dict(poller.poll(1000))  # the GIL is released while waiting
                if waker.fd in events:
                    waker.clear()
                    if not self._run_commands():
                        return
                if watched is not None and watched is dealer.sock and watched in events:
                    self._receive(watched)
        except Exception:  # the thread must not die silently: lookups then time out, and this says why
            logger.exception("the lookup transport's I/O thread failed")
        finally:
            dealer.close_socket()

    def _run_commands(self) -> bool:
        """Do what the caller handed over; False once told to stop."""
        outbox, dealer = self._outbox, self._dealer
        handed_back = False
        while outbox:
            item = outbox.popleft()
            if isinstance(item, list):  # a step's frames
                for frame_id, batch in item:
                    frames, refused = encode_frame(frame_id, batch)
                    if refused:
                        self._inbox.append((_UNENCODED, refused, _clock()))
                        handed_back = True
                    if frames is None:
                        continue
                    try:
                        dealer.send(frames)
                    except zmq.ZMQError as e:  # the queue to the server is full (it is far behind): fail, never block
                        self._inbox.append((_UNSENT, frame_id, str(e), _clock()))
                        handed_back = True
            elif item[0] == _RESET:
                try:
                    dealer.socket().send_multipart(protocol.encode_reset(item[1]), flags=NOBLOCK)
                except zmq.ZMQError as e:
                    logger.warning("cannot send a reset to the lookup server at %s: %s", self.address, e)
            elif item[0] == _REBUILD:
                _, silent_s, count = item
                diagnosis = dealer.diagnose()
                if self._log_limit.allow(_clock()):
                    logger.warning("lookup server at %s silent for %.3f s: rebuilding the socket (%d rebuilds so "
                                   "far)%s", self.address, silent_s, count, f"; {diagnosis}" if diagnosis else "")
                dealer.close_socket()
            elif item[0] == _STOP:
                return False
        if handed_back and self._waiting:
            self._arrived.set()
        return True

    def _receive(self, sock: zmq.Socket) -> None:
        """Read and decode every reply that has arrived; hand them back together."""
        inbox = self._inbox
        got = False
        while True:
            try:
                frame = sock.recv(NOBLOCK)
            except zmq.Again:
                break
            now = _clock()
            got = True
            try:
                reply = protocol.decode_reply(frame)
            except protocol.ProtocolError as e:
                if self._log_limit.allow(now):
                    logger.warning("dropping a malformed reply from %s: %s", self.address, e.reason)
                inbox.append((_MALFORMED, e.frame_id, e.reason, now))
                continue
            answers = protocol.answers_of(reply) if reply.status == protocol.OK else None
            inbox.append((_REPLY, reply, answers, now))
        if got and self._waiting:
            self._arrived.set()


__all__ = ["ThreadedPipelinedTransport"]

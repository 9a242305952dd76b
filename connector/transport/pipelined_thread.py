"""The ``pipelined`` transport with its socket on a thread of its own: the scheduler's thread makes no zmq call.

Where it is used: for async lookups (``lookup_async``), where the scheduler never waits for an answer and
every microsecond on its thread is one ``schedule()`` pays; docs/architecture.md has the measurements behind
the rule. Blocking lookups go through :mod:`.pipelined`, whose socket lives on the caller's thread.

Who does what:

* the caller's thread marks a step's lookups sent (their deadlines start at the hand-over) and hands them over:
  one ``deque.append`` and one eventfd write a step, however many lookups (the write keeps the GIL, so the I/O
  thread sends when the caller next lets go of it, not in the middle of ``schedule()``: :mod:`..waker`);
* the I/O thread (``lookout-io``) gives them ids, groups them into frames, encodes each (joins the hashes, one
  msgpack body) and sends it; it reads every reply, decodes it and matches each answer to its lookup, and
  hands the answers back, one ``deque.append`` a reply; it keeps the book of what is in flight, counts late
  replies, and rebuilds the socket when the server stays silent past a deadline ("lazy pirate"). It wakes the
  caller's thread only while the caller waits (a blocking call, a wait budget, a reset);
* the caller's thread applies the answers at its next call (a lookup's fields have one writer) and times out
  a lookup after its deadline: the one it waits for (``collect``), or the one it asks about (the client).

Refusals (``busy``, ``bad_request``) and CURVE behave as in :mod:`.pipelined`, over the same socket
(:mod:`.dealer`).
"""

from __future__ import annotations

import collections
import heapq
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import zmq

from mooncake_lookout.connector.logs import RateLimit
from mooncake_lookout.connector.lookup import ERROR, TIMEOUT, Lookup
from mooncake_lookout.connector.transport.base import TransportClosed
from mooncake_lookout.connector.transport.dealer import NOBLOCK, DealerTransport, encode_frame, plan_frames
from mooncake_lookout.connector.transport.timer_slack import tight_slack
from mooncake_lookout.connector.waker import Waker
from mooncake_lookout.connector.wire import pipelined as protocol

if TYPE_CHECKING:
    from mooncake_lookout.connector.curve import ClientCurve

logger = logging.getLogger(__name__)
_clock = time.perf_counter

# What the caller's thread hands the I/O thread (besides a step's lookups: a list).
_RESET, _STOP = "reset", "stop"
# What the I/O thread hands back: answers of one reply, lookups failed together, a reset's verdict.
_ANSWERS, _FAILED, _RESET_DONE = range(3)


class ThreadedPipelinedTransport(DealerTransport):
    """Carries lookups to a :class:`~mooncake_lookout.connector.server.LookupServer`; the socket on ``lookout-io``.

    Same arguments as :class:`~.pipelined.PipelinedTransport`. ``send``, ``collect``, ``reset`` and ``close``
    come from one caller thread; ``on_late_reply`` and ``on_rebuild`` are called on the I/O thread.
    """

    hands_back = True
    sends_from_any_thread = True  # a hand-over is a deque append and an eventfd write

    def __init__(self, address: str, *, timeout_s: float, on_late_reply: Callable[[], None] | None = None,
                 on_rebuild: Callable[[], None] | None = None, curve: ClientCurve | None = None,
                 watch_handshakes: bool | None = None) -> None:
        super().__init__(address, timeout_s=timeout_s, on_late_reply=on_late_reply, on_rebuild=on_rebuild,
                         curve=curve, watch_handshakes=watch_handshakes)
        self._outbox: collections.deque[Any] = collections.deque()  # caller -> I/O thread
        self._inbox: collections.deque[tuple[Any, ...]] = collections.deque()  # I/O thread -> caller
        self.news = self._inbox
        self._resets: dict[int, tuple[bool, str]] = {}  # a reset's verdict, by frame id (caller's thread)
        self._reset_ids = iter(range(1 << 62, 1 << 63))
        self._waker = Waker()
        self._arrived = threading.Event()
        self._waiting = False  # the caller waits on _arrived: the I/O thread sets it after each hand-back
        self._io = _Book(self)  # the I/O thread's state
        self._thread = threading.Thread(target=self._io.run, name="lookout-io", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> int:
        """Lookups the I/O thread has sent and holds no answer for."""
        return len(self._io.lookups)

    # -- the caller's thread -------------------------------------------------------------------------------
    def send(self, lookups: Sequence[Lookup], *, urgent: bool = False) -> None:
        """Hand ``lookups`` to the I/O thread; their deadlines start now."""
        if self._closed:
            raise TransportClosed("lookup transport is closed")
        now = lookups[0].t_queued or _clock() if lookups else _clock()  # the client's hand-over time, read once
        for lk in lookups:
            deadline = now + lk.timeout_s
            latest = lk.latest
            lk.deadline = latest if latest is not None and latest < deadline else deadline
            lk.t_start = now
        self._outbox.append(lookups)
        self._waker.wake()

    def collect(self, wait_s: float = 0.0, until: Lookup | None = None) -> None:
        """Apply every answer handed back; with ``until``, wait up to ``wait_s`` for its answer."""
        inbox = self._inbox
        if inbox:
            self._take(inbox)
        if until is None or wait_s <= 0 or until.outcome is not None:
            return
        end = _clock() + wait_s
        if until.deadline is not None and until.deadline < end:
            end = until.deadline
        with tight_slack():  # the wait ends on time (timer_slack.py)
            while until.outcome is None:
                now = _clock()
                if now >= end:
                    if until.expired(now):  # the one lookup waited for ends at its deadline (the others when asked)
                        self._finish(until, TIMEOUT, now, error="no reply before the deadline")
                    return
                self._wait(end - now)
                self._take(inbox)

    def _wait(self, seconds: float) -> None:
        """Sleep until the I/O thread hands something back, or ``seconds`` pass (the GIL released)."""
        self._waiting = True
        self._arrived.clear()
        if not self._inbox:
            self._arrived.wait(seconds)
        self._waiting = False

    def _take(self, inbox: collections.deque[tuple[Any, ...]]) -> None:
        finish, epoch = self._finish, self._epoch
        while inbox:
            item = inbox.popleft()
            kind = item[0]
            if kind == _ANSWERS:  # the common case, written out (Lookup.finish, inline)
                _, answers, received, reply_epoch, sent_at = item
                epoch(reply_epoch, sent_at, received)  # before its lookups finish: they were answered in it
                on_answer = self.on_answer
                for lk, outcome, hit, tails, error in answers:
                    if lk.outcome is not None:  # ended meanwhile: late, unless forgotten and answered in time
                        if self._reply_late(lk, received):
                            self._count_late()
                        continue
                    lk.outcome, lk.t_answer, lk.hit_length, lk.tail_key_boundaries, lk.error = (
                        outcome, received, hit, tails, error)
                    if on_answer is not None and lk.adopted:
                        on_answer(lk)
            elif kind == _FAILED:
                _, lookups, received, error, refused = item
                for lk in lookups:
                    finish(lk, ERROR, received, error=error, refused=refused)
            else:  # _RESET_DONE
                _, frame_id, received, ok, reply_epoch, why = item
                self._resets[frame_id] = (ok, why)
                if ok:
                    epoch(reply_epoch, received, received)

    def reset(self, timeout_s: float) -> bool:
        """Send a reset behind every lookup already handed over (the server fences it) and wait for its reply."""
        if self._closed:
            return False
        frame_id = next(self._reset_ids)
        self._outbox.append((_RESET, frame_id))
        self._waker.wake()
        end = _clock() + timeout_s
        try:
            while frame_id not in self._resets:
                left = end - _clock()
                if left <= 0:
                    return False
                self._wait(left)
                self._take(self._inbox)
            ok, why = self._resets[frame_id]
            if not ok:  # a wipe refused or failed: the caller only gets False, so say why here
                logger.warning("lookup server at %s did not reset the store: %s", self.address, why)
            return ok
        finally:
            self._resets.pop(frame_id, None)

    def close(self) -> None:
        """Stop the I/O thread and close the socket; lookups in flight finish as errors. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._outbox.append((_STOP,))
        self._waker.wake()
        self._thread.join(5.0)
        self._take(self._inbox)
        now = _clock()
        for lk in list(self._io.lookups.values()):
            self._finish(lk, ERROR, now, error="transport closed")
        if not self._thread.is_alive():
            self._dealer.close()
            self._waker.close()

    def _hand_back(self, item: tuple[Any, ...]) -> None:
        """An item for the caller (I/O thread): queued, and the caller woken if it waits."""
        self._inbox.append(item)
        if self._waiting:
            self._arrived.set()


class _Book:
    """The I/O thread's side: the socket, what is in flight, and the loop. Nothing here is read by the caller
    but ``lookups`` (its size, and what is left at close, once the thread has stopped)."""

    def __init__(self, transport: ThreadedPipelinedTransport) -> None:
        self.t = transport
        self.lookups: dict[int, Lookup] = {}  # lookup id -> lookup, sent and not answered
        self.deadlines: list[tuple[float, int]] = []  # heap of (deadline, lookup id)
        self.frames: dict[int, tuple[list[int], float]] = {}  # frame id -> (its lookup ids, when sent)
        self.resets: set[int] = set()
        self.ids = iter(range(1, 1 << 62))
        self.last_reply = _clock()
        self.log_limit = RateLimit(10.0)

    def run(self) -> None:
        dealer, waker = self.t._dealer, self.t._waker
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
                events = dict(poller.poll(self._poll_ms()))  # the GIL is released while waiting
                if waker.fd in events:
                    waker.clear()
                    if not self.commands():
                        return
                if watched is not None and watched is dealer.sock and watched in events:
                    self.receive(watched)
                if self.lookups:
                    self.expire(_clock())
        except Exception:  # the thread must not die silently: lookups then time out, and this says why
            logger.exception("the lookup transport's I/O thread failed")
        finally:
            dealer.close_socket()

    def _poll_ms(self) -> int:
        """Wake at least once a deadline while something is in flight (to notice a silent server), else once
        a second."""
        return max(1, int(min(self.t.timeout_s, 1.0) * 1000)) if self.lookups else 1000

    def commands(self) -> bool:
        """Do what the caller handed over; False once told to stop."""
        outbox, dealer = self.t._outbox, self.t._dealer
        while outbox:
            item = outbox.popleft()
            if isinstance(item, list):  # a step's lookups, or one sent at arrival: a frame each (the server's
                self.send(item)         # per-peer bound counts frames' lookups; merged, they could exceed it)
            elif item[0] == _RESET:
                try:
                    dealer.socket().send_multipart(protocol.encode_reset(item[1]), flags=NOBLOCK)
                    self.resets.add(item[1])
                except zmq.ZMQError as e:
                    self.t._hand_back((_RESET_DONE, item[1], _clock(), False, 0, f"cannot send: {e}"))
            elif item[0] == _STOP:
                return False
        return True

    def send(self, lookups: list[Lookup]) -> None:
        dealer, inflight = self.t._dealer, self.lookups
        for frame_id, batch in plan_frames(lookups, self.ids):
            frames, refused = encode_frame(frame_id, batch)
            now = _clock()
            if refused:
                self.t._hand_back((_FAILED, [lk for lk, _ in refused], now, refused[0][1], False))
                batch = [lk for lk in batch if all(lk is not r for r, _ in refused)]
            if frames is None:
                continue
            try:
                dealer.send(frames)
            except zmq.ZMQError as e:  # the queue to the server is full (it is far behind): fail, never block
                self.t._hand_back((_FAILED, batch, now, f"cannot send to the lookup server: {e}", False))
                continue
            if not inflight:
                self.last_reply = now  # silence is only counted while something waits
            deadlines = self.deadlines
            for lk in batch:
                inflight[lk.lookup_id] = lk
                heapq.heappush(deadlines, (lk.deadline or now, lk.lookup_id))
            self.frames[frame_id] = ([lk.lookup_id for lk in batch], now)

    def receive(self, sock: zmq.Socket) -> None:
        """Read and decode every reply that has arrived; hand back their answers, matched to their lookups."""
        while True:
            try:
                frame = sock.recv(NOBLOCK)
            except zmq.Again:
                return
            now = self.last_reply = _clock()
            try:
                reply = protocol.decode_reply(frame)
            except protocol.ProtocolError as e:
                if self.log_limit.allow(now):
                    logger.warning("dropping a malformed reply from %s: %s", self.t.address, e.reason)
                self.fail_frame(e.frame_id, now, f"malformed reply: {e.reason}", False)
                continue
            self.accept(reply, now)

    def accept(self, reply: protocol.Reply, now: float) -> None:
        frame_id, ok = reply.frame_id, reply.status == protocol.OK
        if frame_id in self.resets:
            self.resets.discard(frame_id)
            self.t._hand_back((_RESET_DONE, frame_id, now, ok, reply.epoch, f"{reply.status}: {reply.reason}"))
            return
        if not ok:
            error, refused = protocol.frame_error(reply)
            self.fail_frame(frame_id, now, error, refused)
            return
        carried = self.frames.pop(frame_id, None)
        inflight, answers = self.lookups, []
        for lookup_id, outcome, hit, tails, why in protocol.answers_of(reply):
            lk = inflight.pop(lookup_id, None)
            if lk is None or lk.cancelled:  # forgotten, or past its deadline (expired here)
                if self.t._reply_late(lk, now):
                    self.t._count_late()
            else:
                answers.append((lk, outcome, hit, tails, why))
        if carried is not None:  # only an answer to a frame we sent names the epoch we asked in
            self.t._hand_back((_ANSWERS, answers, now, reply.epoch, carried[1]))
        elif answers:
            self.t._hand_back((_ANSWERS, answers, now, 0, now))

    def fail_frame(self, frame_id: int, now: float, error: str, refused: bool) -> None:
        """A frame refused, failed, or its reply unreadable: its lookups fail (none known: a late reply)."""
        carried = self.frames.pop(frame_id, None) if frame_id else None
        if carried is None:
            self.t._count_late()
            return
        failed = [lk for lk in (self.lookups.pop(i, None) for i in carried[0]) if lk is not None]
        self.t._hand_back((_FAILED, failed, now, error, refused))

    def expire(self, now: float) -> None:
        """Forget lookups past their deadline (the caller times each out when it asks); rebuild the socket if
        one of them heard nothing since it was sent and the server has been silent a while."""
        silent = False
        deadlines, inflight = self.deadlines, self.lookups
        while deadlines and deadlines[0][0] <= now:
            lk = inflight.pop(heapq.heappop(deadlines)[1], None)
            if lk is not None and self.last_reply <= (lk.t_start or now):
                silent = True
        if not inflight:
            deadlines.clear()
            self.frames.clear()
        if silent and now - self.last_reply >= min(self.t.timeout_s, 1.0):
            dealer = self.t._dealer
            diagnosis = dealer.diagnose()
            if self.log_limit.allow(now):
                logger.warning("lookup server at %s silent for %.3f s: rebuilding the socket (%d rebuilds so far)%s",
                               self.t.address, now - self.last_reply, self.t.rebuilds + 1,
                               f"; {diagnosis}" if diagnosis else "")
            dealer.close_socket()
            self.frames.clear()
            self.t.rebuilds += 1
            self.last_reply = now
            if self.t._on_rebuild is not None:
                self.t._on_rebuild()


__all__ = ["ThreadedPipelinedTransport"]

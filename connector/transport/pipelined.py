"""The ``pipelined`` transport: many lookups in flight over one DEALER socket, driven by the caller's thread.

Why no thread of its own: on these machines waking a thread or handing the GIL over costs more than the
Python work of a lookup, so the scheduler's thread owns the socket. ``send`` puts every lookup handed to
it in one frame (the client hands over a step's lookups together), ``collect`` drains every reply that
has arrived with non-blocking receives, and a wait is one poll of the socket's descriptor with a timeout
(the GIL released meanwhile). A step thus pays one send and one drain, however many lookups it holds.

Failure handling:

* a sent lookup past its deadline finishes as ``Outcome.TIMEOUT``; its reply, if it comes later, is
  dropped and counted in ``late_replies`` (and passed to ``on_late_reply``), like a reply nobody asked for;
* when a lookup times out and nothing at all came back from the server since it was sent, the server
  looks dead or wedged: the DEALER is closed and rebuilt ("lazy pirate"), which drops requests queued for
  the old connection, so a restarted server is reached again;
* a server ``error`` becomes ``Outcome.ERROR`` with its reason (a store error is not a miss); a frame the
  server refused (``bad_request``) or turned away (``busy``: this client is over its share of the server)
  fails each of its lookups with the server's reason.

CURVE (``curve``, over TCP): the socket encrypts and authenticates with the keys given, set once when it
is built, so a lookup's path is the same with or without it. A server that refuses the handshake answers
nothing; then, on the slow path only (a silent server), :mod:`.handshake` reads why from the socket's
monitor and the warning says it (``diagnosis`` keeps it for ``doctor``).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import select
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import zmq

from mooncake_lookout.connector.events import Outcome
from mooncake_lookout.connector.job import Answer, LookupJob
from mooncake_lookout.connector.logs import RateLimit
from mooncake_lookout.connector.transport.base import Transport, TransportClosed
from mooncake_lookout.connector.transport.handshake import HandshakeWatch
from mooncake_lookout.connector.wire import pipelined as protocol

if TYPE_CHECKING:
    from mooncake_lookout.connector.curve import ClientCurve

logger = logging.getLogger(__name__)
# Plain ints: pyzmq's constants are enums, and an enum operation costs about a microsecond on the hot path.
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)

_HWM = 100_000
_FD_SETSIZE = 1024  # select() cannot watch a higher descriptor


class PipelinedTransport(Transport):
    """Carries lookups to a :class:`~mooncake_lookout.connector.server.LookupServer` over DEALER/ROUTER.

    ``address``: a ZMQ endpoint (``ipc://...`` or ``tcp://127.0.0.1:PORT``). ``timeout_s``: how long the
    server may stay silent while a lookup waits before the socket is rebuilt (each lookup keeps its own
    deadline). ``curve``: CURVE keys for a server that requires them. ``watch_handshakes``: keep the socket's
    monitor to explain a refused handshake (default: with CURVE). Use from one thread only.
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
        self._ids = itertools.count(1)
        self._inflight: dict[int, LookupJob] = {}
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, lookup id)
        # frame id -> (the lookups it carried, when it was sent, when to forget it): a refused frame fails its
        # lookups, and a reply's epoch counts from when its frame was sent.
        self._frames: collections.OrderedDict[int, tuple[list[int], float, float]] = collections.OrderedDict()
        self._resets: dict[int, bool | None] = {}
        self._reset_sent: dict[int, float] = {}
        self._last_reply = time.perf_counter()
        self._log_limit = RateLimit(10.0)
        self._ctx = zmq.Context(io_threads=1)
        self._sock: zmq.Socket | None = None
        self._fd = -1
        self._curve = curve
        self._watch_handshakes = curve is not None if watch_handshakes is None else watch_handshakes
        self._handshakes: HandshakeWatch | None = None
        self.diagnosis: str | None = None  # why the server answered nothing, when a handshake said so

    @property
    def in_flight(self) -> int:
        """Lookups sent and not yet answered."""
        return len(self._inflight)

    # -- sending -------------------------------------------------------------------------------------------
    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, _HWM)
            sock.setsockopt(zmq.RCVHWM, _HWM)
            if self._curve is not None:
                self._curve.apply(sock)
            if self._watch_handshakes:
                self._handshakes = HandshakeWatch(sock, curve=self._curve is not None)
            sock.connect(self.address)
            self._sock, self._fd = sock, int(sock.getsockopt(zmq.FD))
        return self._sock

    def send(self, jobs: Sequence[LookupJob], *, urgent: bool = False) -> None:
        """Send ``jobs`` in as few frames as the protocol's limits allow (one, in the common case)."""
        if self._closed:
            raise TransportClosed("lookup transport is closed")
        batch: list[protocol.Query] = []
        carried: list[LookupJob] = []
        size = 0
        for job in jobs:
            if job.cancelled or job.answer is not None:
                continue
            lookup_id = next(self._ids)
            try:
                q = protocol.query(lookup_id, job.num_tokens, job.block_hashes, job.known, job.epoch)
            except protocol.ProtocolError as e:
                job.finish(Answer(Outcome.ERROR, error=str(e)))
                continue
            job.lookup_id = lookup_id
            qsize = protocol.query_bytes(q)
            if batch and (len(batch) == protocol.MAX_QUERIES or size + qsize > protocol.MAX_BODY_BYTES):
                self._send_frame(batch, carried)
                batch, carried, size = [], [], 0
            batch.append(q)
            carried.append(job)
            size += qsize
        if batch:
            self._send_frame(batch, carried)

    def _send_frame(self, batch: list[protocol.Query], jobs: list[LookupJob]) -> None:
        frame_id = next(self._ids)
        now = time.perf_counter()
        try:
            self._socket().send_multipart(protocol.encode_lookups(frame_id, batch), flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:  # the queue to the server is full (it is far behind): fail, never block
            for job in jobs:
                job.finish(Answer(Outcome.ERROR, error=f"cannot send to the lookup server: {e}"))
            return
        if not self._inflight:
            self._last_reply = now  # silence is only counted while something waits
        for job in jobs:
            job.sent(now)
            assert job.deadline is not None
            self._inflight[job.lookup_id] = job
            heapq.heappush(self._deadlines, (job.deadline, job.lookup_id))
        self._frames[frame_id] = ([job.lookup_id for job in jobs], now, now + 2 * self.timeout_s)

    def forget(self, job: LookupJob) -> None:
        """Drop ``job``: a reply for it will count as late."""
        job.cancelled = True
        self._inflight.pop(job.lookup_id, None)

    # -- receiving -----------------------------------------------------------------------------------------
    def collect(self, wait_s: float = 0.0, until: LookupJob | None = None) -> None:
        """Drain every reply that has arrived; with ``until``, wait up to ``wait_s`` for its answer."""
        if self._sock is None:
            self._expire(time.perf_counter())
            return
        self._drain()
        if until is not None and wait_s > 0 and until.answer is None:
            end = time.perf_counter() + wait_s
            if until.deadline is not None:
                end = min(end, until.deadline)
            while until.answer is None and self._sock is not None:
                left = end - time.perf_counter()
                if left <= 0 or not self._wait_readable(left):
                    break
                self._drain()
        self._expire(time.perf_counter())

    def _wait_readable(self, seconds: float) -> bool:
        """Wait up to ``seconds`` until the socket has a reply; the GIL is released while waiting."""
        sock = self._sock
        assert sock is not None
        if _readable(sock):
            return True
        if self._fd < _FD_SETSIZE:
            # ZMQ's descriptor signals new socket events (edge-triggered): check EVENTS after each wake-up.
            end = time.perf_counter() + seconds
            while True:
                select.select([self._fd], [], [], seconds)
                if _readable(sock):
                    return True
                seconds = end - time.perf_counter()
                if seconds <= 0:
                    return False
        # A descriptor select() cannot watch: libzmq's poll, whose whole-millisecond timeout is rounded down.
        return bool(sock.poll(int(seconds * 1000), zmq.POLLIN))

    def _drain(self) -> None:
        sock = self._sock
        assert sock is not None
        # Ask EVENTS before each read: ending a drain on ``zmq.Again`` costs an exception (~10 us here), and a
        # step drains once even when nothing came.
        while _readable(sock):
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self._last_reply = time.perf_counter()
            try:
                if len(frames) != 1:
                    raise protocol.ProtocolError(f"a reply has 1 frame, got {len(frames)}")
                reply = protocol.decode_reply(frames[0])
            except protocol.ProtocolError as e:
                if self._log_limit.allow(time.perf_counter()):
                    logger.warning("dropping a malformed reply from %s: %s", self.address, e.reason)
                self._fail_frame(e.frame_id, Answer(Outcome.ERROR, error=f"malformed reply: {e.reason}"))
                continue
            self._accept(reply)

    def _accept(self, reply: protocol.Reply) -> None:
        ok = reply.status == protocol.OK
        if reply.frame_id in self._resets:
            self._resets[reply.frame_id] = ok
            if not ok:  # a wipe refused or failed: the caller only gets False, so say why here
                logger.warning("lookup server at %s did not reset the store: %s: %s", self.address, reply.status,
                               reply.reason)
            else:
                self._epoch(reply.epoch, self._reset_sent.get(reply.frame_id, time.perf_counter()))
            return
        carried = self._frames.pop(reply.frame_id, None)
        if carried is not None and ok:
            # Only an answer names the store's epoch: a refusal (busy, bad_request) or a failure says nothing of
            # the store's state. Before its lookups finish: they were answered in this epoch.
            self._epoch(reply.epoch, carried[1])
        if carried is None and not reply.results:
            self._count_late()  # a reply to a frame nobody waits for (a reset given up on, say)
            return
        if reply.status != protocol.OK:
            if carried is None:
                self._count_late()
            else:
                self._fail_frame_ids(carried[0], protocol.frame_error(reply))
            return
        inflight = self._inflight
        for result in reply.results:
            job = inflight.pop(result.lookup_id, None)
            if job is None:
                self._count_late()
            else:
                job.finish(protocol.answer_of(result))

    def _fail_frame(self, frame_id: int, answer: Answer) -> None:
        carried = self._frames.pop(frame_id, None) if frame_id else None
        if carried is None:
            self._count_late()
        else:
            self._fail_frame_ids(carried[0], answer)

    def _fail_frame_ids(self, lookup_ids: list[int], answer: Answer) -> None:
        for lookup_id in lookup_ids:
            job = self._inflight.pop(lookup_id, None)
            if job is not None:
                job.finish(answer)

    def _expire(self, now: float) -> None:
        """Time out every lookup past its deadline; rebuild the socket if the server stayed silent throughout."""
        deadlines = self._deadlines
        silent_expiry = False
        while deadlines and deadlines[0][0] <= now:
            _, lookup_id = heapq.heappop(deadlines)
            job = self._inflight.pop(lookup_id, None)
            if job is None:
                continue  # answered or forgotten already
            if self._last_reply <= (job.sent_at or now):
                silent_expiry = True
            job.finish(Answer(Outcome.TIMEOUT, error="no reply before the deadline"))
        if silent_expiry and now - self._last_reply >= min(self.timeout_s, 1.0):
            diagnosis = self._handshakes.diagnose() if self._handshakes is not None else None
            if diagnosis is not None:
                self.diagnosis = diagnosis
            if self._log_limit.allow(now):
                logger.warning("lookup server at %s silent for %.3f s: rebuilding the socket (%d rebuilds so far)%s",
                               self.address, now - self._last_reply, self.rebuilds + 1,
                               f"; {diagnosis}" if diagnosis else "")
            self._rebuild()
        if not self._inflight:
            deadlines.clear()
        frames = self._frames
        while frames:
            frame_id, (_, _, forget_at) = next(iter(frames.items()))
            if forget_at > now:
                break
            del frames[frame_id]

    def _rebuild(self) -> None:
        """Drop the connection (and every request queued on it); the next send opens a new one."""
        self._close_socket()
        self._frames.clear()
        self.rebuilds += 1
        self._last_reply = time.perf_counter()
        if self._on_rebuild is not None:
            self._on_rebuild()

    # -- reset and close -----------------------------------------------------------------------------------
    def reset(self, timeout_s: float) -> bool:
        """Send a reset behind every lookup already sent (the server fences it) and wait for its reply."""
        if self._closed:
            return False
        frame_id = next(self._ids)
        try:
            self._socket().send_multipart(protocol.encode_reset(frame_id), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        self._resets[frame_id] = None
        self._reset_sent[frame_id] = time.perf_counter()
        end = time.perf_counter() + timeout_s
        try:
            while self._resets[frame_id] is None:
                left = end - time.perf_counter()
                if left <= 0 or self._sock is None:
                    return False
                if self._wait_readable(left):
                    self._drain()
            return bool(self._resets[frame_id])
        finally:
            self._resets.pop(frame_id, None)
            self._reset_sent.pop(frame_id, None)
            self._expire(time.perf_counter())

    def close(self) -> None:
        """Close the socket; lookups in flight finish as errors. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for job in self._inflight.values():
            job.finish(Answer(Outcome.ERROR, error="transport closed"))
        self._inflight.clear()
        self._close_socket()
        self._ctx.term()

    def _close_socket(self) -> None:
        if self._handshakes is not None:
            self._handshakes.close()
            self._handshakes = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock, self._fd = None, -1


def _readable(sock: zmq.Socket) -> bool:
    """True if a reply waits on ``sock`` (reading EVENTS also re-arms its edge-triggered descriptor)."""
    return bool(cast(int, sock.getsockopt(_EVENTS)) & _POLLIN)


__all__ = ["PipelinedTransport"]

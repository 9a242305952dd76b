"""The ``pipelined`` transport: many lookups in flight over one DEALER socket, replies matched by id.

Why: vLLM's REQ/REP channel carries one lookup at a time, so a burst of N requests costs N round trips.
Here one IO thread owns the DEALER; the caller's ``submit`` only puts the job on a ``queue.SimpleQueue``
and writes an eventfd the IO thread polls (no lock on the scheduler's path, no socket touched by two
threads). Each job leaves with a fresh request id; its reply finishes it, whatever the order.

Failure handling, the same contract as the ``upstream`` transport:

* a job past its deadline finishes as ``Outcome.TIMEOUT``; its reply, if it comes later, is dropped and
  counted in ``late_replies`` (and passed to ``on_late_reply``), like a reply with an id nobody sent;
* when a job expires and nothing at all came back from the server since it was sent, the server looks
  dead or wedged: the DEALER is closed and rebuilt ("lazy pirate"), which drops requests queued for the
  old connection, and a restarted server is reached again;
* a server ``error`` reply becomes ``Outcome.ERROR`` with its reason (a store error is not a miss).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Union

import zmq

from mooncake_lookout.connector.events import Outcome
from mooncake_lookout.connector.job import Answer, LookupJob
from mooncake_lookout.connector.transport.base import Transport, TransportClosed
from mooncake_lookout.connector.transport.names import PIPELINED
from mooncake_lookout.connector.waker import Waker
from mooncake_lookout.connector.wire import pipelined as protocol

logger = logging.getLogger(__name__)


class _Reset:
    """A reset waiting for its reply: the caller blocks on ``future`` up to ``deadline``."""

    __slots__ = ("future", "deadline")

    def __init__(self, deadline: float) -> None:
        self.future: Future[bool] = Future()
        self.deadline = deadline


_STOP = object()
_Item = Union[LookupJob, _Reset, object]


class PipelinedTransport(Transport):
    """Carries lookups to a :class:`~mooncake_lookout.connector.server.loop.LookupServer` over DEALER/ROUTER.

    ``address``: a ZMQ endpoint (``ipc://...`` or ``tcp://127.0.0.1:PORT``). ``timeout_s``: how long the
    server may stay silent while a lookup waits before the socket is rebuilt (jobs keep their own
    deadlines). ``on_late_reply`` is called (on the IO thread) for every reply dropped as late or unknown.
    """

    name = PIPELINED

    def __init__(self, address: str, *, timeout_s: float, on_late_reply: Callable[[], None] | None = None,
                 on_rebuild: Callable[[], None] | None = None, max_inflight: int = 65_536) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.max_inflight = max_inflight
        self.late_replies = 0
        self.rebuilds = 0
        self.on_late_reply = on_late_reply
        self._on_rebuild = on_rebuild
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._waker = Waker()
        self._closed = False
        self._ids = itertools.count(1)
        self._inflight: dict[int, LookupJob | _Reset] = {}
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, request id)
        self._sent_at: dict[int, float] = {}
        self._last_reply = time.perf_counter()
        self._ctx = zmq.Context(io_threads=1)
        self._sock: zmq.Socket | None = None
        self._poller = zmq.Poller()  # used by the IO thread only, like the socket
        self._poller.register(self._waker.fd, zmq.POLLIN)
        self._thread = threading.Thread(target=self._loop, name="lookout-pipelined", daemon=True)
        self._thread.start()

    # -- caller's thread ------------------------------------------------------------------------------------
    def submit(self, job: LookupJob) -> None:
        """Queue ``job`` and wake the IO thread; never blocks."""
        if self._closed:
            raise TransportClosed("lookup transport is closed")
        self._queue.put(job)
        self._waker.wake()

    def reset(self, timeout_s: float) -> bool:
        """Send a reset behind every lookup already submitted (the server fences it) and wait for its reply."""
        if self._closed:
            return False
        item = _Reset(time.perf_counter() + timeout_s)
        self._queue.put(item)
        self._waker.wake()
        try:
            return item.future.result(timeout=timeout_s)
        except Exception:  # timed out, failed or refused: not acknowledged
            return False

    def close(self) -> None:
        """Stop the IO thread; lookups still queued or in flight finish as errors. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._waker.wake()
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self._waker.close()
            self._ctx.term()

    # -- IO thread ---------------------------------------------------------------------------------------------
    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self.max_inflight)
            sock.setsockopt(zmq.RCVHWM, self.max_inflight)
            sock.connect(self.address)
            self._sock = sock
            self._poller.register(sock, zmq.POLLIN)
        return self._sock

    def _rebuild(self) -> None:
        """Drop the connection (and every request queued on it); the next send opens a new one."""
        if self._sock is not None:
            self._poller.unregister(self._sock)
            self._sock.close(linger=0)
            self._sock = None
        self.rebuilds += 1
        self._last_reply = time.perf_counter()
        if self._on_rebuild is not None:
            self._on_rebuild()

    def _loop(self) -> None:
        self._socket()
        stopping = False
        while not stopping:
            timeout_ms = self._poll_timeout_ms()
            try:
                events = dict(self._poller.poll(timeout_ms))
                if self._waker.fd in events:
                    self._waker.clear()
                    stopping = self._take_queued()
                if self._sock is not None and self._sock in events:
                    self._read_replies()
                self._expire()
            except Exception:  # never let one bad reply or job kill the thread
                logger.exception("pipelined lookup transport failed")
        self._fail_all("transport closed")
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _poll_timeout_ms(self) -> int:
        if not self._deadlines:
            return 1000
        wait = self._deadlines[0][0] - time.perf_counter()
        return max(0, min(1000, int(wait * 1000) + 1))

    def _take_queued(self) -> bool:
        """Send everything submitted since the last wake; True once close() asked the thread to stop."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return False
            if item is _STOP:
                return True
            if isinstance(item, LookupJob):
                self._send_lookup(item)
            elif isinstance(item, _Reset):
                self._send_reset(item)

    def _track(self, rid: int, item: LookupJob | _Reset, deadline: float) -> None:
        now = time.perf_counter()
        if not self._inflight:
            self._last_reply = now  # silence is only counted while something waits
        self._inflight[rid] = item
        self._sent_at[rid] = now
        heapq.heappush(self._deadlines, (deadline, rid))

    def _send_lookup(self, job: LookupJob) -> None:
        if getattr(job, "cancelled", False):
            return
        job.start()
        if job.remaining() <= 0:
            job.finish(Answer(Outcome.TIMEOUT, error="deadline passed while queued"))
            return
        if len(self._inflight) >= self.max_inflight:
            job.finish(Answer(Outcome.REJECTED, error=f"{self.max_inflight} lookups already in flight"))
            return
        rid = next(self._ids)
        try:
            frames = protocol.encode_lookup(rid, job.num_tokens, job.block_hashes)
        except protocol.ProtocolError as e:
            job.finish(Answer(Outcome.ERROR, error=str(e)))
            return
        if self._send(frames):
            self._track(rid, job, job.deadline)
        else:
            job.finish(Answer(Outcome.ERROR, error="send queue to the lookup server is full"))

    def _send_reset(self, item: _Reset) -> None:
        if not item.future.set_running_or_notify_cancel():
            return
        rid = next(self._ids)
        if self._send(protocol.encode_reset(rid)):
            self._track(rid, item, item.deadline)
        else:
            item.future.set_result(False)

    def _send(self, frames: list[bytes]) -> bool:
        try:
            self._socket().send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    def _read_replies(self) -> None:
        sock = self._sock
        assert sock is not None
        while True:
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
                logger.warning("dropping a malformed reply from %s: %s", self.address, e.reason)
                item = self._inflight.pop(e.request_id, None) if e.request_id else None
                if item is not None:
                    self._sent_at.pop(e.request_id, None)
                    self._finish(item, Answer(Outcome.ERROR, error=f"malformed reply: {e.reason}"))
                else:
                    self._count_late()
                continue
            item = self._inflight.pop(reply.request_id, None)
            if item is None:
                self._count_late()
                continue
            self._sent_at.pop(reply.request_id, None)
            if isinstance(item, _Reset):
                item.future.set_result(reply.status == protocol.OK)
            else:
                item.finish(protocol.answer_of(reply))

    def _count_late(self) -> None:
        self.late_replies += 1
        if self.on_late_reply is not None:
            try:
                self.on_late_reply()
            except Exception:  # telemetry must never break the transport
                logger.exception("on_late_reply callback failed")

    def _expire(self) -> None:
        """Time out every job past its deadline; rebuild the socket if the server stayed silent throughout."""
        now = time.perf_counter()
        silent_expiry = False
        while self._deadlines and self._deadlines[0][0] <= now:
            _, rid = heapq.heappop(self._deadlines)
            item = self._inflight.pop(rid, None)
            if item is None:
                continue  # answered already
            sent = self._sent_at.pop(rid, now)
            if self._last_reply <= sent:
                silent_expiry = True
            self._finish(item, Answer(Outcome.TIMEOUT, error="no reply before the deadline"))
        if silent_expiry and now - self._last_reply >= min(self.timeout_s, 1.0):
            logger.warning("lookup server at %s silent for %.3f s: rebuilding the socket", self.address,
                           now - self._last_reply)
            self._rebuild()
        if not self._inflight:
            self._deadlines.clear()
            self._sent_at.clear()

    @staticmethod
    def _finish(item: LookupJob | _Reset, answer: Answer) -> None:
        if isinstance(item, _Reset):
            if not item.future.done():
                item.future.set_result(False)
        else:
            item.finish(answer)

    def _fail_all(self, reason: str) -> None:
        """Finish everything in flight or still queued as an error, so no caller waits on it."""
        for item in self._inflight.values():
            self._finish(item, Answer(Outcome.ERROR, error=reason))
        self._inflight.clear()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, LookupJob):
                item.finish(Answer(Outcome.ERROR, error=reason))
            elif isinstance(item, _Reset):
                item.future.cancel()


__all__ = ["PipelinedTransport"]

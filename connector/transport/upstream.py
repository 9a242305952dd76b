"""The ``upstream`` transport: vLLM 0.33's REQ/REP lookup channel, made deadline-bound.

vLLM's ``LookupKeyServer`` answers one lookup at a time, so lookups queue. One thread of ours owns the REQ
socket and sends the next lookup the moment the previous answer is in: a burst is served at the server's
pace whatever the scheduler is doing (measured faster than driving the socket from the scheduler's
thread, which could only advance once per scheduler call). Each round trip polls with the job's own
deadline, counted from the moment it is sent (waiting in this queue is not the server's fault); on expiry
the socket is closed and rebuilt (ZMQ's "lazy pirate"), so a stalled or restarted server never wedges the
thread. ``send`` appends to a deque and notifies the thread; ``urgent`` jobs (a caller is about to block on
them) jump the queue. Answers are written by the thread; the caller waits on the job's :class:`DoneFlag`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence

import zmq

from mooncake_lookout.connector.events import Outcome
from mooncake_lookout.connector.job import Answer, DoneFlag, LookupJob
from mooncake_lookout.connector.logs import RateLimit
from mooncake_lookout.connector.transport.base import Transport, TransportClosed
from mooncake_lookout.connector.wire import upstream as wire

logger = logging.getLogger(__name__)


class _Reset:
    """A reset waiting for its turn and its reply."""

    __slots__ = ("timeout_s", "done", "ok")

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.done = threading.Event()
        self.ok = False


_STOP = object()
QUEUED_BEHIND_TIMEOUT = "not sent: queued behind a lookup the server did not answer in time"


class UpstreamTransport(Transport):
    """Speaks vLLM's ``LookupKeyServer`` wire format over REQ, with deadlines and socket rebuilds.

    ``address`` is a ZMQ endpoint (``ipc://...`` as vLLM derives it, or ``tcp://127.0.0.1:PORT``).
    """

    name = "upstream"

    def __init__(self, address: str, *, on_rebuild: Callable[[], None] | None = None) -> None:
        self.address = address
        self.rebuilds = 0
        self.late_replies = 0
        self._on_rebuild = on_rebuild
        self._queue: collections.deque[object] = collections.deque()
        self._ready = threading.Condition(threading.Lock())
        self._closed = False
        self._inflight_deadline: float | None = None  # written by the thread, read by the caller
        self._log_limit = RateLimit(10.0)
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._thread = threading.Thread(target=self._loop, name="lookout-upstream", daemon=True)
        self._thread.start()

    # -- caller's thread ------------------------------------------------------------------------------------
    def send(self, jobs: Sequence[LookupJob], *, urgent: bool = False) -> None:
        """Queue ``jobs`` for the thread (``urgent``: in front of the others)."""
        if self._closed:
            raise TransportClosed("lookup transport is closed")
        for job in jobs:
            job.done = DoneFlag()
        with self._ready:
            if urgent:
                self._queue.extendleft(reversed(jobs))
            else:
                self._queue.extend(jobs)
            self._ready.notify()

    def collect(self, wait_s: float = 0.0, until: LookupJob | None = None) -> None:
        """Answers are written by the thread; with ``until``, wait up to ``wait_s`` for its answer."""
        if until is not None and wait_s > 0 and until.answer is None and until.done is not None:
            if until.deadline is not None:
                wait_s = min(wait_s, max(0.0, until.deadline - time.perf_counter()))
            until.done.wait(wait_s)

    def overdue(self, now: float) -> bool:
        """True once the lookup in flight has outlived its deadline (the server is not answering)."""
        deadline = self._inflight_deadline
        return deadline is not None and now >= deadline

    def reset(self, timeout_s: float) -> bool:
        """Queue a reset behind every lookup already queued (so it is fenced) and wait up to ``timeout_s``."""
        if self._closed:
            return False
        item = _Reset(timeout_s)
        with self._ready:
            self._queue.append(item)
            self._ready.notify()
        item.done.wait(timeout_s)
        return item.ok

    def close(self) -> None:
        """Stop the thread after the round trip it is in (bounded by that job's deadline); close the socket there."""
        if self._closed:
            return
        self._closed = True
        with self._ready:
            self._queue.append(_STOP)
            self._ready.notify()
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self._ctx.term()

    # -- transport thread ---------------------------------------------------------------------------------
    def _next(self) -> object:
        with self._ready:
            while not self._queue:
                self._ready.wait()
            return self._queue.popleft()

    def _loop(self) -> None:
        while True:
            item = self._next()
            if item is _STOP:
                break
            try:
                if isinstance(item, LookupJob):
                    self._lookup(item)
                elif isinstance(item, _Reset):
                    self._reset(item)
            except Exception:  # never let one lookup kill the thread
                logger.exception("lookup transport failed")
        self._drain()
        if self._sock is not None:
            self._sock.close(linger=0)

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
            self._sock = sock
        return self._sock

    def _rebuild(self) -> None:
        if self._log_limit.allow(time.perf_counter()):
            logger.warning("lookup server at %s did not answer in time: rebuilding the socket (%d rebuilds so far)",
                           self.address, self.rebuilds + 1)
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self.rebuilds += 1
        if self._on_rebuild is not None:
            self._on_rebuild()

    def _round_trip(self, frames: list[bytes], timeout_s: float) -> bytes | None:
        """Send ``frames`` and wait for the reply; ``None`` on timeout (the socket is then rebuilt)."""
        sock = self._socket()
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            if sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
                return sock.recv()
        except zmq.ZMQError:
            self._rebuild()
            raise
        self._rebuild()
        return None

    def _lookup(self, job: LookupJob) -> None:
        if job.cancelled or job.answer is not None:
            return
        try:
            frames = wire.encode_lookup(job.num_tokens, job.block_hashes)
        except wire.WireError as e:
            job.finish(Answer(Outcome.ERROR, error=str(e)))
            return
        job.sent()
        self._inflight_deadline = job.deadline
        try:
            reply = self._round_trip(frames, (job.deadline or 0.0) - time.perf_counter())
        except zmq.ZMQError as e:
            job.finish(Answer(Outcome.ERROR, error=f"zmq: {e}"))
            return
        finally:
            self._inflight_deadline = None
        if reply is None:
            job.finish(Answer(Outcome.TIMEOUT, error="no reply before the deadline"))
            self._fail_queued()
        elif job.cancelled:
            self._count_late()
        else:
            job.finish(wire.decode_lookup_reply(reply))

    def _fail_queued(self) -> None:
        """The server left a lookup unanswered: the lookups queued behind it end now (they were never sent,
        so this is not held against the server a second time), instead of each waiting a deadline in turn."""
        with self._ready:
            queued = [item for item in self._queue if isinstance(item, LookupJob)]
            self._queue = collections.deque(item for item in self._queue if not isinstance(item, LookupJob))
        for job in queued:
            job.finish(Answer(Outcome.TIMEOUT, error=QUEUED_BEHIND_TIMEOUT, local=True))

    def _reset(self, item: _Reset) -> None:
        try:
            reply = self._round_trip([wire.RESET_MSG], item.timeout_s)
            item.ok = reply == wire.RESP_OK
        finally:
            item.done.set()

    def _drain(self) -> None:
        """Finish whatever is still queued at close as errors, so no caller waits on it."""
        while self._queue:
            item = self._queue.popleft()
            if isinstance(item, LookupJob):
                item.finish(Answer(Outcome.ERROR, error="transport closed"))
            elif isinstance(item, _Reset):
                item.done.set()


__all__ = ["UpstreamTransport"]

"""The ``upstream`` transport: vLLM 0.33's REQ/REP lookup channel, made deadline-bound.

vLLM's ``LookupKeyServer`` answers one lookup at a time, so lookups queue. One thread of ours owns the REQ
socket and sends the next lookup the moment the previous answer is in: a burst is served at the server's
pace whatever the scheduler is doing (measured faster than driving the socket from the scheduler's
thread, which could only advance once per scheduler call). Each round trip polls with the lookup's own
deadline, counted from the moment it is sent (waiting in this queue is not the server's fault); on expiry
the socket is closed and rebuilt (ZMQ's "lazy pirate"), so a stalled or restarted server never wedges the
thread. ``send`` appends to a deque and notifies the thread; ``urgent`` lookups (a caller is about to block
on them) jump the queue. The thread marks a lookup sent when it sends it (its deadline starts then) and hands
each answer back; the caller's thread applies it (``collect``), and waits on an event for one it needs.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from mooncake_lookout.connector.logs import RateLimit
from mooncake_lookout.connector.lookup import ERROR, TIMEOUT, Lookup
from mooncake_lookout.connector.transport.base import Transport, TransportClosed
from mooncake_lookout.connector.transport.timer_slack import tight_slack
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
    hands_back = True

    def __init__(self, address: str, *, on_rebuild: Callable[[], None] | None = None) -> None:
        self.address = address
        self.rebuilds = 0
        self.late_replies = 0
        self._on_rebuild = on_rebuild
        self._queue: collections.deque[object] = collections.deque()
        self._ready = threading.Condition(threading.Lock())
        # (lookup, outcome, when, hit, tails, error, local, replied) handed back by the thread; applied by the caller.
        self._answers: collections.deque[tuple[Any, ...]] = collections.deque()
        self.news = self._answers
        self._arrived = threading.Event()
        self._closed = False
        self._inflight_deadline: float | None = None  # written by the thread, read by the caller
        self.last_sent = 0.0  # when the thread last sent a lookup (written by the thread, read by the caller)
        self._log_limit = RateLimit(10.0)
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._thread = threading.Thread(target=self._loop, name="lookout-upstream", daemon=True)
        self._thread.start()

    # -- caller's thread ------------------------------------------------------------------------------------
    def send(self, lookups: Sequence[Lookup], *, urgent: bool = False) -> None:
        """Queue ``lookups`` for the thread (``urgent``: in front of the others)."""
        if self._closed:
            raise TransportClosed("lookup transport is closed")
        with self._ready:
            if urgent:
                self._queue.extendleft(reversed(lookups))
            else:
                self._queue.extend(lookups)
            self._ready.notify()

    def collect(self, wait_s: float = 0.0, until: Lookup | None = None) -> None:
        """Apply the answers handed back; with ``until``, wait up to ``wait_s`` for its answer."""
        answers = self._answers
        if answers:
            self._apply(answers)
        if until is None or wait_s <= 0 or until.outcome is not None:
            return
        end = time.perf_counter() + wait_s
        with tight_slack():  # the wait ends on time (timer_slack.py)
            while until.outcome is None:
                left = end - time.perf_counter()
                if until.deadline is not None:
                    left = min(left, until.deadline - time.perf_counter())
                if left <= 0:
                    return
                self._arrived.clear()
                if not answers:
                    self._arrived.wait(left)
                self._apply(answers)

    def _apply(self, answers: collections.deque[tuple[Any, ...]]) -> None:
        while answers:
            lk, outcome, now, hit, tails, error, local, replied = answers.popleft()
            if not replied and lk.outcome is not None:
                continue  # the thread's own verdict (silence, a socket error) on a lookup already ended: no reply
            if not lk.cancelled:
                self._finish(lk, outcome, now, hit, tails, error, local=local)
            elif replied and self._reply_late(lk, now):  # a reply for a lookup nobody wants, past its deadline
                self._count_late()

    def _hand_back(self, lk: Lookup, outcome: Any, hit: int = 0, tails: tuple[Any, ...] = (),
                   error: str | None = None, *, local: bool = False, replied: bool = False) -> None:
        """An answer for the caller (transport thread): queued, and the caller woken if it waits. Only one that
        carries the server's reply (``replied``) can be a late reply; the thread's own timeout is silence (the
        caller may have timed the lookup out first: counting it late would tell the breaker the server is alive)."""
        self._answers.append((lk, outcome, time.perf_counter(), hit, tails, error, local, replied))
        self._arrived.set()

    def overdue(self, now: float) -> bool:
        """True once the lookup in flight has outlived its deadline (the server is not answering)."""
        deadline = self._inflight_deadline
        return deadline is not None and now >= deadline

    def stuck(self, lk: Lookup, now: float) -> bool:
        """Queued behind an overdue lookup, or the thread sent nothing for a whole deadline since ``lk`` was
        queued (it is starved or wedged): a queued lookup waits for the one ahead of it, never longer."""
        if lk.t_start is not None or lk.outcome is not None:
            return False
        queued = lk.t_queued
        return self.overdue(now) or (queued is not None and now >= max(queued, self.last_sent) + lk.timeout_s)

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
        """Stop the thread after the round trip it is in (bounded by that lookup's deadline); close the socket there."""
        if self._closed:
            return
        self._closed = True
        with self._ready:
            self._queue.append(_STOP)
            self._ready.notify()
        self._thread.join(timeout=5.0)
        self._apply(self._answers)
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
                if isinstance(item, Lookup):
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

    def _lookup(self, lk: Lookup) -> None:
        if lk.cancelled or lk.outcome is not None:
            return
        hashes = lk.block_hashes
        try:
            frames = wire.encode_lookup(lk.num_tokens, hashes if len(hashes) == lk.num_hashes else
                                        hashes[:lk.num_hashes])
        except wire.WireError as e:
            self._hand_back(lk, ERROR, error=str(e))
            return
        lk.sent(time.perf_counter())  # the one field this thread writes: the lookup is on the wire from now
        self.last_sent = lk.t_start or 0.0
        self._inflight_deadline = lk.deadline
        try:
            reply = self._round_trip(frames, (lk.deadline or 0.0) - time.perf_counter())
        except zmq.ZMQError as e:
            self._inflight_deadline = None
            self._hand_back(lk, ERROR, error=f"zmq: {e}")
            return
        if reply is None:
            # The lookups queued behind it end first, while it still counts as overdue: a caller must never
            # find one of them neither failed nor behind an overdue lookup (it would defer past the deadline).
            self._fail_queued()
            self._inflight_deadline = None
            self._hand_back(lk, TIMEOUT, error="no reply before the deadline")
            return
        self._inflight_deadline = None
        outcome, hit, tails, error = wire.decode_lookup_reply(reply)
        self._hand_back(lk, outcome, hit, tails, error, replied=True)

    def _fail_queued(self) -> None:
        """The server left a lookup unanswered: the lookups queued behind it end now (they were never sent,
        so this is not held against the server a second time), instead of each waiting a deadline in turn."""
        with self._ready:
            queued = [item for item in self._queue if isinstance(item, Lookup)]
            self._queue = collections.deque(item for item in self._queue if not isinstance(item, Lookup))
        for lk in queued:
            self._hand_back(lk, TIMEOUT, error=QUEUED_BEHIND_TIMEOUT, local=True)

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
            if isinstance(item, Lookup):
                self._hand_back(item, ERROR, error="transport closed")
            elif isinstance(item, _Reset):
                item.done.set()


__all__ = ["UpstreamTransport"]

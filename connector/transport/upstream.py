"""The ``upstream`` transport: vLLM 0.33's REQ/REP lookup channel, made deadline-bound.

One thread owns the REQ socket and carries one lookup at a time, as vLLM's server expects. Each round
trip polls with the job's remaining time; on expiry the socket is closed and rebuilt (ZMQ's "lazy
pirate"), so a stalled or restarted server never wedges the thread. The caller's path only puts the job
on a ``queue.SimpleQueue``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Union

import zmq

from mooncake_lookout.connector.events import Outcome
from mooncake_lookout.connector.job import Answer, LookupJob
from mooncake_lookout.connector.transport.base import Transport, TransportClosed
from mooncake_lookout.connector.transport.names import UPSTREAM
from mooncake_lookout.connector.wire import upstream as wire

logger = logging.getLogger(__name__)

_STOP = object()
_Item = Union[LookupJob, "tuple[Future[bool], float]", object]


class UpstreamTransport(Transport):
    """Speaks vLLM's ``LookupKeyServer`` wire format over REQ, with deadlines and socket rebuilds.

    ``address`` is a ZMQ endpoint (``ipc://...`` as vLLM derives it, or ``tcp://127.0.0.1:PORT``).
    """

    name = UPSTREAM

    def __init__(self, address: str, *, on_rebuild: Callable[[], None] | None = None) -> None:
        self.address = address
        self.rebuilds = 0
        self._on_rebuild = on_rebuild
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._closed = False
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._thread = threading.Thread(target=self._loop, name="lookout-upstream", daemon=True)
        self._thread.start()

    def submit(self, job: LookupJob) -> None:
        if self._closed:
            raise TransportClosed("lookup transport is closed")
        self._queue.put(job)

    def reset(self, timeout_s: float) -> bool:
        """Queue a reset behind every lookup already submitted (so it is fenced) and wait up to ``timeout_s``."""
        if self._closed:
            return False
        fut: Future[bool] = Future()
        self._queue.put((fut, timeout_s))
        try:
            return fut.result(timeout=timeout_s)
        except Exception:  # timed out or failed: not acknowledged
            return False

    def close(self) -> None:
        """Stop the thread after the round trip it is in (bounded by that job's deadline) and close the socket there."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self._ctx.term()

    # -- transport thread ---------------------------------------------------------------------------------
    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
            self._sock = sock
        return self._sock

    def _rebuild(self) -> None:
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

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            try:
                if isinstance(item, LookupJob):
                    self._lookup(item)
                else:
                    self._reset(*item)  # type: ignore[misc]
            except Exception:  # never let one lookup kill the thread
                logger.exception("lookup transport failed")
        self._drain()
        if self._sock is not None:
            self._sock.close(linger=0)

    def _lookup(self, job: LookupJob) -> None:
        if job.cancelled:
            return
        job.start()
        remaining = job.remaining()
        if remaining <= 0:
            job.finish(Answer(Outcome.TIMEOUT, error="deadline passed while queued"))
            return
        try:
            frames = wire.encode_lookup(job.num_tokens, job.block_hashes)
        except wire.WireError as e:
            job.finish(Answer(Outcome.ERROR, error=str(e)))
            return
        try:
            reply = self._round_trip(frames, remaining)
        except zmq.ZMQError as e:
            job.finish(Answer(Outcome.ERROR, error=f"zmq: {e}"))
            return
        if reply is None:
            job.finish(Answer(Outcome.TIMEOUT, error="no reply before the deadline"))
        else:
            job.finish(wire.decode_lookup_reply(reply))

    def _reset(self, fut: Future, timeout_s: float) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            reply = self._round_trip([wire.RESET_MSG], timeout_s)
            fut.set_result(reply == wire.RESP_OK)
        except Exception as e:
            fut.set_exception(e)

    def _drain(self) -> None:
        """Finish whatever is still queued at close as errors, so no caller waits on it."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, LookupJob):
                item.finish(Answer(Outcome.ERROR, error="transport closed"))
            elif isinstance(item, tuple):
                item[0].cancel()


__all__ = ["UpstreamTransport"]

"""The lookup server: one ROUTER socket, validated frames, concurrent and coalesced store calls.

Why: vLLM's ``LookupKeyServer`` answers one lookup at a time with one store call each, and dies on a
malformed frame. This server

* answers both our ``pipelined`` protocol (:mod:`..wire.pipelined`, DEALER clients) and vLLM 0.33's own wire
  format (REQ clients, :mod:`..wire.upstream`) on the same socket, so it drops in for vLLM's server;
* validates every frame and answers anything malformed, truncated, oversized or of another version with
  an error reply, then keeps serving;
* runs store calls on a small pool (``workers``) and, when the backend has ``lookup_many``, coalesces
  the lookups waiting together into ONE call (one ``batch_is_exist`` for all their keys);
* fences ``reset``: lookups received before it are answered first, lookups received after it wait
  until it is done, so no lookup straddles a wipe.

Threads: one IO thread owns the ROUTER and the request queue; pool threads only call the backend and
hand results back through a ``queue.SimpleQueue`` plus a :class:`~..waker.Waker`. ``close()`` from any
thread sets a flag and wakes the IO thread, which closes its own socket.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import zmq

from mooncake_lookout.connector.addresses import prepare_ipc_path
from mooncake_lookout.connector.job import LookupResult
from mooncake_lookout.connector.server.backend import LookupBackend
from mooncake_lookout.connector.server.observer import ServerObserver, ServerStats
from mooncake_lookout.connector.transport.names import PIPELINED, UPSTREAM
from mooncake_lookout.connector.waker import Waker
from mooncake_lookout.connector.wire import pipelined as protocol
from mooncake_lookout.connector.wire import upstream as upstream_wire

logger = logging.getLogger(__name__)

# ZMQ drops (and disconnects) a peer sending a message above this: a memory guard well above the limits
# the protocol answers with an error (MAX_BODY_BYTES), so oversized frames still get their error reply.
HARD_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_RECV_BURST = 1024  # messages read per loop turn before completions are looked at again
_HWM = 100_000  # messages queued per peer and direction; past it ZMQ holds off reading (or drops replies)

WIRE_PIPELINED = PIPELINED
WIRE_UPSTREAM = UPSTREAM


_METRIC_STATUS = {protocol.OK: "ok", protocol.MISS: "ok", protocol.ERROR: "error",
                  protocol.BAD_REQUEST: "bad_request"}


@dataclass(eq=False)
class _Request:
    """One validated request waiting for (or in) a store call, with what it takes to reply."""

    envelope: list[bytes]
    wire: str
    op: str
    request_id: int = protocol.UNKNOWN_ID
    num_tokens: int = 0
    hashes: list[bytes] = field(default_factory=list)


class LookupServer:
    """Serves lookups for ``backend`` on ``address`` (``ipc://PATH``, ``tcp://HOST:PORT``; ``None``: a private IPC dir).

    ``workers``: store calls that may run at once. ``max_batch_hashes``: the most block hashes coalesced into
    one store call. Use as a context manager, or call :meth:`start` and :meth:`close`.
    """

    def __init__(self, backend: LookupBackend, address: str | None = None, *, workers: int = 2,
                 max_batch_hashes: int = 16_384, observers: Iterable[ServerObserver] = ()) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.backend = backend
        self.workers = workers
        self.max_batch_hashes = max_batch_hashes
        self.stats = ServerStats()
        self._observers: list[ServerObserver] = [self.stats, *observers]
        self._batching = callable(getattr(backend, "lookup_many", None))
        self._requested_address = address
        self._address: str | None = None
        self._private_dir: str | None = None
        self._ipc_path: str | None = None
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._waker: Waker | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._drain_s = 0.0
        self._pending: collections.deque[_Request] = collections.deque()
        self._done: queue.SimpleQueue[tuple[list[_Request], list[Any], float]] = queue.SimpleQueue()
        self._running_calls = 0
        self._queued_in_calls = 0  # requests inside running store calls
        self._reset_running = False

    # -- lifecycle -----------------------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """The endpoint clients connect to (with the real port when bound to ``tcp://...:0``)."""
        if self._address is None:
            raise RuntimeError("the lookup server is not started")
        return self._address

    def start(self) -> LookupServer:
        """Bind the socket (errors raise here, naming the address) and start serving."""
        if self._thread is not None:
            raise RuntimeError("the lookup server is already started")
        address = self._requested_address
        if address is None:
            self._private_dir = tempfile.mkdtemp(prefix="mooncake-lookout-")  # mode 0700
            address = "ipc://" + os.path.join(self._private_dir, "lookup.sock")
        if address.startswith("ipc://"):
            self._ipc_path = address.removeprefix("ipc://")
            prepare_ipc_path(self._ipc_path)
        elif address.startswith("tcp://") and address.endswith(":0"):
            address = address[:-2] + ":*"
        ctx = zmq.Context(io_threads=1)
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, HARD_MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.SNDHWM, _HWM)
        sock.setsockopt(zmq.RCVHWM, _HWM)
        try:
            sock.bind(address)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            ctx.term()
            self._remove_private_dir()
            raise zmq.ZMQError(e.errno, f"{e.strerror} (addr={address!r})") from None
        if self._ipc_path is not None:
            os.chmod(self._ipc_path, 0o600)
        self._address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ctx, self._sock = ctx, sock
        self._waker = Waker()
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="lookout-server-store")
        self._thread = threading.Thread(target=self._loop, name="lookout-server-io", daemon=True)
        self._thread.start()
        logger.info("lookup server listening on %s (%d workers, coalescing %s)", self._address, self.workers,
                    "on" if self._batching else "off")
        return self

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop serving; idempotent, from any thread.

        The IO thread stops reading, answers the store calls already running (for up to ``timeout_s / 2``),
        answers what is still queued with an error, and closes its socket.
        """
        if self._thread is None or self._stop:
            return
        self._drain_s = timeout_s / 2
        self._stop = True
        assert self._waker is not None and self._pool is not None
        self._waker.wake()
        self._thread.join(timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if not self._thread.is_alive():
            assert self._ctx is not None
            self._ctx.term()
            if self._running_calls == 0:
                self._waker.close()
            else:  # a store call is still running and will wake us once: its descriptor must stay valid
                logger.warning("lookup server closed with %d store calls still running", self._running_calls)
        if self._ipc_path is not None and os.path.lexists(self._ipc_path):
            os.unlink(self._ipc_path)
        self._remove_private_dir()

    def _remove_private_dir(self) -> None:
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None

    def __enter__(self) -> LookupServer:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- IO thread ---------------------------------------------------------------------------------------------
    def _emit(self, name: str, *args: Any) -> None:
        for obs in self._observers:
            try:
                getattr(obs, name)(*args)
            except Exception:  # telemetry must never break serving
                logger.exception("server observer %r failed in %s", obs, name)

    def _loop(self) -> None:
        sock, waker = self._sock, self._waker
        assert sock is not None and waker is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(waker.fd, zmq.POLLIN)
        while not self._stop:
            try:
                events = dict(poller.poll(1000))
                if waker.fd in events:
                    waker.clear()
                self._reply_finished()
                if sock in events:
                    self._receive()
                self._dispatch()
            except Exception:  # one bad frame or reply must not stop the server
                logger.exception("lookup server loop failed")
        # Closing: answer the store calls already running (bounded), then refuse what is still queued.
        poller.unregister(sock)
        deadline = time.perf_counter() + self._drain_s
        while self._running_calls and time.perf_counter() < deadline:
            if poller.poll(max(1, int((deadline - time.perf_counter()) * 1000))):
                waker.clear()
                self._reply_finished()
        for req in self._pending:
            self._reply_error(req, "lookup server shutting down")
        self._pending.clear()
        sock.close(linger=0)

    def _receive(self) -> None:
        sock = self._sock
        assert sock is not None
        for _ in range(_RECV_BURST):
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            self._accept(frames)
        self._emit("queue_depth", self._depth())

    def _accept(self, frames: list[bytes]) -> None:
        """Validate one message; queue it, or answer it with an error at once."""
        if len(frames) >= 2 and frames[1] == b"":  # REQ envelope: identity, empty delimiter
            envelope, payload = frames[:2], frames[2:]
        else:
            envelope, payload = frames[:1], frames[1:]
        tag = payload[0] if payload else b""
        if tag in (upstream_wire.LOOKUP_MSG, upstream_wire.RESET_MSG):
            self._accept_upstream(envelope, tag, payload[1:])
            return
        try:
            req = protocol.decode_request(payload)
        except protocol.ProtocolError as e:
            self._emit("answered", "bad_request")
            self._send(envelope, protocol.encode_status(e.request_id, protocol.BAD_REQUEST, e.reason))
            return
        if isinstance(req, protocol.Reset):
            self._pending.append(_Request(envelope, WIRE_PIPELINED, protocol.OP_RESET, req.request_id))
        else:
            self._pending.append(_Request(envelope, WIRE_PIPELINED, protocol.OP_LOOKUP, req.request_id,
                                          req.num_tokens, req.hashes))

    def _accept_upstream(self, envelope: list[bytes], tag: bytes, rest: list[bytes]) -> None:
        if tag == upstream_wire.RESET_MSG:
            if rest:
                self._refuse_upstream(envelope, "reset takes no payload frames")
                return
            self._pending.append(_Request(envelope, WIRE_UPSTREAM, protocol.OP_RESET))
            return
        try:
            if len(rest) == 3 and len(rest[2]) > protocol.MAX_BODY_BYTES:
                raise upstream_wire.WireError(f"hash frame of {len(rest[2])} bytes exceeds {protocol.MAX_BODY_BYTES}")
            num_tokens, hashes = upstream_wire.decode_lookup(rest)
            if len(hashes) > protocol.MAX_HASHES:
                raise upstream_wire.WireError(f"{len(hashes)} hashes exceed the limit of {protocol.MAX_HASHES}")
        except upstream_wire.WireError as e:
            self._refuse_upstream(envelope, str(e))
            return
        self._pending.append(_Request(envelope, WIRE_UPSTREAM, protocol.OP_LOOKUP, protocol.UNKNOWN_ID,
                                      num_tokens, hashes))

    def _refuse_upstream(self, envelope: list[bytes], reason: str) -> None:
        logger.warning("refusing a malformed upstream-format request: %s", reason)
        self._emit("answered", "bad_request")
        self._send(envelope, upstream_wire.RESP_ERR)

    def _dispatch(self) -> None:
        """Start store calls while workers are free; a reset waits for the calls ahead of it and blocks those behind."""
        assert self._pool is not None
        pending = self._pending
        while pending and not self._reset_running and self._running_calls < self.workers:
            if pending[0].op == protocol.OP_RESET:
                if self._running_calls:
                    return  # fence: lookups received before the reset finish first
                self._reset_running = True
                self._start_call([pending.popleft()])
                return
            batch = [pending.popleft()]
            if self._batching:
                hashes = len(batch[0].hashes)
                while pending and pending[0].op == protocol.OP_LOOKUP and \
                        hashes + len(pending[0].hashes) <= self.max_batch_hashes:
                    hashes += len(pending[0].hashes)
                    batch.append(pending.popleft())
            self._start_call(batch)
        self._emit("queue_depth", self._depth())

    def _depth(self) -> int:
        """Requests received and not yet answered: queued, plus those inside running store calls."""
        return len(self._pending) + self._queued_in_calls

    def _start_call(self, batch: list[_Request]) -> None:
        assert self._pool is not None
        self._running_calls += 1
        self._queued_in_calls += len(batch)
        self._emit("inflight", self._running_calls)
        self._pool.submit(self._call_store, batch)

    def _call_store(self, batch: list[_Request]) -> None:
        """Pool thread: run one store call and hand its results to the IO thread."""
        t0 = time.perf_counter()
        results: list[Any]
        try:
            if batch[0].op == protocol.OP_RESET:
                results = [self.backend.reset()]
            elif self._batching:
                results = list(self.backend.lookup_many([(r.num_tokens, r.hashes) for r in batch]))  # type: ignore[attr-defined]
                if len(results) != len(batch):
                    raise RuntimeError(f"backend returned {len(results)} results for {len(batch)} lookups")
            else:
                results = [self.backend.lookup(batch[0].num_tokens, batch[0].hashes)]
        except Exception as e:  # the store failed: every lookup in the call gets the error
            logger.warning("store call failed: %r", e)
            results = [e] * len(batch)
        self._done.put((batch, results, time.perf_counter() - t0))
        assert self._waker is not None
        self._waker.wake()

    def _reply_finished(self) -> None:
        """Answer the store calls that ended. Telemetry is recorded before each reply leaves, so a client
        that has its answer also sees it counted."""
        while True:
            try:
                batch, results, seconds = self._done.get_nowait()
            except queue.Empty:
                return
            self._running_calls -= 1
            self._queued_in_calls -= len(batch)
            failed = any(isinstance(r, Exception) or r is False for r in results)
            self._emit("store_call", len(batch), seconds, failed)
            self._emit("inflight", self._running_calls)
            if batch[0].op == protocol.OP_RESET:
                self._reset_running = False
                self._reply_reset(batch[0], results[0])
                continue
            for req, result in zip(batch, results):
                if isinstance(result, Exception) or not hasattr(result, "hit_length"):
                    self._reply_error(req, _reason(result))
                else:
                    self._reply_result(req, result)

    def _reply_result(self, req: _Request, result: LookupResult) -> None:
        self._emit("answered", "ok")
        if req.wire == WIRE_UPSTREAM:
            self._send(req.envelope, upstream_wire.encode_lookup_reply(result))
        else:
            self._send(req.envelope, protocol.encode_result(req.request_id, result))

    def _reply_error(self, req: _Request, reason: str) -> None:
        self._emit("answered", "error")
        if req.wire == WIRE_UPSTREAM:
            self._send(req.envelope, upstream_wire.RESP_ERR)
        else:
            self._send(req.envelope, protocol.encode_status(req.request_id, protocol.ERROR, reason))

    def _reply_reset(self, req: _Request, outcome: Any) -> None:
        if isinstance(outcome, Exception) or outcome is False:
            logger.error("store reset failed: %s", _reason(outcome))
            self._reply_error(req, _reason(outcome))
            return
        self._emit("answered", "ok")
        if req.wire == WIRE_UPSTREAM:
            self._send(req.envelope, upstream_wire.RESP_OK)
        else:
            self._send(req.envelope, protocol.encode_status(req.request_id, protocol.OK))

    def _send(self, envelope: list[bytes], payload: bytes) -> None:
        assert self._sock is not None
        try:
            self._sock.send_multipart([*envelope, payload], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the peer is gone or slow: its reply is lost, the server goes on
            logger.debug("dropping a reply: %s", e)


def _reason(result: Any) -> str:
    if isinstance(result, Exception):
        return f"{type(result).__name__}: {result}"
    if result is False:
        return "store reported failure"
    return f"backend returned {type(result).__name__}, not a LookupResult"


__all__ = ["HARD_MAX_MESSAGE_BYTES", "LookupServer"]

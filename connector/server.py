"""The lookup server: one ROUTER socket, one loop, one store call for every lookup that is ready.

Why: vLLM's ``LookupKeyServer`` answers one lookup at a time with one store call each, and dies on a
malformed frame. This server

* answers both our ``pipelined`` protocol (:mod:`.protocol`, DEALER clients, many lookups per frame) and
  vLLM 0.33's own wire format (REQ clients, :mod:`.upstream_wire`) on the same socket, so it drops in for
  vLLM's server;
* runs ONE loop on ONE thread: drain every frame that is ready, validate each, answer all their lookups
  with one store call (``lookup_many``: one ``batch_is_exist`` over the union of their keys), reply, repeat.
  Batches grow with load by themselves, and no lookup is handed to another thread (each hand-off is a
  wake-up that costs more than the lookup's own Python work on these machines);
* answers anything malformed, truncated, oversized or of another version with an error reply, then
  keeps serving;
* fences ``reset``: lookups received before it are answered first, lookups received after it wait until
  it is done (frames are handled in arrival order), so no lookup straddles a wipe.

Threads: the loop's thread owns the socket. ``close()`` from any thread sets a flag and wakes the loop,
which closes its own socket. Observers are called on the loop's thread.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol, Sequence, Union, runtime_checkable

import zmq

from mooncake_lookout.connector import protocol
from mooncake_lookout.connector import upstream_wire
from mooncake_lookout.connector.events import FanOut
from mooncake_lookout.connector.job import HashBlob, LookupResult
from mooncake_lookout.connector.waker import Waker

logger = logging.getLogger(__name__)

# ZMQ drops (and disconnects) a peer sending a message above this: a memory guard well above the limits
# the protocol answers with an error (MAX_BODY_BYTES), so oversized frames still get their error reply.
HARD_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
RECV_BURST = 4096  # frames read per turn of the loop before they are answered
_HWM = 100_000  # messages queued per peer and direction; past it ZMQ holds off reading (or drops replies)


@runtime_checkable
class LookupBackend(Protocol):
    """What the server asks: a prefix lookup and a wipe. vLLM's store worker and our PrefixIndex both fit."""

    def lookup(self, num_tokens: int, hashes: Sequence[bytes]) -> LookupResult: ...

    def reset(self) -> Any: ...


@runtime_checkable
class BatchLookupBackend(LookupBackend, Protocol):
    """A backend that answers many lookups with one store call; an exception in the list is that lookup's error."""

    def lookup_many(self, queries: Sequence[tuple[int, Sequence[bytes]]]) -> list[Any]: ...


class ServerObserver:
    """Hooks for the server's telemetry, all called on the loop's thread; override what you need.

    ``status`` values are ``metrics.catalogue.SERVER_STATUSES``: ``ok`` (hits and misses), ``error``
    (the store failed), ``bad_request`` (the frame was refused).
    """

    def queue_depth(self, depth: int) -> None:
        """Lookups received and not yet answered."""

    def inflight(self, calls: int) -> None:
        """Store calls running right now (0 or 1: the loop makes one at a time)."""

    def store_call(self, batch_size: int, seconds: float, failed: bool) -> None:
        """One store call ended (``failed``: it raised or returned an error for some lookup)."""

    def answered(self, status: str) -> None:
        """One lookup (or reset, or refused frame) was answered."""


@dataclass
class ServerStats(ServerObserver):
    """Plain counters of what the server did (tests, ``doctor``, logs); always kept."""

    answered_by_status: dict[str, int] = field(default_factory=lambda: collections.Counter())
    store_calls: int = 0
    store_errors: int = 0
    coalesced_lookups: int = 0
    max_batch: int = 0
    max_inflight: int = 0
    depth: int = 0

    def queue_depth(self, depth: int) -> None:
        self.depth = depth

    def inflight(self, calls: int) -> None:
        self.max_inflight = max(self.max_inflight, calls)

    def store_call(self, batch_size: int, seconds: float, failed: bool) -> None:
        self.store_calls += 1
        self.coalesced_lookups += batch_size
        self.max_batch = max(self.max_batch, batch_size)
        self.store_errors += failed

    def answered(self, status: str) -> None:
        self.answered_by_status[status] += 1


@dataclass(eq=False)
class _Frame:
    """A validated pipelined lookup frame: its queries are answered together, in one reply."""

    envelope: list[bytes]
    frame_id: int
    queries: list[protocol.Query]


@dataclass(eq=False)
class _UpstreamLookup:
    """A lookup in vLLM's wire format (one per REQ message)."""

    envelope: list[bytes]
    num_tokens: int
    hashes: HashBlob


@dataclass(eq=False)
class _Reset:
    """A reset, in either wire format."""

    envelope: list[bytes]
    frame_id: int | None  # None: vLLM's wire format


_Work = Union[_Frame, _UpstreamLookup, _Reset]


def prepare_ipc_path(path: str) -> None:
    """Make ``path``'s directory private (create it 0700, or refuse one others can enter); drop a stale socket."""
    parent = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(parent):
        os.makedirs(parent, mode=0o700, exist_ok=True)
        os.chmod(parent, 0o700)
    st = os.stat(parent)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"IPC directory {parent} must be owned by uid {os.getuid()} with mode 0700 "
            f"(is uid {st.st_uid}, mode {oct(st.st_mode & 0o777)}); use a private directory")
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it")
        if _someone_listens(path):
            raise OSError(errno.EADDRINUSE, f"a server already listens on {path}")
        os.unlink(path)


def _someone_listens(path: str) -> bool:
    """True if a process accepts connections on the Unix socket ``path`` (a stale file refuses them)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(path)
        except OSError:
            return False
        return True


class LookupServer:
    """Serves lookups for ``backend`` on ``address`` (``ipc://PATH``, ``tcp://HOST:PORT``; ``None``: a private IPC dir).

    ``max_batch_hashes``: the most block hashes asked in one store call (a larger batch is split).
    Use as a context manager, or call :meth:`start` and :meth:`close`.
    """

    def __init__(self, backend: LookupBackend, address: str | None = None, *, max_batch_hashes: int = 65_536,
                 observers: Iterable[ServerObserver] = ()) -> None:
        self.backend = backend
        self.max_batch_hashes = max_batch_hashes
        self.stats = ServerStats()
        self._observe = FanOut([self.stats, *observers], base=ServerObserver)
        self._batching = callable(getattr(backend, "lookup_many", None))
        self._requested_address = address
        self._address: str | None = None
        self._private_dir: str | None = None
        self._ipc_path: str | None = None
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._waker: Waker | None = None
        self._thread: threading.Thread | None = None
        self._stop = False

    # -- lifecycle -----------------------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """The endpoint clients connect to (with the real port when bound to ``tcp://...:0``)."""
        if self._address is None:
            raise RuntimeError("the lookup server is not started")
        return self._address

    def start(self) -> "LookupServer":
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
        self._thread = threading.Thread(target=self._loop, name="lookout-server", daemon=True)
        self._thread.start()
        logger.info("lookup server listening on %s (one store call per batch: %s)", self._address,
                    "yes" if self._batching else "no, the backend has no lookup_many")
        return self

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop serving; idempotent, from any thread.

        The loop finishes the batch it is answering (a store call cannot be interrupted; it is bounded by
        the store client's own timeout), then closes its socket. Waits up to ``timeout_s`` for it.
        """
        if self._thread is None or self._stop:
            return
        self._stop = True
        assert self._waker is not None
        self._waker.wake()
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            assert self._ctx is not None
            self._ctx.term()
            self._waker.close()
        else:  # a store call is still running; its socket and descriptor must stay valid until it ends
            logger.warning("lookup server closed with a store call still running")
        if self._ipc_path is not None and os.path.lexists(self._ipc_path):
            os.unlink(self._ipc_path)
        self._remove_private_dir()

    def _remove_private_dir(self) -> None:
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None

    def __enter__(self) -> "LookupServer":
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the loop ------------------------------------------------------------------------------------------------
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
                if sock in events and not self._stop:
                    self._answer(self._receive())
            except Exception:  # one bad frame or reply must not stop the server
                logger.exception("lookup server loop failed")
        # Closing: what is already queued gets an error reply at once, not a client-side timeout.
        for item in self._receive():
            self._refuse(item, "lookup server shutting down")
        sock.close(linger=0)

    def _receive(self) -> list[_Work]:
        """Every frame that is ready (up to :data:`RECV_BURST`), validated, in arrival order."""
        sock = self._sock
        assert sock is not None
        work: list[_Work] = []
        for _ in range(RECV_BURST):
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            item = self._accept(frames)
            if item is not None:
                work.append(item)
        self._observe.queue_depth(sum(len(w.queries) if isinstance(w, _Frame) else 1 for w in work))
        return work

    def _accept(self, frames: list[bytes]) -> _Work | None:
        """Validate one message: its work item, or ``None`` once it has been answered with an error."""
        if len(frames) >= 2 and frames[1] == b"":  # REQ envelope: identity, empty delimiter
            envelope, payload = frames[:2], frames[2:]
        else:
            envelope, payload = frames[:1], frames[1:]
        tag = payload[0] if payload else b""
        if tag in (upstream_wire.LOOKUP_MSG, upstream_wire.RESET_MSG):
            return self._accept_upstream(envelope, tag, payload[1:])
        try:
            req = protocol.decode_request(payload)
        except protocol.ProtocolError as e:
            self._observe.answered("bad_request")
            self._send(envelope, protocol.encode_status(e.frame_id, protocol.BAD_REQUEST, e.reason))
            return None
        if isinstance(req, protocol.Reset):
            return _Reset(envelope, req.frame_id)
        return _Frame(envelope, req.frame_id, req.queries)

    def _accept_upstream(self, envelope: list[bytes], tag: bytes, rest: list[bytes]) -> _Work | None:
        if tag == upstream_wire.RESET_MSG:
            if rest:
                return self._refuse_upstream(envelope, "reset takes no payload frames")
            return _Reset(envelope, None)
        try:
            if len(rest) == 3 and len(rest[2]) > protocol.MAX_BODY_BYTES:
                raise upstream_wire.WireError(f"hash frame of {len(rest[2])} bytes exceeds {protocol.MAX_BODY_BYTES}")
            num_tokens, hashes = upstream_wire.decode_lookup(rest)
            if len(hashes) > protocol.MAX_HASHES:
                raise upstream_wire.WireError(f"{len(hashes)} hashes exceed the limit of {protocol.MAX_HASHES}")
        except upstream_wire.WireError as e:
            return self._refuse_upstream(envelope, str(e))
        return _UpstreamLookup(envelope, num_tokens, hashes)

    def _refuse_upstream(self, envelope: list[bytes], reason: str) -> None:
        logger.warning("refusing a malformed upstream-format request: %s", reason)
        self._observe.answered("bad_request")
        self._send(envelope, upstream_wire.RESP_ERR)
        return None

    # -- answering -------------------------------------------------------------------------------------------
    def _answer(self, work: list[_Work]) -> None:
        """Answer ``work`` in order: the lookups between two resets together, then each reset (the fence)."""
        lookups: list[_Frame | _UpstreamLookup] = []
        for item in work:
            if isinstance(item, _Reset):
                self._answer_lookups(lookups)
                lookups = []
                self._answer_reset(item)
            else:
                lookups.append(item)
        self._answer_lookups(lookups)

    def _answer_lookups(self, items: list[_Frame | _UpstreamLookup]) -> None:
        queries: list[tuple[int, Sequence[bytes]]] = []
        for item in items:
            if isinstance(item, _Frame):
                queries.extend((q.num_tokens, q.block_hashes) for q in item.queries)
            else:
                queries.append((item.num_tokens, item.hashes))
        if not queries:
            return
        results: list[Any] = []
        for chunk in self._chunks(queries):
            results.extend(self._call_store(chunk))
        self._observe.queue_depth(0)
        at = 0
        for item in items:
            if isinstance(item, _Frame):
                n = len(item.queries)
                answers = results[at:at + n]
                at += n
                for answer in answers:
                    self._observe.answered("error" if _failed(answer) else "ok")
                self._send(item.envelope, protocol.encode_reply(
                    item.frame_id, [protocol.result_of(q.lookup_id, _as_result(a))
                                    for q, a in zip(item.queries, answers)]))
            else:
                answer = results[at]
                at += 1
                if _failed(answer):
                    self._observe.answered("error")
                    self._send(item.envelope, upstream_wire.RESP_ERR)
                else:
                    self._observe.answered("ok")
                    self._send(item.envelope, upstream_wire.encode_lookup_reply(answer))

    def _chunks(self, queries: list[tuple[int, Sequence[bytes]]]) -> Iterable[list[tuple[int, Sequence[bytes]]]]:
        """Split ``queries`` so no store call asks more than ``max_batch_hashes`` keys (one per lookup at least)."""
        chunk: list[tuple[int, Sequence[bytes]]] = []
        hashes = 0
        for q in queries:
            if chunk and hashes + len(q[1]) > self.max_batch_hashes:
                yield chunk
                chunk, hashes = [], 0
            chunk.append(q)
            hashes += len(q[1])
        if chunk:
            yield chunk

    def _call_store(self, queries: list[tuple[int, Sequence[bytes]]]) -> list[Any]:
        """One store call for ``queries`` (or one per query, for a backend without ``lookup_many``)."""
        self._observe.inflight(1)
        t0 = time.perf_counter()
        results: list[Any]
        try:
            if self._batching:
                results = list(self.backend.lookup_many(queries))  # type: ignore[attr-defined]
                if len(results) != len(queries):
                    raise RuntimeError(f"backend returned {len(results)} results for {len(queries)} lookups")
            else:
                results = []
                for num_tokens, hashes in queries:
                    try:
                        results.append(self.backend.lookup(num_tokens, hashes))
                    except Exception as e:  # that lookup's error; the others go on
                        results.append(e)
        except Exception as e:  # the store failed: every lookup in the call gets the error
            logger.warning("store call failed: %r", e)
            results = [e] * len(queries)
        seconds = time.perf_counter() - t0
        self._observe.inflight(0)
        self._observe.store_call(len(queries), seconds, any(_failed(r) for r in results))
        return results

    def _answer_reset(self, item: _Reset) -> None:
        self._observe.inflight(1)
        t0 = time.perf_counter()
        try:
            outcome: Any = self.backend.reset()
        except Exception as e:
            outcome = e
        self._observe.inflight(0)
        failed = isinstance(outcome, Exception) or outcome is False
        self._observe.store_call(1, time.perf_counter() - t0, failed)
        if failed:
            logger.error("store reset failed: %s", _reason(outcome))
        self._observe.answered("error" if failed else "ok")
        if item.frame_id is None:
            self._send(item.envelope, upstream_wire.RESP_ERR if failed else upstream_wire.RESP_OK)
        elif failed:
            self._send(item.envelope, protocol.encode_status(item.frame_id, protocol.ERROR, _reason(outcome)))
        else:
            self._send(item.envelope, protocol.encode_status(item.frame_id, protocol.OK))

    def _refuse(self, item: _Work, reason: str) -> None:
        """Answer ``item`` with an error without asking the store."""
        self._observe.answered("error")
        if isinstance(item, _UpstreamLookup) or (isinstance(item, _Reset) and item.frame_id is None):
            self._send(item.envelope, upstream_wire.RESP_ERR)
        else:
            self._send(item.envelope, protocol.encode_status(item.frame_id or protocol.UNKNOWN_ID, protocol.ERROR,
                                                             reason))

    def _send(self, envelope: list[bytes], payload: bytes) -> None:
        assert self._sock is not None
        try:
            self._sock.send_multipart([*envelope, payload], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the peer is gone or slow: its reply is lost, the server goes on
            logger.debug("dropping a reply: %s", e)


def _failed(result: Any) -> bool:
    return isinstance(result, BaseException) or not hasattr(result, "hit_length")


def _as_result(result: Any) -> LookupResult | BaseException:
    if isinstance(result, BaseException):
        return result
    if not hasattr(result, "hit_length"):
        return RuntimeError(f"backend returned {type(result).__name__}, not a LookupResult")
    return result  # type: ignore[no-any-return]


def _reason(result: Any) -> str:
    if isinstance(result, Exception):
        return f"{type(result).__name__}: {result}"
    if result is False:
        return "store reported failure"
    return f"backend returned {type(result).__name__}, not a LookupResult"


__all__ = ["BatchLookupBackend", "LookupBackend", "LookupServer", "ServerObserver", "ServerStats",
           "prepare_ipc_path"]

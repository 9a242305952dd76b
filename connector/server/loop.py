"""The lookup server: one ROUTER socket, one loop, one store call for every lookup that is ready.

Why: vLLM's ``LookupKeyServer`` answers one lookup at a time with one store call each, and dies on a
malformed frame. This server

* answers both our ``pipelined`` protocol (DEALER clients, many lookups per frame) and vLLM 0.33's own
  wire format (REQ clients) on the same socket (:mod:`.intake` tells them apart), so it drops in for
  vLLM's server;
* runs ONE loop on ONE thread: drain every frame that is ready, validate each, answer all their lookups
  with one store call (``lookup_many``: one ``batch_is_exist`` over the union of their keys), reply, repeat.
  Batches grow with load by themselves, and no lookup is handed to another thread (each hand-off is a
  wake-up that costs more than the lookup's own Python work on these machines). A lone message (nothing
  waits, nothing behind it: a lightly loaded server's every turn) is answered as soon as it is read, without
  the queue's bookkeeping, which cost 15-25 us of each round trip cold;
* answers anything malformed, truncated, oversized or of another version with an error reply, then
  keeps serving;
* fences ``reset``: lookups received before it are answered first, lookups received after it wait until
  it is done (frames are handled in arrival order), so no lookup straddles a wipe;
* decides who gets what (:mod:`.admission`): bounds on what waits, per peer and in all, in lookups, keys and
  bytes (``busy`` past one), a share of each store call per peer (a flood is spread over turns), paced turns
  for peers past a bound (:mod:`.pacing`), and ``reset`` only where a peer may wipe the store (IPC, or CURVE:
  every peer authenticated). With ``curve`` the socket is a CURVE server and pyzmq's ZAP handler
  (:mod:`.auth`) admits only the allowed client keys.

Threads: the loop's thread owns the socket. ``close()`` from any thread sets a flag and wakes the loop,
which closes its own socket. Observers are called on the loop's thread.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import zmq

from mooncake_lookout.connector.addresses import prepare_ipc_path
from mooncake_lookout.connector.server import intake, lease, listen
from mooncake_lookout.connector.server.admission import Admission
from mooncake_lookout.connector.server.backend import LookupBackend, as_result, failed
from mooncake_lookout.connector.server.epoch import MarkerStore
from mooncake_lookout.connector.server.epoch import Query as _Query
from mooncake_lookout.connector.server.lease import LeaseProbe
from mooncake_lookout.connector.server.limits import DEFAULT_LIMITS, Limits, frame_bytes
from mooncake_lookout.connector.server.observer import ServerObserver, ServerObserverSet, ServerStats
from mooncake_lookout.connector.server.store_calls import StoreCalls
from mooncake_lookout.connector.waker import Waker
from mooncake_lookout.connector.wire import pipelined as protocol
from mooncake_lookout.connector.wire import upstream as upstream_wire

if TYPE_CHECKING:
    from mooncake_lookout.connector.curve import ServerCurve

logger = logging.getLogger(__name__)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: pyzmq's enums cost ~1 us per operation
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)

RECV_BURST = 4096  # frames read per turn of the loop before they are answered
BUSY_BURST = 16  # frames turned away busy per turn: past it the turn answers, so a flood cannot stretch it


class LookupServer:
    """Serves lookups for ``backend`` on ``address`` (``ipc://PATH``, ``tcp://HOST:PORT``; ``None``: a private IPC dir).

    ``max_batch_hashes``: the most block hashes asked in one store call (a larger batch is split).
    ``curve``: serve CURVE clients of its allow-list only. ``limits``: what may wait in the server, per peer and
    in all (lookups, store keys, bytes; ``busy`` past a bound), and each peer's share of a turn (:mod:`.limits`).
    Use as a context manager, or call :meth:`start` and :meth:`close`.
    """

    def __init__(self, backend: LookupBackend, address: str | None = None, *, max_batch_hashes: int = 65_536,
                 observers: Iterable[ServerObserver] = (), marker: bool = True,
                 lease_window_s: float | None = None, curve: ServerCurve | None = None,
                 limits: Limits = DEFAULT_LIMITS) -> None:
        self.backend = backend
        self.stats = ServerStats()
        self._observe = ServerObserverSet([self.stats, *observers])
        self._store = StoreCalls(backend, self._observe, marker=marker, max_batch_hashes=max_batch_hashes)
        # The store's epoch (server/epoch.py, kept by the store calls): with ``lease_window_s``, trusted only once
        # the master's key lease is known to cover it (server/lease.py).
        self._lease_window_s = lease_window_s
        self.lease_probe: LeaseProbe | None = None
        self._requested_address = address
        self._address: str | None = None
        self._private_dir: str | None = None
        self._ipc_path: str | None = None
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._waker: Waker | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self.curve = curve
        self._listener: listen.Listener | None = None
        self._admission = Admission(limits=limits, curve=curve is not None)
        self._reported: tuple[int, int, int] | None = None  # the waiting gauges last reported

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
        self._admission.resets_allowed = listen.resets_allowed(address, self.curve)
        try:
            self._listener = listener = listen.bind_router(address, self.curve)
        except zmq.ZMQError:
            self._remove_private_dir()
            raise
        if self._ipc_path is not None:
            os.chmod(self._ipc_path, 0o600)
        self._address = listener.address
        self._ctx, self._sock = listener.ctx, listener.sock
        window_s = self._lease_window_s
        marker = self._store.marker
        if marker is not None and window_s is None:  # the caller vouches for the lease
            marker.trust()
            marker.renew()
        self._observe.prefix_cache_state(lease.OFF if marker is None else lease.ON if window_s is None
                                         else lease.PROBING)
        if marker is not None and window_s is not None:
            store = getattr(self.backend, "store", None)
            self.lease_probe = LeaseProbe(store, cast(MarkerStore, self.backend).marker_key(""), window_s,
                                          marker.trust, self._observe.prefix_cache_state)
        self._observe.bounds(self._admission.limits.bounds())
        self._waker = Waker()
        self._thread = threading.Thread(target=self._loop, name="lookout-server", daemon=True)
        self._thread.start()
        logger.info("lookup server listening on %s (one store call per batch: %s; CURVE: %s; reset: %s)",
                    self._address, "yes" if self._store.batching else "no, the backend has no lookup_many",
                    "on" if self.curve is not None else "off",
                    "allowed" if self._admission.resets_allowed else "refused (plain TCP)")
        return self

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop serving; idempotent, from any thread.

        The loop finishes the batch it is answering (a store call cannot be interrupted; it is bounded by
        the store client's own timeout), then closes its socket. Waits up to ``timeout_s`` for it.
        """
        if self._thread is None or self._stop:
            return
        self._stop = True
        if self.lease_probe is not None:
            self.lease_probe.close()
        assert self._waker is not None
        self._waker.wake()
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            assert self._ctx is not None and self._listener is not None
            self._listener.stop_auth()
            self._ctx.term()
            self._waker.close()
        else:  # a store call is still running; its socket and descriptor must stay valid until it ends
            logger.warning("lookup server closed with a store call still running")
        if self._ipc_path is not None and os.path.lexists(self._ipc_path):
            os.unlink(self._ipc_path)
        self._remove_private_dir()

    @property
    def allow_list(self) -> Any:
        """With CURVE, the allow-list that admits clients (:class:`.auth.AllowList`: ``refused`` counts the others)."""
        return self._listener.allow_list if self._listener is not None else None

    def _remove_private_dir(self) -> None:
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None

    def __enter__(self) -> LookupServer:
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
        admission = self._admission
        while not self._stop:
            try:
                wait = admission.wait_s(time.perf_counter())  # work ready: answer it, then look again
                events = dict(poller.poll(1000 if wait is None else math.ceil(wait * 1000)))
                if waker.fd in events:
                    waker.clear()
                if self._stop:
                    break
                if sock in events:
                    self._receive(readable=True)
                now = time.perf_counter()
                if admission.ready(now):
                    self._turn(now)
            except Exception:  # one bad frame or reply must not stop the server
                logger.exception("lookup server loop failed")
        # Closing: what is already queued gets an error reply at once, not a client-side timeout.
        self._receive(closing=True)
        for refusal in admission.pacer.drain():
            self._reply(refusal)
        for item in admission.drain():
            self._refuse(item, "lookup server shutting down")
        sock.close(linger=0)

    def _turn(self, now: float) -> None:
        """Answer what may be answered: the flooding peers' held replies and shares only when their turn is due."""
        admission = self._admission
        flood = admission.flood_turn(now)
        if flood:
            for refusal in admission.pacer.release():
                self._reply(refusal)
        for batch in admission.take(flood):
            self._answer(batch)
        if flood:
            end = time.perf_counter()
            admission.pacer.turn_took(end - now, end)
        self._report_waiting()

    def _receive(self, *, readable: bool = False, closing: bool = False) -> None:
        """Take in every frame that is ready (up to :data:`RECV_BURST`, or :data:`BUSY_BURST` turned away busy);
        ``readable``: the poll just said one is (no look first).

        A lone lookup message (nothing waits, nothing behind it) is answered here and now, unless ``closing``: the
        common case of a lightly loaded server, where the queue would hold it for this turn only, and its
        bookkeeping cost 15-25 us a round trip (cold, measured in-process against the same loop without it)."""
        sock, admission = self._sock, self._admission
        assert sock is not None
        copy = not admission.curve  # a CURVE frame carries its peer's key: read it as a zmq.Frame
        busy = 0
        # EVENTS before each read: ending on ``zmq.Again`` costs an exception per batch (~10 us here).
        ready = readable or cast(int, sock.getsockopt(_EVENTS)) & _POLLIN
        for _ in range(RECV_BURST):
            if not ready:
                break
            try:
                frames = sock.recv_multipart(flags=_NOBLOCK, copy=copy)
            except zmq.Again:
                break
            ready = cast(int, sock.getsockopt(_EVENTS)) & _POLLIN
            taken = admission.take_in(frames, alone=not (ready or closing))
            if taken is None:  # queued
                continue
            if not isinstance(taken, intake.Refusal):  # alone: answered now (it would be the turn's only batch)
                self._answer_at_once(taken, frames)
                continue
            if not taken.later:
                self._reply(taken)
            if taken.status == protocol.BUSY:
                busy += 1
                if busy >= BUSY_BURST:
                    break
        self._report_waiting()

    def _report_waiting(self) -> None:
        """The gauges of what waits, when they changed (twice a turn otherwise: each event costs the loop)."""
        self._report(self._admission.total.counts())

    def _report(self, counts: tuple[int, int, int]) -> None:
        if counts != self._reported:
            self._reported = counts
            self._observe.queue_depth(counts[0])
            self._observe.waiting(counts[1], counts[2])

    def _answer_at_once(self, item: intake.Frame | intake.UpstreamLookup, message: list[Any]) -> None:
        """Answer a lone message the admission let through; the gauges show it waiting meanwhile, as if queued."""
        n = intake.lookups_in(item)
        self._report((n, intake.keys_in(item), frame_bytes(sum(map(len, message)), n)))
        self._answer_lookups([item])
        self._report_waiting()

    # -- answering -------------------------------------------------------------------------------------------
    def _answer(self, work: list[intake.Work]) -> None:
        """Answer ``work`` in order: the lookups between two resets together, then each reset (the fence)."""
        lookups: list[intake.Frame | intake.UpstreamLookup] = []
        for item in work:
            if isinstance(item, intake.Reset):
                self._answer_lookups(lookups)
                lookups = []
                self._answer_reset(item)
            else:
                lookups.append(item)
        self._answer_lookups(lookups)

    def _answer_lookups(self, items: list[intake.Frame | intake.UpstreamLookup]) -> None:
        queries: list[_Query] = []
        for item in items:
            if isinstance(item, intake.Frame):
                queries.extend((q.num_tokens, q.block_hashes, q.known, q.epoch) for q in item.queries)
            else:
                queries.append((item.num_tokens, item.hashes, 0, 0))
        if not queries:
            return
        results, epochs = self._store.lookups(queries)
        epoch = epochs if isinstance(epochs, int) else 0  # the common case: one store call, one epoch for all
        at = 0
        for item in items:
            if isinstance(item, intake.Frame):
                n = len(item.queries)
                answers = results[at:at + n]
                if not isinstance(epochs, int):  # a frame over several calls: the one epoch they all confirmed, if any
                    vouched = set(epochs[at:at + n])
                    epoch = vouched.pop() if len(vouched) == 1 else 0
                at += n
                errors = sum(map(failed, answers))
                if errors:
                    self._observe.answered("error", errors)
                if errors < n:
                    self._observe.answered("ok", n - errors)
                self._send(item.envelope, protocol.encode_reply(
                    item.frame_id, [protocol.result_of(q.lookup_id, as_result(a))
                                    for q, a in zip(item.queries, answers)], epoch))
            else:
                answer = results[at]
                at += 1
                if failed(answer):
                    self._observe.answered("error")
                    self._send(item.envelope, upstream_wire.RESP_ERR)
                else:
                    self._observe.answered("ok")
                    self._send(item.envelope, upstream_wire.encode_lookup_reply(answer))

    @property
    def prefix_cache_state(self) -> str:
        """Whether the server keeps a store epoch, or why not (``server/lease.py``'s ``STATES``)."""
        if self._store.marker is None:
            return lease.OFF
        return self.lease_probe.state if self.lease_probe is not None else lease.ON

    @property
    def epoch(self) -> int:
        """The store's epoch as this server last saw it (0: no marker kept, clients must not cache)."""
        return self._store.epoch

    def _answer_reset(self, item: intake.Reset) -> None:
        why = self._store.reset()  # None: wiped, under a new epoch
        if why is not None:
            logger.error("store reset failed: %s", why)
        self._observe.answered("error" if why is not None else "ok")
        if item.frame_id is None:
            self._send(item.envelope, upstream_wire.RESP_ERR if why is not None else upstream_wire.RESP_OK)
        elif why is not None:  # no new epoch (nothing says it was wiped), and no word for the old one: it may have been
            self._send(item.envelope, protocol.encode_status(item.frame_id, protocol.ERROR, why))
        else:
            self._send(item.envelope, protocol.encode_status(item.frame_id, protocol.OK, epoch=self.epoch))

    def _reply(self, refusal: intake.Refusal) -> None:
        self._observe.answered(refusal.status, refusal.count)
        self._send(refusal.envelope, refusal.reply)

    def _refuse(self, item: intake.Work, reason: str) -> None:
        """Answer ``item`` with an error without asking the store."""
        self._observe.answered("error")
        if isinstance(item, intake.UpstreamLookup) or (isinstance(item, intake.Reset) and item.frame_id is None):
            self._send(item.envelope, upstream_wire.RESP_ERR)
        else:
            self._send(item.envelope, protocol.encode_status(item.frame_id or protocol.UNKNOWN_ID, protocol.ERROR,
                                                             reason))

    def _send(self, envelope: list[bytes], payload: bytes) -> None:
        send = cast(zmq.Socket, self._sock).send
        try:
            for part in envelope:  # the routing id(s): a ROUTER drops a reply to a gone peer, never blocks
                send(part, _SNDMORE | _NOBLOCK)
            send(payload, _NOBLOCK)
        except zmq.ZMQError as e:  # the peer is gone or slow: its reply is lost, the server goes on
            logger.debug("dropping a reply: %s", e)


__all__ = ["LookupServer"]

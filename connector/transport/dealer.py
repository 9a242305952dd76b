"""The ``pipelined`` wire's client socket and frames, for whichever thread owns them.

A step's lookups are split into frames on the caller's thread (:func:`plan_frames`: ids and sizes only,
nothing copied), then each frame is encoded where the socket lives (:func:`encode_frame`: the hashes joined
into one ``bytes`` per lookup, one msgpack body). :class:`Dealer` is the DEALER socket itself: built lazily,
rebuilt after a silent server ("lazy pirate"), CURVE keys set once, and a handshake monitor that explains a
refused CURVE handshake on the slow path only. Use a :class:`Dealer` from one thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import zmq

from mooncake_lookout.connector.lookup import Lookup
from mooncake_lookout.connector.transport.base import Transport
from mooncake_lookout.connector.transport.handshake import HandshakeWatch
from mooncake_lookout.connector.wire import pipelined as protocol

if TYPE_CHECKING:
    from mooncake_lookout.connector.curve import ClientCurve

logger = logging.getLogger(__name__)

HWM = 100_000
# Plain ints: pyzmq's constants are enums, and an enum operation costs about a microsecond on the hot path.
NOBLOCK, SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)
SEND_MORE = NOBLOCK | SNDMORE
EVENTS, POLLIN, RCVTIMEO = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVTIMEO)


def plan_frames(lookups: Sequence[Lookup], ids: Iterator[int]) -> list[tuple[int, list[Lookup]]]:
    """Give each lookup not cancelled its id, and group them into frames within the protocol's limits."""
    frames: list[tuple[int, list[Lookup]]] = []
    batch: list[Lookup] = []
    size = 0
    for lk in lookups:
        if lk.cancelled or lk.outcome is not None:
            continue
        lk.lookup_id = next(ids)
        qsize = lk.num_hashes * len(lk.last_hash) + 32
        if batch and (len(batch) == protocol.MAX_QUERIES or size + qsize > protocol.MAX_BODY_BYTES):
            frames.append((next(ids), batch))
            batch, size = [], 0
        batch.append(lk)
        size += qsize
    if batch:
        frames.append((next(ids), batch))
    return frames


def encode_frame(frame_id: int, lookups: Sequence[Lookup]) -> tuple[list[bytes] | None, list[tuple[Lookup, str]]]:
    """The two frames of a request carrying ``lookups`` (None if none could be encoded), and those that could
    not be, with why (they fail; the others go)."""
    queries: list[protocol.Query] = []
    refused: list[tuple[Lookup, str]] = []
    for lk in lookups:
        hashes = lk.block_hashes
        if len(hashes) != lk.num_hashes:  # the prompt grew since it was asked: send what was asked
            hashes = hashes[:lk.num_hashes]
        try:
            queries.append(protocol.query(lk.lookup_id, lk.num_tokens, hashes, lk.known, lk.epoch))
        except protocol.ProtocolError as e:
            refused.append((lk, str(e)))
    if not queries:
        return None, refused
    return protocol.encode_lookups(frame_id, queries), refused


class Dealer:
    """A DEALER socket to ``address``, built when first used; CURVE keys and a handshake monitor if asked."""

    def __init__(self, address: str, *, curve: ClientCurve | None = None, watch_handshakes: bool | None = None) -> None:
        self.address = address
        self.ctx = zmq.Context(io_threads=1)
        self.sock: zmq.Socket | None = None
        self.fd = -1
        self._recv_timeout_ms = -1  # the socket's RCVTIMEO (ZMQ's default: none)
        self._curve = curve
        self._watch = curve is not None if watch_handshakes is None else watch_handshakes
        self._handshakes: HandshakeWatch | None = None
        self.diagnosis: str | None = None  # why the server answered nothing, when a handshake said so

    def socket(self) -> zmq.Socket:
        """The socket, connected (built now if there is none)."""
        if self.sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, HWM)
            sock.setsockopt(zmq.RCVHWM, HWM)
            if self._curve is not None:
                self._curve.apply(sock)
            if self._watch:
                self._handshakes = HandshakeWatch(sock, curve=self._curve is not None)
            sock.connect(self.address)
            self.sock, self.fd = sock, int(sock.getsockopt(zmq.FD))
        return self.sock

    def send(self, frames: list[bytes]) -> None:
        """Send a request's two frames without blocking (raises ``zmq.ZMQError`` when the queue is full)."""
        sock = self.socket()
        sock.send(frames[0], SEND_MORE)
        sock.send(frames[1], NOBLOCK, copy=False)

    def recv_within(self, sock: zmq.Socket, ms: int) -> bytes | None:
        """The next reply, waiting up to ``ms`` whole milliseconds (one blocking read, the GIL released: a wake-up
        when it comes, no look before); ``None`` when none came in time."""
        if ms != self._recv_timeout_ms:
            sock.setsockopt(RCVTIMEO, ms)
            self._recv_timeout_ms = ms
        try:
            return sock.recv()
        except zmq.Again:
            return None

    def diagnose(self) -> str | None:
        """Why a CURVE handshake was refused, if the monitor says so (slow path only)."""
        diagnosis = self._handshakes.diagnose() if self._handshakes is not None else None
        if diagnosis is not None:
            self.diagnosis = diagnosis
        return diagnosis

    def close_socket(self) -> None:
        """Drop the connection and every request queued on it; the next use opens a new one."""
        if self._handshakes is not None:
            self._handshakes.close()
            self._handshakes = None
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock, self.fd, self._recv_timeout_ms = None, -1, -1

    def close(self) -> None:
        """Close the socket and the context."""
        self.close_socket()
        self.ctx.term()


def readable(sock: zmq.Socket) -> bool:
    """True if a reply waits on ``sock`` (reading EVENTS also re-arms its edge-triggered descriptor)."""
    return bool(int(sock.getsockopt(EVENTS)) & POLLIN)


class DealerTransport(Transport):
    """What both ``pipelined`` transports hold (the socket on the caller's thread or on a thread of its own): the
    address, the deadline, the late-reply and rebuild counters and hooks, and the :class:`Dealer`."""

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
        self._dealer = Dealer(address, curve=curve, watch_handshakes=watch_handshakes)

    @property
    def diagnosis(self) -> str | None:
        """Why the server answered nothing, when a refused CURVE handshake said so."""
        return self._dealer.diagnosis


__all__ = ["DealerTransport", "Dealer", "HWM", "encode_frame", "plan_frames", "readable"]

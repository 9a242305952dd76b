"""Bench floors: what a lookup costs on this machine with no lookup library at all.

Why: a ratio to upstream says who is faster, not how far from the machine's limit either is. Two floors,
measured in the same run as the clients they judge:

* **round-trip floor**: a raw ZMQ DEALER on the caller's thread, a raw ROUTER in a child process whose
  handler makes one real ``batch_is_exist`` of the lookup's keys and replies. The p50/p99 of a blocking
  round trip (send, wait, receive) is what any blocking lookup between two processes pays here.
* **step round-trip floor**: the same for one step of scenario (c): its new requests' keys in one store call
  (each key once, as our server asks them), each round trip after a pause as long as (c)'s model step. What a
  call that waits for a step's answers pays with no lookup library at all: the round-trip floor is one lookup,
  asked back to back while everything is warm; (c)'s calls wait for several, after a model step.
* **touch floor**: one send plus one drain of a reply that has already arrived, on the caller's thread:
  the caller's CPU cost only (the round trip happened while it slept, as during a model step). A client
  that sends and drains once per step cannot cost the scheduler's thread less per step.
* **split floor**: a send in one step and one ``recv`` of the reply in the next, timed and added up: the
  least an async lookup costs a caller whose answer comes a step after its send (two wake-ups of the
  socket, where the touch floor has one).
* **kernel-socket floor**: the round-trip floor's request and store call over a Unix ``SOCK_SEQPACKET`` socket
  instead of ZMQ, asked beside it: what the machine's own sockets cost, without ZMQ's I/O threads (each a
  wake-up of its own, on each side). The difference between the two is what the transport, not the store or
  any lookup code, adds to every round trip.

The keys travel ready-made (newline-joined) so the handler does nothing but the store call: the floor
holds no key layout of its own, and serves the bench's index and a vLLM deployment's keys alike.

The child is this module run as a script (:func:`child_main`): it opens a lookup-only store client
(it cannot write), binds its ROUTER (and, with ``--socket``, a ``SOCK_SEQPACKET`` listener served on a thread),
prints ``floor listening on ADDRESS`` and serves until SIGTERM.
:class:`FloorServer` starts it (:class:`~mooncake_lookout.connector.rigs.processes.ChildProcess`),
waits for that line and stops it by pid.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

import zmq

from mooncake_lookout.connector.rigs.processes import ChildProcess

CHILD_MODULE = "mooncake_lookout.connector.bench.floors"
READY_PREFIX = "floor listening on "
MAX_REQUEST_BYTES = 1 << 22  # a floor request's keys, newline-joined (the bench's prompts need far less)


def key_frame(keys: Sequence[str]) -> bytes:
    """One floor request: the store keys of a lookup, newline-joined."""
    return "\n".join(keys).encode()


def joined_frame(frames: Sequence[bytes]) -> bytes:
    """One floor request for several lookups: their keys in one store call, each key once."""
    return b"\n".join(dict.fromkeys(key for frame in frames for key in frame.split(b"\n")))


# -- parent side -------------------------------------------------------------------------------------------

class FloorServer:
    """The floor's child process and a raw DEALER on the caller's thread; a context manager.

    ``master``: the Mooncake master's ``host:port``. ``rpc_timeout_ms`` bounds one store call in the child.
    """

    def __init__(self, master: str, *, rpc_timeout_ms: int | None = 30_000, start_timeout_s: float = 60.0) -> None:
        self.master = master
        self.rpc_timeout_ms = rpc_timeout_ms
        self.start_timeout_s = start_timeout_s
        self.address = ""
        self._dir: str | None = None
        self._child: ChildProcess | None = None
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._seq: socket.socket | None = None  # the kernel-socket floor's connection

    def start(self) -> FloorServer:
        """Spawn the child, wait for its ready line, connect the DEALER and the socket; on failure stop what started."""
        try:
            self._dir = tempfile.mkdtemp(prefix="lookout-floor-")  # mode 0700
            seq_path = os.path.join(self._dir, "floor.seq")
            argv = [sys.executable, "-m", CHILD_MODULE, "--master", self.master,
                    "--address", "ipc://" + os.path.join(self._dir, "floor.sock"), "--socket", seq_path]
            if self.rpc_timeout_ms is not None:
                argv += ["--rpc-timeout-ms", str(self.rpc_timeout_ms)]
            env = dict(os.environ, MC_LOG_LEVEL=os.environ.get("MC_LOG_LEVEL", "ERROR"), PYTHONUNBUFFERED="1")
            self._child = ChildProcess(argv, env=env, keep_lines=100, name="floor")
            line = self._child.wait_line(READY_PREFIX, self.start_timeout_s, "the floor's ready line")
            self.address = line[len(READY_PREFIX):].strip()
            self._ctx = zmq.Context(io_threads=1)
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
            self._sock = sock
            seq = self._seq = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            seq.connect(seq_path)
        except BaseException:
            self.close()
            raise
        return self

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            raise RuntimeError("the floor server is not started")
        return self._sock

    def round_trips(self, frames: Sequence[bytes], timeout_s: float = 10.0, pause_s: float = 0.0) -> list[float]:
        """Seconds of each blocking round trip: send one frame, wait for its reply, receive it; ``pause_s``: sleep
        that long before each (untimed), as a scheduler's model step comes between its lookups."""
        sock = self._socket()
        out = []
        timeout_ms = int(timeout_s * 1000)
        for frame in frames:
            if pause_s > 0:
                time.sleep(pause_s)
            t0 = time.perf_counter()
            sock.send(frame, flags=zmq.NOBLOCK, copy=False)
            if not sock.poll(timeout_ms, zmq.POLLIN):
                raise TimeoutError(f"the floor's server did not answer in {timeout_s} s")
            sock.recv()
            out.append(time.perf_counter() - t0)
        return out

    def socket_round_trips(self, frames: Sequence[bytes], timeout_s: float = 10.0) -> list[float]:
        """Seconds of each blocking round trip of the kernel-socket floor: the same request, store call and reply as
        :meth:`round_trips`, over a Unix ``SOCK_SEQPACKET`` connection (no ZMQ)."""
        seq = self._seq
        if seq is None:
            raise RuntimeError("the floor server is not started")
        seq.settimeout(timeout_s)
        out = []
        for frame in frames:
            t0 = time.perf_counter()
            try:
                seq.send(frame)
                reply = seq.recv(64)
            except TimeoutError:
                raise TimeoutError(f"the floor's socket server did not answer in {timeout_s} s") from None
            if not reply:
                raise ConnectionError("the floor's socket server closed the connection")
            out.append(time.perf_counter() - t0)
        return out

    def touches(self, frames: Sequence[bytes], step_s: float = 0.001, timeout_s: float = 10.0) -> list[float]:
        """Seconds the caller's thread pays for one send plus one drain of an arrived reply, per frame.

        The reply to the previous frame arrives during a ``step_s`` pause (as during a model step; the
        caller's thread does not touch the socket meanwhile); then the next frame is sent and the reply
        received, timed together. A pause too short for the reply (it had not arrived) gives no sample:
        the reply is waited for untimed and the next frame tried.
        """
        sock = self._socket()
        if not frames:
            return []
        timeout_ms = int(timeout_s * 1000)
        out = []
        sock.send(frames[0], flags=zmq.NOBLOCK, copy=False)
        for frame in [*frames[1:], None]:
            time.sleep(step_s)
            t0 = time.perf_counter()
            if frame is not None:
                sock.send(frame, flags=zmq.NOBLOCK, copy=False)
            try:
                sock.recv(flags=zmq.NOBLOCK)
            except zmq.Again:  # not arrived yet: no sample; wait for it, and for the frame just sent
                for _ in range(2 if frame is not None else 1):
                    if not sock.poll(timeout_ms, zmq.POLLIN):
                        raise TimeoutError(f"the floor's server did not answer in {timeout_s} s") from None
                    sock.recv()
                if frame is not None:  # nothing is in flight now: start the chain again
                    sock.send(frame, flags=zmq.NOBLOCK, copy=False)
                continue
            out.append(time.perf_counter() - t0)
        return out

    def splits(self, frames: Sequence[bytes], step_s: float = 0.001, timeout_s: float = 10.0) -> list[float]:
        """Seconds the caller's thread pays for an async lookup split over two wake-ups, per frame: a send in
        one step, then, after a ``step_s`` pause, one ``recv(NOBLOCK)`` of the arrived reply; the two timed
        and added up.

        The least an async lookup costs a caller that sends in one step and reads the answer in the next (the
        touch floor lets one wake-up do both). A reply not there after the pause gives no sample (it is
        waited for untimed).
        """
        sock = self._socket()
        timeout_ms = int(timeout_s * 1000)
        out = []
        for frame in frames:
            t0 = time.perf_counter()
            sock.send(frame, flags=zmq.NOBLOCK, copy=False)
            sent = time.perf_counter() - t0
            time.sleep(step_s)
            t1 = time.perf_counter()
            try:
                sock.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                if not sock.poll(timeout_ms, zmq.POLLIN):
                    raise TimeoutError(f"the floor's server did not answer in {timeout_s} s") from None
                sock.recv()
                continue
            out.append(sent + time.perf_counter() - t1)
        return out

    def close(self) -> None:
        """Close the DEALER and the socket connection, stop the child by pid, remove its folder; safe to call twice."""
        if self._seq is not None:
            self._seq.close()
            self._seq = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._child is not None:
            self._child.stop()
            self._child = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> FloorServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- child side --------------------------------------------------------------------------------------------

def _hit_blocks(codes: Sequence[int]) -> int:
    n = 0
    for code in codes:
        if code != 1:
            break
        n += 1
    return n


def _answer(store: Any, frame: bytes) -> bytes:
    """One floor request's reply, on either socket: its keys in one ``batch_is_exist``, the hit blocks as 4 bytes."""
    return _hit_blocks(store.batch_is_exist(bytes(frame).decode().split("\n"))).to_bytes(4, "big")


def _serve_socket(listener: socket.socket, store: Any, stop: threading.Event) -> None:
    """The kernel-socket floor's server: each request on a connection, one ``batch_is_exist``, the hit blocks back."""
    listener.settimeout(0.2)
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        with conn:
            while frame := conn.recv(MAX_REQUEST_BYTES):
                conn.send(_answer(store, frame))


def child_main(argv: Sequence[str] | None = None) -> int:
    """Serve floor requests until SIGTERM: one ``batch_is_exist`` per request, the hit blocks as the reply."""
    p = argparse.ArgumentParser(prog=f"python -m {CHILD_MODULE}", description="the bench's round-trip floor")
    p.add_argument("--master", required=True, metavar="HOST:PORT")
    p.add_argument("--address", required=True, help="ipc://PATH or tcp://127.0.0.1:PORT to bind")
    p.add_argument("--rpc-timeout-ms", type=int, default=None)
    p.add_argument("--socket", default=None, metavar="PATH",
                   help="also serve the kernel-socket floor on this Unix SOCK_SEQPACKET path")
    args = p.parse_args(argv)
    from mooncake_lookout.connector.server.store import open_store

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    store = open_store(args.master, rpc_timeout_ms=args.rpc_timeout_ms)  # sizes 0/0: lookups only, no puts
    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(args.address)
    if args.socket is not None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(args.socket)
        listener.listen()
        threading.Thread(target=_serve_socket, args=(listener, store, stop), name="socket-floor", daemon=True).start()
    print(READY_PREFIX + sock.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    while not stop.is_set():
        if not sock.poll(200, zmq.POLLIN):
            continue
        envelope, frame = sock.recv_multipart()
        sock.send_multipart([envelope, _answer(store, frame)])
    sock.close(linger=0)
    ctx.term()
    os._exit(0)  # the store client's close() takes ~1 s; a child being stopped need not wait for it


__all__ = ["CHILD_MODULE", "FloorServer", "READY_PREFIX", "child_main", "joined_frame", "key_frame"]

if __name__ == "__main__":
    sys.exit(child_main())

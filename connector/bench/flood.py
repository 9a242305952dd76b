"""A flooding peer, as a process of its own: keeps ``--window`` lookups in flight at a lookup server, forever.

Why a process: the peer whose latency the bench measures must not share a GIL with the flood. What it
models: a client that ignores any bound on lookups in flight (a scheduler with a huge
``lookup_max_pending``, or anyone with a valid key): frames of ``--frame-lookups`` lookups of ``--hashes``
block hashes each, one new frame sent for each reply, as fast as the server answers. It prints ``flooding``
once its window is sent, ``steady`` once that whole window was answered and, on SIGTERM, one JSON line:
lookups answered ok, busy and otherwise, and frames.

``python -m mooncake_lookout.connector.bench.flood --address tcp://127.0.0.1:PORT [--curve-server-key F
--curve-secret-key F]``
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Sequence

import zmq

from mooncake_lookout.connector.rigs.workload import unique_hashes
from mooncake_lookout.connector.wire import pipelined as protocol

READY = "flooding"
STEADY = "steady"  # printed once the whole first window has been answered: the flood is in its steady state


def _frames(count: int, lookups: int, hashes: int) -> list[list[bytes]]:
    """``count`` distinct request frames (cold prefixes: the store answers misses, which cost it as much)."""
    out = []
    for f in range(count):
        queries = [protocol.query(f * lookups + i + 1, hashes * 16 + 1,
                                  unique_hashes(hashes, seed=7_000_000 + f * lookups + i)) for i in range(lookups)]
        out.append(protocol.encode_lookups(f + 1, queries))
    return out


def flood(address: str, window: int, frame_lookups: int, hashes: int, curve: object | None = None) -> dict[str, int]:
    """Flood ``address`` until SIGTERM; returns the counts."""
    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 1_000_000)
    sock.setsockopt(zmq.RCVHWM, 1_000_000)
    if curve is not None:
        curve.apply(sock)  # type: ignore[attr-defined]
    sock.connect(address)
    frames = _frames(16, frame_lookups, hashes)
    counts = {"ok": 0, "busy": 0, "other": 0, "frames": 0}
    sent = 0
    first_window = max(1, window // frame_lookups)
    for _ in range(first_window):
        sock.send_multipart(frames[sent % len(frames)], copy=False)
        sent += 1
    print(READY, flush=True)
    t0 = time.perf_counter()
    while not stop[0]:
        if not sock.poll(100):
            continue
        while True:
            try:
                reply = protocol.decode_reply(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            counts["frames"] += 1
            key = "ok" if reply.status == protocol.OK else "busy" if reply.status == protocol.BUSY else "other"
            counts[key] += frame_lookups
            sock.send_multipart(frames[sent % len(frames)], copy=False)
            sent += 1
            if counts["frames"] == first_window:
                print(STEADY, flush=True)
    counts["seconds"] = round(time.perf_counter() - t0, 3)  # type: ignore[assignment]
    sock.close(linger=0)
    ctx.term()
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    """Flood until SIGTERM, then print the counts as one JSON line."""
    p = argparse.ArgumentParser(prog="python -m mooncake_lookout.connector.bench.flood", description=__doc__)
    p.add_argument("--address", required=True)
    p.add_argument("--window", type=int, default=32_768, help="lookups kept in flight")
    p.add_argument("--frame-lookups", type=int, default=32, help="lookups per frame")
    p.add_argument("--hashes", type=int, default=8, help="block hashes per lookup")
    p.add_argument("--curve-server-key", default=None, help="the server's public key file (CURVE)")
    p.add_argument("--curve-secret-key", default=None, help="this client's key pair file (CURVE)")
    args = p.parse_args(argv)
    curve = None
    if args.curve_secret_key:
        from mooncake_lookout.connector.curve import ClientCurve

        curve = ClientCurve.from_files(args.curve_server_key, args.curve_secret_key)
    print(json.dumps(flood(args.address, args.window, args.frame_lookups, args.hashes, curve)), flush=True)
    return 0


__all__ = ["READY", "STEADY", "flood", "main"]

if __name__ == "__main__":
    sys.exit(main())

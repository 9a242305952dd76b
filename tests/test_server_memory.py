"""One peer cannot park more than its bytes in the lookup server: past the bound it is answered ``busy``, and a
frame that could never fit is refused with the bound it passes.

The server is a process of its own over a real Mooncake master; its memory is read from ``/proc`` (``VmHWM``: the
peak resident set). To make frames pile up in it, the store is slowed by an INJECTED delay before each store call
(``InjectedDelayBackend`` in the server process: a slow store cannot be produced on demand for real), as a
stalled master would. The worst a peer can send here: lookups of the most hashes the wire allows (65,536 of 32
bytes: a 2 MiB frame each), as fast as it can, while the server is inside a store call.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from mooncake_lookout.connector.rigs.server_process import ServerProcess
from mooncake_lookout.connector.rigs.sizing import resident_bytes
from mooncake_lookout.connector.rigs.workload import unique_hashes
from mooncake_lookout.connector.server.listen import RECV_HWM
from mooncake_lookout.connector.wire import pipelined as p

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

MiB = 1 << 20
BLOCK = 16
HASHES = p.MAX_HASHES  # one lookup of the most hashes a query may carry
FRAMES = 60
BOUND = 8 * MiB  # the peer's bytes bound under test: four frames of the flood at most (with their lookups' cost)
DELAY_MS = 200.0  # the injected delay of each store call
# What the allocator may keep on top of live objects (freed frames are not always handed back to the system).
ALLOCATOR_SLACK = 24 * MiB


@pytest.fixture
def server(mooncake_master: Any) -> Iterator[ServerProcess]:
    with ServerProcess("pipelined", mooncake_master.rpc_address, namespace=f"mem-{uuid.uuid4().hex[:8]}",
                       delay_ms=DELAY_MS, delay_on=True, standby=False,
                       server_options={"max_peer_bytes": BOUND}) as s:
        yield s


@pytest.fixture
def dealer(server: ServerProcess) -> Iterator[zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    yield sock
    ctx.destroy(linger=0)


def _replies(sock: zmq.Socket, n: int, bound_s: float = 120.0) -> list[p.Reply]:
    out = []
    while len(out) < n:
        assert sock.poll(int(bound_s * 1000)), f"{len(out)} of {n} replies came within {bound_s} s"
        out.append(p.decode_reply(sock.recv()))
    return out


def _frame(frame_id: int, body: bytes) -> list[bytes]:
    """A lookup frame of ``body`` (a body can be sent under any number of frame ids)."""
    header, _ = p.encode_lookups(frame_id, [p.query(0, 1, [b"h"])])
    return [header, body]


def test_one_peer_cannot_park_more_than_its_bytes(server: ServerProcess, dealer: zmq.Socket) -> None:
    _, body = p.encode_lookups(1, [p.query(1, HASHES * BLOCK + 1, unique_hashes(HASHES, seed=71))])
    size = len(body)
    assert 2 * MiB <= size < 2 * MiB + 64 * 1024
    base = resident_bytes(server.pid, "VmHWM")
    dealer.send_multipart(_frame(1, body), copy=False)  # alone: what answering one such lookup costs the server
    (alone,) = _replies(dealer, 1)
    assert alone.status == p.OK and alone.results[0].status == p.MISS
    one = resident_bytes(server.pid, "VmHWM") - base
    dealer.send_multipart(p.encode_lookups(2, [p.query(2, 2 * BLOCK + 1, unique_hashes(2, seed=72))]))
    for i in range(FRAMES):  # the server is in that slow store call meanwhile: the flood piles up behind it
        dealer.send_multipart(_frame(10 + i, body), copy=False)
    replies = _replies(dealer, FRAMES + 1)
    grown = resident_bytes(server.pid, "VmHWM") - base
    # Its bound in the admission, what ZMQ reads ahead on the connection (RECV_HWM messages and the one being
    # read) and the frame being taken in, beside what one answer costs anyway: not the flood's 120 MiB.
    allowance = one + BOUND + (RECV_HWM + 2) * size + ALLOCATOR_SLACK
    assert grown <= allowance, (f"the server grew {grown / MiB:.0f} MiB for {FRAMES} frames of {size / MiB:.1f} "
                                f"MiB (one alone: {one / MiB:.0f} MiB), over {allowance / MiB:.0f} MiB")
    statuses = [r.status for r in replies]
    assert set(statuses) == {p.OK, p.BUSY}, statuses
    assert all("(max_peer_bytes)" in r.reason for r in replies if r.status == p.BUSY)


def test_a_frame_bigger_than_the_bound_is_refused_not_parked(server: ServerProcess, dealer: zmq.Socket) -> None:
    hashes = [h * 5 for h in unique_hashes(HASHES, seed=73)]  # 160-byte hashes: a 10 MiB frame
    frame = p.encode_lookups(3, [p.query(3, HASHES * BLOCK + 1, hashes)])
    dealer.send_multipart(frame, copy=False)
    (reply,) = _replies(dealer, 1)
    assert (reply.status, reply.frame_id) == (p.BAD_REQUEST, 3)
    said = re.fullmatch(r"a frame of (\d+) bytes can never fit this lookup server's bound of (\d+) bytes "
                        r"\(max_peer_bytes\): .*", reply.reason)
    assert said, reply.reason
    size = sum(len(part) for part in frame)
    assert size <= int(said[1]) <= size + 64 and int(said[2]) == BOUND  # its bytes as received: with its routing id
    dealer.send_multipart(p.encode_lookups(4, [p.query(4, 2 * BLOCK + 1, unique_hashes(2, seed=74))]))
    assert _replies(dealer, 1)[0].status == p.OK, "the peer's next frame is served: nothing was parked"

"""Who gets what from the lookup server: a bound per peer (``busy`` past it), a fair share of each store call,
the reset fence, and resets refused where a peer may not wipe the store.

First :class:`Admission` on its own, fed the real frames clients send (encoded by the wire modules), then the
real server over a real Mooncake master, with real sockets (plain and CURVE). To make a flood pile up in
the server deterministically, the store is slowed by an INJECTED delay (``InjectedDelayBackend``: a slow
store cannot be produced on demand for real); the test waits until the server is inside that slow call,
then floods. Speed (the other peer's latency under a flood) is measured by ``connector/bench/security.py``,
not asserted here: these tests check who gets answered and how.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import zmq

from mooncake_lookout.connector.curve import ClientCurve, ServerCurve, create_key_files
from mooncake_lookout.connector.lookup import Lookup, Outcome
from mooncake_lookout.connector.rigs.faults import InjectedDelayBackend
from mooncake_lookout.connector.rigs.workload import unique_hashes
from mooncake_lookout.connector.server import LookupServer, ServerObserver, intake
from mooncake_lookout.connector.server.admission import RESET_REFUSED, Admission
from mooncake_lookout.connector.server.limits import LOOKUP_OVERHEAD_BYTES, Limits
from mooncake_lookout.connector.server.pacing import RELEASED_PER_TURN
from mooncake_lookout.connector.server.prefix_index import PrefixIndex
from mooncake_lookout.connector.transport.pipelined import PipelinedTransport
from mooncake_lookout.connector.wire import pipelined as p
from mooncake_lookout.connector.wire import upstream as upstream_wire
from mooncake_lookout.metrics.catalogue import SERVER_BOUND_MEASURES, SERVER_BOUND_SCOPES

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

BLOCK = 16
SLOW_STORE_S = 0.1  # the injected delay of each store call


def frame(peer: bytes, frame_id: int, lookups: int, hashes: int = 2) -> list[bytes]:
    """A DEALER's lookup frame as the ROUTER reads it: the peer's routing id, header, body."""
    queries = [p.query(frame_id * 1000 + i, hashes * BLOCK + 1, unique_hashes(hashes, seed=frame_id * 1000 + i))
               for i in range(lookups)]
    return [peer, *p.encode_lookups(frame_id, queries)]


def ids(batch: Sequence[intake.Work]) -> list[int | None]:
    return [item.frame_id if isinstance(item, (intake.Frame, intake.Reset)) else None for item in batch]


def turn(admission: Admission) -> list[list[int | None]]:
    """The frame ids of one turn's batches (each answered with a store call of its own), in order."""
    return [ids(batch) for batch in admission.take()]


# -- Admission on its own -------------------------------------------------------------------------------------
def test_a_batch_takes_whole_frames_up_to_a_share_of_each_peer() -> None:
    admission = Admission(limits=Limits(share_keys=64))  # frames of 16 lookups x 2 hashes: 32 keys each
    for i in range(1, 6):
        assert admission.take_in(frame(b"A", i, 16)) is None
    assert admission.depth == 80
    assert turn(admission) == [[1, 2]] and admission.depth == 48
    assert turn(admission) == [[3, 4]]
    assert admission.take_in(frame(b"A", 6, 100)) is None  # 200 keys: a frame is never split
    assert turn(admission) == [[5, 6]]
    assert not admission and admission.depth == 0
    step = Admission()  # a client's step (one frame of 128 lookups of 8 blocks) goes whole, the next one after
    assert step.take_in(frame(b"A", 1, 128, hashes=8)) is None and step.take_in(frame(b"A", 2, 1)) is None
    assert turn(step) == [[1]] and turn(step) == [[2]]


def test_a_peer_past_its_bound_is_busy_and_the_others_are_not() -> None:
    admission = Admission(limits=Limits(max_peer_lookups=40))
    assert admission.take_in(frame(b"A", 1, 16)) is None
    assert admission.take_in(frame(b"A", 2, 16)) is None
    busy = admission.take_in(frame(b"A", 3, 16))
    assert busy is not None and (busy.status, busy.count, busy.envelope) == ("busy", 16, [b"A"])
    reply = p.decode_reply(busy.reply)
    assert (reply.status, reply.frame_id) == (p.BUSY, 3) and "32 lookups" in reply.reason and "40" in reply.reason
    assert admission.take_in(frame(b"B", 4, 16)) is None  # another peer has its own bound
    assert turn(admission) == [[1, 2, 4]]  # both wait no more than the turn: one call
    assert admission.take_in(frame(b"A", 5, 16)) is None, "answered lookups no longer count"
    never = admission.take_in(frame(b"A", 6, 41))  # a frame over the bound on its own could never be taken
    assert never is not None and (never.status, never.count) == (p.BAD_REQUEST, 1)
    assert "a frame of 41 lookups can never fit" in p.decode_reply(never.reply).reason


def _bytes_of(message: list[bytes]) -> int:
    return sum(len(part) for part in message) + LOOKUP_OVERHEAD_BYTES * intake.query_count(message[-1])


def test_what_waits_is_bounded_in_bytes_and_keys_per_peer_and_in_all() -> None:
    one = frame(b"A", 1, 4, hashes=64)  # 4 lookups of 64 hashes: 256 keys, ~9 KB
    size = _bytes_of(one)
    admission = Admission(limits=Limits(max_peer_bytes=2 * size, max_total_bytes=3 * size, share_keys=1024))
    assert admission.take_in(one) is None and admission.take_in(frame(b"A", 2, 4, hashes=64)) is None
    assert admission.total.bytes == 2 * size and admission.total.keys == 512
    busy = admission.take_in(frame(b"A", 3, 4, hashes=64))
    assert busy is not None and (busy.status, busy.count) == (p.BUSY, 4)
    reason = p.decode_reply(busy.reply).reason
    assert f"{2 * size} bytes of this peer already wait" in reason and "(max_peer_bytes)" in reason
    assert admission.take_in(frame(b"B", 4, 4, hashes=64)) is None  # another peer: its own bound, and room in all
    busy = admission.take_in(frame(b"C", 5, 4, hashes=64))  # a third: room of its own, none in all
    assert busy is not None and busy.status == p.BUSY and "of all peers" in p.decode_reply(busy.reply).reason
    assert turn(admission) == [[1, 2, 4]]
    assert (admission.total.bytes, admission.total.keys, admission.depth) == (0, 0, 0), "answered: no longer counted"
    keys = Admission(limits=Limits(max_peer_keys=300))
    assert keys.take_in(frame(b"A", 1, 4, hashes=64)) is None
    busy = keys.take_in(frame(b"A", 2, 1, hashes=64))  # 256 + 64 keys > 300
    assert busy is not None and busy.status == p.BUSY and "256 keys of this peer" in p.decode_reply(busy.reply).reason


def test_a_lone_message_with_nothing_waiting_comes_back_to_be_answered_at_once_and_never_jumps_the_queue() -> None:
    """``alone`` (the loop read no message behind it): with nothing queued, fenced or held, a lookup message within
    the bounds comes back to be answered now, without the queue's bookkeeping; else it waits its turn as ever."""
    admission = Admission()
    lone = admission.take_in(frame(b"A", 1, 2), alone=True)
    assert isinstance(lone, intake.Frame) and lone.frame_id == 1 and len(lone.queries) == 2
    assert not admission and admission.depth == 0, "handed back, not queued"
    upstream = admission.take_in([b"B", b"", *upstream_wire.encode_lookup(33, [b"h" * 32] * 2)], alone=True)
    assert isinstance(upstream, intake.UpstreamLookup) and not admission
    # Something waits: a lone message is queued behind it, in arrival order.
    assert admission.take_in(frame(b"A", 2, 1)) is None
    assert admission.take_in(frame(b"B", 3, 1), alone=True) is None
    assert turn(admission) == [[2, 3]] and not admission
    # A reset waits: the fence holds the lone lookup behind it; a reset itself is never handed back.
    assert admission.take_in([b"A", *p.encode_reset(4)], alone=True) is None
    assert admission.take_in(frame(b"B", 5, 1), alone=True) is None
    assert turn(admission) == [[4]] and turn(admission) == [[5]]
    # Past a bound on its own: refused as ever.
    refused = Admission(limits=Limits(max_peer_keys=100)).take_in(frame(b"A", 6, 1, hashes=101), alone=True)
    assert isinstance(refused, intake.Refusal) and refused.status == p.BAD_REQUEST


def test_a_frame_that_can_never_fit_is_refused_with_the_bound_it_passes() -> None:
    big = frame(b"A", 1, 1, hashes=4096)  # one lookup of 4096 hashes: ~131 KB
    admission = Admission(limits=Limits(max_peer_bytes=64_000))
    refused = admission.take_in(big)
    assert refused is not None and (refused.status, refused.count) == (p.BAD_REQUEST, 1)
    reply = p.decode_reply(refused.reply)
    assert reply.frame_id == 1 and f"a frame of {sum(map(len, big))} bytes can never fit" in reply.reason
    assert "bound of 64000 bytes (max_peer_bytes)" in reply.reason
    assert not admission and admission.total.bytes == 0, "a refused frame is not parked"
    upstream = admission.take_in([b"A", b"", *upstream_wire.encode_lookup(65_537, [b"h" * 32] * 4096)])
    assert upstream is not None and (upstream.status, upstream.reply) == (p.BAD_REQUEST, upstream_wire.RESP_ERR)
    keys = Admission(limits=Limits(max_peer_keys=100)).take_in(frame(b"A", 2, 1, hashes=101))
    assert keys is not None and keys.status == p.BAD_REQUEST
    assert "a frame of 101 keys can never fit" in p.decode_reply(keys.reply).reason


def test_past_a_byte_bound_a_frame_is_turned_away_unread() -> None:
    admission = Admission(limits=Limits(max_peer_bytes=20_000))
    assert admission.take_in(frame(b"A", 1, 4, hashes=64)) is None  # ~9 KB waits
    header = frame(b"A", 2, 3)[1]
    garbage = admission.take_in([b"A", header, b"\x93" + b"x" * 12_000])  # past the bound by its length: not decoded
    assert garbage is not None and (garbage.status, garbage.count) == (p.BUSY, 3)
    assert "(max_peer_bytes)" in p.decode_reply(garbage.reply).reason
    never = admission.take_in([b"A", header, b"\x93" + b"x" * 30_000])  # longer than the bound itself
    assert never is not None and never.status == p.BAD_REQUEST and "can never fit" in p.decode_reply(never.reply).reason


def test_the_bounds_are_checked_and_named() -> None:
    with pytest.raises(ValueError, match="max_peer_bytes must be at least 1"):
        Limits(max_peer_bytes=0)
    with pytest.raises(ValueError, match=r"max_peer_keys \(10\) exceeds max_total_keys \(5\)"):
        Limits(max_peer_keys=10, max_total_keys=5)
    bounds = Limits().bounds()
    assert set(bounds) == {(s, m) for s in SERVER_BOUND_SCOPES for m in SERVER_BOUND_MEASURES}
    assert bounds["peer", "bytes"] == Limits().max_peer_bytes


def test_at_its_bound_a_peer_costs_only_a_header_read() -> None:
    admission = Admission(limits=Limits(max_peer_lookups=16))
    assert admission.take_in(frame(b"A", 1, 16)) is None
    header = frame(b"A", 2, 3)[1]
    garbage = admission.take_in([b"A", header, b"\x93 not msgpack at all"])  # the body is never decoded
    assert garbage is not None and garbage.status == "busy" and garbage.count == 3
    assert p.decode_reply(garbage.reply).frame_id == 2
    req = admission.take_in([b"A", b"", *upstream_wire.encode_lookup(33, [b"h" * 8])])  # vLLM's format
    assert req is not None and (req.status, req.reply, req.envelope) == ("busy", upstream_wire.RESP_ERR, [b"A", b""])
    junk = admission.take_in([b"A", b"junk", b""])  # not a lookup: refused as malformed, as from anyone
    assert junk is not None and junk.status == p.BAD_REQUEST


def test_a_peer_past_its_bound_is_paced_and_the_others_are_not() -> None:
    """Its busy replies are held and sent a few per turn of its; its turns wait while others are answered at once."""
    admission = Admission(limits=Limits(max_peer_lookups=32, share_keys=32))  # one 16-lookup frame of 2 keys a turn
    for i in range(1, 3):
        assert admission.take_in(frame(b"flood", i, 16)) is None
    held = [admission.take_in(frame(b"flood", i, 16)) for i in range(3, 3 + RELEASED_PER_TURN + 2)]
    assert all(r is not None and r.status == p.BUSY and r.later for r in held), "busy replies go later"
    assert admission.ready(0.0) and admission.flood_turn(0.0)  # its first turn is due at once
    released = admission.pacer.release()
    assert released == held[:RELEASED_PER_TURN], "the oldest first, a few per turn"
    assert turn(admission) == [[1]]
    admission.pacer.turn_took(0.002, now=10.0)  # that turn took 2 ms: the next comes 6 ms later (a quarter)
    assert not admission.ready(10.001) and admission.wait_s(10.001) == pytest.approx(0.005)
    assert admission.take_in(frame(b"other", 50, 1)) is None  # another peer: answered now, the flood waits
    assert admission.ready(10.001) and not admission.flood_turn(10.001)
    assert [ids(batch) for batch in admission.take(flood=False)] == [[50]]
    assert not admission.ready(10.006 - 1e-4) and admission.ready(10.006) and admission.flood_turn(10.006)
    assert admission.pacer.release() == held[RELEASED_PER_TURN:] and not admission.pacer
    assert turn(admission) == [[2]] and not admission


def test_a_peer_turned_away_by_the_total_bound_is_not_paced() -> None:
    admission = Admission(limits=Limits(max_peer_lookups=32, max_total_lookups=32))
    assert admission.take_in(frame(b"A", 1, 32)) is None
    busy = admission.take_in(frame(b"B", 2, 1))  # all peers at their bound together: B is not flooding
    assert busy is not None and busy.status == p.BUSY and not busy.later and not admission.pacer


def test_a_flood_is_answered_share_by_share_after_the_light_peers() -> None:
    admission = Admission(limits=Limits(share_keys=64))  # frames of 16 lookups x 2 hashes: 32 keys each
    for i in range(1, 11):
        assert admission.take_in(frame(b"flood", i, 16)) is None
    assert admission.take_in(frame(b"other", 11, 1)) is None
    assert turn(admission) == [[11], [1, 2]], "the other's lookup first, then the flood's share (64 keys)"
    assert admission.take_in(frame(b"other", 12, 1)) is None
    assert turn(admission) == [[12], [3, 4]], "the other's next lookup waits for no share of the backlog"


def test_a_reset_is_fenced_even_when_shares_split_the_lookups_before_it() -> None:
    admission = Admission(limits=Limits(share_keys=1))
    for message in (frame(b"A", 1, 1), frame(b"A", 2, 1), frame(b"B", 3, 1), [b"B", *p.encode_reset(4)],
                    frame(b"A", 5, 1), frame(b"B", 6, 1)):
        assert admission.take_in(message) is None
    batches = []
    while admission:
        batches.append(turn(admission))
    assert batches == [[[1, 3]], [[2]], [[4]], [[5, 6]]]


def test_resets_are_refused_where_a_peer_may_not_wipe_the_store() -> None:
    admission = Admission(resets_allowed=False)
    ours = admission.take_in([b"A", *p.encode_reset(7)])
    assert ours is not None and ours.status == "refused"
    reply = p.decode_reply(ours.reply)
    assert (reply.status, reply.frame_id, reply.reason) == (p.BAD_REQUEST, 7, RESET_REFUSED)
    vllms = admission.take_in([b"B", b"", upstream_wire.RESET_MSG])
    assert vllms is not None and (vllms.status, vllms.reply) == ("refused", upstream_wire.RESP_ERR)
    assert not admission


# -- the server, over a real master ---------------------------------------------------------------------------
@pytest.fixture
def slow(prefix_index: PrefixIndex) -> InjectedDelayBackend:
    return InjectedDelayBackend(prefix_index, SLOW_STORE_S)


def _poll(cond: Callable[[], bool], bound_s: float = 10.0) -> None:
    deadline = time.perf_counter() + bound_s
    while not cond():
        assert time.perf_counter() < deadline, "condition not reached within the bound"
        time.sleep(0.001)


def _dealer(ctx: zmq.Context, address: str, curve: ClientCurve | None = None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.apply(sock)
    sock.connect(address)
    return sock


def _replies(sock: zmq.Socket, n: int, bound_s: float = 20.0) -> list[p.Reply]:
    out = []
    deadline = time.perf_counter() + bound_s
    while len(out) < n:
        assert sock.poll(max(1, int((deadline - time.perf_counter()) * 1000))), f"{len(out)} of {n} replies came"
        out.append(p.decode_reply(sock.recv()))
    assert not sock.poll(50), "more replies than requests"
    return out


def _lookup(frame_id: int, hashes: list[bytes]) -> list[bytes]:
    return p.encode_lookups(frame_id, [p.query(frame_id, len(hashes) * BLOCK + 1, hashes)])


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_a_flooding_peer_gets_busy_replies_and_the_other_peer_is_served(
        ctx: zmq.Context, slow: InjectedDelayBackend, prefix_index: PrefixIndex) -> None:
    others = [unique_hashes(4, seed=900 + i) for i in range(3)]
    prefix_index.store_prefixes(others)
    seen = MostWaiting()
    with LookupServer(slow, limits=Limits(max_peer_lookups=64), observers=[seen]) as server:
        flooder, other = _dealer(ctx, server.address), _dealer(ctx, server.address)
        flooder.send_multipart(_lookup(1, unique_hashes(2, seed=1)))  # the server goes into a slow store call
        _poll(lambda: slow.delayed_calls >= 1)
        for i in range(2, 42):  # 40 frames of 16 lookups pile up meanwhile: 640 lookups, the bound is 64
            flooder.send_multipart(frame(b"", i, 16)[1:])
        for i, hashes in enumerate(others):
            other.send_multipart(_lookup(100 + i, hashes))
        flood = _replies(flooder, 41)
        mine = _replies(other, 3)
    statuses = [r.status for r in flood]
    assert set(statuses) <= {p.OK, p.BUSY}
    assert statuses.count(p.BUSY) >= 1 and statuses.count(p.OK) >= 1 + 64 // 16
    assert all("bound is 64" in r.reason for r in flood if r.status == p.BUSY)
    assert [(r.status, r.results[0].hit_length) for r in mine] == [(p.OK, 4 * BLOCK)] * 3, "the other peer was starved"
    assert server.stats.answered_by_status["busy"] == 16 * statuses.count(p.BUSY)
    # What waited was reported: the flooder's up to its bound (64 lookups of 2 keys) beside the other's 3 lookups of
    # 4 keys, their frames' bytes; then nothing.
    assert 128 <= seen.keys <= 128 + 12 and 64 * 2 * 32 < seen.bytes < 4 * 4096 and seen.last == (0, 0)


class MostWaiting(ServerObserver):
    """The most store keys and bytes the server reported waiting, and its last report."""

    def __init__(self) -> None:
        self.keys = self.bytes = 0
        self.last = (0, 0)

    def waiting(self, keys: int, nbytes: int) -> None:
        self.keys, self.bytes, self.last = max(self.keys, keys), max(self.bytes, nbytes), (keys, nbytes)


def test_with_curve_a_peer_is_its_key_not_its_connection(ctx: zmq.Context, slow: InjectedDelayBackend,
                                                         tmp_path: Path) -> None:
    folder = str(tmp_path)
    server_key = create_key_files(folder, "server")
    clients = [create_key_files(folder, name) for name in ("one", "two")]
    (tmp_path / "allowed").mkdir()
    for public, _ in clients:
        shutil.copy(public, tmp_path / "allowed")
    curve = ServerCurve.from_files(server_key[1], str(tmp_path / "allowed"))
    one, two = (ClientCurve.from_files(server_key[0], secret) for _, secret in clients)
    busy = {}
    with LookupServer(slow, "tcp://127.0.0.1:0", curve=curve, limits=Limits(max_peer_lookups=20)) as server:
        for case, keys in (("same key", (one, one)), ("two keys", (one, two))):
            socks = [_dealer(ctx, server.address, key) for key in keys]
            for i, sock in enumerate(socks):  # handshakes done: what follows reaches the server at once
                sock.send_multipart(_lookup(50 + i, unique_hashes(1, seed=3)))
                _replies(sock, 1)
            start = slow.delayed_calls
            socks[0].send_multipart(_lookup(1, unique_hashes(1, seed=2)))  # a slow store call to pile up behind
            _poll(lambda start=start: slow.delayed_calls > start)
            for i, sock in enumerate(socks):  # 16 lookups on each connection: 32 for one key, past its bound of 20
                sock.send_multipart(frame(b"", 10 + i, 16)[1:])
            replies = _replies(socks[0], 2) + _replies(socks[1], 1)
            busy[case] = [r.status for r in replies].count(p.BUSY)
            for sock in socks:
                sock.close(linger=0)
    assert busy == {"same key": 1, "two keys": 0}


def test_a_refused_frame_ends_its_lookups_as_errors_not_misses(prefix_index: PrefixIndex) -> None:
    with LookupServer(prefix_index, limits=Limits(max_peer_lookups=1)) as server:
        transport = PipelinedTransport(server.address, timeout_s=5.0)
        jobs = []
        for i in range(2):
            jobs.append(Lookup(f"r{i}", 2 * BLOCK + 1, unique_hashes(2, seed=i), "pipelined", 0, time.perf_counter(),
                               5.0))
        try:
            transport.send(jobs)  # one frame of 2 lookups: over a bound of 1 on its own
            deadline = time.perf_counter() + 10
            while any(job.outcome is None for job in jobs):
                assert time.perf_counter() < deadline
                transport.collect(0.05, until=jobs[0])
        finally:
            transport.close()
    assert [job.outcome for job in jobs] == [Outcome.ERROR] * 2
    # turned away without asking the store: a refusal, which says nothing of the store
    assert all(job.error.startswith("bad_request: a frame of 2 lookups can never fit") and job.refused for job in jobs)


def test_every_status_the_server_answers_with_is_a_catalogue_label() -> None:
    from mooncake_lookout.metrics.catalogue import SERVER_REFUSED, SERVER_STATUSES

    assert set(SERVER_STATUSES) == {*p.FRAME_STATUSES, SERVER_REFUSED}, "a wire status without its metric label"

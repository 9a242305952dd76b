"""LookupServer against a real Mooncake master: concurrency, coalescing, bad frames, upstream format, reset fencing.

Clients here are raw ZMQ sockets (DEALER for our protocol, REQ for vLLM's), so the server is tested on its
own; the transport has its own tests.
"""

from __future__ import annotations

import os
import random
import signal
import stat
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry

from mooncake_lookout.connector.rigs.master import EmbeddedMaster, free_port
from mooncake_lookout.connector.rigs.processes import ChildProcess
from mooncake_lookout.connector.rigs.workload import shared_prefix_workload
from mooncake_lookout.connector.server import LookupServer, ServerObserver
from mooncake_lookout.connector.server.limits import Limits
from mooncake_lookout.connector.server.prefix_index import PrefixIndex
from mooncake_lookout.connector.server.store import open_store
from mooncake_lookout.connector.wire import pipelined as p
from mooncake_lookout.connector.wire import upstream as upstream_wire
from mooncake_lookout.metrics import catalogue
from mooncake_lookout.metrics.server_sink import ServerMetrics

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

BLOCK = 16


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _dealer(ctx: zmq.Context, address: str) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    return s


def _recv(sock: zmq.Socket, timeout_s: float = 10.0) -> list[bytes]:
    assert sock.poll(int(timeout_s * 1000)), "no reply within the bound"
    return sock.recv_multipart()


def _reply(sock: zmq.Socket, timeout_s: float = 10.0) -> p.Reply:
    frames = _recv(sock, timeout_s)
    assert len(frames) == 1
    return p.decode_reply(frames[0])


def _answer(sock: zmq.Socket, timeout_s: float = 10.0) -> p.Result:
    """The one result of a reply to a one-lookup frame."""
    reply = _reply(sock, timeout_s)
    assert reply.status == p.OK and len(reply.results) == 1, reply
    return reply.results[0]


def _fill(filler: PrefixIndex, n: int) -> tuple[list[Any], list[int]]:
    """``n`` requests of 8 own blocks; request i has its first ``i % 9`` blocks stored. Returns (requests, hits)."""
    reqs = shared_prefix_workload(n, prefix_blocks=0, unique_blocks=8, seed=n)
    filler.store_prefixes([r.block_hashes[: i % 9] for i, r in enumerate(reqs) if i % 9])
    return reqs, [(i % 9) * BLOCK for i in range(n)]


def test_hundreds_of_concurrent_lookups_are_each_matched_and_coalesced(
        ctx: zmq.Context, filler: PrefixIndex, index: PrefixIndex) -> None:
    reqs, expected = _fill(filler, 240)
    clients = 3
    with LookupServer(index) as server:
        socks = [_dealer(ctx, server.address) for _ in range(clients)]
        # Every client sends all its lookups before reading any reply: hundreds in flight at once.
        for c, sock in enumerate(socks):
            for i in range(c, len(reqs), clients):
                sock.send_multipart(p.encode_lookup(1000 + i, reqs[i].num_tokens, reqs[i].block_hashes))
        got: dict[int, int] = {}
        for c, sock in enumerate(socks):
            for _ in range(c, len(reqs), clients):
                result = _answer(sock)
                assert result.lookup_id not in got
                assert result.status == (p.OK if result.hit_length else p.MISS)
                got[result.lookup_id] = result.hit_length
        stats = server.stats
    assert got == {1000 + i: hit for i, hit in enumerate(expected)}
    assert index.store_calls < len(reqs)  # coalesced: fewer store calls than lookups
    assert stats.store_calls == index.store_calls
    assert stats.max_batch > 1
    assert stats.answered_by_status["ok"] == len(reqs)


def _bad_frames() -> list[tuple[str, list[bytes], int, str]]:
    good_body = p.encode_lookup(5, 64, [b"h" * 32] * 3)[1]
    header = msgspec.msgpack.encode([p.VERSION, 5, p.OP_LOOKUP])
    return [
        ("malformed", [b"\xc1\xc1", good_body], p.UNKNOWN_ID, "malformed header"),
        ("truncated", [header, good_body[:-7]], 5, "malformed lookup body"),
        ("oversized", [header, b"\x91" * (p.MAX_BODY_BYTES + 1)], 5, "exceeds"),
        ("wrong_version", [msgspec.msgpack.encode([p.VERSION + 1, 5, p.OP_LOOKUP]), good_body], 5, "version"),
        ("too_many_hashes", [header, msgspec.msgpack.encode([[1, 16, 1, b"h" * (p.MAX_HASHES + 1)]])], 5,
         "hashes exceed"),
        ("one_frame", [header], p.UNKNOWN_ID, "2 frames"),
    ]


@pytest.mark.parametrize("name, frames, rid, reason", _bad_frames(), ids=[f[0] for f in _bad_frames()])
def test_bad_frames_get_an_error_reply_and_others_keep_being_served(
        ctx: zmq.Context, filler: PrefixIndex, index: PrefixIndex, name: str, frames: list[bytes], rid: int,
        reason: str) -> None:
    reqs, expected = _fill(filler, 9)
    with LookupServer(index) as server:
        bad, good = _dealer(ctx, server.address), _dealer(ctx, server.address)
        bad.send_multipart(frames)
        for i, r in enumerate(reqs):
            good.send_multipart(p.encode_lookup(i + 1, r.num_tokens, r.block_hashes))
        refusal = _reply(bad)
        assert (refusal.status, refusal.frame_id) == (p.BAD_REQUEST, rid)
        assert reason in refusal.reason
        assert sorted((r.lookup_id, r.hit_length) for r in (_answer(good) for _ in reqs)) == \
            [(i + 1, hit) for i, hit in enumerate(expected)]
        # The bad client itself is still served afterwards.
        bad.send_multipart(p.encode_lookup(77, reqs[8].num_tokens, reqs[8].block_hashes))
        assert (_answer(bad).lookup_id, server.stats.answered_by_status["bad_request"]) == (77, 1)


def test_fuzzed_frames_each_get_exactly_one_reply_and_serving_goes_on(
        ctx: zmq.Context, filler: PrefixIndex, index: PrefixIndex) -> None:
    reqs, expected = _fill(filler, 9)
    rng = random.Random(1234)
    valid = p.encode_lookup(1, reqs[8].num_tokens, reqs[8].block_hashes)

    def mutate(frames: list[bytes]) -> list[bytes]:
        frames = [bytearray(f) for f in frames]
        for _ in range(rng.randint(1, 4)):
            f = frames[rng.randrange(len(frames))]
            choice = rng.random()
            if choice < 0.4 and f:
                f[rng.randrange(len(f))] = rng.randrange(256)
            elif choice < 0.7:
                del f[rng.randrange(len(f) + 1):]
            else:
                f.extend(rng.randbytes(rng.randint(1, 8)))
        if rng.random() < 0.1:
            frames.append(bytearray(rng.randbytes(3)))
        return [bytes(f) for f in frames]

    with LookupServer(index) as server:
        sock = _dealer(ctx, server.address)
        for _ in range(300):
            frames = mutate(valid) if rng.random() < 0.7 else [rng.randbytes(rng.randint(0, 40))
                                                                 for _ in range(rng.randint(1, 3))]
            sock.send_multipart(frames)
            reply = _recv(sock)
            if frames[0] == b"":  # a DEALER speaking like REQ gets its empty delimiter back
                assert reply[0] == b""
                reply = reply[1:]
            assert len(reply) == 1
            if reply[0] != upstream_wire.RESP_ERR:  # frames that happen to start with vLLM's tags
                assert p.decode_reply(reply[0]).status in p.FRAME_STATUSES
            assert not sock.poll(0)  # exactly one reply
        sock.send_multipart(valid)
        assert _answer(sock).hit_length == expected[8]
        assert sum(server.stats.answered_by_status.values()) == 301


def test_vllm_req_clients_are_answered_in_vllms_own_format(
        ctx: zmq.Context, filler: PrefixIndex, index: PrefixIndex) -> None:
    reqs, expected = _fill(filler, 9)
    with LookupServer(index) as server:
        req = ctx.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(server.address)
        for r, hit in zip(reqs, expected):
            req.send_multipart(upstream_wire.encode_lookup(r.num_tokens, list(r.block_hashes)))
            assert upstream_wire.decode_lookup_reply(_recv(req)[0])[1] == hit
        req.send_multipart([upstream_wire.LOOKUP_MSG, b"\x00\x00\x00\x10", b"\x00\x20", b"x" * 33])
        assert _recv(req) == [upstream_wire.RESP_ERR]  # malformed: refused, and the REQ cycle goes on
        req.send(upstream_wire.RESET_MSG)
        assert _recv(req) == [upstream_wire.RESP_OK]
        req.send_multipart(upstream_wire.encode_lookup(reqs[8].num_tokens, list(reqs[8].block_hashes)))
        assert upstream_wire.decode_lookup_reply(_recv(req)[0])[1] == 0  # wiped


class _DelayedIndex:
    """The real PrefixIndex with an INJECTED delay before each store call, to hold lookups in flight.

    It also records the order in which store calls start and end, which is what fencing is about.
    """

    def __init__(self, index: PrefixIndex, delay_s: float) -> None:
        self.index = index
        self.delay_s = delay_s
        self.events: list[str] = []
        self._lock = threading.Lock()

    def _log(self, event: str) -> None:
        with self._lock:
            self.events.append(event)

    def lookup(self, num_tokens: int, hashes: Sequence[bytes]) -> Any:
        return self.lookup_many([(num_tokens, hashes)])[0]

    def lookup_many(self, queries: Sequence[tuple[int, Sequence[bytes]]]) -> list[Any]:
        self._log("lookup-start")
        time.sleep(self.delay_s)  # injected: a slow store
        try:
            return self.index.lookup_many(queries)
        finally:
            self._log("lookup-end")

    def reset(self) -> bool:
        self._log("reset-start")
        try:
            return self.index.reset()
        finally:
            self._log("reset-end")


def test_reset_waits_for_lookups_before_it_and_holds_those_after_it(
        ctx: zmq.Context, filler: PrefixIndex, index: PrefixIndex) -> None:
    reqs, expected = _fill(filler, 9)
    backend = _DelayedIndex(index, delay_s=0.2)
    with LookupServer(backend) as server:
        a, b = _dealer(ctx, server.address), _dealer(ctx, server.address)
        a.send_multipart(p.encode_lookup(1, reqs[8].num_tokens, reqs[8].block_hashes))
        # Wait until the first lookup is inside the (slow) store call, then reset and look up again.
        deadline = time.perf_counter() + 5
        while "lookup-start" not in backend.events:
            assert time.perf_counter() < deadline
            time.sleep(0.001)
        b.send_multipart(p.encode_reset(2))
        b.send_multipart(p.encode_lookup(3, reqs[8].num_tokens, reqs[8].block_hashes))
        before = _reply(a)
        reset = _reply(b)
        after = _reply(b)
    assert (before.results[0].lookup_id, before.results[0].hit_length) == (1, expected[8])  # before the wipe
    assert (reset.frame_id, reset.status) == (2, p.OK)
    assert (after.results[0].lookup_id, after.results[0].status) == (3, p.MISS)  # saw the store after the wipe
    assert backend.events == ["lookup-start", "lookup-end", "reset-start", "reset-end",
                              "lookup-start", "lookup-end"]


def test_store_errors_are_errors_not_misses(private_master: EmbeddedMaster, ctx: zmq.Context) -> None:
    """A real store fault: the master is paused, so the store call times out with an error code."""
    master = private_master
    store = open_store(master.rpc_address, rpc_timeout_ms=300)
    try:
        index = PrefixIndex(store, BLOCK, f"err{os.getpid()}")
        req = shared_prefix_workload(1, prefix_blocks=0, unique_blocks=4, seed=99)[0]
        with LookupServer(index) as server:
            dealer = _dealer(ctx, server.address)
            upstream = ctx.socket(zmq.REQ)
            upstream.setsockopt(zmq.LINGER, 0)
            upstream.connect(server.address)
            master.pause()
            try:
                dealer.send_multipart(p.encode_lookup(8, req.num_tokens, req.block_hashes))
                upstream.send_multipart(upstream_wire.encode_lookup(req.num_tokens, list(req.block_hashes)))
                reply = _reply(dealer, timeout_s=20)
                legacy = _recv(upstream, timeout_s=20)
            finally:
                master.resume()
            (result,) = reply.results
            assert (result.lookup_id, result.status) == (8, p.ERROR)
            assert "batch_is_exist" in result.reason
            assert legacy == [upstream_wire.RESP_ERR]  # the extension: one byte, vLLM logs a failed lookup
            assert server.stats.store_errors >= 1
            assert server.stats.answered_by_status["error"] == 2
    finally:
        store.close()


def test_ipc_socket_lives_in_a_private_directory(index: PrefixIndex, tmp_path: Any) -> None:
    with LookupServer(index) as server:
        path = server.address.removeprefix("ipc://")
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert not os.path.exists(os.path.dirname(path))  # its private directory is removed at close

    fresh = tmp_path / "new" / "lookup.sock"
    with LookupServer(index, f"ipc://{fresh}") as server:
        assert stat.S_IMODE(os.stat(fresh.parent).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o600
        with pytest.raises(OSError, match="already listens"):  # a live server's socket is never stolen
            LookupServer(index, f"ipc://{fresh}").start()

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    with pytest.raises(PermissionError, match="0700"):
        LookupServer(index, f"ipc://{shared}/lookup.sock").start()

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "lookup.sock").write_text("not a socket")
    with pytest.raises(FileExistsError, match="not a socket"):
        LookupServer(index, f"ipc://{private}/lookup.sock").start()


def test_tcp_binds_loopback_on_a_free_port_and_bind_errors_name_the_address(index: PrefixIndex) -> None:
    with LookupServer(index, "tcp://127.0.0.1:0") as server:
        assert server.address.startswith("tcp://127.0.0.1:") and not server.address.endswith(":0")
        with pytest.raises(zmq.ZMQError, match="addr="):
            LookupServer(index, server.address).start()


def test_close_from_another_thread_while_clients_hammer_it(ctx: zmq.Context, filler: PrefixIndex,
                                                           index: PrefixIndex) -> None:
    reqs, _ = _fill(filler, 9)
    server = LookupServer(index).start()
    sock = _dealer(ctx, server.address)
    for i in range(200):
        sock.send_multipart(p.encode_lookup(i + 1, reqs[i % 9].num_tokens, reqs[i % 9].block_hashes))
    _reply(sock)  # it is serving
    closer = threading.Thread(target=server.close)
    closer.start()
    closer.join(10)
    assert not closer.is_alive()
    statuses = set()
    while sock.poll(200):
        statuses.add(p.decode_reply(sock.recv()).status)
    assert statuses <= {p.OK, p.ERROR}  # anything still queued at close got an error reply
    server.close()  # idempotent


class _Recorder(ServerObserver):
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def store_call(self, batch_size: int, seconds: float, failed: bool) -> None:
        self.calls.append(("store_call", (batch_size, seconds >= 0, failed)))

    def answered(self, status: str, count: int = 1) -> None:
        self.calls.append(("answered", status))
        raise RuntimeError("a broken observer must not break serving")


def test_observers_see_store_calls_and_answers_and_cannot_break_the_server(
        ctx: zmq.Context, filler: PrefixIndex, index: PrefixIndex) -> None:
    reqs, expected = _fill(filler, 9)
    rec = _Recorder()
    with LookupServer(index, observers=[rec]) as server:
        sock = _dealer(ctx, server.address)
        sock.send_multipart(p.encode_lookup(1, reqs[5].num_tokens, reqs[5].block_hashes))
        assert _answer(sock).hit_length == expected[5]
        sock.send_multipart([b"junk", b""])
        assert _reply(sock).status == p.BAD_REQUEST
    assert ("store_call", (1, True, False)) in rec.calls
    assert [c for c in rec.calls if c[0] == "answered"] == [("answered", "ok"), ("answered", "bad_request")]


class _Counter(ServerObserver):
    def __init__(self) -> None:
        self.answered_calls: list[tuple[str, int]] = []
        self.gauge_reports = 0

    def answered(self, status: str, count: int = 1) -> None:
        self.answered_calls.append((status, count))

    def queue_depth(self, depth: int) -> None:
        self.gauge_reports += 1


def test_a_frame_is_counted_in_one_event_per_status_and_unchanged_gauges_are_not_reported_again(
        ctx: zmq.Context, filler: PrefixIndex, index: PrefixIndex) -> None:
    """Each event is a call the loop makes between a frame and its reply: a frame of many lookups makes one
    ``answered`` per status (was one per lookup), and the waiting gauges are reported when they change (they
    were reported twice a turn)."""
    reqs, expected = _fill(filler, 8)
    counter = _Counter()
    with LookupServer(index, observers=[counter]) as server:
        sock = _dealer(ctx, server.address)
        for frame_id in (1, 2):
            sock.send_multipart(p.encode_lookups(frame_id, [p.query(i, r.num_tokens, r.block_hashes)
                                                            for i, r in enumerate(reqs, start=10 * frame_id)]))
            reply = _reply(sock)
            assert reply.status == p.OK and [r.hit_length for r in reply.results] == expected
    assert counter.answered_calls == [("ok", 8), ("ok", 8)]
    # per frame: the frame waits (8 lookups), then nothing waits; the same values twice over are not re-reported
    assert counter.gauge_reports == 4


def test_prometheus_observer_reports_catalogue_metrics(ctx: zmq.Context, filler: PrefixIndex,
                                                       index: PrefixIndex) -> None:
    reqs, expected = _fill(filler, 9)
    registry = CollectorRegistry()
    limits = Limits(max_peer_bytes=123_456, max_total_keys=7_654_321)
    with LookupServer(index, observers=[ServerMetrics(registry)], limits=limits) as server:
        sock = _dealer(ctx, server.address)
        for i, r in enumerate(reqs):
            sock.send_multipart(p.encode_lookup(i + 1, r.num_tokens, r.block_hashes))
        sock.send_multipart([b"junk", b""])
        replies = [_reply(sock) for _ in range(len(reqs) + 1)]
    assert sum(r.status == p.BAD_REQUEST for r in replies) == 1
    value = registry.get_sample_value
    assert value(catalogue.SERVER_REQUESTS.name + "_total", {"status": "ok"}) == len(reqs)
    assert value(catalogue.SERVER_REQUESTS.name + "_total", {"status": "bad_request"}) == 1
    assert value(catalogue.SERVER_REQUESTS.name + "_total", {"status": "error"}) == 0
    calls = value(catalogue.SERVER_BATCH_SIZE.name + "_count")
    assert calls == index.store_calls and value(catalogue.SERVER_BATCH_SIZE.name + "_sum") == len(reqs)
    assert value(catalogue.SERVER_STORE_SECONDS.name + "_count") == calls
    assert value(catalogue.SERVER_QUEUE_DEPTH.name) == 0 and value(catalogue.SERVER_INFLIGHT.name) == 0
    assert value(catalogue.SERVER_STORE_ERRORS.name + "_total") == 0
    assert value(catalogue.SERVER_WAITING_BYTES.name) == 0 and value(catalogue.SERVER_WAITING_KEYS.name) == 0
    bounds = {(scope, measure): value(catalogue.SERVER_BOUNDS.name, {"scope": scope, "measure": measure})
              for scope in catalogue.SERVER_BOUND_SCOPES for measure in catalogue.SERVER_BOUND_MEASURES}
    assert bounds == limits.bounds() and bounds["peer", "bytes"] == 123_456 and bounds["total", "keys"] == 7_654_321


def test_serve_command_with_embedded_master_answers_and_serves_metrics(tmp_path: Any) -> None:
    metrics_port = free_port()
    serve = ChildProcess(
        [sys.executable, "-m", "mooncake_lookout.connector.cli.serve", "--embedded-master", "--tcp-port", "0",
         "--metrics-port", str(metrics_port), "--lease-window-ms", "1000", "--log-level", "INFO"], name="serve")
    ctx = zmq.Context()
    try:
        address = serve.wait_line("listening on ", 60.0).split()[-1]
        assert address.startswith("tcp://127.0.0.1:")  # TCP on request, loopback by default
        sock = _dealer(ctx, address)
        sock.send_multipart(p.encode_lookup(5, 129, [b"h" * 32] * 8))
        result = _answer(sock, timeout_s=20)
        assert (result.lookup_id, result.status) == (5, p.MISS)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert f'{catalogue.SERVER_REQUESTS.name}_total{{status="ok"}} 1.0' in text
        # The embedded master leases a found key as a real one does by default (10 s), so the clients'
        # prefix caches may trust a found block for the window asked, with the load's margin: the probe passes.
        from mooncake_lookout.connector.server.lease import probe_window_s

        verdict = serve.wait_line(lambda line: "key lease" in line, 30.0, "the lease probe's verdict")
        assert f"covers {probe_window_s(1.0) * 1000:g} ms" in verdict and "ERROR" not in verdict, verdict
        serve.proc.send_signal(signal.SIGTERM)
        assert serve.wait_exit(30) == 0  # stops cleanly, its embedded master with it
    finally:
        ctx.destroy(linger=0)
        serve.kill()



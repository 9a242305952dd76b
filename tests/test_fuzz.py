"""Bad input, property-based (hypothesis): the lookup server process fed malformed, truncated, oversized and
wrong-version frames; the client's decoders and a live client fed malformed replies; the config parser fed
bad keys and values. The server must answer every message with exactly one reply (an error for bad input)
and keep serving; the client must never crash, never hang past its deadline, and never turn garbage from our
versioned protocol into a hit.

The server tests run twice: on a private IPC socket, and on a CURVE TCP socket (an allowed client's frames,
decrypted by the server, must get the same answers); raw bytes thrown at the listening socket, below ZMQ's
handshake, must not bring either down.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake_lookout.connector.client import LookupClient
from mooncake_lookout.connector.config import KEYS, ConfigError, LookupConfig
from mooncake_lookout.connector.curve import ClientCurve, create_key_files
from mooncake_lookout.connector.events import Outcome, OutcomeCounter
from mooncake_lookout.connector.rigs.server_process import ServerProcess
from mooncake_lookout.connector.rigs.soak import SLACK_S, collector_held
from mooncake_lookout.connector.rigs.workload import unique_hashes
from mooncake_lookout.connector.server.prefix_index import PrefixIndex
from mooncake_lookout.connector.transport.pipelined import PipelinedTransport
from mooncake_lookout.connector.transport.upstream import UpstreamTransport
from mooncake_lookout.connector.wire import pipelined as protocol
from mooncake_lookout.connector.wire import upstream as upstream_wire

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

BLOCK = 16
REPLY_BOUND_MS = 5000
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))

_enc = msgspec.msgpack.Encoder()


@pytest.fixture(scope="module", params=["ipc", "curve"])
def served(request: Any, mooncake_master: Any, _session_writer: Any,
           tmp_path_factory: Any) -> Iterator[tuple[ServerProcess, PrefixIndex, ClientCurve | None]]:
    """Our lookup server in its own process over the session master, with one stored prefix: on a private IPC
    socket, or on a CURVE TCP socket (with the keys of a client it admits)."""
    ns = f"fuzz-{uuid.uuid4().hex[:8]}"
    index = PrefixIndex(_session_writer, BLOCK, ns)
    index.store_prefixes([unique_hashes(4, seed=77)])
    kwargs: dict[str, Any] = {}
    client = None
    if request.param == "curve":
        keys = tmp_path_factory.mktemp("curve")
        server_public, server_secret = create_key_files(str(keys), "server")
        client_public, client_secret = create_key_files(str(keys), "client")
        shutil.copy(client_public, keys / "allowed.key")
        client = ClientCurve.from_files(server_public, client_secret)
        kwargs = dict(address="tcp://127.0.0.1:0", server_options={
            "curve_secret_key": server_secret, "curve_allowed_clients": str(keys / "allowed.key")})
    with ServerProcess("pipelined", mooncake_master.rpc_address, namespace=ns, standby=False, **kwargs) as server:
        yield server, index, client
    index.remove_all(force=True)


@pytest.fixture(scope="module")
def dealer(served: tuple[ServerProcess, PrefixIndex, ClientCurve | None]) -> Iterator[zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if served[2] is not None:
        served[2].apply(sock)
    sock.connect(served[0].address)
    yield sock
    sock.close(linger=0)
    ctx.term()


def exchange(sock: zmq.Socket, frames: list[bytes]) -> list[bytes]:
    """Send one message and return its one reply (bounded); fails on silence or on a second reply."""
    sock.send_multipart(frames)
    assert sock.poll(REPLY_BOUND_MS, zmq.POLLIN), f"no reply to {[f[:32] for f in frames]}"
    reply = sock.recv_multipart()
    assert not sock.poll(0, zmq.POLLIN), "more than one reply to one message"
    return reply


def assert_still_serving(served: tuple[ServerProcess, PrefixIndex, ClientCurve | None], sock: zmq.Socket) -> None:
    server, index, _ = served
    assert server.running, f"the server process died:\n{server.output()}"
    hashes = unique_hashes(4, seed=77)
    # Hypothesis mines literals from the code, so a fuzzed b"reset" may well have wiped the store: legal.
    index.store_prefixes([hashes])
    reply = exchange(sock, protocol.encode_lookup(424242, 4 * BLOCK + 1, hashes))
    (result,) = protocol.decode_reply(reply[0]).results
    assert (result.lookup_id, result.status, result.hit_length) == (424242, protocol.OK, 4 * BLOCK)


# -- the server ---------------------------------------------------------------------------------------------
frames_any = st.lists(st.binary(max_size=300), min_size=0, max_size=5)
good_header = st.builds(lambda rid: _enc.encode(protocol.Header(protocol.VERSION, rid, protocol.OP_LOOKUP)),
                        st.integers(1, 2**63))
wrong_version = st.builds(lambda v, rid: _enc.encode(protocol.Header(v, rid, protocol.OP_LOOKUP)),
                          st.integers(-2**31, 2**31).filter(lambda v: v != protocol.VERSION), st.integers(1, 2**63))
valid_body = st.builds(
    lambda queries: protocol.encode_lookups(1, [protocol.query(i + 1, n, hs) for i, (n, hs) in enumerate(queries)])[1],
    st.lists(st.tuples(st.integers(0, 2**32 - 1),
                       st.integers(1, 64).flatmap(lambda size: st.lists(st.binary(min_size=size, max_size=size),
                                                                        max_size=20))),
             min_size=1, max_size=4))


@FUZZ
@given(frames=frames_any)
def test_random_frames_each_get_one_reply(served, dealer, frames: list[bytes]) -> None:
    if not frames:
        frames = [b""]
    reply = exchange(dealer, frames)
    # An empty first frame reads as a REQ envelope (vLLM's client): the reply keeps the delimiter.
    assert len(reply) == (2 if frames[0] == b"" else 1)


@FUZZ
@given(header=good_header, body=valid_body, cut=st.integers(1, 10_000))
def test_truncated_bodies_are_bad_requests_naming_the_id(served, dealer, header: bytes, body: bytes, cut: int) -> None:
    truncated = body[: max(0, len(body) - cut)]
    rid = msgspec.msgpack.decode(header)[1]
    reply = protocol.decode_reply(exchange(dealer, [header, truncated])[0])
    assert reply.status == protocol.BAD_REQUEST and reply.frame_id == rid and reply.reason


@FUZZ
@given(header=wrong_version, body=valid_body)
def test_wrong_versions_are_refused(served, dealer, header: bytes, body: bytes) -> None:
    reply = protocol.decode_reply(exchange(dealer, [header, body])[0])
    assert reply.status == protocol.BAD_REQUEST and "version" in reply.reason


@FUZZ
@given(header=st.binary(min_size=protocol.MAX_HEADER_BYTES + 1, max_size=protocol.MAX_HEADER_BYTES + 64),
       body=st.binary(max_size=64))
def test_oversized_headers_are_refused(served, dealer, header: bytes, body: bytes) -> None:
    reply = protocol.decode_reply(exchange(dealer, [header, body])[0])
    assert reply.status == protocol.BAD_REQUEST


@FUZZ
@given(parts=st.lists(st.binary(max_size=40), min_size=0, max_size=4))
def test_malformed_vllm_format_requests_get_vllms_error_byte(served, dealer, parts: list[bytes]) -> None:
    # A REQ envelope (empty delimiter) as vLLM's client sends, with a lookup tag and garbage after it.
    frames = [b"", upstream_wire.LOOKUP_MSG, *parts]
    try:
        upstream_wire.decode_lookup(parts)
        valid = True
    except upstream_wire.WireError:
        valid = False
    reply = exchange(dealer, frames)
    assert reply[0] == b"" and len(reply) == 2
    if not valid:
        assert reply[1] == upstream_wire.RESP_ERR


def _raw_stream(address: str) -> socket.socket:
    """A plain stream socket to the server's listening address, below ZMQ (no handshake)."""
    if address.startswith("tcp://"):
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        return socket.create_connection((host, int(port)), timeout=2)
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.settimeout(2)
    raw.connect(address.removeprefix("ipc://"))
    return raw


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(junk=st.binary(min_size=1, max_size=600))
def test_raw_bytes_below_the_handshake_are_dropped(served, junk: bytes) -> None:
    with _raw_stream(served[0].address) as raw:
        try:
            raw.sendall(junk)
        except OSError:  # the server already dropped the connection: that is the point
            pass


def test_oversized_body_is_refused_and_the_server_survives_every_fuzzed_input(served, dealer) -> None:
    header = _enc.encode(protocol.Header(protocol.VERSION, 9, protocol.OP_LOOKUP))
    reply = protocol.decode_reply(exchange(dealer, [header, b"\x00" * (protocol.MAX_BODY_BYTES + 1)])[0])
    assert reply.status == protocol.BAD_REQUEST and reply.frame_id == 9
    assert_still_serving(served, dealer)


# -- the client's decoders ------------------------------------------------------------------------------------
@settings(max_examples=500, deadline=None)
@given(payload=st.binary(max_size=200))
def test_pipelined_reply_decoder_raises_only_protocol_errors(payload: bytes) -> None:
    try:
        reply = protocol.decode_reply(payload)
    except protocol.ProtocolError:
        return
    if reply.status != protocol.OK:
        error, refused = protocol.frame_error(reply)
        assert isinstance(error, str) and isinstance(refused, bool)
    for result, (lookup_id, outcome, hit, _, _) in zip(reply.results, protocol.answers_of(reply)):
        assert lookup_id == result.lookup_id and isinstance(outcome, Outcome)
        if result.status == protocol.ERROR:
            assert outcome == Outcome.ERROR and hit == 0


@settings(max_examples=500, deadline=None)
@given(payload=st.binary(max_size=200))
def test_vllm_reply_decoder_never_raises(payload: bytes) -> None:
    outcome, hit, tails, _ = upstream_wire.decode_lookup_reply(payload)
    assert isinstance(outcome, Outcome) and isinstance(tails, tuple)
    if len(payload) < 4 or (len(payload) - 4) % 8:
        assert outcome == Outcome.ERROR and hit == 0


garbage_reply = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda v, s: _enc.encode([v, 0, s, "", [[1, s, 10**6, [], ""]]]), st.integers(-5, 5),
              st.text(max_size=8)),
    st.builds(lambda x: _enc.encode(x),
              st.lists(st.one_of(st.integers(-2**63, 2**64 - 1), st.text(), st.none()), max_size=8)),
)


class GarbageServer:
    """A real ROUTER on loopback that answers every request with the next fuzzed reply (or stays silent)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.replies: list[list[bytes]] = []
        self._stop = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self._stop:
            if not self.sock.poll(20, zmq.POLLIN):
                continue
            frames = self.sock.recv_multipart()
            envelope = frames[:2] if len(frames) > 1 and frames[1] == b"" else frames[:1]
            if self.replies:
                for payload in self.replies.pop(0):
                    self.sock.send_multipart([*envelope, payload])

    def close(self) -> None:
        self._stop = True
        self.thread.join(5)
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture(scope="module")
def garbage() -> Iterator[GarbageServer]:
    g = GarbageServer()
    yield g
    g.close()


@pytest.mark.parametrize("transport", ["pipelined", "upstream"])
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(replies=st.lists(garbage_reply, min_size=0, max_size=3))
def test_live_client_survives_malformed_replies(garbage: GarbageServer, transport: str, replies: list[bytes]) -> None:
    cfg = LookupConfig(lookup_timeout_ms=50, lookup_breaker_failures=1000, lookup_transport=transport)
    t = (PipelinedTransport(garbage.address, timeout_s=cfg.timeout_s) if transport == "pipelined"
         else UpstreamTransport(garbage.address))
    counter = OutcomeCounter()
    client = LookupClient(cfg, t, observer=counter)
    try:
        garbage.replies.append(replies)
        hashes = unique_hashes(4, seed=5)
        with collector_held():
            t0 = time.perf_counter()
            result = client.lookup("g", 4 * BLOCK + 1, hashes)
            took = time.perf_counter() - t0
        assert took <= cfg.timeout_s + SLACK_S
        rec = counter.records[-1]
        if transport == "pipelined":
            # Our protocol is versioned and id-tagged: garbage is an error or a timeout, never a hit.
            assert rec.outcome in (Outcome.ERROR, Outcome.TIMEOUT) and result.hit_length == 0
        else:
            # vLLM's format has no integrity: 4 stray bytes decode as a hit. A hit covering the whole prompt
            # is refused as an error (vLLM #55113), so no such answer reaches the scheduler.
            assert result.hit_length < 4 * BLOCK + 1
            assert t._thread.is_alive(), "a malformed reply killed the transport thread"
    finally:
        garbage.replies.clear()
        client.close()


# -- the config parser -------------------------------------------------------------------------------------
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                           max_leaves=5)
known = st.sampled_from([k.name for k in KEYS])


@settings(max_examples=400, deadline=None)
@given(extra=st.dictionaries(st.one_of(known, st.text(max_size=20), st.text(max_size=12).map("lookup_".__add__)),
                             json_values, max_size=6))
def test_config_parser_fails_only_with_a_message_naming_the_key(extra: dict[str, Any]) -> None:
    try:
        cfg = LookupConfig.from_extra_config(extra)
    except ConfigError as e:
        assert any(repr(k) in str(e) for k in extra), f"the error does not name the key: {e}"
        return
    for key in KEYS:
        value = getattr(cfg, key.name)
        assert key.check(value) and not (isinstance(value, float) and math.isnan(value))


@settings(max_examples=200, deadline=None)
@given(key=known, value=json_values)
def test_each_known_key_takes_only_good_values(key: str, value: Any) -> None:
    try:
        cfg = LookupConfig.from_extra_config({key: value})
    except ConfigError as e:
        assert repr(key) in str(e)
        return
    spec = next(k for k in KEYS if k.name == key)
    got = getattr(cfg, key)
    assert isinstance(got, spec.kind) and spec.check(got)
    assert not isinstance(value, bool) or spec.kind is bool


def test_no_process_left_behind(served) -> None:
    server = served[0]
    assert os.path.exists(f"/proc/{server.pid}")

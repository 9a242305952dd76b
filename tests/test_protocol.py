"""The pipelined protocol's frames: round trips, limits, and a clear error for every kind of bad frame."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_lookout.connector.events import Outcome
from mooncake_lookout.connector.job import LookupResult, TailKeyBoundary
from mooncake_lookout.connector.wire import pipelined as p

hashes_st = st.lists(st.binary(min_size=1, max_size=64), max_size=40)


@given(rid=st.integers(1, p.MAX_ID), num_tokens=st.integers(0, p.MAX_U32), hashes=hashes_st)
def test_lookup_round_trips(rid: int, num_tokens: int, hashes: list[bytes]) -> None:
    req = p.decode_request(p.encode_lookup(rid, num_tokens, hashes))
    assert req == p.Lookup(rid, num_tokens, hashes)


def test_reset_round_trips() -> None:
    assert p.decode_request(p.encode_reset(42)) == p.Reset(42)


@given(rid=st.integers(0, p.MAX_ID), hit=st.integers(0, p.MAX_U32),
       tails=st.lists(st.tuples(st.integers(0, p.MAX_U32), st.integers(0, p.MAX_U32)), max_size=4))
def test_result_reply_round_trips_to_an_answer(rid: int, hit: int, tails: list[tuple[int, int]]) -> None:
    result = LookupResult(hit, tuple(TailKeyBoundary(g, n) for g, n in tails))
    reply = p.decode_reply(p.encode_result(rid, result))
    assert reply.request_id == rid
    assert reply.status == (p.OK if hit else p.MISS)
    answer = p.answer_of(reply)
    assert answer.result == result
    assert answer.outcome is (Outcome.HIT if hit else Outcome.MISS)


@pytest.mark.parametrize("status", [p.ERROR, p.BAD_REQUEST])
def test_error_replies_stay_errors_with_their_reason(status: str) -> None:
    answer = p.answer_of(p.decode_reply(p.encode_status(7, status, "master unreachable")))
    assert answer.outcome is Outcome.ERROR
    assert answer.result.hit_length == 0
    assert "master unreachable" in (answer.error or "")


def test_client_refuses_to_encode_what_the_server_would_refuse() -> None:
    with pytest.raises(p.ProtocolError, match="hashes exceed"):
        p.encode_lookup(1, 16, [b"x"] * (p.MAX_HASHES + 1))
    with pytest.raises(p.ProtocolError, match="outside"):
        p.encode_lookup(1, 16, [b"x" * (p.MAX_HASH_BYTES + 1)])
    with pytest.raises(p.ProtocolError, match="outside"):
        p.encode_lookup(1, 16, [b""])
    with pytest.raises(p.ProtocolError, match="num_tokens"):
        p.encode_lookup(1, p.MAX_U32 + 1, [])


def _header(version: int = p.VERSION, rid: int = 9, op: str = p.OP_LOOKUP) -> bytes:
    return msgspec.msgpack.encode([version, rid, op])


def _refusal(frames: list[bytes]) -> p.ProtocolError:
    with pytest.raises(p.ProtocolError) as info:
        p.decode_request(frames)
    return info.value


def test_wrong_version_is_refused_naming_the_request() -> None:
    err = _refusal([_header(version=p.VERSION + 1), msgspec.msgpack.encode([16, [b"a"]])])
    assert err.request_id == 9 and "version" in err.reason


def test_truncated_body_is_refused_naming_the_request() -> None:
    body = p.encode_lookup(9, 64, [b"h" * 32] * 4)[1]
    err = _refusal([_header(), body[:-5]])
    assert err.request_id == 9 and "malformed lookup body" in err.reason


def test_oversized_body_is_refused_without_decoding_it() -> None:
    err = _refusal([_header(), b"\x00" * (p.MAX_BODY_BYTES + 1)])
    assert err.request_id == 9 and "exceeds" in err.reason


def test_too_many_hashes_in_a_hand_made_body_are_refused() -> None:
    body = msgspec.msgpack.encode([16, [b"a"] * (p.MAX_HASHES + 1)])
    assert "hashes exceed" in _refusal([_header(), body]).reason


@pytest.mark.parametrize("frames, reason", [
    ([b"\xc1garbage", b""], "malformed header"),
    ([_header()], "2 frames"),
    ([_header(), b"", b""], "2 frames"),
    ([b"\x90" * (p.MAX_HEADER_BYTES + 1), b""], "header of"),
    ([_header(op="drop_tables"), b""], "unknown op"),
    ([_header(op=p.OP_RESET), b"x"], "empty body"),
    ([_header(rid=-1), b""], "out of range"),
    ([_header(), msgspec.msgpack.encode([16, [b"a"], "extra"])], "malformed lookup body"),
    ([_header(), msgspec.msgpack.encode(["16", [b"a"]])], "malformed lookup body"),
    ([_header(), msgspec.msgpack.encode([-1, [b"a"]])], "num_tokens"),
])
def test_malformed_requests_are_refused_with_a_reason(frames: list[bytes], reason: str) -> None:
    assert reason in _refusal(frames).reason


@settings(max_examples=300)
@given(frames=st.lists(st.binary(max_size=64), max_size=3))
def test_arbitrary_bytes_only_ever_raise_protocol_error(frames: list[bytes]) -> None:
    try:
        p.decode_request(frames)
    except p.ProtocolError:
        pass


@pytest.mark.parametrize("frame, reason", [
    (b"\xc1", "malformed reply"),
    (msgspec.msgpack.encode([p.VERSION + 1, 3, p.OK, 0, [], ""]), "version"),
    (msgspec.msgpack.encode([p.VERSION, 3, "maybe", 0, [], ""]), "unknown reply status"),
])
def test_client_refuses_malformed_replies(frame: bytes, reason: str) -> None:
    with pytest.raises(p.ProtocolError, match=reason):
        p.decode_reply(frame)

"""The pipelined protocol's frames: round trips, limits, and a clear error for every kind of bad frame."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_lookout.connector.events import Outcome
from mooncake_lookout.connector.job import HashBlob, LookupResult, TailKeyBoundary
from mooncake_lookout.connector.wire import pipelined as p

hash_lists = st.integers(1, 64).flatmap(
    lambda size: st.lists(st.binary(min_size=size, max_size=size), max_size=40))


@given(lookups=st.lists(st.tuples(st.integers(1, p.MAX_ID), st.integers(0, p.MAX_U32), hash_lists),
                        min_size=1, max_size=8))
def test_a_frame_of_lookups_round_trips(lookups: list[tuple[int, int, list[bytes]]]) -> None:
    frames = p.encode_lookups(5, [p.query(lid, n, hashes) for lid, n, hashes in lookups])
    req = p.decode_request(frames)
    assert isinstance(req, p.Lookups) and req.frame_id == 5
    assert [(q.lookup_id, q.num_tokens, list(q.block_hashes)) for q in req.queries] == lookups


def test_reset_round_trips() -> None:
    assert p.decode_request(p.encode_reset(42)) == p.Reset(42)


def test_hashes_travel_as_one_blob_and_read_back_as_a_sequence() -> None:
    hashes = [bytes([i]) * 32 for i in range(5)]
    q = p.query(1, 80, hashes)
    assert q.hashes == b"".join(hashes) and q.hash_len == 32
    blob = q.block_hashes
    assert isinstance(blob, HashBlob) and len(blob) == 5
    assert blob[0] == hashes[0] and blob[-1] == hashes[-1] and blob[1:3] == hashes[1:3]
    assert blob.hex(2) == [h.hex() for h in hashes[:2]]


@given(lid=st.integers(0, p.MAX_ID), hit=st.integers(0, p.MAX_U32),
       tails=st.lists(st.tuples(st.integers(0, p.MAX_U32), st.integers(0, p.MAX_U32)), max_size=4))
def test_result_reply_round_trips_to_an_answer(lid: int, hit: int, tails: list[tuple[int, int]]) -> None:
    result = LookupResult(hit, tuple(TailKeyBoundary(g, n) for g, n in tails))
    reply = p.decode_reply(p.encode_reply(7, [p.result_of(lid, result)]))
    assert reply.frame_id == 7 and reply.status == p.OK
    (res,) = reply.results
    assert res.lookup_id == lid and res.status == (p.OK if hit else p.MISS)
    (answer,) = p.answers_of(reply)
    assert answer == (lid, Outcome.HIT if hit else Outcome.MISS, hit, result.tail_key_boundaries, None)


def test_a_store_error_stays_an_error_with_its_reason() -> None:
    reply = p.decode_reply(p.encode_reply(7, [p.result_of(3, RuntimeError("master unreachable"))]))
    ((lookup_id, outcome, hit, _, error),) = p.answers_of(reply)
    assert (lookup_id, outcome, hit) == (3, Outcome.ERROR, 0)
    assert "master unreachable" in (error or "")


@pytest.mark.parametrize("status", [p.ERROR, p.BAD_REQUEST, p.BUSY])
def test_a_refused_frame_fails_its_lookups_with_the_reason(status: str) -> None:
    error, refused = p.frame_error(p.decode_reply(p.encode_status(7, status, "master unreachable")))
    assert "master unreachable" in error and status in error
    assert refused is (status != p.ERROR)  # turned away without asking the store: it says nothing of the store


def test_client_refuses_to_encode_what_the_server_would_refuse() -> None:
    with pytest.raises(p.ProtocolError, match="hashes exceed"):
        p.query(1, 16, [b"x"] * (p.MAX_HASHES + 1))
    with pytest.raises(p.ProtocolError, match="outside"):
        p.query(1, 16, [b"x" * (p.MAX_HASH_BYTES + 1)])
    with pytest.raises(p.ProtocolError, match="outside"):
        p.query(1, 16, [b""])
    with pytest.raises(p.ProtocolError, match="num_tokens"):
        p.query(1, p.MAX_U32 + 1, [])
    with pytest.raises(p.ProtocolError, match="queries"):
        p.encode_lookups(1, [p.query(i, 16, [b"x"]) for i in range(p.MAX_QUERIES + 1)])


def _header(version: int = p.VERSION, fid: int = 9, op: str = p.OP_LOOKUP) -> bytes:
    return msgspec.msgpack.encode([version, fid, op])


def _body(*queries: list) -> bytes:
    return msgspec.msgpack.encode(list(queries))


def _refusal(frames: list[bytes]) -> p.ProtocolError:
    with pytest.raises(p.ProtocolError) as info:
        p.decode_request(frames)
    return info.value


def test_wrong_version_is_refused_naming_the_frame() -> None:
    err = _refusal([_header(version=p.VERSION - 1), _body([1, 16, 1, b"a"])])
    assert err.frame_id == 9 and "version" in err.reason


def test_truncated_body_is_refused_naming_the_frame() -> None:
    body = p.encode_lookups(9, [p.query(1, 64, [b"h" * 32] * 4)])[1]
    err = _refusal([_header(), body[:-5]])
    assert err.frame_id == 9 and "malformed lookup body" in err.reason


def test_oversized_body_is_refused_without_decoding_it() -> None:
    err = _refusal([_header(), b"\x00" * (p.MAX_BODY_BYTES + 1)])
    assert err.frame_id == 9 and "exceeds" in err.reason


def test_too_many_hashes_in_a_hand_made_body_are_refused() -> None:
    body = _body([1, 16, 1, b"a" * (p.MAX_HASHES + 1)])
    assert "hashes exceed" in _refusal([_header(), body]).reason


@pytest.mark.parametrize("frames, reason", [
    ([b"\xc1garbage", b""], "malformed header"),
    ([_header()], "2 frames"),
    ([_header(), b"", b""], "2 frames"),
    ([b"\x90" * (p.MAX_HEADER_BYTES + 1), b""], "header of"),
    ([_header(op="drop_tables"), b""], "unknown op"),
    ([_header(op=p.OP_RESET), b"x"], "empty body"),
    ([_header(fid=-1), b""], "out of range"),
    ([_header(), _body()], "queries"),
    ([_header(), _body([1, 16, 1, b"a", "extra"])], "malformed lookup body"),
    ([_header(), _body(["1", 16, 1, b"a"])], "malformed lookup body"),
    ([_header(), _body([1, 16, "1", b"a"])], "malformed lookup body"),
    ([_header(), _body([1, -1, 1, b"a"])], "num_tokens"),
    ([_header(), _body([-1, 16, 1, b"a"])], "lookup id"),
    ([_header(), _body([1, 16, 3, b"abcd"])], "not a multiple"),
    ([_header(), _body([1, 16, 0, b"abcd"])], "hash_len"),
    ([_header(), _body([1, 16, p.MAX_HASH_BYTES + 1, b"a" * (p.MAX_HASH_BYTES + 1)])], "hash_len"),
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
    (msgspec.msgpack.encode([p.VERSION + 1, 3, p.OK, "", []]), "version"),
    (msgspec.msgpack.encode([p.VERSION, 3, "maybe", "", []]), "unknown reply status"),
    (msgspec.msgpack.encode([p.VERSION, 3, p.OK, "", [[1, "perhaps", 0, [], ""]]]), "unknown result status"),
])
def test_client_refuses_malformed_replies(frame: bytes, reason: str) -> None:
    with pytest.raises(p.ProtocolError, match=reason):
        p.decode_reply(frame)

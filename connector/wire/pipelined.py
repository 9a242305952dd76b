"""The ``pipelined`` lookup protocol: versioned, id-tagged msgspec frames over DEALER/ROUTER.

Why it exists: vLLM's lookup channel (REQ/REP) carries one lookup at a time. Tagging each request with an
id lets a client keep many lookups in flight and match replies in any order; a version field lets both
ends refuse what they do not understand instead of misreading it. ``docs/protocol.md`` is the user-level
description; this module is the single definition both ends import.

Request, two ZMQ frames (a DEALER sends them as they are; a ROUTER sees its peer identity in front):

* ``header``: msgpack array ``[version, request_id, op]`` (:class:`Header`), at most
  :data:`MAX_HEADER_BYTES` bytes. ``op`` is ``"lookup"`` or ``"reset"``.
* ``body``: for ``lookup`` a msgpack array ``[num_tokens, [hash, ...]]`` (:class:`LookupBody`), at most
  :data:`MAX_BODY_BYTES` bytes and :data:`MAX_HASHES` hashes of at most :data:`MAX_HASH_BYTES` bytes each;
  for ``reset`` an empty frame.

Keeping the header apart from the body means the server can name the request in its error reply even
when the body is truncated, oversized or garbage.

Reply, one frame: msgpack array ``[version, request_id, status, hit_length, [[group_id, num_tokens], ...],
reason]`` (:class:`Reply`). ``status`` is one of :data:`STATUSES`:

* ``ok``: the lookup ran and found ``hit_length`` tokens (``> 0``), or a reset succeeded;
* ``miss``: the lookup ran and found nothing;
* ``error``: the store failed (``reason`` says how); the answer is unknown, not a miss;
* ``bad_request``: the frame was refused (malformed, truncated, wrong version, over a limit).

A request whose header cannot be read at all is answered with ``request_id`` :data:`UNKNOWN_ID`.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from mooncake_lookout.connector.events import Outcome
from mooncake_lookout.connector.job import Answer, LookupResult, TailKeyBoundary

VERSION = 1
UNKNOWN_ID = 0
MAX_HEADER_BYTES = 256
MAX_HASHES = 65_536  # 1M tokens at block size 16
MAX_HASH_BYTES = 256
# 65,536 hashes of 32 bytes plus msgpack overhead fit with room to spare.
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_U32 = 0xFFFFFFFF
MAX_ID = 2**64 - 1

OP_LOOKUP = "lookup"
OP_RESET = "reset"
OPS = (OP_LOOKUP, OP_RESET)

OK = "ok"
MISS = "miss"
ERROR = "error"
BAD_REQUEST = "bad_request"
STATUSES = (OK, MISS, ERROR, BAD_REQUEST)


class ProtocolError(ValueError):
    """A frame that breaks the protocol; ``request_id`` names the request when the header was readable."""

    def __init__(self, reason: str, request_id: int = UNKNOWN_ID) -> None:
        super().__init__(reason)
        self.reason = reason
        self.request_id = request_id


class Header(msgspec.Struct, array_like=True, frozen=True):
    """Frame 1 of a request: who asks (``request_id``), what (``op``) and in which protocol ``version``."""

    version: int
    request_id: int
    op: str


class LookupBody(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """Frame 2 of a lookup: the prompt length and its block hashes, oldest first."""

    num_tokens: int
    hashes: list[bytes]


class Reply(msgspec.Struct, array_like=True, frozen=True):
    """The one-frame answer to a request; ``tails`` are (group_id, num_tokens) boundaries of the hit."""

    version: int
    request_id: int
    status: str
    hit_length: int = 0
    tails: list[tuple[int, int]] = []
    reason: str = ""


class Lookup(msgspec.Struct, frozen=True):
    """A lookup request, validated."""

    request_id: int
    num_tokens: int
    hashes: list[bytes]


class Reset(msgspec.Struct, frozen=True):
    """A reset request, validated."""

    request_id: int


_MISS_ANSWER = Answer(Outcome.MISS)
_ENCODER = msgspec.msgpack.Encoder()
_HEADER = msgspec.msgpack.Decoder(Header)
_BODY = msgspec.msgpack.Decoder(LookupBody)
_REPLY = msgspec.msgpack.Decoder(Reply)


# -- client side ---------------------------------------------------------------------------------------------
def encode_lookup(request_id: int, num_tokens: int, hashes: Sequence[bytes]) -> list[bytes]:
    """The two frames of a lookup; raises :class:`ProtocolError` if it would break a limit."""
    body = LookupBody(num_tokens, list(hashes))  # bytes, bytearray or memoryview items all encode as bin
    check_lookup(request_id, body)
    frames = [_ENCODER.encode(Header(VERSION, request_id, OP_LOOKUP)), _ENCODER.encode(body)]
    if len(frames[1]) > MAX_BODY_BYTES:
        raise ProtocolError(f"lookup body of {len(frames[1])} bytes exceeds {MAX_BODY_BYTES}", request_id)
    return frames


def encode_reset(request_id: int) -> list[bytes]:
    """The two frames of a reset (the body is empty)."""
    return [_ENCODER.encode(Header(VERSION, request_id, OP_RESET)), b""]


def decode_reply(frame: bytes) -> Reply:
    """Parse a reply frame; raises :class:`ProtocolError` on anything malformed or of another version."""
    try:
        reply = _REPLY.decode(frame)
    except msgspec.MsgspecError as e:
        raise ProtocolError(f"malformed reply: {e}") from None
    if reply.version != VERSION:
        raise ProtocolError(f"reply version {reply.version}, expected {VERSION}", reply.request_id)
    if reply.status not in STATUSES:
        raise ProtocolError(f"unknown reply status {reply.status!r}", reply.request_id)
    return reply


def answer_of(reply: Reply) -> Answer:
    """A lookup reply as the :class:`Answer` a job finishes with: errors stay errors, never misses."""
    if reply.status == MISS and not reply.tails:
        return _MISS_ANSWER
    if reply.status == OK or reply.status == MISS:
        tails = tuple(TailKeyBoundary(g, n) for g, n in reply.tails)
        return Answer.from_result(LookupResult(reply.hit_length, tails))
    return Answer(Outcome.ERROR, error=f"{reply.status}: {reply.reason}")


# -- server side ---------------------------------------------------------------------------------------------
def check_lookup(request_id: int, body: LookupBody) -> None:
    """Raise :class:`ProtocolError` if a lookup breaks a limit (both ends run the same checks)."""
    if not 0 <= body.num_tokens <= MAX_U32:
        raise ProtocolError(f"num_tokens {body.num_tokens} out of range 0..{MAX_U32}", request_id)
    if len(body.hashes) > MAX_HASHES:
        raise ProtocolError(f"{len(body.hashes)} hashes exceed the limit of {MAX_HASHES}", request_id)
    if body.hashes:
        sizes = list(map(len, body.hashes))
        shortest, longest = min(sizes), max(sizes)
        if shortest < 1 or longest > MAX_HASH_BYTES:
            bad = shortest if shortest < 1 else longest
            raise ProtocolError(f"a hash of {bad} bytes is outside 1..{MAX_HASH_BYTES}", request_id)


def decode_request(frames: Sequence[bytes]) -> Lookup | Reset:
    """Parse and validate a request's two frames; raises :class:`ProtocolError` naming the id when known."""
    if len(frames) != 2:
        raise ProtocolError(f"a request has 2 frames (header, body), got {len(frames)}")
    header_frame, body_frame = frames
    if len(header_frame) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(header_frame)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = _HEADER.decode(header_frame)
    except msgspec.MsgspecError as e:
        raise ProtocolError(f"malformed header: {e}") from None
    rid = header.request_id
    if not 0 <= rid <= MAX_ID:
        raise ProtocolError(f"request id {rid} out of range")
    if header.version != VERSION:
        raise ProtocolError(f"unsupported protocol version {header.version}, this server speaks {VERSION}", rid)
    if header.op == OP_RESET:
        if len(body_frame):
            raise ProtocolError("reset takes an empty body", rid)
        return Reset(rid)
    if header.op != OP_LOOKUP:
        raise ProtocolError(f"unknown op {header.op!r}; known: {', '.join(OPS)}", rid)
    if len(body_frame) > MAX_BODY_BYTES:
        raise ProtocolError(f"lookup body of {len(body_frame)} bytes exceeds {MAX_BODY_BYTES}", rid)
    try:
        body = _BODY.decode(body_frame)
    except msgspec.MsgspecError as e:
        raise ProtocolError(f"malformed lookup body: {e}", rid) from None
    check_lookup(rid, body)
    return Lookup(rid, body.num_tokens, body.hashes)


def encode_result(request_id: int, result: LookupResult) -> bytes:
    """The reply to a lookup that ran: ``ok`` with the hit, or ``miss``."""
    status = OK if result.hit_length > 0 else MISS
    tails = [(t.group_id, t.num_tokens) for t in result.tail_key_boundaries]
    return _ENCODER.encode(Reply(VERSION, request_id, status, result.hit_length, tails))


def encode_status(request_id: int, status: str, reason: str = "") -> bytes:
    """A reply without a result: a reset's ``ok``, a store ``error`` or a ``bad_request``, with its reason."""
    return _ENCODER.encode(Reply(VERSION, request_id, status, reason=reason))


__all__ = [
    "BAD_REQUEST", "ERROR", "Header", "Lookup", "LookupBody", "MAX_BODY_BYTES", "MAX_HASHES", "MAX_HASH_BYTES",
    "MAX_HEADER_BYTES", "MISS", "OK", "OPS", "OP_LOOKUP", "OP_RESET", "ProtocolError", "Reply", "Reset", "STATUSES",
    "UNKNOWN_ID", "VERSION", "answer_of", "check_lookup", "decode_reply", "decode_request", "encode_lookup",
    "encode_reset", "encode_result", "encode_status",
]

"""The ``pipelined`` lookup protocol: versioned msgspec frames over DEALER/ROUTER, many lookups per frame.

Why it exists: vLLM's lookup channel (REQ/REP) carries one lookup at a time, and every lookup that
crosses a thread or a socket on its own pays a wake-up. Here one frame carries every lookup the
scheduler asked for in one step, the server answers all of them with one store call, and one reply
frame brings every answer back: a step pays one send and one receive, however many lookups it holds.
A version field lets both ends refuse what they do not understand instead of misreading it.
``docs/protocol.md`` is the user-level description; this module is the single definition both ends import.

Request, two ZMQ frames (a DEALER sends them as they are; a ROUTER sees its peer identity in front):

* ``header``: msgpack array ``[version, frame_id, op]`` (:class:`Header`), at most :data:`MAX_HEADER_BYTES`;
  ``op`` is ``"lookup"`` or ``"reset"``.
* ``body``: for ``lookup`` a msgpack array of queries ``[lookup_id, num_tokens, hash_len, hashes]``
  (:class:`Query`), where ``hashes`` is the block hashes concatenated (``hash_len`` bytes each, as in vLLM's
  own wire format: one ``bytes`` is cheap to encode, a list of 4,096 is not); at most :data:`MAX_QUERIES`
  queries, :data:`MAX_HASHES` hashes each, :data:`MAX_BODY_BYTES` in all. For ``reset`` an empty frame.

Reply, one frame per request frame: ``[version, frame_id, status, reason, results]`` (:class:`Reply`), with
one ``[lookup_id, status, hit_length, [[group_id, num_tokens], ...], reason]`` (:class:`Result`) per query.
Frame ``status``: ``ok``, ``error`` (the server could not answer: every query failed), ``bad_request``
(the frame was refused: malformed, or a ``reset`` from a peer that may not wipe the store) or ``busy`` (this
peer already has as many lookups waiting at the server as it may; nothing was asked of the store).
Query ``status``: ``ok`` (``hit_length`` > 0), ``miss`` or ``error`` (the store
failed: the answer is unknown, not a miss). A frame whose header cannot be read is answered with
``frame_id`` :data:`UNKNOWN_ID`.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from mooncake_lookout.connector.job import HashBlob, LookupResult, TailKeyBoundary
from mooncake_lookout.connector.lookup import Outcome

VERSION = 2
UNKNOWN_ID = 0
MAX_HEADER_BYTES = 256
MAX_QUERIES = 4096  # lookups in one frame; the client starts a new frame past it
MAX_HASHES = 65_536  # 1M tokens at block size 16
MAX_HASH_BYTES = 256
# A frame holds at most this much; the client starts a new frame before it (so a step's lookups may
# travel in a few frames), the server refuses a larger one.
MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_U32 = 0xFFFFFFFF
MAX_ID = 2**64 - 1

OP_LOOKUP = "lookup"
OP_RESET = "reset"
OPS = (OP_LOOKUP, OP_RESET)

OK = "ok"
MISS = "miss"
ERROR = "error"
BAD_REQUEST = "bad_request"
BUSY = "busy"  # added within version 2: a client that does not know it fails the frame's lookups, as it should
FRAME_STATUSES = (OK, ERROR, BAD_REQUEST, BUSY)
RESULT_STATUSES = (OK, MISS, ERROR)


class ProtocolError(ValueError):
    """A frame that breaks the protocol; ``frame_id`` names the frame when its header was readable."""

    def __init__(self, reason: str, frame_id: int = UNKNOWN_ID) -> None:
        super().__init__(reason)
        self.reason = reason
        self.frame_id = frame_id


class Header(msgspec.Struct, array_like=True, frozen=True):
    """Frame 1 of a request: which frame (``frame_id``), what (``op``), in which protocol ``version``."""

    version: int
    frame_id: int
    op: str


class Query(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """One lookup in a request body: its id, the prompt length and its block hashes, concatenated.

    ``known``: leading blocks the client already knows are in the store (its prefix cache: each was found
    present within its lease); the server asks the store only for the blocks after them, and only if
    ``epoch`` (the store's epoch they were found in, from a reply) is still the store's: else it asks all.
    """

    lookup_id: int
    num_tokens: int
    hash_len: int
    hashes: bytes
    known: int = 0
    epoch: int = 0

    @property
    def block_hashes(self) -> HashBlob:
        """The block hashes, oldest first, as a sequence over the concatenated bytes (no copy)."""
        return HashBlob(self.hashes, self.hash_len)


class Result(msgspec.Struct, array_like=True, frozen=True):
    """The answer to one query; ``tails`` are (group_id, num_tokens) boundaries of the hit."""

    lookup_id: int
    status: str
    hit_length: int = 0
    tails: list[tuple[int, int]] = []
    reason: str = ""


class Reply(msgspec.Struct, array_like=True, frozen=True):
    """The one-frame answer to a request frame.

    ``epoch`` names the store's state as the server last saw it: it changes when the server finds its
    marker key gone (a wipe by any instance, a master restart), so clients drop what they cached. 0: the
    server keeps no marker (clients must not cache).
    """

    version: int
    frame_id: int
    status: str
    reason: str = ""
    results: list[Result] = []
    epoch: int = 0


class Reset(msgspec.Struct, frozen=True):
    """A reset request, validated."""

    frame_id: int


class Lookups(msgspec.Struct, frozen=True):
    """A lookup request frame, validated."""

    frame_id: int
    queries: list[Query]
    keys: int = 0  # store keys answering it asks (blocks its client does not already know)


_ENCODER = msgspec.msgpack.Encoder()
_HEADER = msgspec.msgpack.Decoder(Header)
_BODY = msgspec.msgpack.Decoder(list[Query])
_REPLY = msgspec.msgpack.Decoder(Reply)


# -- client side ---------------------------------------------------------------------------------------------
def query(lookup_id: int, num_tokens: int, block_hashes: Sequence[bytes], known: int = 0, epoch: int = 0) -> Query:
    """One lookup as a :class:`Query`; raises :class:`ProtocolError` if it would break a limit.

    The hashes must share one length (vLLM's do: one hash function per engine).
    """
    hash_len = len(block_hashes[0]) if block_hashes else 0
    if block_hashes and not hash_len:
        raise ProtocolError(f"lookup {lookup_id}: a hash of 0 bytes is outside 1..{MAX_HASH_BYTES}")
    blob = b"".join(block_hashes)
    q = Query(lookup_id, num_tokens, hash_len, blob, known, epoch)
    check_query(q)
    return q


def encode_lookups(frame_id: int, queries: Sequence[Query]) -> list[bytes]:
    """The two frames of a lookup request carrying ``queries`` (already checked by :func:`query`)."""
    if not 0 < len(queries) <= MAX_QUERIES:
        raise ProtocolError(f"a frame carries 1..{MAX_QUERIES} queries, got {len(queries)}", frame_id)
    return [_ENCODER.encode(Header(VERSION, frame_id, OP_LOOKUP)), _ENCODER.encode(queries)]


def encode_lookup(lookup_id: int, num_tokens: int, block_hashes: Sequence[bytes]) -> list[bytes]:
    """The frames of a request carrying one lookup (its frame id is the lookup id): probes and tools."""
    return encode_lookups(lookup_id, [query(lookup_id, num_tokens, block_hashes)])


def query_bytes(q: Query) -> int:
    """About how many body bytes ``q`` takes (the client starts a new frame before :data:`MAX_BODY_BYTES`)."""
    return len(q.hashes) + 32


def encode_reset(frame_id: int) -> list[bytes]:
    """The two frames of a reset (the body is empty)."""
    return [_ENCODER.encode(Header(VERSION, frame_id, OP_RESET)), b""]


def decode_reply(frame: bytes) -> Reply:
    """Parse a reply frame; raises :class:`ProtocolError` on anything malformed or of another version."""
    try:
        reply = _REPLY.decode(frame)
    except msgspec.MsgspecError as e:
        raise ProtocolError(f"malformed reply: {e}") from None
    if reply.version != VERSION:
        raise ProtocolError(f"reply version {reply.version}, expected {VERSION}", reply.frame_id)
    if reply.status not in FRAME_STATUSES:
        raise ProtocolError(f"unknown reply status {reply.status!r}", reply.frame_id)
    for r in reply.results:
        if r.status not in RESULT_STATUSES:
            raise ProtocolError(f"unknown result status {r.status!r} for lookup {r.lookup_id}", reply.frame_id)
    return reply


# One query's answer as the client applies it: (lookup id, outcome, hit tokens, tail boundaries, error).
Answered = tuple[int, Outcome, int, tuple[TailKeyBoundary, ...], "str | None"]
_NO_TAILS: tuple[TailKeyBoundary, ...] = ()


def answers_of(reply: Reply) -> list[Answered]:
    """Each result of an ``ok`` reply as the answer its lookup ends with: errors stay errors, never misses."""
    out: list[Answered] = []
    for r in reply.results:
        if r.status == ERROR:
            out.append((r.lookup_id, Outcome.ERROR, 0, _NO_TAILS, r.reason or "store error"))
        elif r.hit_length > 0 or r.tails:
            tails = tuple(TailKeyBoundary(g, n) for g, n in r.tails)
            out.append((r.lookup_id, Outcome.HIT if r.hit_length > 0 else Outcome.MISS, r.hit_length, tails, None))
        else:
            out.append((r.lookup_id, Outcome.MISS, 0, _NO_TAILS, None))
    return out


def frame_error(reply: Reply) -> tuple[str, bool]:
    """Why every lookup of a refused or failed frame ends in error, and whether the server turned the frame away
    (``busy``, ``bad_request``) without asking the store, which says nothing of the store."""
    return f"{reply.status}: {reply.reason}", reply.status in (BUSY, BAD_REQUEST)


# -- server side ---------------------------------------------------------------------------------------------
def check_query(q: Query, frame_id: int = UNKNOWN_ID) -> int:
    """Raise :class:`ProtocolError` if a query breaks a limit (both ends run the same checks); else the number of
    store keys it asks (its blocks past the ``known`` ones)."""
    if not 0 <= q.lookup_id <= MAX_ID:
        raise ProtocolError(f"lookup id {q.lookup_id} out of range", frame_id)
    if not 0 <= q.num_tokens <= MAX_U32:
        raise ProtocolError(f"lookup {q.lookup_id}: num_tokens {q.num_tokens} out of range 0..{MAX_U32}", frame_id)
    if not q.hashes:
        if not 0 <= q.hash_len <= MAX_HASH_BYTES:
            raise ProtocolError(f"lookup {q.lookup_id}: hash_len {q.hash_len} outside 0..{MAX_HASH_BYTES}", frame_id)
        if q.known:
            raise ProtocolError(f"lookup {q.lookup_id}: {q.known} known blocks of 0", frame_id)
        return 0
    if not 1 <= q.hash_len <= MAX_HASH_BYTES:
        raise ProtocolError(f"lookup {q.lookup_id}: hash_len {q.hash_len} outside 1..{MAX_HASH_BYTES}", frame_id)
    if len(q.hashes) % q.hash_len:
        raise ProtocolError(f"lookup {q.lookup_id}: {len(q.hashes)} hash bytes are not a multiple of "
                            f"hash_len {q.hash_len}", frame_id)
    blocks = len(q.hashes) // q.hash_len
    if blocks > MAX_HASHES:
        raise ProtocolError(f"lookup {q.lookup_id}: {blocks} hashes exceed the limit of {MAX_HASHES}", frame_id)
    if not 0 <= q.known <= blocks:
        raise ProtocolError(f"lookup {q.lookup_id}: {q.known} known blocks of {blocks}", frame_id)
    return blocks - q.known


def frame_id_of(header_frame: bytes) -> int | None:
    """The frame id of a lookup request's header, read without its body; None for anything else."""
    if len(header_frame) > MAX_HEADER_BYTES:
        return None
    try:
        header = _HEADER.decode(header_frame)
    except msgspec.MsgspecError:
        return None
    if header.version != VERSION or header.op != OP_LOOKUP or not 0 <= header.frame_id <= MAX_ID:
        return None
    return header.frame_id


def decode_request(frames: Sequence[bytes]) -> Lookups | Reset:
    """Parse and validate a request's two frames; raises :class:`ProtocolError` naming the frame when known."""
    if len(frames) != 2:
        raise ProtocolError(f"a request has 2 frames (header, body), got {len(frames)}")
    header_frame, body_frame = frames
    if len(header_frame) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(header_frame)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = _HEADER.decode(header_frame)
    except msgspec.MsgspecError as e:
        raise ProtocolError(f"malformed header: {e}") from None
    fid = header.frame_id
    if not 0 <= fid <= MAX_ID:
        raise ProtocolError(f"frame id {fid} out of range")
    if header.version != VERSION:
        raise ProtocolError(f"unsupported protocol version {header.version}, this server speaks {VERSION}", fid)
    if header.op == OP_RESET:
        if len(body_frame):
            raise ProtocolError("reset takes an empty body", fid)
        return Reset(fid)
    if header.op != OP_LOOKUP:
        raise ProtocolError(f"unknown op {header.op!r}; known: {', '.join(OPS)}", fid)
    if len(body_frame) > MAX_BODY_BYTES:
        raise ProtocolError(f"lookup body of {len(body_frame)} bytes exceeds {MAX_BODY_BYTES}", fid)
    try:
        queries = _BODY.decode(body_frame)
    except msgspec.MsgspecError as e:
        raise ProtocolError(f"malformed lookup body: {e}", fid) from None
    if not 0 < len(queries) <= MAX_QUERIES:
        raise ProtocolError(f"a frame carries 1..{MAX_QUERIES} queries, got {len(queries)}", fid)
    keys = 0
    for q in queries:
        keys += check_query(q, fid)
    return Lookups(fid, queries, keys)


def result_of(lookup_id: int, outcome: LookupResult | BaseException) -> Result:
    """The :class:`Result` of one query: its hit (``ok``), ``miss``, or the store ``error`` it met."""
    if isinstance(outcome, BaseException):
        return Result(lookup_id, ERROR, reason=f"{type(outcome).__name__}: {outcome}")
    tails = [(t.group_id, t.num_tokens) for t in outcome.tail_key_boundaries]
    return Result(lookup_id, OK if outcome.hit_length > 0 else MISS, outcome.hit_length, tails)


def encode_reply(frame_id: int, results: Sequence[Result], epoch: int = 0) -> bytes:
    """The ``ok`` reply to a lookup frame, one result per query."""
    return _ENCODER.encode(Reply(VERSION, frame_id, OK, "", list(results), epoch))


def encode_status(frame_id: int, status: str, reason: str = "", epoch: int = 0) -> bytes:
    """A reply without results: a reset's ``ok``, a frame-wide ``error``, ``bad_request`` or ``busy``, and why."""
    return _ENCODER.encode(Reply(VERSION, frame_id, status, reason, epoch=epoch))


__all__ = [
    "Answered", "BAD_REQUEST", "BUSY", "ERROR", "FRAME_STATUSES", "Header", "Lookups", "MAX_BODY_BYTES", "MAX_HASHES",
    "MAX_HASH_BYTES", "MAX_HEADER_BYTES", "MAX_QUERIES", "MISS", "OK", "OPS", "OP_LOOKUP", "OP_RESET",
    "ProtocolError", "Query", "RESULT_STATUSES", "Reply", "Reset", "Result", "UNKNOWN_ID", "VERSION", "answers_of",
    "check_query", "decode_reply", "decode_request", "encode_lookup", "encode_lookups", "encode_reply", "encode_reset",
    "encode_status", "frame_error", "frame_id_of", "query", "query_bytes", "result_of",
]

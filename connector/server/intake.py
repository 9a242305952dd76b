"""What the lookup server works on: each incoming message, validated, as a work item or a refusal.

One socket carries both wire formats: our ``pipelined`` frames (a DEALER's two frames, many lookups each)
and vLLM 0.33's own requests (a REQ's identity and empty delimiter, then a tag). :func:`parse` tells them
apart, validates every field against the protocol's limits, and returns either the work to answer or the
reply that refuses it (a malformed frame is answered, never dropped, and never reaches the store).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

from mooncake_lookout.connector.job import HashBlob
from mooncake_lookout.connector.wire import pipelined as protocol
from mooncake_lookout.connector.wire import upstream as upstream_wire

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Frame:
    """A validated pipelined lookup frame: its queries are answered together, in one reply."""

    envelope: list[bytes]
    frame_id: int
    queries: list[protocol.Query]
    keys: int  # store keys answering it asks


@dataclass(eq=False)
class UpstreamLookup:
    """A lookup in vLLM's wire format (one per REQ message)."""

    envelope: list[bytes]
    num_tokens: int
    hashes: HashBlob


@dataclass(eq=False)
class Reset:
    """A reset, in either wire format."""

    envelope: list[bytes]
    frame_id: int | None  # None: vLLM's wire format


@dataclass(eq=False)
class Refusal:
    """A message turned away: the reply that says why, the ``server_requests`` status and the lookups it counts;
    ``later``: the reply is held, to go at its peer's next turn (:mod:`.pacing`)."""

    envelope: list[bytes]
    reply: bytes
    status: str = protocol.BAD_REQUEST
    count: int = 1
    later: bool = False


Work = Union[Frame, UpstreamLookup, Reset]


def split(frames: Sequence[bytes]) -> tuple[list[bytes], Sequence[bytes]]:
    """(envelope, payload) of one message: a REQ's identity and empty delimiter, or a DEALER's identity."""
    if len(frames) >= 2 and frames[1] == b"":
        return list(frames[:2]), frames[2:]
    return list(frames[:1]), frames[1:]


def parse(frames: Sequence[bytes]) -> Work | Refusal:
    """One message as the work it asks for, or the reply refusing it."""
    envelope, payload = split(frames)
    tag = payload[0] if payload else b""
    if tag in (upstream_wire.LOOKUP_MSG, upstream_wire.RESET_MSG):
        return _parse_upstream(envelope, tag, payload[1:])
    try:
        req = protocol.decode_request(payload)
    except protocol.ProtocolError as e:
        return Refusal(envelope, protocol.encode_status(e.frame_id, protocol.BAD_REQUEST, e.reason))
    if isinstance(req, protocol.Reset):
        return Reset(envelope, req.frame_id)
    return Frame(envelope, req.frame_id, req.queries, req.keys)


def _parse_upstream(envelope: list[bytes], tag: bytes, rest: Sequence[bytes]) -> Work | Refusal:
    if tag == upstream_wire.RESET_MSG:
        if rest:
            return _refuse_upstream(envelope, "reset takes no payload frames")
        return Reset(envelope, None)
    try:
        if len(rest) == 3 and len(rest[2]) > protocol.MAX_BODY_BYTES:
            raise upstream_wire.WireError(f"hash frame of {len(rest[2])} bytes exceeds {protocol.MAX_BODY_BYTES}")
        num_tokens, hashes = upstream_wire.decode_lookup(rest)
        if len(hashes) > protocol.MAX_HASHES:
            raise upstream_wire.WireError(f"{len(hashes)} hashes exceed the limit of {protocol.MAX_HASHES}")
    except upstream_wire.WireError as e:
        return _refuse_upstream(envelope, str(e))
    return UpstreamLookup(envelope, num_tokens, hashes)


def _refuse_upstream(envelope: list[bytes], reason: str) -> Refusal:
    logger.warning("refusing a malformed upstream-format request: %s", reason)
    return Refusal(envelope, upstream_wire.RESP_ERR)


def lookups_in(work: Work) -> int:
    """How many lookups a work item carries."""
    return len(work.queries) if isinstance(work, Frame) else 1


def keys_in(work: Frame | UpstreamLookup) -> int:
    """How many keys answering ``work`` asks the store (the blocks its client does not already know)."""
    return work.keys if isinstance(work, Frame) else len(work.hashes)


def query_count(body: bytes) -> int:
    """How many queries a lookup body holds, read from its msgpack array header alone (1 if unreadable)."""
    if not body:
        return 1
    first = body[0]
    if 0x91 <= first <= 0x9F:  # fixarray
        return first & 0x0F
    if first == 0xDC and len(body) >= 3:  # array 16
        return max(1, int.from_bytes(body[1:3], "big"))
    if first == 0xDD and len(body) >= 5:  # array 32
        return max(1, int.from_bytes(body[1:5], "big"))
    return 1


__all__ = ["Frame", "Refusal", "Reset", "UpstreamLookup", "Work", "keys_in", "lookups_in", "parse", "query_count",
           "split"]

"""vLLM 0.33's lookup channel wire format, byte for byte (``mooncake/store/protocol.py`` upstream).

Request frames: ``b"lookup"``, num_tokens (u32 BE), hash_len (u16 BE), the hashes concatenated; or ``b"reset"``.
Lookup reply: hit_length (u32 BE) then zero or more 8-byte (group_id u32, num_tokens u32) tail boundaries.
Reset reply: ``b"\\x01"`` ok, ``b"\\x00"`` error.

One extension, invisible to vLLM's own client: a lookup answered with the single byte ``b"\\x00"`` means the
store failed. vLLM's client cannot decode it and logs a failed lookup (a miss, as before); ours counts an error.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from mooncake_lookout.connector.job import HashBlob, LookupResult, TailKeyBoundary
from mooncake_lookout.connector.lookup import Outcome

LOOKUP_MSG = b"lookup"
RESET_MSG = b"reset"
RESP_OK = b"\x01"
RESP_ERR = b"\x00"
MAX_U32 = 0xFFFFFFFF
_U32 = struct.Struct(">I")
_U16 = struct.Struct(">H")
_BOUNDARY = struct.Struct(">II")


class WireError(ValueError):
    """A frame or reply that does not follow the wire format."""


def encode_lookup(num_tokens: int, block_hashes: Sequence[bytes]) -> list[bytes]:
    """The request frames of one lookup; every hash must have the same length."""
    if not 0 <= num_tokens <= MAX_U32:
        raise WireError(f"num_tokens {num_tokens} does not fit in u32")
    hash_len = len(block_hashes[0]) if block_hashes else 0
    if hash_len > 0xFFFF or any(len(h) != hash_len for h in block_hashes):
        raise WireError("block hashes must all have the same length (< 65536 bytes)")
    return [LOOKUP_MSG, _U32.pack(num_tokens), _U16.pack(hash_len), b"".join(block_hashes)]


def decode_lookup(frames: Sequence[bytes]) -> tuple[int, HashBlob]:
    """Parse lookup request frames (after the tag) into (num_tokens, hashes); raises :class:`WireError`."""
    if len(frames) != 3 or len(frames[0]) != 4 or len(frames[1]) != 2:
        raise WireError("lookup wants 3 frames: u32 num_tokens, u16 hash_len, hashes")
    num_tokens = _U32.unpack(frames[0])[0]
    hash_len = _U16.unpack(frames[1])[0]
    blob = bytes(frames[2])
    if hash_len == 0 and blob:
        raise WireError("hash_len 0 with a non-empty hash frame")
    if hash_len and len(blob) % hash_len:
        raise WireError(f"hash frame of {len(blob)} bytes is not a multiple of hash_len {hash_len}")
    return num_tokens, HashBlob(blob, hash_len)


def encode_lookup_reply(result: LookupResult) -> bytes:
    """The reply bytes for a lookup result."""
    out = bytearray(_U32.pack(result.hit_length))
    for b in result.tail_key_boundaries:
        out += _BOUNDARY.pack(b.group_id, b.num_tokens)
    return bytes(out)


def decode_lookup_reply(payload: bytes) -> tuple[Outcome, int, tuple[TailKeyBoundary, ...], str | None]:
    """A reply as (outcome, hit tokens, tail boundaries, error): a hit or miss, the store-error extension, or an
    error for anything malformed (never a miss)."""
    if payload == RESP_ERR:
        return Outcome.ERROR, 0, (), "store error reported by the lookup server"
    n = len(payload)
    if n < 4 or (n - 4) % _BOUNDARY.size:
        return Outcome.ERROR, 0, (), f"malformed lookup reply of {n} bytes"
    hit = _U32.unpack_from(payload, 0)[0]
    tails = tuple(TailKeyBoundary(*_BOUNDARY.unpack_from(payload, off)) for off in range(4, n, _BOUNDARY.size))
    return (Outcome.HIT if hit > 0 else Outcome.MISS), hit, tails, None


__all__ = [
    "LOOKUP_MSG", "RESET_MSG", "RESP_ERR", "RESP_OK", "WireError", "decode_lookup", "decode_lookup_reply",
    "encode_lookup", "encode_lookup_reply",
]

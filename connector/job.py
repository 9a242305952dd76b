"""The values a lookup's answer is made of, shared by both ends: a hit and its tail boundaries, and block hashes.

The server's backends answer with :class:`LookupResult`; the client serves vLLM a
:class:`~mooncake_lookout.connector.lookup.Lookup`, which has the same two fields. :class:`HashBlob` reads the
hashes both wire formats carry (one ``bytes``) as a sequence.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload


@dataclass(frozen=True)
class TailKeyBoundary:
    """A (group, tokens) boundary of the hit; same fields as vLLM's ``TailKeyBoundary``."""

    group_id: int
    num_tokens: int


@dataclass(frozen=True)
class LookupResult:
    """What the scheduler reads; same fields as vLLM's ``MooncakeLookupResult``, so it drops in."""

    hit_length: int
    tail_key_boundaries: tuple[TailKeyBoundary, ...] = ()


MISS = LookupResult(0)


class HashBlob(Sequence[bytes]):
    """Block hashes concatenated in one ``bytes`` (how both wire formats carry them), read as a sequence.

    Slicing and indexing copy only the hashes asked for; :meth:`hex` gives every hash's hex digits at
    the cost of one ``bytes.hex`` (store keys are built from them).
    """

    __slots__ = ("blob", "hash_len")

    def __init__(self, blob: bytes, hash_len: int) -> None:
        self.blob = blob
        self.hash_len = hash_len

    def __len__(self) -> int:
        return len(self.blob) // self.hash_len if self.hash_len else 0

    @overload
    def __getitem__(self, i: int) -> bytes: ...
    @overload
    def __getitem__(self, i: slice) -> list[bytes]: ...

    def __getitem__(self, i: int | slice) -> bytes | list[bytes]:
        n, size = len(self), self.hash_len
        if isinstance(i, slice):
            return [self.blob[k * size:(k + 1) * size] for k in range(*i.indices(n))]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        return self.blob[i * size:(i + 1) * size]

    def __iter__(self) -> Iterator[bytes]:
        size = self.hash_len
        return (self.blob[k * size:(k + 1) * size] for k in range(len(self)))

    def hex(self, count: int | None = None, start: int = 0) -> list[str]:
        """Hex digits of the hashes from ``start`` up to ``count`` (all by default)."""
        n = len(self) if count is None else min(count, len(self))
        start = min(max(start, 0), n)
        step = 2 * self.hash_len
        digits = self.blob[start * self.hash_len:n * self.hash_len].hex()
        return [digits[k:k + step] for k in range(0, (n - start) * step, step)]


__all__ = ["HashBlob", "LookupResult", "MISS", "TailKeyBoundary"]

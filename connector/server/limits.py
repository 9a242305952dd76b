"""How much may wait in the lookup server: per peer and in all, counted in lookups, store keys and bytes.

Why bytes and keys too: one lookup may carry 65,536 hashes (a 16 MiB frame), so a bound on lookups alone
lets one peer park GiBs in the server, which runs inside vLLM's rank-0 worker. :class:`Limits` holds every
bound and the share of a turn; :class:`Waiting` counts what waits (one per peer, one for all); the flags of
``serve`` and of the rigs' server process are made from :class:`Limits`' fields (:func:`add_limit_arguments`,
:func:`limits_from_args`), so a bound is named and explained in one place.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from mooncake_lookout.metrics.catalogue import SERVER_BOUND_MEASURES, SERVER_BOUND_SCOPES

# What a decoded lookup holds beyond its share of the frame's bytes (its Python objects): measured 120-140 bytes
# with CPython 3.12 and msgspec, so a frame's waiting bytes are its length plus this much per lookup.
LOOKUP_OVERHEAD_BYTES = 160
MiB = 1 << 20


def _limit(default: int, help: str, flag: str = "") -> int:
    return field(default=default, metadata={"help": help, "flag": flag})


@dataclass(frozen=True)
class Limits:
    """The server's bounds on what waits in it (``busy`` past one) and each peer's share of a turn.

    A frame that would pass a bound of its peer, or of all peers, is answered ``busy`` (nothing asked of the
    store); a frame that passes a bound on its own could never be taken, and is refused as ``bad_request``
    with the reason. ValueError (naming the setting) for a bound below 1 or a peer's bound above the total.
    """

    max_peer_lookups: int = _limit(4096, "lookups one peer may have waiting in the server (a frame's most "
                                         "lookups, 4x a client's default lookup_max_pending)")
    max_peer_keys: int = _limit(1 << 20, "store keys (blocks the client does not know present) one peer may have "
                                         "waiting: about a second of store calls")
    max_peer_bytes: int = _limit(64 * MiB, "bytes one peer's waiting frames may hold in the server (their length "
                                           f"plus {LOOKUP_OVERHEAD_BYTES} per lookup; a frame is at most 16 MiB)")
    max_total_lookups: int = _limit(16384, "lookups all peers together may have waiting")
    max_total_keys: int = _limit(4 << 20, "store keys all peers together may have waiting")
    max_total_bytes: int = _limit(256 * MiB, "bytes all peers' waiting frames may hold in the server")
    share_keys: int = _limit(256, "store keys of one peer per store call (whole frames, at least one), so a flood "
                                  "is spread over turns and others wait for one share (~0.2-0.3 ms of "
                                  "batch_is_exist here)", flag="--peer-share-keys")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"{f.name} must be at least 1, got {getattr(self, f.name)}")
        for measure in SERVER_BOUND_MEASURES:
            peer, total = self.bound("peer", measure), self.bound("total", measure)
            if peer > total:
                raise ValueError(f"max_peer_{measure} ({peer}) exceeds max_total_{measure} ({total}): one peer "
                                 "could never reach its own bound")

    def bound(self, scope: str, measure: str) -> int:
        """The bound of ``scope`` (``peer``, ``total``) on ``measure`` (``lookups``, ``keys``, ``bytes``)."""
        return int(getattr(self, f"max_{scope}_{measure}"))

    def bounds(self) -> dict[tuple[str, str], int]:
        """Every bound by ``(scope, measure)``: the ``server_bounds`` gauge's series."""
        return {(s, m): self.bound(s, m) for s in SERVER_BOUND_SCOPES for m in SERVER_BOUND_MEASURES}


DEFAULT_LIMITS = Limits()
UNBOUNDED = Limits(**{f.name: 10**15 for f in dataclasses.fields(Limits)})  # no bound at all (a bench's baseline)


class Waiting:
    """Lookups, store keys and bytes waiting in the server (of one peer, or of all)."""

    __slots__ = ("lookups", "keys", "bytes")

    def __init__(self) -> None:
        self.lookups = self.keys = self.bytes = 0

    def add(self, lookups: int, keys: int, nbytes: int, sign: int = 1) -> None:
        """Count a frame in (``sign`` 1) or out (-1)."""
        self.lookups += sign * lookups
        self.keys += sign * keys
        self.bytes += sign * nbytes

    def get(self, measure: str) -> int:
        """``lookups``, ``keys`` or ``bytes``."""
        return int(getattr(self, measure))

    def counts(self) -> tuple[int, int, int]:
        """Lookups, keys and bytes, as one value (compared to know whether anything changed)."""
        return self.lookups, self.keys, self.bytes


def frame_bytes(raw_bytes: int, lookups: int) -> int:
    """What a frame of ``raw_bytes`` carrying ``lookups`` lookups holds while it waits (see LOOKUP_OVERHEAD_BYTES)."""
    return raw_bytes + LOOKUP_OVERHEAD_BYTES * lookups


def _flag(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def add_limit_arguments(group: argparse._ActionsContainer) -> None:
    """One flag per field of :class:`Limits` (``--max-peer-bytes`` ...; ``--peer-share-keys``), default: unset."""
    for f in dataclasses.fields(Limits):
        group.add_argument(_flag(f), type=int, default=None, dest=f.name, metavar="N",
                           help=f"{f.metadata['help']} (default {f.default:,})")


def limits_from_args(args: argparse.Namespace) -> Limits:
    """The :class:`Limits` the flags of :func:`add_limit_arguments` ask for; ValueError naming a bad one."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)
             if getattr(args, f.name, None) is not None}
    return Limits(**given)


def flag_of(name: str) -> str:
    """The command-line flag of the :class:`Limits` field ``name``."""
    return _flag(next(f for f in dataclasses.fields(Limits) if f.name == name))


__all__ = ["DEFAULT_LIMITS", "LOOKUP_OVERHEAD_BYTES", "Limits", "UNBOUNDED", "Waiting", "add_limit_arguments",
           "flag_of", "frame_bytes", "limits_from_args"]

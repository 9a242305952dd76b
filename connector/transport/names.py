"""The transports by name: the only place in the code base that spells them.

A name is what ``lookup_transport`` takes, what a transport reports in ``LookupRecord.transport`` and
the ``transport`` label of metrics; the lookup server uses the same two names for the wire formats it
speaks, since each transport has one.
"""

from __future__ import annotations

UPSTREAM = "upstream"  # vLLM 0.33's REQ/REP lookup channel and wire format, one lookup in flight
PIPELINED = "pipelined"  # ours: DEALER/ROUTER, many lookups in flight, matched by id
TRANSPORTS: tuple[str, ...] = (UPSTREAM, PIPELINED)

__all__ = ["PIPELINED", "TRANSPORTS", "UPSTREAM"]

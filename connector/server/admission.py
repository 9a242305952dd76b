"""Which frames the lookup server takes in, from whom, and in what order it answers them.

Why: one loop answers every client of a lookup server. Without bounds, a peer that floods it (a scheduler
with a huge ``lookup_max_pending``, or anyone who reaches a TCP port) fills every store call with its own
lookups and the other peers wait behind them; and on plain TCP anyone could wipe the store. Here:

* **who**: a peer is its ZMQ routing id; on a CURVE socket, its authenticated public key (the ``User-Id``
  the ZAP handler stamps on its frames), so reconnecting does not make a new peer;
* **a bound per peer**: at most ``max_peer_lookups`` lookups of one peer wait in the server; a frame that
  would pass it is answered ``busy`` at once (nothing asked of the store), and once a peer is at its bound
  its frames cost no decoding beyond the header;
* **a share of each turn**: one turn takes at most ``share_keys`` store keys of each peer (whole frames, at
  least one), so a flood is answered over several turns and whoever comes next waits for one share at most,
  not for the flood's whole backlog (a peer alone too: the next one may arrive meanwhile). Peers whose whole
  wait fits in the turn are answered first, in a store call of their own, before the shares of peers with a
  backlog: a light peer does not wait for a flood's share either;
* **reset**: taken only where the peer may wipe the store (``resets_allowed``: IPC, or every peer
  authenticated by CURVE); elsewhere refused with ``bad_request``. An accepted reset is answered once every
  lookup read before it is, and no lookup read after it is answered before it (the fence).

Everything here runs on the server's loop thread; no lock, no wake-up.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence
from typing import Any

import zmq

from mooncake_lookout.connector.logs import RateLimit
from mooncake_lookout.connector.server import intake
from mooncake_lookout.connector.wire import pipelined as protocol
from mooncake_lookout.connector.wire import upstream as upstream_wire
from mooncake_lookout.metrics.catalogue import SERVER_REFUSED as REFUSED

logger = logging.getLogger(__name__)

DEFAULT_MAX_PEER_LOOKUPS = 4096  # a frame's most lookups (MAX_QUERIES), 4x a client's default lookup_max_pending
DEFAULT_SHARE_KEYS = 256  # store keys of one peer per batch (~0.2-0.3 ms of batch_is_exist here): what the next waits
RESET_REFUSED = ("reset refused: this lookup server listens on plain TCP; only a CURVE-authenticated peer or an "
                 "IPC client may wipe the store")
_Queued = tuple[int, intake.Frame | intake.UpstreamLookup]  # (arrival number, lookups)


class Admission:
    """Takes in each message of the server's socket; queues its lookups per peer; hands out fair batches.

    ``curve``: the socket is a CURVE server, its messages come as ``zmq.Frame`` s (``copy=False``) carrying
    the client's key. ``resets_allowed``: a peer of this socket may wipe the store.
    """

    def __init__(self, *, max_peer_lookups: int = DEFAULT_MAX_PEER_LOOKUPS, share_keys: int = DEFAULT_SHARE_KEYS,
                 resets_allowed: bool = True, curve: bool = False) -> None:
        if max_peer_lookups < 1 or share_keys < 1:
            raise ValueError(f"max_peer_lookups ({max_peer_lookups}) and share_keys ({share_keys}) must be >= 1")
        self.max_peer_lookups = max_peer_lookups
        self.share_keys = share_keys
        self.resets_allowed = resets_allowed
        self.curve = curve
        self.depth = 0  # lookups waiting, every peer
        self._seq = 0
        self._queues: dict[bytes, collections.deque[_Queued]] = {}
        self._waiting: dict[bytes, int] = {}  # lookups waiting, per peer
        self._resets: collections.deque[tuple[int, intake.Reset]] = collections.deque()
        self._log_limit = RateLimit(10.0)

    def __bool__(self) -> bool:
        """True while something waits to be answered."""
        return bool(self._queues or self._resets)

    # -- taking in ---------------------------------------------------------------------------------------------
    def take_in(self, message: Sequence[Any]) -> intake.Refusal | None:
        """Queue one message's work; or the reply that turns it away (malformed, busy, a refused reset)."""
        if self.curve:
            frames: Sequence[bytes] = [f.bytes for f in message]
            try:
                peer = message[0].get("User-Id").encode()
            except zmq.ZMQError:  # no ZAP verdict on the connection: its routing id, as without CURVE
                peer = frames[0]
        else:
            frames = message
            peer = frames[0]
        if self._waiting.get(peer, 0) >= self.max_peer_lookups:
            refusal = self._busy_at_bound(frames)
            if refusal is not None:
                return refusal
        item = intake.parse(frames)
        if isinstance(item, intake.Refusal):
            return item
        self._seq += 1
        if isinstance(item, intake.Reset):
            if not self.resets_allowed:
                return self._refuse_reset(item)
            self._resets.append((self._seq, item))
            return None
        n = intake.lookups_in(item)
        waiting = self._waiting.get(peer, 0) + n
        if waiting > self.max_peer_lookups:
            return self._busy(item.envelope, item.frame_id if isinstance(item, intake.Frame) else None, n,
                              waiting - n)
        self._waiting[peer] = waiting
        self.depth += n
        queue = self._queues.get(peer)
        if queue is None:
            queue = self._queues[peer] = collections.deque()
        queue.append((self._seq, item))
        return None

    def _busy_at_bound(self, frames: Sequence[bytes]) -> intake.Refusal | None:
        """A lookup frame from a peer already at its bound: ``busy`` from the header alone (None: not a lookup)."""
        envelope, payload = intake.split(frames)
        if payload and payload[0] == upstream_wire.LOOKUP_MSG:
            return self._busy(envelope, None, 1, self.max_peer_lookups)
        if len(payload) == 2:
            frame_id = protocol.frame_id_of(payload[0])
            if frame_id is not None:
                return self._busy(envelope, frame_id, intake.query_count(payload[1]), self.max_peer_lookups)
        return None

    def _busy(self, envelope: list[bytes], frame_id: int | None, lookups: int, waiting: int) -> intake.Refusal:
        if frame_id is None:  # vLLM's wire format: its error byte
            return intake.Refusal(envelope, upstream_wire.RESP_ERR, protocol.BUSY, lookups)
        reason = (f"busy: {waiting} lookups of this peer already wait at the lookup server, its bound is "
                  f"{self.max_peer_lookups}")
        return intake.Refusal(envelope, protocol.encode_status(frame_id, protocol.BUSY, reason), protocol.BUSY,
                              lookups)

    def _refuse_reset(self, item: intake.Reset) -> intake.Refusal:
        if self._log_limit.allow(time.monotonic()):
            logger.warning("%s (a reset from an unauthenticated peer)", RESET_REFUSED)
        if item.frame_id is None:
            return intake.Refusal(item.envelope, upstream_wire.RESP_ERR, REFUSED)
        return intake.Refusal(item.envelope, protocol.encode_status(item.frame_id, protocol.BAD_REQUEST,
                                                                    RESET_REFUSED), REFUSED)

    # -- handing out -------------------------------------------------------------------------------------------
    def take(self) -> list[list[intake.Work]]:
        """This turn's batches, each answered with one store call, in order: the lookups of peers whose whole wait
        fits in the turn, then the shares of peers with a backlog (each in arrival order); or one reset alone."""
        fence = self._resets[0][0] if self._resets else None
        if fence is not None and all(queue[0][0] > fence for queue in self._queues.values()):
            return [[self._resets.popleft()[1]]]
        share, peers = self.share_keys, len(self._queues)
        light: list[_Queued] = []
        heavy: list[_Queued] = []
        for peer in list(self._queues):
            queue = self._queues[peer]
            taken: list[_Queued] = []
            keys = lookups = 0
            while queue and (fence is None or queue[0][0] < fence) and keys < share:
                entry = queue.popleft()
                taken.append(entry)
                lookups += intake.lookups_in(entry[1])
                keys += intake.keys_in(entry[1])
            self.depth -= lookups
            if queue:
                self._waiting[peer] -= lookups
                heavy += taken
            else:
                del self._queues[peer], self._waiting[peer]
                light += taken
        if peers == 1:
            return [[item for _, item in light or heavy]]
        return [[item for _, item in sorted(batch, key=lambda entry: entry[0])] for batch in (light, heavy) if batch]

    def drain(self) -> list[intake.Work]:
        """Everything still waiting, in arrival order (the server is closing: each gets an error reply)."""
        entries: list[tuple[int, intake.Work]] = [e for queue in self._queues.values() for e in queue]
        entries += self._resets
        self._queues.clear()
        self._waiting.clear()
        self._resets.clear()
        self.depth = 0
        return [item for _, item in sorted(entries, key=lambda entry: entry[0])]


__all__ = ["Admission", "DEFAULT_MAX_PEER_LOOKUPS", "DEFAULT_SHARE_KEYS", "RESET_REFUSED"]

"""Which frames the lookup server takes in, from whom, and in what order it answers them.

Why: one loop answers every client of a lookup server. Without bounds, a peer that floods it (a scheduler
with a huge ``lookup_max_pending``, or anyone who reaches a TCP port) fills every store call with its own
lookups and the other peers wait behind them; and on plain TCP anyone could wipe the store. Here:

* **who**: a peer is its ZMQ routing id; on a CURVE socket, its authenticated public key (the ``User-Id``
  the ZAP handler stamps on its frames), so reconnecting does not make a new peer;
* **bounds on what waits** (:class:`~.limits.Limits`): lookups, store keys and bytes, of each peer and of all
  peers together (the server runs inside vLLM's worker: one lookup may carry 16 MiB of hashes). A frame that
  would pass one is answered ``busy`` at once (nothing asked of the store); once a peer (or all) is at a bound,
  or a message's length alone would pass the bytes bound, it costs no decoding beyond the header. A frame that
  passes a bound on its own could never be taken: it is refused as ``bad_request``, naming the bound;
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
from typing import Any, NamedTuple

import zmq

from mooncake_lookout.connector.logs import RateLimit
from mooncake_lookout.connector.server import intake
from mooncake_lookout.connector.server.limits import DEFAULT_LIMITS, Limits, Waiting, frame_bytes
from mooncake_lookout.connector.server.pacing import Pacer
from mooncake_lookout.connector.wire import pipelined as protocol
from mooncake_lookout.connector.wire import upstream as upstream_wire
from mooncake_lookout.metrics.catalogue import SERVER_BOUND_MEASURES
from mooncake_lookout.metrics.catalogue import SERVER_REFUSED as REFUSED

logger = logging.getLogger(__name__)

DEFAULT_MAX_PEER_LOOKUPS = DEFAULT_LIMITS.max_peer_lookups
DEFAULT_SHARE_KEYS = DEFAULT_LIMITS.share_keys
RESET_REFUSED = ("reset refused: this lookup server listens on plain TCP; only a CURVE-authenticated peer or an "
                 "IPC client may wipe the store")
_Queued = tuple[int, intake.Frame | intake.UpstreamLookup, int, int]  # (arrival number, lookups, keys, bytes)
_NOTHING = Waiting()  # what a peer with nothing waiting has (never changed)


class Over(NamedTuple):
    """A bound a frame would pass: whose (``peer``, ``total``), what it counts, what waits, what the frame adds."""

    scope: str
    measure: str
    waiting: int
    adding: int
    bound: int

    @property
    def never(self) -> bool:
        """The frame passes the bound on its own: it could never be taken."""
        return self.adding > self.bound

    def reason(self) -> str:
        name = f"max_{self.scope}_{self.measure}"
        if self.never:
            return (f"a frame of {self.adding} {self.measure} can never fit this lookup server's bound of "
                    f"{self.bound} {self.measure} ({name}): send smaller frames, or raise the bound")
        whose = "this peer" if self.scope == "peer" else "all peers"
        return (f"busy: {self.waiting} {self.measure} of {whose} already wait at the lookup server, its bound is "
                f"{self.bound} ({name}); this frame brings {self.adding}")


class Admission:
    """Takes in each message of the server's socket; queues its lookups per peer; hands out fair batches.

    ``limits``: the bounds on what waits (per peer and in all) and the share of a turn. ``curve``: the socket
    is a CURVE server, its messages come as ``zmq.Frame`` s (``copy=False``) carrying the client's key.
    ``resets_allowed``: a peer of this socket may wipe the store.
    """

    def __init__(self, *, limits: Limits = DEFAULT_LIMITS, resets_allowed: bool = True, curve: bool = False) -> None:
        self.limits = limits
        self._peer_bounds = tuple(limits.bound("peer", m) for m in SERVER_BOUND_MEASURES)  # lookups, keys, bytes
        self._total_bounds = tuple(limits.bound("total", m) for m in SERVER_BOUND_MEASURES)
        self.resets_allowed = resets_allowed
        self.curve = curve
        self.total = Waiting()  # every peer's
        self._seq = 0
        self._queues: dict[bytes, collections.deque[_Queued]] = {}
        self._waiting: dict[bytes, Waiting] = {}  # per peer with something queued
        self._resets: collections.deque[tuple[int, intake.Reset]] = collections.deque()
        self._log_limit = RateLimit(10.0)
        self.pacer = Pacer()  # held busy replies of the peers past a bound, and when their turn is due

    def __bool__(self) -> bool:
        """True while something waits to be answered."""
        return bool(self._queues or self._resets or self.pacer)

    def ready(self, now: float) -> bool:
        """Something may be answered now: a reset, a peer's lookups, or the flooding peers' due turn."""
        pacer = self.pacer
        return (bool(self._resets) or any(not pacer.flooding(peer) for peer in self._queues)
                or (bool(pacer) and pacer.due(now)))

    def wait_s(self, now: float) -> float | None:
        """Seconds until something may be answered (0: now); None when nothing waits."""
        if self.ready(now):
            return 0.0
        return self.pacer.wait_s(now) if self.pacer else None

    def flood_turn(self, now: float) -> bool:
        """This turn serves the flooding peers (their held replies and shares): due, or a reset waits for them."""
        return bool(self.pacer) and (bool(self._resets) or self.pacer.due(now))

    @property
    def depth(self) -> int:
        """Lookups waiting, every peer."""
        return self.total.lookups

    # -- taking in ---------------------------------------------------------------------------------------------
    def take_in(self, message: Sequence[Any], *, alone: bool = False
                ) -> intake.Refusal | intake.Frame | intake.UpstreamLookup | None:
        """Queue one message's work; or the reply that turns it away (malformed, busy, too big, a refused reset).

        ``alone``: the loop read no other message behind this one. If nothing waits either (nothing queued, fenced
        or held), its lookups, within the bounds, are returned instead of queued: the turn's only batch, which the
        loop answers at once, without the queue's bookkeeping.
        """
        if self.curve:
            frames: Sequence[bytes] = [f.bytes for f in message]
            try:
                peer = message[0].get("User-Id").encode()
            except zmq.ZMQError:  # no ZAP verdict on the connection: its routing id, as without CURVE
                peer = frames[0]
        else:
            frames = message
            peer = frames[0]
        raw = sum(map(len, frames))
        waiting = self._waiting.get(peer, _NOTHING)
        full = self._full(waiting, raw)
        if full is not None:
            refusal = self._refuse_unread(frames, full)
            if refusal is not None:
                return self._paced(peer, refusal, full)
        item = intake.parse(frames)
        if isinstance(item, intake.Refusal):
            return item
        self._seq += 1
        if isinstance(item, intake.Reset):
            if not self.resets_allowed:
                return self._refuse_reset(item)
            self._resets.append((self._seq, item))
            return None
        n, keys = intake.lookups_in(item), intake.keys_in(item)
        nbytes = frame_bytes(raw, n)
        over = self._over(waiting, n, keys, nbytes)
        if over is not None:
            frame_id = item.frame_id if isinstance(item, intake.Frame) else None
            return self._paced(peer, self._turn_away(item.envelope, frame_id, n, over), over)
        if alone and not self:  # nothing before it, nothing after it read: it need not wait
            return item
        if waiting is _NOTHING:
            waiting = self._waiting[peer] = Waiting()
            self._queues[peer] = collections.deque()
        waiting.add(n, keys, nbytes)
        self.total.add(n, keys, nbytes)
        self._queues[peer].append((self._seq, item, keys, nbytes))
        return None

    def _full(self, waiting: Waiting, raw: int) -> Over | None:
        """Before decoding: a bound the peer (or all peers) is at, or that this message's bytes alone would pass."""
        (lookups, keys, nbytes), total = self._peer_bounds, self.total
        all_lookups, all_keys, all_bytes = self._total_bounds
        if (waiting.lookups < lookups and waiting.keys < keys and waiting.bytes + raw <= nbytes
                and total.lookups < all_lookups and total.keys < all_keys and total.bytes + raw <= all_bytes):
            return None  # the common case, in plain comparisons: this runs for every message
        for scope, w in (("peer", waiting), ("total", total)):
            bound = self.limits.bound
            if w.lookups >= bound(scope, "lookups"):
                return Over(scope, "lookups", w.lookups, 1, bound(scope, "lookups"))
            if w.keys >= bound(scope, "keys"):
                return Over(scope, "keys", w.keys, 1, bound(scope, "keys"))
            if w.bytes + raw > bound(scope, "bytes"):
                return Over(scope, "bytes", w.bytes, raw, bound(scope, "bytes"))
        return None

    def _over(self, waiting: Waiting, lookups: int, keys: int, nbytes: int) -> Over | None:
        """A bound this frame would pass (one it passes on its own first), or None: it may wait."""
        peer, total = self._peer_bounds, self._total_bounds
        everyone = self.total
        if (waiting.lookups + lookups <= peer[0] and waiting.keys + keys <= peer[1]
                and waiting.bytes + nbytes <= peer[2] and everyone.lookups + lookups <= total[0]
                and everyone.keys + keys <= total[1] and everyone.bytes + nbytes <= total[2]):
            return None  # the common case, in plain comparisons
        adding = {"lookups": lookups, "keys": keys, "bytes": nbytes}
        found: Over | None = None
        for scope, w in (("peer", waiting), ("total", self.total)):
            for measure, value in adding.items():
                bound = self.limits.bound(scope, measure)
                if value > bound:
                    return Over(scope, measure, w.get(measure), value, bound)
                if found is None and w.get(measure) + value > bound:
                    found = Over(scope, measure, w.get(measure), value, bound)
        return found

    def _refuse_unread(self, frames: Sequence[bytes], over: Over) -> intake.Refusal | None:
        """A lookup message past a bound, refused from its header alone (None: not a lookup, parse it)."""
        envelope, payload = intake.split(frames)
        if payload and payload[0] == upstream_wire.LOOKUP_MSG:
            return self._turn_away(envelope, None, 1, over)
        if len(payload) == 2:
            frame_id = protocol.frame_id_of(payload[0])
            if frame_id is not None:
                lookups = intake.query_count(payload[1])  # from the body's array header, not its contents
                if over.measure == "lookups":
                    over = over._replace(adding=lookups)
                return self._turn_away(envelope, frame_id, lookups, over)
        return None

    def _turn_away(self, envelope: list[bytes], frame_id: int | None, lookups: int, over: Over) -> intake.Refusal:
        """``busy`` (it may fit later), or ``bad_request`` for a frame past a bound on its own (it never will)."""
        status, count = (protocol.BAD_REQUEST, 1) if over.never else (protocol.BUSY, lookups)
        if over.never and self._log_limit.allow(time.monotonic()):
            logger.warning("refusing a frame: %s", over.reason())
        if frame_id is None:  # vLLM's wire format: its error byte
            return intake.Refusal(envelope, upstream_wire.RESP_ERR, status, count)
        return intake.Refusal(envelope, protocol.encode_status(frame_id, status, over.reason()), status, count)

    def _paced(self, peer: bytes, refusal: intake.Refusal, over: Over) -> intake.Refusal:
        """A ``busy`` reply to a peer past a bound of its own is held for its next turn, if the pacer has room."""
        refusal.later = refusal.status == protocol.BUSY and over.scope == "peer" and self.pacer.hold(peer, refusal)
        return refusal

    def _refuse_reset(self, item: intake.Reset) -> intake.Refusal:
        if self._log_limit.allow(time.monotonic()):
            logger.warning("%s (a reset from an unauthenticated peer)", RESET_REFUSED)
        if item.frame_id is None:
            return intake.Refusal(item.envelope, upstream_wire.RESP_ERR, REFUSED)
        return intake.Refusal(item.envelope, protocol.encode_status(item.frame_id, protocol.BAD_REQUEST,
                                                                    RESET_REFUSED), REFUSED)

    # -- handing out -------------------------------------------------------------------------------------------
    def take(self, flood: bool = True) -> list[list[intake.Work]]:
        """This turn's batches, each answered with one store call, in order: the lookups of peers whose whole wait
        fits in the turn, then the shares of peers with a backlog (each in arrival order); or one reset alone.
        Without ``flood`` (:meth:`flood_turn`), the flooding peers' lookups wait for their turn."""
        fence = self._resets[0][0] if self._resets else None
        if fence is not None and all(queue[0][0] > fence for queue in self._queues.values()):
            return [[self._resets.popleft()[1]]]
        share, peers = self.limits.share_keys, len(self._queues)
        light: list[_Queued] = []
        heavy: list[_Queued] = []
        for peer in list(self._queues):
            if not flood and self.pacer.flooding(peer):
                continue
            queue = self._queues[peer]
            taken: list[_Queued] = []
            keys = lookups = nbytes = 0
            while queue and (fence is None or queue[0][0] < fence) and keys < share:
                entry = queue.popleft()
                taken.append(entry)
                lookups += intake.lookups_in(entry[1])
                keys += entry[2]
                nbytes += entry[3]
            self.total.add(lookups, keys, nbytes, -1)
            if queue:
                self._waiting[peer].add(lookups, keys, nbytes, -1)
                heavy += taken
            else:
                del self._queues[peer], self._waiting[peer]
                light += taken
        if peers == 1:
            return [[entry[1] for entry in light or heavy]]
        return [[entry[1] for entry in sorted(batch, key=lambda entry: entry[0])] for batch in (light, heavy) if batch]

    def drain(self) -> list[intake.Work]:
        """Everything still waiting, in arrival order (the server is closing: each gets an error reply)."""
        entries: list[tuple[int, intake.Work]] = [(e[0], e[1]) for queue in self._queues.values() for e in queue]
        entries += self._resets
        self._queues.clear()
        self._waiting.clear()
        self._resets.clear()
        self.total = Waiting()
        return [item for _, item in sorted(entries, key=lambda entry: entry[0])]


__all__ = ["Admission", "DEFAULT_MAX_PEER_LOOKUPS", "DEFAULT_SHARE_KEYS", "Over", "RESET_REFUSED"]

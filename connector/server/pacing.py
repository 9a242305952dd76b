"""Pacing for peers past a bound: their ``busy`` replies are held back and their turns spaced, so a flood cannot keep
the lookup server busy all the time.

Why: a busy reply is cheap, but each one invites the flooder's next frame, so a peer past its bound ping-pongs
with the server as fast as both can run; and a server that is never idle is, on shared cores, the last process
the kernel runs when another peer's lookup arrives (it has used its share), and its store calls for the flood
are what that lookup waits behind. Here a peer past a bound of its own (it was answered ``busy``) is *flooding*:

* its ``busy`` replies wait (at most :data:`PEER_HELD` per peer, :data:`TOTAL_HELD` in all: past those they
  go at once, as before), and at most :data:`RELEASED_PER_TURN` of them are sent at each of its turns;
* its turns (its share of the store calls, and those replies) take at most :data:`FLOOD_SHARE` of the server's
  time: after a turn of ``d`` seconds the next waits ``d * (1 / FLOOD_SHARE - 1)`` (at least :data:`MIN_GAP_S`).
  Its frames that arrive meanwhile are read (so the server sees everyone's) and turned away later: a flooder
  that waits for its replies stops sending, and the server sleeps in its poll until another peer's lookup
  wakes it, or the flood's next turn is due.

Other peers are not paced: a light peer is answered in the first turn after its frame arrives, and a peer turned
away only because all peers together are at a bound is answered ``busy`` at once (an overloaded server does not
slow itself down further). Runs on the server's loop thread, as :mod:`.admission` does.
"""

from __future__ import annotations

import collections

from mooncake_lookout.connector.server import intake

PEER_HELD = 4096  # busy replies held for one peer (each ~0.3 KB: its envelope and encoded reply)
TOTAL_HELD = 16384  # busy replies held for all peers
RELEASED_PER_TURN = 4  # busy replies of one flooding peer sent at each of its turns
FLOOD_SHARE = 0.25  # of the server's time, at most, for the flooding peers' turns
MIN_GAP_S = 0.001  # the least time between two turns of the flooding peers


class Pacer:
    """Held ``busy`` replies per flooding peer, and when the flooding peers' next turn is due."""

    def __init__(self) -> None:
        self._held: dict[bytes, collections.deque[intake.Refusal]] = {}
        self._count = 0
        self._due = 0.0  # perf_counter seconds

    def hold(self, peer: bytes, refusal: intake.Refusal) -> bool:
        """Keep ``refusal`` (a ``busy`` reply to ``peer``) for its peer's next turn; False if it must go at once."""
        held = self._held.get(peer)
        if self._count >= TOTAL_HELD or (held is not None and len(held) >= PEER_HELD):
            return False
        if held is None:
            held = self._held[peer] = collections.deque()
        held.append(refusal)
        self._count += 1
        return True

    def flooding(self, peer: bytes) -> bool:
        """``peer`` was turned away and some of its ``busy`` replies still wait: its turns are paced."""
        return peer in self._held

    def __bool__(self) -> bool:
        """True while some ``busy`` reply waits."""
        return bool(self._held)

    def due(self, now: float) -> bool:
        """The flooding peers' turn may come now."""
        return now >= self._due

    def wait_s(self, now: float) -> float:
        """Seconds until the flooding peers' next turn."""
        return max(0.0, self._due - now)

    def release(self) -> list[intake.Refusal]:
        """The oldest held replies of each flooding peer (up to :data:`RELEASED_PER_TURN`), to send this turn."""
        out: list[intake.Refusal] = []
        for peer in list(self._held):
            held = self._held[peer]
            for _ in range(min(RELEASED_PER_TURN, len(held))):
                out.append(held.popleft())
            if not held:
                del self._held[peer]
        self._count -= len(out)
        return out

    def turn_took(self, seconds: float, now: float) -> None:
        """The flooding peers' turn ended at ``now`` after ``seconds``: when their next may come."""
        self._due = now + max(seconds * (1 / FLOOD_SHARE - 1), MIN_GAP_S)

    def drain(self) -> list[intake.Refusal]:
        """Every held reply (the server is closing: they are sent as they are)."""
        out = [refusal for held in self._held.values() for refusal in held]
        self._held.clear()
        self._count = 0
        return out


__all__ = ["FLOOD_SHARE", "MIN_GAP_S", "PEER_HELD", "Pacer", "RELEASED_PER_TURN", "TOTAL_HELD"]

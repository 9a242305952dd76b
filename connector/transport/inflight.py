"""What the ``pipelined`` transports know on the caller's thread: frames and lookups in flight, and their answers.

Both ``pipelined`` transports (the socket on the caller's thread, or on a thread of its own) keep this book on
the caller's thread: lookup ids, the frames that carried them (a refused frame fails its lookups, and an
answer's epoch counts from when its frame was sent), the deadlines, and resets awaiting their reply. A reply is
applied here, so each lookup has one writer. Nothing here touches a socket.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Callable, Sequence

from mooncake_lookout.connector.lookup import ERROR, TIMEOUT, Lookup
from mooncake_lookout.connector.wire import pipelined as protocol

# What applying a reply reports back to its transport: answers, epochs, late replies, finished lookups.
Finish = Callable[..., None]


class InFlight:
    """Lookups and frames sent and not yet answered; ``timeout_s`` bounds how long a frame is remembered."""

    def __init__(self, timeout_s: float, *, finish: Finish, epoch: Callable[[int, float, float], None],
                 late: Callable[[], None]) -> None:
        self.timeout_s = timeout_s
        self._finish = finish
        self._epoch = epoch
        self._late = late
        self.ids = itertools.count(1)
        self.lookups: dict[int, Lookup] = {}
        self.forgotten: dict[int, float] = {}  # lookup id -> deadline, of lookups forgotten while in flight
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, lookup id)
        # frame id -> (the lookups it carried, when it was sent, when to forget it)
        self.frames: collections.OrderedDict[int, tuple[list[int], float, float]] = collections.OrderedDict()
        self.resets: dict[int, bool | None] = {}
        self.reset_sent: dict[int, float] = {}
        self.reset_refusals: dict[int, str] = {}  # why a reset was not done, by frame id
        self.last_reply = 0.0  # when a reply was last taken in (or the book last had nothing in flight)

    def __len__(self) -> int:
        return len(self.lookups)

    def sent(self, frame_id: int, lookups: Sequence[Lookup], now: float) -> None:
        """``lookups`` left in frame ``frame_id`` at ``now``: their deadlines start."""
        if not self.lookups:
            self.last_reply = now  # silence is only counted while something waits
        inflight, deadlines = self.lookups, self._deadlines
        ids = []
        for lk in lookups:
            lk.sent(now)
            lookup_id = lk.lookup_id
            inflight[lookup_id] = lk
            heapq.heappush(deadlines, (lk.deadline or now, lookup_id))
            ids.append(lookup_id)
        self.frames[frame_id] = (ids, now, now + 2 * self.timeout_s)

    def forget(self, lk: Lookup) -> None:
        """Nobody waits for ``lk``: a reply for it before its deadline is dropped quietly, one after it is late."""
        if self.lookups.pop(lk.lookup_id, None) is not None and lk.deadline is not None:
            self.forgotten[lk.lookup_id] = lk.deadline

    def apply(self, reply: protocol.Reply, answers: list[protocol.Answered] | None, now: float) -> None:
        """Take in one reply (``answers``: its results as :func:`~.wire.pipelined.answers_of` gives them, or
        None to read them here)."""
        self.last_reply = now
        ok = reply.status == protocol.OK
        frame_id = reply.frame_id
        if frame_id in self.resets:
            self.resets[frame_id] = ok
            if ok:
                self._epoch(reply.epoch, self.reset_sent.get(frame_id, now), now)
            else:
                self.reset_refusals[frame_id] = f"{reply.status}: {reply.reason}"
            return
        carried = self.frames.pop(frame_id, None)
        if carried is None and not reply.results:
            self._late()  # a reply to a frame nobody waits for (a reset given up on, say)
            return
        if not ok:
            if carried is None:
                self._late()
            else:
                error, refused = protocol.frame_error(reply)
                self.fail(carried[0], now, error, refused=refused)
            return
        if carried is not None:
            # Only an answer names the store's epoch: a refusal (busy, bad_request) or a failure says nothing of
            # the store's state. Before its lookups finish: they were answered in this epoch.
            self._epoch(reply.epoch, carried[1], now)
        inflight, finish = self.lookups, self._finish
        forgotten = self.forgotten
        for lookup_id, outcome, hit, tails, why in (answers if answers is not None else protocol.answers_of(reply)):
            lk = inflight.pop(lookup_id, None)
            if lk is None:
                if forgotten.pop(lookup_id, 0.0) <= now:  # unknown, or forgotten and past its deadline
                    self._late()
            else:
                finish(lk, outcome, now, hit, tails, why)

    def fail_frame(self, frame_id: int, now: float, error: str) -> None:
        """A reply to ``frame_id`` could not be read: its lookups fail (a frame id of 0: nobody's, a late reply)."""
        carried = self.frames.pop(frame_id, None) if frame_id else None
        if carried is None:
            self._late()
        else:
            self.fail(carried[0], now, error)

    def fail(self, lookup_ids: list[int], now: float, error: str, *, refused: bool = False) -> None:
        """The lookups ``lookup_ids`` end with ``error`` (``refused``: the server turned them away)."""
        inflight, finish = self.lookups, self._finish
        for lookup_id in lookup_ids:
            lk = inflight.pop(lookup_id, None)
            if lk is not None:
                finish(lk, ERROR, now, error=error, refused=refused)

    def fail_all(self, now: float, error: str) -> None:
        """Every lookup in flight ends with ``error`` (the transport is closing)."""
        self.fail(list(self.lookups), now, error)

    def expire(self, now: float) -> float:
        """Time out every lookup past its deadline. Returns how long the longest waiter among those that heard
        nothing since they were sent has waited (0.0 when none): the server may be dead or wedged, and the caller
        rebuilds the connection after a while. A blocking call waits from its own start (its bound, ``latest``,
        is its deadline counted from then), a little before its lookup is sent."""
        deadlines = self._deadlines
        silent = 0.0
        inflight, finish = self.lookups, self._finish
        while deadlines and deadlines[0][0] <= now:
            _, lookup_id = heapq.heappop(deadlines)
            lk = inflight.pop(lookup_id, None)
            if lk is None:
                self.forgotten.pop(lookup_id, None)  # a reply from now on is late
                continue  # answered or forgotten already
            if self.last_reply <= (lk.t_start or now):
                began = lk.t_start or now
                if lk.latest is not None:
                    began = min(began, lk.latest - lk.timeout_s)
                silent = max(silent, now - began)
            finish(lk, TIMEOUT, now, error="no reply before the deadline")
        if not inflight and not self.forgotten:
            deadlines.clear()
        frames = self.frames
        while frames:
            frame_id, (_, _, forget_at) = next(iter(frames.items()))
            if forget_at > now:
                break
            del frames[frame_id]
        return silent

    def next_deadline(self) -> float | None:
        """The earliest deadline of a lookup still in flight (stale entries included: a bound, not a promise)."""
        return self._deadlines[0][0] if self._deadlines else None


__all__ = ["Finish", "InFlight"]

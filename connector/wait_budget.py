"""How long the scheduler may wait for lookup answers in one step (``lookup_wait_us``), fixed or ``auto``.

Why a budget per step: in async mode a lookup sent at the start of a step is often answered a few hundred
microseconds later; waiting that long uses the answer in the step it was asked for, instead of deferring
the request a whole step. A budget per *step* (not per call) keeps a step with many new requests from
waiting many times over.

``auto`` follows the measured round trip: the budget is the p90 of recent waits plus a margin, at most
``lookup_wait_auto_share`` of the measured step interval (the cap). A wait that ran out counts in that p90 at the
budget it had (it needed at least that), so while more than one wait in ten runs out the budget climbs by the
margin at each refresh, up to the cap: an estimate from answered waits alone never sees the answers past the
budget, and stayed low while most waits ran out. Auto stops waiting (the budget is 0, the scheduler defers at
once) only when most waits given the whole cap (a step's first, at the cap) run out: the store is far, or slow
right now. A p90 past the cap is no reason to stop: most answers still land within it. (Auto stopped there, and
with the low estimate above went without a wait in 18-54% of the bench's scenario-c steps; alternating the two
rules in one process, a request deferred 0.08-0.34 steps under the old one and 0.05-0.19 under this.) A wait is
timed from when it began (or the send, if later), not from the send: the scheduler's own work between the send
and the call that waits already covers part of the round trip, and timing from the send made auto give up on
waits it could afford. While the budget is 0, one step in :data:`PROBE_EVERY` still waits up to the cap, to
notice when the store is close again; a probe answered within the cap starts the history afresh from it, so
waits measured while the store was slow (a cold start, a past stall) do not keep auto from waiting once it is
close again (they would: while auto does not wait, only probes add samples). Auto gives up the same way when
no answer has ever come within the cap (no round trip measured, most of its first :data:`LEARN_WAITS` waits
ran out). Used only from the scheduler's thread.
"""

from __future__ import annotations

SAMPLES = 64  # recent waits remembered: each one's round trip, or the budget it ran out of
WAITS = 32  # recent waits given the whole cap whose outcome (answered in time or not) is remembered
MAX_RAN_OUT = 0.5  # past this share of those running out, auto stops waiting (and probes)
PROBE_EVERY = 32  # steps between probes while auto has given up waiting
MARGIN_S = 50e-6  # added to the p90: wake-up and decode after the reply lands
FIRST_STEP_S = 0.010  # step interval assumed until two steps have been seen
LEARN_WAITS = 8  # waits that may run out before auto, having caught no answer at all, stops waiting


class WaitBudget:
    """The per-step wait budget; ``fixed_s`` is ``lookup_wait_us`` in seconds, or ``None`` for ``auto``."""

    def __init__(self, fixed_s: float | None, *, share: float = 0.25) -> None:
        self.fixed_s = fixed_s
        self.share = share
        self.step_interval_s = FIRST_STEP_S
        self.in_force_s = fixed_s if fixed_s is not None else 0.0
        self._left_s = self.in_force_s
        self._rtts: list[float] = []
        self._rtt_next = 0
        self._ran_out: list[bool] = []
        self._wait_next = 0
        self._p90_s: float | None = None  # unknown until an answer is measured
        self._answered = False  # a wait was answered since the history began
        self._waited = False  # this step has waited already (a later wait has what the first left)
        self._fresh = 0
        self._probing = False  # this step waits only to probe (auto had stopped waiting)
        self._cap_s = 0.0
        self._last_step: float | None = None
        self.last_interval_s: float | None = None  # seconds between the last two steps; None before two
        self._steps = 0

    @property
    def auto(self) -> bool:
        """True when the budget follows the measured round trip."""
        return self.fixed_s is None

    @property
    def rtt_p90_s(self) -> float | None:
        """The p90 of recent waits, a wait that ran out counted at its budget (``auto`` only); ``None`` until an
        answer is measured."""
        return self._p90_s

    def left(self) -> float:
        """Seconds this step may still wait."""
        return self._left_s

    def spend(self, seconds: float) -> None:
        """Count ``seconds`` of waiting against this step's budget."""
        self._left_s = max(0.0, self._left_s - seconds)

    def observe(self, rtt_s: float | None) -> None:
        """One wait's outcome: the round trip of an answer that came while waiting, or ``None`` (ran out)."""
        if not self.auto:
            return
        in_force, first = self.in_force_s, not self._waited
        self._waited = True
        if rtt_s is None:
            if first and in_force >= self._cap_s:  # it had the whole cap: evidence the store is too far for it
                self._outcome(True)  # (a later wait of the step had what the first left: no such evidence)
            self._sample(in_force)  # it needed more than its budget: the p90 climbs past it
            return
        self._outcome(False)
        if self._probing and rtt_s + MARGIN_S <= self._cap_s:  # close again: forget the slow history
            self._rtts, self._rtt_next, self._ran_out, self._wait_next = [], 0, [False], 1
            self._p90_s, self._fresh, self._probing = None, 0, False
        self._answered = True
        self._sample(rtt_s)

    def _outcome(self, ran_out: bool) -> None:
        _push(self._ran_out, ran_out, WAITS, self._wait_next)
        self._wait_next = (self._wait_next + 1) % WAITS

    def _sample(self, seconds: float) -> None:
        _push(self._rtts, seconds, SAMPLES, self._rtt_next)
        self._rtt_next = (self._rtt_next + 1) % SAMPLES
        self._fresh += 1
        if self._answered and (self._fresh >= 8 or len(self._rtts) <= 8):
            ordered = sorted(self._rtts)
            self._p90_s = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
            self._fresh = 0

    def new_step(self, now: float) -> float:
        """A scheduling step begins: refresh the budget (``auto``: from the round trip and step interval)."""
        last, self._last_step = self._last_step, now
        if last is not None:
            self.last_interval_s = interval = now - last
            self.step_interval_s += 0.2 * (interval - self.step_interval_s)
        if self.fixed_s is not None:  # a fixed budget (0: async lookups that never wait): nothing else to learn
            self._left_s = self.in_force_s
            return self.in_force_s
        self._steps += 1
        self._probing = False
        self._waited = False
        cap = self._cap_s = self.share * self.step_interval_s
        ran_out = sum(self._ran_out) / len(self._ran_out) if self._ran_out else 0.0
        if self._p90_s is None and (len(self._ran_out) < LEARN_WAITS or ran_out <= MAX_RAN_OUT):
            self.in_force_s = cap  # nothing measured yet: wait up to the cap to learn
        elif self._p90_s is not None and ran_out <= MAX_RAN_OUT:  # a p90 past the cap: most still land in it
            self.in_force_s = min(self._p90_s + MARGIN_S, cap)
        else:
            self._probing = self._steps % PROBE_EVERY == 0
            self.in_force_s = cap if self._probing else 0.0
        self._left_s = self.in_force_s
        return self.in_force_s


def _push(ring: list, value: object, size: int, at: int) -> None:
    if len(ring) < size:
        ring.append(value)
    else:
        ring[at] = value


__all__ = ["WaitBudget"]

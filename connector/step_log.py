"""What the lookups of one scheduling step did, kept for telemetry that reads it once per step.

Why: every call an observer gets on the scheduler's thread is a function vLLM's ``schedule()`` runs, cold after
a model step. The telemetry a deployment runs (vLLM's stats each step, spans for sampled requests) needs the
step's figures, not each event as it happens: the client appends each lookup that ended to a list and counts
deferrals, nothing more, and the stats collector (metrics/vllm_stats.py) turns a step's log into vLLM's stats
record once per step; spans are built on a thread of their own from the sampled lookups (metrics/tracing.py).

Used on the scheduler's thread only (the client writes it, the stats collector swaps it out each step).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from mooncake_lookout.connector.lookup import Lookup, Outcome

if TYPE_CHECKING:
    from mooncake_lookout.connector.events import ObserverSet
    from mooncake_lookout.connector.transport.base import Transport

_clock = time.perf_counter


class StepLog:
    """One step's lookups that ended (answered to the scheduler, or discarded), its deferrals and what else it
    counted; the gauges the step ended with are read from the client when the log is taken."""

    __slots__ = ("ended", "sampled", "deferrals", "calls", "dropped", "arrivals_dropped", "clears", "breaker",
                 "intervals")

    def __init__(self) -> None:
        self.ended: list[Lookup] = []  # each lookup once: consumed (its answer used) or discarded
        self.sampled: list[Lookup] = []  # the ended lookups to trace
        self.deferrals = 0  # times the scheduler was told to ask again
        self.calls: list[float] = []  # seconds of each scheduler call into the lookup path
        self.dropped: dict[str, int] = {}  # held answers forgotten, by reason
        self.arrivals_dropped: dict[str, int] = {}  # lookups sent at arrival and never taken over, by reason
        self.clears: dict[str, int] = {}  # prefix cache clears, by reason
        self.breaker: bool | None = None  # the breaker's state, if it changed in the step
        self.intervals: list[float] = []  # seconds between step ends

    def __bool__(self) -> bool:
        """True when the step did anything worth reporting."""
        return bool(self.ended or self.deferrals or self.calls or self.dropped or self.arrivals_dropped
                    or self.clears or self.breaker is not None or self.intervals)


class Reporting:
    """What the client tells telemetry: each event into the step's log (when kept) and to the observers (when
    any is attached). A mixin of :class:`~mooncake_lookout.connector.client.LookupClient`, which owns the fields."""

    log: StepLog | None
    observers: ObserverSet
    transport: Transport
    sampler: Any
    _ev: ObserverSet | None

    def take_log(self) -> StepLog:
        """What happened since the last call (the first call starts the log): for telemetry read once a step."""
        log, self.log = self.log, StepLog()
        return log if log is not None else StepLog()

    def scheduler_call(self, mode: str, seconds: float) -> None:
        """Time one scheduler call spent in the lookup path (the adapter times them)."""
        if self.log is not None:
            self.log.calls.append(seconds)
        if self._ev is not None:
            self._ev.scheduler_call(mode, seconds)

    def _defer(self, lk: Lookup) -> None:
        """The scheduler is told to ask again."""
        lk.deferrals += 1
        if self.log is not None:
            self.log.deferrals += 1
        if self._ev is not None:
            self._ev.deferred(lk)

    def _adopted(self, lk: Lookup) -> None:
        """A lookup sent at arrival became its request's: its events so far, in order (it may be answered)."""
        if self.sampler is not None:
            lk.sampled = self.sampler(lk.trace_headers)
        ev = self._ev
        if ev is not None:
            ev.submitted(lk)
            if ev.listens("started"):
                ev.started(lk)
            if lk.outcome is not None and ev.listens("answered"):
                ev.answered(lk)

    def _ended(self, lk: Lookup) -> None:
        """``lk`` ended: its answer was used, or it was discarded."""
        log = self.log
        if log is not None:
            log.ended.append(lk)
            if lk.sampled:
                log.sampled.append(lk)

    def _drop(self, lk: Lookup) -> None: ...

    def arrival_dropped(self, lk: Lookup, reason: str) -> None:
        """A lookup sent at arrival that its request never took over ended (arrivals.py): ``discarded``, with why.
        It was never the client's, so its events start here (``submitted`` first: gauges of pending stay level)."""
        lk.outcome, lk.t_consume = Outcome.DISCARDED, _clock()
        log = self.log
        if log is not None:
            log.ended.append(lk)
            log.arrivals_dropped[reason] = log.arrivals_dropped.get(reason, 0) + 1
        ev = self._ev
        if ev is not None:
            ev.submitted(lk)
            ev.discarded(lk)
            ev.arrival_dropped(lk, reason)

    def _dropped(self, lk: Lookup, reason: str, *, forget: bool = True) -> None:
        """An answer is not served (``expired``, ``wiped``, ``evicted``); ``forget``: drop its lookup too."""
        if self.log is not None:
            self.log.dropped[reason] = self.log.dropped.get(reason, 0) + 1
        if self._ev is not None:
            self._ev.answer_dropped(lk, reason)
        if forget:
            self._drop(lk)

    def _cache_cleared(self, reason: str, blocks: int) -> None:
        if self.log is not None:
            self.log.clears[reason] = self.log.clears.get(reason, 0) + 1
        if self._ev is not None:
            self._ev.cache_cleared(reason, blocks)

    def _cache_state_changed(self, state: str) -> None:
        """The prefix cache turned on, off or unproven (rare: not in the step's log; vLLM's stats read the state)."""
        if self._ev is not None:
            self._ev.prefix_cache_state(state)

    def _breaker_changed(self, is_open: bool) -> None:
        if self.log is not None:
            self.log.breaker = is_open
        if self._ev is not None:
            self._ev.breaker_changed(is_open)

    def _listen(self) -> None:
        """Observers were added: make their events from now on (none is made while nobody listens)."""
        ev: Any = self.observers if self.observers.observers else None
        self._ev = ev
        self.transport.on_answer = ev.answered if ev is not None and ev.listens("answered") else None
        own = getattr(self, "_own_late_reply", None)  # a transport's own callback, given when it was built
        self.transport.on_late_reply = own if own is not None else ev.late_reply if ev is not None else None


__all__ = ["Reporting", "StepLog"]

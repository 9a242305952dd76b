"""Lifecycle of one lookup, reported to observers so metrics and spans attach without touching the client.

Every event runs on the caller's thread (vLLM's scheduler): ``started`` when the lookup is handed to the
transport, ``answered`` when its answer is applied (a transport's own thread never calls observers; the
one exception is ``late_reply`` from the ``upstream`` transport's thread, which observers must keep to an
integer bump). Whatever an observer does there, vLLM's ``schedule()`` pays: keep it to counting, and send
real work to a thread of its own (:class:`BackgroundObserver`).

An observer must never block and never raise; :class:`ObserverSet` logs and swallows what one raises,
so telemetry cannot break a lookup.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from mooncake_lookout.connector.lookup import Lookup, Outcome

logger = logging.getLogger(__name__)


# The record observers read is the lookup itself: one object per lookup (lookup.py).
LookupRecord = Lookup


class LookupObserver(Protocol):
    """Receives lookup lifecycle events; every method is optional in spirit, so subclass :class:`NullObserver`."""

    def submitted(self, rec: LookupRecord) -> None: ...
    def started(self, rec: LookupRecord) -> None: ...
    def answered(self, rec: LookupRecord) -> None: ...
    def deferred(self, rec: LookupRecord) -> None: ...
    def consumed(self, rec: LookupRecord) -> None: ...
    def discarded(self, rec: LookupRecord) -> None: ...
    def breaker_changed(self, is_open: bool) -> None: ...
    def scheduler_call(self, mode: str, seconds: float) -> None: ...
    def late_reply(self) -> None: ...
    def answer_dropped(self, rec: LookupRecord, reason: str) -> None: ...
    def arrival_dropped(self, rec: LookupRecord, reason: str) -> None: ...
    def step_ended(self, wait_budget_s: float, held: int, cached_blocks: int,
                   interval_s: float | None = None) -> None: ...
    def cache_cleared(self, reason: str, blocks: int) -> None: ...
    def prefix_cache_state(self, state: str) -> None: ...


class NullObserver:
    """Does nothing; subclass it and override the events you need."""

    def submitted(self, rec: LookupRecord) -> None:
        """A lookup was created (or answered at once: rejected, breaker open)."""

    def started(self, rec: LookupRecord) -> None:
        """The lookup was handed to the transport (``t_queued``; ``t_start`` is when it left, which a transport
        with a queue of its own may do later)."""

    def answered(self, rec: LookupRecord) -> None:
        """The answer was taken in (``t_answer``), before the caller asks for it."""

    def deferred(self, rec: LookupRecord) -> None:
        """The caller asked and got ``None``: it will retry on a later step."""

    def consumed(self, rec: LookupRecord) -> None:
        """The caller received the answer; the lookup is no longer pending."""

    def discarded(self, rec: LookupRecord) -> None:
        """The lookup was dropped before its answer was used (finish, abort, preemption, reset, re-query)."""

    def breaker_changed(self, is_open: bool) -> None:
        """The circuit breaker opened or closed."""

    def scheduler_call(self, mode: str, seconds: float) -> None:
        """Time one scheduler call spent inside the lookup path (``mode``: sync, async, budget)."""

    def late_reply(self) -> None:
        """A reply came for a lookup that had already ended, or for none."""

    def answer_dropped(self, rec: LookupRecord, reason: str) -> None:
        """A held answer was forgotten before use: ``expired`` (older than its TTL), ``evicted`` (bound) or
        ``wiped`` (the store was wiped since it was answered)."""

    def arrival_dropped(self, rec: LookupRecord, reason: str) -> None:
        """A lookup sent as its request arrived was never taken over by the request (after ``discarded``):
        ``unclaimed`` (not claimed before its deadline: aborted before admission, say), ``prompt_changed``,
        ``reset`` (fenced by a reset) or ``closed`` (connector/arrivals.py)."""

    def step_ended(self, wait_budget_s: float, held: int, cached_blocks: int,
                   interval_s: float | None = None) -> None:
        """A scheduling step ended: the next step's wait budget, the answers held for requests not yet
        allocated, the blocks the prefix cache remembers, and the seconds since the previous step ended
        (``None`` for the first step)."""

    def cache_cleared(self, reason: str, blocks: int) -> None:
        """The prefix cache forgot ``blocks`` blocks: ``reset``, ``epoch`` (the store was wiped, by anyone)
        or ``failure`` (a lookup failed: the master may have restarted)."""

    def prefix_cache_state(self, state: str) -> None:
        """The prefix cache turned ``on`` (the server named a store epoch), ``off`` or ``unproven`` (a cache, but
        no epoch: nothing is cached and no hit held until the server shows the master's lease covers the ttl)."""


def events_of(base: type) -> tuple[str, ...]:
    """The event names of an observer base class: its public methods."""
    return tuple(n for n in vars(base) if not n.startswith("_") and callable(getattr(base, n)))


_EVENTS = events_of(NullObserver)


class FanOut:
    """Calls every observer that overrides an event of ``base``; one that raises is logged, never propagated.

    Each event is an attribute bound once, when an observer is added: a no-op when nobody listens, a
    guarded direct call for one listener, a guarded loop for several. Used for the client's events
    (:class:`ObserverSet`) and the lookup server's.
    """

    def __init__(self, observers: Sequence[Any] = (), *, base: type) -> None:
        self.observers: list[Any] = []
        self._base = base
        self._events = events_of(base)
        self._handlers: dict[str, tuple[Any, ...]] = {name: () for name in self._events}
        # Called after an observer is added (the client then stops skipping its events).
        self.on_add: Callable[[], None] | None = None
        for obs in observers:
            self.add(obs)

    def add(self, observer: Any) -> None:
        """Attach one more observer."""
        self.observers.append(observer)
        for name in self._events:
            method = getattr(observer, name, None)
            if method is None or getattr(method, "__func__", None) is getattr(self._base, name):
                continue  # not overridden: nothing to call
            self._handlers[name] = handlers = (*self._handlers[name], method)
            setattr(self, name, _dispatcher(name, handlers))
        if self.on_add is not None:
            self.on_add()

    def listens(self, event: str) -> bool:
        """True if some observer overrides ``event``."""
        return bool(self._handlers[event])


def _dispatcher(name: str, handlers: tuple[Any, ...]) -> Any:
    def emit(*args: Any) -> None:
        for handler in handlers:
            try:
                handler(*args)
            except Exception:  # telemetry must never break a lookup
                logger.exception("observer %r failed in %s", handler, name)
    return emit


class ObserverSet(FanOut, NullObserver):
    """Fans lookup events out to several lookup observers (see :class:`FanOut`)."""

    def __init__(self, observers: Sequence[LookupObserver] = ()) -> None:
        super().__init__(observers, base=NullObserver)


class BackgroundObserver(NullObserver):
    """Runs another observer on a thread of its own, in batches, so the hot threads only append to a deque.

    For observers whose work is not cheap (spans, a ``prometheus_client`` registry). The caller's cost is
    one ``deque.append`` (no lock, no wake-up); the thread drains the deque every ``interval_s``, so its
    work (and its share of the GIL) comes in bursts instead of once per event. Events keep their order;
    the wrapped observer reads each record when its turn comes, and the record's timestamps say when
    things happened. Past ``max_backlog`` queued events, new ones are dropped (counted in ``dropped``)
    rather than let memory grow.
    """

    def __init__(self, observer: LookupObserver, *, interval_s: float = 0.05, max_backlog: int = 100_000,
                 name: str = "lookout-telemetry") -> None:
        self.observer = observer
        self.dropped = 0
        self.interval_s = interval_s
        self._max_backlog = max_backlog
        # Items: (event, args), or a threading.Event to set once everything before it is handled (flush).
        self._events: collections.deque[Any] = collections.deque()
        self._wake = threading.Event()
        self._closing = False
        self._handlers = ObserverSet([observer])
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        for event in _EVENTS:  # only the events the wrapped observer listens to are queued at all
            if self._handlers.listens(event):
                setattr(self, event, functools.partial(self._put, event))

    def _put(self, event: Any, *args: Any) -> None:
        if len(self._events) >= self._max_backlog:
            self.dropped += 1
            return
        self._events.append((event, args))

    def call(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` on the thread, in turn with the events (one append here): a batch of work at once."""
        self._put(fn, *args)

    def _run(self) -> None:
        while not self._closing:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            self._drain()
        self._drain()

    def _drain(self) -> None:
        events = self._events
        while events:
            item = events.popleft()
            if isinstance(item, threading.Event):
                item.set()
                continue
            event, args = item
            if callable(event):
                try:
                    event(*args)
                except Exception:  # telemetry must never break anything
                    logger.exception("background work %r failed", event)
            else:
                getattr(self._handlers, event)(*args)
            time.sleep(0)  # hand the GIL to a waiting hot thread between events, not once per switch interval

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Handle every event queued so far now; False if that took over ``timeout_s``."""
        done = threading.Event()
        self._events.append(done)
        self._wake.set()
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Handle what is queued, then stop the thread."""
        self._closing = True
        self._wake.set()
        self._thread.join(timeout_s)


class OutcomeCounter(NullObserver):
    """Counts how lookups ended and keeps the ended records: for ``demo``, ``bench`` and tests."""

    def __init__(self, keep: int = 100_000) -> None:
        self.outcomes: dict[Outcome, int] = {o: 0 for o in Outcome}
        self.deferrals = 0
        self.records: list[LookupRecord] = []
        self.breaker_changes: list[bool] = []
        self.arrivals_dropped: dict[str, int] = {}  # lookups sent at arrival and never taken over, by reason
        self._keep = keep

    def _ended(self, rec: LookupRecord) -> None:
        assert rec.outcome is not None
        self.outcomes[rec.outcome] += 1
        if len(self.records) < self._keep:
            self.records.append(rec)

    def consumed(self, rec: LookupRecord) -> None:
        self._ended(rec)

    def discarded(self, rec: LookupRecord) -> None:
        self._ended(rec)

    def deferred(self, rec: LookupRecord) -> None:
        self.deferrals += 1

    def breaker_changed(self, is_open: bool) -> None:
        self.breaker_changes.append(is_open)

    def arrival_dropped(self, rec: LookupRecord, reason: str) -> None:
        self.arrivals_dropped[reason] = self.arrivals_dropped.get(reason, 0) + 1

    def count(self, *outcomes: Outcome) -> int:
        """Lookups that ended with any of ``outcomes``."""
        return sum(self.outcomes[o] for o in outcomes)


__all__ = ["BackgroundObserver", "FanOut", "LookupObserver", "LookupRecord", "NullObserver", "ObserverSet", "Outcome",
           "OutcomeCounter", "events_of"]

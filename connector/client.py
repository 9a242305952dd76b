"""LookupClient: vLLM's ``LookupKeyClient`` calls, bounded in time, in memory and in trust.

What the scheduler can count on:

* ``lookup(..., non_block=False)`` never waits past ``lookup_block_ms``, and a lookup blocks at most once: unanswered
  by then, it is deferred (``None``, vLLM asks again on a later step) and runs on to its deadline, later calls only
  reading it, so a slow answer is still a hit. ``non_block=True`` waits at most what is left of the step's budget
  (``lookup_wait_us``, or ``auto``). A lookup *sent* and unanswered by its deadline (``lookup_timeout_ms``) is a
  timeout; time in the client's own queue never counts against the deadline or the breaker.
* A step's lookups travel together: its first call takes in the answers that came (an answer is served first);
  the first call for a pending lookup hands over every lookup started since the last hand-over, and
  :meth:`end_step` the rest. With the socket on this thread (blocking, or a wait budget) a step's first
  :data:`ADMISSION_FRAMES` admissions leave at once, a frame each; async lookups may leave earlier still, from
  vLLM's input thread (:attr:`arrivals`, the one state shared with another thread: arrivals.py).
* The breaker (breaker.py) opens on failure, not slowness: errors, and timeouts with no reply at all, counted
  once per send or poll, at a rate over ``lookup_breaker_window_s`` with a minimum volume; a late reply proves the
  server alive. Open, lookups answer a miss at once for ``lookup_breaker_cooldown_s``, then one probe decides.
* At most ``lookup_max_pending`` lookups are queued or in flight: past it an admission starts none, a
  non-blocking ask defers, a blocking ask gets a miss (``rejected``). At most ``lookup_max_held`` answers are
  held (past it, the oldest is forgotten).
* An answer is served only for the request it was asked for (same ``num_tokens``, same hashes), in the current
  generation (``reset`` bumps it), and only while every block it counts is trusted: found by a store check sent
  at most ``lookup_answer_ttl_ms`` before (docs/reliability.md, "No stale hit"; :meth:`StoreView.untrusted`).
  Failed or refused answers are not held: the next call asks again.
* Store errors and timeouts are reported as such, never as misses. ``busy`` and ``bad_request`` replies fail
  only their lookups: they clear nothing and do not feed the breaker.

The scheduler's thread does what it must: one object a lookup (:class:`Lookup`, also the result vLLM reads); a
pending one costs a look-up and a deferral; telemetry an append to the step's log (:class:`StepLog`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from mooncake_lookout.connector.answers import Answers
from mooncake_lookout.connector.arrivals import Arrivals, arrivals_for
from mooncake_lookout.connector.breaker import CircuitBreaker
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.events import LookupObserver, ObserverSet
from mooncake_lookout.connector.job import TailKeyBoundary
from mooncake_lookout.connector.lookup import ERROR, HIT, TIMEOUT, Lookup, Outcome
from mooncake_lookout.connector.prefix_cache import PrefixCache, StoreView
from mooncake_lookout.connector.step_log import Reporting, StepLog
from mooncake_lookout.connector.transport.base import Transport, TransportClosed
from mooncake_lookout.connector.wait_budget import WaitBudget

_clock = time.perf_counter
ADMISSION_FRAMES = 4  # frames a step sent at admission; past them, a send each costs more than a head start gains


class LookupClient(Answers, Reporting):
    """Asynchronous, deadline-bound prefix lookups; one instance per scheduler, used from one thread."""

    def __init__(self, config: LookupConfig, transport: Transport, *,
                 observer: LookupObserver | None = None) -> None:
        self.config = config
        self.transport = transport
        self.observers = observer if isinstance(observer, ObserverSet) else ObserverSet(
            [observer] if observer is not None else [])
        self.breaker = CircuitBreaker(config.lookup_breaker_failures, config.lookup_breaker_cooldown_s,
                                      probe_timeout_s=config.timeout_s, rate=config.lookup_breaker_failure_rate,
                                      window_s=config.lookup_breaker_window_s,
                                      heard=lambda: transport.late_replies, on_change=self._breaker_changed)
        self.budget = WaitBudget(config.wait_s, share=config.lookup_wait_auto_share)
        self.generation = 0
        self.log: StepLog | None = None  # kept once a reader asks for it (take_log)
        self.sampler: Any = None  # trace_headers -> bool, when spans are on (metrics/tracing.py)
        self._timeout_s = config.timeout_s
        self._block_s = config.block_s
        self._defers = config.block_s < config.timeout_s  # a blocking call that ran out of its bound defers
        self._max_pending = config.lookup_max_pending
        self._may_wait = config.lookup_wait_us != 0  # a fixed budget, or auto: calls may wait
        self._open = 0  # lookups submitted and not yet answered to the caller
        self._lookups: dict[str, Lookup] = {}  # each request's current lookup: pending, or its answer held
        self.by_request: Mapping[str, Lookup] = self._lookups  # the same, for reading (a look-up, not a call)
        self._held: dict[str, None] = {}  # requests whose answer is held, oldest first
        self._unsent: list[Lookup] = []
        self._news = transport.news  # answers a transport's own thread handed back, not applied yet
        self._reads_socket = not transport.hands_back  # collect reads a socket itself (else: only when news came)
        self._admission_frames = self._admission_frames_left = ADMISSION_FRAMES if self._reads_socket else 0
        # The store's epoch as answers name it (a wipe by anyone changes it) and the prefix cache under it,
        # on once the scheduler adapter says the layout allows it (prefix_cache.py).
        self.store_view = StoreView(config, self._cache_cleared, self._cache_state_changed)
        transport.on_epoch = self.store_view.heard
        self._ev: ObserverSet | None = None  # the observers, when any is attached (else no event is made)
        self._own_late_reply = transport.on_late_reply
        self.observers.on_add = self._listen
        self._listen()
        self._stepped = self._sent_this_step = self._drained_this_step = self._closed = False  # no step known yet
        # Lookups vLLM's input thread sent as their requests arrived (async lookups only: arrivals.py).
        self.arrivals: Arrivals | None = arrivals_for(
            self, transport, enabled=config.lookup_on_arrival and config.lookup_async)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any, *, observer: LookupObserver | None = None) -> LookupClient:
        """Build the client the way vLLM's connector would: config from ``kv_connector_extra_config``."""
        from mooncake_lookout.connector.addresses import lookup_address
        from mooncake_lookout.connector.transport import make_transport
        config = LookupConfig.from_extra_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        return cls(config, make_transport(config, lookup_address(vllm_config, config)), observer=observer)

    def enable_prefix_cache(self, block_size: int) -> bool:
        """Remember found blocks of ``block_size`` tokens, a hash a block (where the layout allows); True if on."""
        return self.store_view.enable(block_size)

    @property
    def cache(self) -> PrefixCache | None:
        """The prefix cache, when on."""
        return self.store_view.cache

    @property
    def pending(self) -> int:
        """Lookups submitted, not yet answered to the scheduler nor discarded (what ``lookup_max_pending`` bounds)."""
        return self._open

    @property
    def held(self) -> int:
        """Answers kept for requests not yet allocated."""
        return len(self._held)

    # -- the scheduler's calls ---------------------------------------------------------------------------
    def lookup(self, req_id: str, num_tokens: int, block_hashes: Sequence[bytes], non_block: bool = False,
               *, trace_headers: Mapping[str, str] | None = None) -> Lookup | None:
        """The hit for ``req_id`` (``hit_length``, ``tail_key_boundaries``), or ``None`` while it is pending
        (``non_block``: ask again on a later step)."""
        now = _clock()
        lk = self._lookups.get(req_id)
        if lk is not None:
            if not lk.asks_for(num_tokens, block_hashes, self.generation):
                self._drop(lk)
                lk = None
            elif lk.held:
                why = self.store_view.untrusted(lk, now)
                if why is None:
                    return lk  # served from hold: no store call, no other work
                self._dropped(lk, why)
                lk = None
            elif not non_block and self._defers and lk.deferrals:  # deferred once: later calls only read it
                non_block = True
        if not non_block or self._may_wait:  # a blocking call, or a wait budget: the general path
            return self._ask(req_id, num_tokens, block_hashes, non_block, trace_headers, now, lk)
        # Async, no wait: the common cases inline (a new lookup, the step's take-in and hand-over, a deferral).
        if lk is None:
            lk = self._submit(req_id, num_tokens, block_hashes, trace_headers, now, admission=True)
            if lk is None or lk.t_consume is not None:  # at the bound (the general path), or answered at once
                return lk if lk is not None else self._ask(req_id, num_tokens, block_hashes, True, trace_headers,
                                                           now, None)
        if not (self._stepped and self._drained_this_step):
            self._drained_this_step = True
            if self._news or self._reads_socket:
                self.transport.collect()
        elif self._news:
            self.transport.collect()
        if lk.outcome is not None:  # answered: served before the hand-over, which it need not wait for
            return self._serve(lk, True, now)
        if self._unsent and not (self._stepped and self._sent_this_step):
            self._flush(now=now)
        deadline = lk.deadline  # None until sent
        if now < deadline if deadline is not None else not self.transport.stuck(lk, now):
            self._defer(lk)
            return None
        return self._ask(req_id, num_tokens, block_hashes, True, trace_headers, now, lk)

    def _ask(self, req_id: str, num_tokens: int, block_hashes: Sequence[bytes], non_block: bool,
             trace_headers: Mapping[str, str] | None, called: float, lk: Lookup | None) -> Lookup | None:
        if lk is None:
            lk = self._submit(req_id, num_tokens, block_hashes, trace_headers, called, admission=non_block)
            if lk is None:  # at the pending bound: answers that came may free room, else ask again next step
                self._tick(non_block)
                lk = self._submit(req_id, num_tokens, block_hashes, trace_headers, called, admission=non_block)
            if lk is None:
                self._defer(Lookup(req_id, num_tokens, block_hashes, self.transport.name, self.generation, called))
                return None
            if lk.t_consume is not None:  # answered at once: refused, or from the prefix cache
                return lk
        if lk.outcome is None:
            if not non_block and lk.t_start is None and not self._defers:  # a call that cannot defer: its
                lk.latest = called + self._timeout_s  # bound caps the lookup's deadline
            self._await(lk, non_block, called)
        if lk.outcome is not None:
            return self._serve(lk, non_block, called)
        now = _clock()
        sent = lk.t_start is not None  # read first: the upstream transport's thread may send it meanwhile
        if (non_block or self._defers) and not lk.expired(now) and not self.transport.stuck(lk, now):
            self._defer(lk)
            return None
        self.transport.forget(lk)
        if sent:  # sent, and its deadline passed unanswered: the server's failure
            lk.finish(TIMEOUT, now, error="no reply before the deadline")
        else:  # still queued (behind a lookup left unanswered, a stalled transport, or the call's bound ran out)
            lk.finish(TIMEOUT, now, error="not sent before the deadline: queued behind other lookups", local=True)
        return self._settle(lk)

    def start(self, req_id: str, num_tokens: int, block_hashes: Sequence[bytes], *,
              trace_headers: Mapping[str, str] | None = None, admission: bool = False) -> Lookup | None:
        """Make sure a current lookup exists for this request (e.g. at admission); never waits. ``admission``: the
        caller can wait, so past ``lookup_max_pending`` nothing is started (``None``) instead of refusing the
        request; the lookup may leave at once (the module's docstring says when)."""
        lk = self._lookups.get(req_id)
        if lk is not None:
            if lk.asks_for(num_tokens, block_hashes, self.generation) and (
                    not lk.held or self.store_view.untrusted(lk, _clock()) is None):
                return lk
            self._drop(lk)
        lk = self._submit(req_id, num_tokens, block_hashes, trace_headers, _clock(), admission=admission)
        if admission and self._admission_frames_left and self._unsent:
            self._admission_frames_left -= 1
            self._flush(admission=True)
        return lk

    def end_step(self) -> None:
        """The scheduling step is over: hand over what is still unsent, refresh the next step's wait budget."""
        if self._unsent:
            self._flush()
        self._stepped = True
        self._sent_this_step = self._drained_this_step = False
        self._admission_frames_left = self._admission_frames
        budget = self.budget
        budget.new_step(now := _clock())
        if self.arrivals is not None:
            self.arrivals.sweep(now)
        if self.log is not None and (interval := budget.last_interval_s) is not None:
            self.log.intervals.append(interval)
        if self._ev is not None:
            self._ev.step_ended(budget.in_force_s, len(self._held), len(self.cache or ()), budget.last_interval_s)

    def discard(self, req_id: str) -> None:
        """Forget ``req_id``'s lookup (allocated, finished, aborted, preempted); an unsent one is never sent."""
        lk = self._lookups.pop(req_id, None)
        if lk is not None and lk.held:  # answered, used and counted: only the hold ends (after allocation)
            self._held.pop(req_id, None)
        elif lk is not None:
            self._drop(lk)

    def reset(self) -> bool:
        """Invalidate every answer held or in flight, then ask the server to wipe the store (fenced behind them);
        waits for its acknowledgement up to ``lookup_reset_timeout_s``, as upstream's client waits for its server."""
        self.generation += 1
        for lk in list(self._lookups.values()):
            self._drop(lk)
        self.store_view.clear("reset")
        ok = False if self._closed else self.transport.reset(self.config.lookup_reset_timeout_s)
        if self.arrivals is not None:  # the reset is handed over: what was sent at arrival before it never serves
            self.arrivals.reset()
        return ok

    def close(self) -> None:
        """Drop every lookup and stop the transport; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self.arrivals is not None:
            self.arrivals.close()
        for lk in list(self._lookups.values()):
            self._drop(lk)
        self.transport.close()

    def has(self, req_id: str) -> bool:
        """True if a lookup (pending or answered) is held for ``req_id``."""
        return req_id in self._lookups

    # -- internals -----------------------------------------------------------------------------------------
    def _submit(self, req_id: str, num_tokens: int, block_hashes: Sequence[bytes],
                trace_headers: Mapping[str, str] | None, now: float, *, admission: bool) -> Lookup | None:
        arrivals = self.arrivals
        if arrivals and (lk := arrivals.take(req_id, num_tokens, block_hashes, self.generation)) is not None:
            self._lookups[req_id] = lk  # sent at arrival, maybe answered: this request's from now on
            self._open += 1
            self._adopted(lk)
            return lk
        if admission and self._open >= self._max_pending:
            return None
        lk = Lookup(req_id, num_tokens, block_hashes, self.transport.name, self.generation, now, self._timeout_s,
                    trace_headers)
        self._lookups[req_id] = lk
        self._open += 1
        if self.sampler is not None:
            lk.sampled = self.sampler(trace_headers)
        if self._ev is not None:
            self._ev.submitted(lk)
        breaker = self.breaker
        refused = (ERROR if self._closed else Outcome.REJECTED if self._open > self._max_pending
                   else None if breaker.closed or breaker.allow() else Outcome.BREAKER_OPEN)
        if refused is not None:
            lk.finish(refused, now, error=refused.value, local=True)
            return self._settle(lk)
        lk.probe = not breaker.closed
        local = self.store_view.plan(lk, num_tokens, now) if self.store_view.cache is not None else None
        if local is None:
            self._unsent.append(lk)
            return lk
        # Every block that can count is known present, and the epoch was confirmed lately: no round trip.
        hit, lk.valid_until = local
        lk.from_cache = True
        lk.finish(HIT, now, hit, (TailKeyBoundary(0, hit),), local=True)
        return self._settle(lk)

    def _tick(self, non_block: bool) -> None:
        """The step's take-in (every answer that came), then hand-over (every lookup since the last), if due."""
        if not (self._stepped and self._drained_this_step) or self._news:  # news: answers handed back since
            self._drained_this_step = True
            self.transport.collect()
        if self._unsent and not (self._stepped and non_block and self._sent_this_step):
            self._flush(urgent=not non_block)

    def _flush(self, *, urgent: bool = False, now: float | None = None, admission: bool = False) -> None:
        """Hand every unsent lookup to the transport, in one frame where the protocol allows."""
        lookups, self._unsent = self._unsent, []
        if not lookups:
            return
        if not admission:  # a send at admission is not the step's hand-over
            self._sent_this_step = True
        now = _clock() if now is None else now
        view = self.store_view
        for lk in lookups:
            lk.t_queued = now
            if lk.known:
                view.recheck(lk, now)
        try:
            self.transport.send(lookups, urgent=urgent)
        except TransportClosed:
            for lk in lookups:
                lk.finish(ERROR, now, error="transport closed")
            return
        if self._ev is not None and self._ev.listens("started"):
            for lk in lookups:
                self._ev.started(lk)

    def _await(self, lk: Lookup, non_block: bool, called: float) -> None:
        """Hand over the step's lookups if due, take in arrived answers, and wait as much as this call may."""
        self._tick(non_block)
        if lk.t_queued is None and lk.outcome is None and self.budget.left() > 0:
            self._flush(urgent=not non_block)  # a wait is allowed: hand over now, whatever was sent this step
        now = _clock()
        if lk.outcome is None and lk.expired(now):
            self.transport.collect()  # its deadline passed since the step's take-in: time it out now
        if lk.outcome is not None:
            return
        wait = self.budget.left() if non_block else called + self._block_s - now
        if lk.deadline is not None:
            wait = min(wait, lk.deadline - now)
        if wait <= 0:
            return
        self.transport.collect(wait, until=lk)
        if non_block:
            self.budget.spend(_clock() - now)
        if lk.t_start is not None:  # what the wait took: the share of the round trip not spent on other work
            self.budget.observe(lk.t_answer - max(now, lk.t_start)
                                if lk.outcome is not None and lk.t_answer is not None else None)


__all__ = ["LookupClient"]

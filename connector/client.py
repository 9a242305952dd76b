"""LookupClient: vLLM's ``LookupKeyClient`` calls, bounded in time, in memory and in trust.

What the scheduler can count on:

* ``lookup(..., non_block=False)`` never waits longer than ``lookup_timeout_ms``; ``non_block=True`` waits
  at most what is left of the step's budget (``lookup_wait_us``, or ``auto``). A lookup *sent* and not
  answered by its deadline is a miss, counted as a timeout; time spent in the client's own queue is not
  the server's failure and never counts against the deadline or the breaker.
* The lookups of one scheduling step travel together: the first call of a step sends every lookup
  started since the last send (those started at admission included) in one frame, and drains every reply
  that has arrived; :meth:`end_step` sends the rest. A step pays one send and one drain.
* After ``lookup_breaker_failures`` consecutive failures (timeouts, errors), lookups answer a miss at once
  for ``lookup_breaker_cooldown_s``, then one probe decides.
* At most ``lookup_max_pending`` lookups are queued or in flight. Past it, a lookup at admission is not
  started yet and a non-blocking ask defers (vLLM asks every waiting request each step in async mode, so
  a deep waiting queue must not turn into refusals); only a blocking ask, which cannot wait, gets a miss
  at once (``rejected``). At most ``lookup_max_held`` answers are held for requests not yet allocated
  (past it, the oldest is forgotten and asked again when needed).
* An answer is served only for the request it was asked for (same ``num_tokens``, same hashes), in the
  current generation (``reset`` bumps it), and only while every block it counts is trusted: found by a store
  check sent at most ``lookup_answer_ttl_ms`` before (known blocks included), so the master's lease leaves the
  load its margin (docs/reliability.md, "No stale hit"; checked in :meth:`StoreView.untrusted`). Failed
  or refused answers are not held: the next call asks again.
* Store errors and timeouts are reported as such to observers, never as plain misses. ``busy`` and
  ``bad_request`` replies fail only their lookups: they clear nothing and do not feed the breaker.

Every method is called from one thread (vLLM's engine-core thread); no state here is shared with another.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from mooncake_lookout.connector.breaker import CircuitBreaker
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.events import LookupObserver, LookupRecord, ObserverSet, Outcome
from mooncake_lookout.connector.job import Answer, LookupJob, LookupResult, TailKeyBoundary
from mooncake_lookout.connector.prefix_cache import PrefixCache, StoreView
from mooncake_lookout.connector.transport.base import Transport, TransportClosed
from mooncake_lookout.connector.wait_budget import WaitBudget

_Key = tuple[int, int, bytes]


class _Entry:
    """One request's lookup as the client tracks it."""

    __slots__ = ("rec", "key", "job", "final", "probe")

    def __init__(self, rec: LookupRecord, key: _Key, job: LookupJob | None, probe: bool) -> None:
        self.rec = rec
        self.key = key
        self.job = job
        self.final: Answer | None = None  # set once the caller has the answer
        self.probe = probe


def _key(num_tokens: int, block_hashes: Sequence[bytes]) -> _Key:
    # vLLM's block hashes are chained: the last one stands for the whole prefix.
    return (num_tokens, len(block_hashes), bytes(block_hashes[-1]) if block_hashes else b"")


class LookupClient:
    """Asynchronous, deadline-bound prefix lookups; one instance per scheduler, used from one thread."""

    def __init__(self, config: LookupConfig, transport: Transport, *,
                 observer: LookupObserver | None = None) -> None:
        self.config = config
        self.transport = transport
        self.observers = observer if isinstance(observer, ObserverSet) else ObserverSet(
            [observer] if observer is not None else [])
        if transport.on_late_reply is None:
            transport.on_late_reply = lambda: self.observers.late_reply()  # observers may be added later
        self.breaker = CircuitBreaker(
            config.lookup_breaker_failures, config.lookup_breaker_cooldown_s,
            probe_timeout_s=config.timeout_s, on_change=lambda is_open: self.observers.breaker_changed(is_open))
        self.budget = WaitBudget(config.wait_s, share=config.lookup_wait_auto_share)
        self.generation = 0
        self._open = 0  # lookups submitted and not yet answered to the caller
        self._entries: dict[str, _Entry] = {}
        self._unsent: list[LookupJob] = []
        self._held: OrderedDict[str, None] = OrderedDict()  # answered entries kept for retries, oldest first
        # The store's epoch as replies name it (a wipe by anyone changes it) and the prefix cache under it,
        # on once the scheduler adapter says the layout allows it (prefix_cache.py).
        self.store_view = StoreView(config, lambda reason, blocks: self.observers.cache_cleared(reason, blocks))
        transport.on_epoch = self.store_view.heard
        # Until the scheduler adapter calls end_step, nothing is known of steps: every call sends and drains.
        self._stepped = False
        self._sent_this_step = False
        self._drained_this_step = False
        self._closed = False

    @classmethod
    def from_vllm_config(cls, vllm_config: Any, *, observer: LookupObserver | None = None) -> LookupClient:
        """Build the client the way vLLM's connector would: config from ``kv_connector_extra_config``."""
        from mooncake_lookout.connector.addresses import lookup_address
        from mooncake_lookout.connector.transport import make_transport

        config = LookupConfig.from_extra_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        return cls(config, make_transport(config, lookup_address(vllm_config, config)), observer=observer)

    def enable_prefix_cache(self, block_size: int) -> bool:
        """Remember found blocks for prompts of ``block_size``-token blocks, each hash one block (the adapter
        calls this for a layout where that holds). True if now on."""
        return self.store_view.enable(block_size)

    @property
    def cache(self) -> PrefixCache | None:
        """The prefix cache, when on."""
        return self.store_view.cache

    @property
    def pending(self) -> int:
        """Lookups submitted and not yet answered to the scheduler (or discarded): what ``lookup_max_pending``
        bounds. Answers kept for requests not yet allocated are not pending (see :attr:`held`)."""
        return self._open

    @property
    def held(self) -> int:
        """Answers kept for requests not yet allocated."""
        return len(self._held)

    # -- the scheduler's calls ---------------------------------------------------------------------------
    def lookup(self, req_id: str, num_tokens: int, block_hashes: Sequence[bytes], non_block: bool = False,
               *, trace_headers: Mapping[str, str] | None = None) -> LookupResult | None:
        """The hit for ``req_id``, or ``None`` while it is pending (``non_block``: ask again on a later step)."""
        return self._lookup(req_id, num_tokens, block_hashes, non_block, trace_headers, time.perf_counter())

    def _lookup(self, req_id: str, num_tokens: int, block_hashes: Sequence[bytes], non_block: bool,
                trace_headers: Mapping[str, str] | None, called: float) -> LookupResult | None:
        entry = self.start(req_id, num_tokens, block_hashes, trace_headers=trace_headers, admission=non_block)
        if entry is None:  # at the pending bound: answers that came may free room, else ask again next step
            self._tick(non_block)
            entry = self.start(req_id, num_tokens, block_hashes, trace_headers=trace_headers, admission=non_block)
        if entry is None:
            rec = LookupRecord(req_id, num_tokens, len(block_hashes), self.transport.name, self.generation, called,
                               deferrals=1)
            self.observers.deferred(rec)
            return None
        if entry.final is not None:  # held, or refused at once
            return entry.final.result
        job = entry.job
        assert job is not None
        if not non_block and job.sent_at is None:
            job.latest = called + self.config.timeout_s  # a blocking call's bound caps the lookup's deadline
        if job.answer is None:
            self._await(job, non_block, called)
        answer = job.answer
        stale = self.store_view.stale(job, answer, time.perf_counter())
        if stale is not None:
            # Answered before a wipe (or a store error) heard since, or too late for its blocks' trust: ask again.
            self.observers.answer_dropped(entry.rec, stale)
            self._drop(req_id, entry)
            # Asked again within the same call's bound: a blocking call never waits past lookup_timeout_ms.
            return None if non_block else self._lookup(req_id, num_tokens, block_hashes, False, trace_headers, called)
        if answer is None:
            now = time.perf_counter()
            sent = job.sent_at is not None  # read first: the upstream transport's thread may send it meanwhile
            if non_block and not job.expired(now) and not self.transport.stuck(job, now):
                entry.rec.deferrals += 1
                self.observers.deferred(entry.rec)
                return None
            self.transport.forget(job)
            if sent:  # sent, and its deadline passed unanswered: the server's failure
                answer = Answer(Outcome.TIMEOUT, error="no reply before the deadline")
            else:  # still queued (behind a lookup left unanswered, a stalled transport, or the call's bound ran out)
                answer = Answer(Outcome.TIMEOUT, error="not sent before the deadline: queued behind other lookups",
                                local=True)
        return self._settle(req_id, entry, answer)

    def start(self, req_id: str, num_tokens: int, block_hashes: Sequence[bytes], *,
              trace_headers: Mapping[str, str] | None = None, admission: bool = False) -> _Entry | None:
        """Make sure a current lookup exists for this request (e.g. at admission); never waits, never sends.

        ``admission``: the caller can wait (a lookup at admission, or a non-blocking ask), so past
        ``lookup_max_pending`` nothing is started (returns ``None``) instead of refusing the request.
        """
        key = _key(num_tokens, block_hashes)
        entry = self._entries.get(req_id)
        if entry is not None and not self._current(entry, key):
            self._drop(req_id, entry)
            entry = None
        if entry is None:
            if admission and self._open >= self.config.lookup_max_pending:
                return None
            entry = self._submit(req_id, num_tokens, block_hashes, key, trace_headers)
        return entry

    def end_step(self) -> None:
        """The scheduling step is over: send what is still unsent, refresh the next step's wait budget."""
        self._flush()
        self._stepped = True
        self._sent_this_step = self._drained_this_step = False
        self.budget.new_step(time.perf_counter())
        self.observers.step_ended(self.budget.in_force_s, len(self._held), len(self.cache or ()),
                                  self.budget.last_interval_s)

    def discard(self, req_id: str) -> None:
        """Forget ``req_id``'s lookup (allocated, finished, aborted, preempted); an unsent one is never sent."""
        entry = self._entries.get(req_id)
        if entry is not None:
            self._drop(req_id, entry)

    def reset(self) -> bool:
        """Invalidate every answer held or in flight, then ask the server to wipe the store (fenced behind them).

        Waits for the server's acknowledgement up to ``lookup_reset_timeout_s``, as upstream's client waits
        for its server (which first drains in-flight puts).
        """
        self.generation += 1
        for req_id, entry in list(self._entries.items()):
            self._drop(req_id, entry)
        self.store_view.clear("reset")
        if self._closed:
            return False
        return self.transport.reset(self.config.lookup_reset_timeout_s)

    def close(self) -> None:
        """Drop every lookup and stop the transport; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for req_id, entry in list(self._entries.items()):
            self._drop(req_id, entry)
        self.transport.close()

    def has(self, req_id: str) -> bool:
        """True if a lookup (pending or answered) is held for ``req_id``."""
        return req_id in self._entries

    # -- internals -----------------------------------------------------------------------------------------
    def _current(self, entry: _Entry, key: _Key) -> bool:
        """Is ``entry`` still the lookup for this request: same prompt, same generation, answer still trusted?"""
        if entry.key != key or entry.rec.generation != self.generation:
            return False
        stale = None if entry.final is None else self.store_view.untrusted(entry.rec, time.perf_counter())
        if stale is not None:
            self.observers.answer_dropped(entry.rec, stale)
        return stale is None

    def _submit(self, req_id: str, num_tokens: int, block_hashes: Sequence[bytes], key: _Key,
                trace_headers: Mapping[str, str] | None) -> _Entry:
        rec = LookupRecord(req_id, num_tokens, len(block_hashes), self.transport.name, self.generation,
                           time.perf_counter(), trace_headers=trace_headers)
        refused: Outcome | None = None
        probe = False
        if self._closed:
            refused = Outcome.ERROR
        elif self._open >= self.config.lookup_max_pending:
            refused = Outcome.REJECTED
        elif not self.breaker.allow():
            refused = Outcome.BREAKER_OPEN
        else:
            probe = self.breaker.is_open
        job = None if refused else LookupJob(rec, block_hashes, self.config.timeout_s, self.observers)
        entry = _Entry(rec, key, job, probe)
        self._entries[req_id] = entry
        self._open += 1
        self.observers.submitted(rec)
        if refused is not None:
            self._settle(req_id, entry, Answer(refused, error=refused.value, local=True))
        elif not self._from_cache(req_id, entry, num_tokens):
            self._unsent.append(job)  # type: ignore[arg-type]
        return entry

    def _from_cache(self, req_id: str, entry: _Entry, num_tokens: int) -> bool:
        """Ask the prefix cache: it marks the blocks it knows (the server skips them); True if it answered all."""
        job = entry.job
        now = time.perf_counter()
        local = self.store_view.plan(job, num_tokens, now) if job is not None else None
        if local is None:
            return False
        hit, until = local  # every block that can count is known present, and no wipe was reported lately
        rec = entry.rec
        rec.from_cache = True
        rec.t_answer = now
        rec.valid_until = until
        self._settle(req_id, entry, Answer(Outcome.HIT, LookupResult(hit, (TailKeyBoundary(0, hit),)), local=True))
        return True

    def _tick(self, non_block: bool) -> None:
        """This step's drain and send, if not done yet: the first call of a step collects every answer that
        has arrived, then sends every lookup started since the last send (draining first: a reply cannot be
        back a few microseconds after its send, and reading the socket right after a send costs most)."""
        if not (self._stepped and self._drained_this_step):
            self._drained_this_step = True
            self.transport.collect()
        if not (self._stepped and non_block and self._sent_this_step) and self._unsent:
            self._flush(urgent=not non_block)

    def _flush(self, *, urgent: bool = False) -> None:
        """Send every unsent lookup, in one frame where the protocol allows."""
        if not self._unsent:
            return
        jobs, self._unsent = self._unsent, []
        self._sent_this_step = True
        now = time.perf_counter()
        view = self.store_view
        for job in jobs:
            job.rec.t_queued = now
            if job.known:
                view.recheck(job, now)
        try:
            self.transport.send(jobs, urgent=urgent)
        except TransportClosed:
            for job in jobs:
                job.finish(Answer(Outcome.ERROR, error="transport closed"))

    def _await(self, job: LookupJob, non_block: bool, called: float) -> None:
        """Send the step's lookups if due, collect arrived answers, and wait as much as this call may."""
        self._tick(non_block)
        if job.sent_at is None and job.answer is None and self.budget.left() > 0:
            self._flush(urgent=not non_block)  # a wait is allowed: send now, whatever was sent this step
        now = time.perf_counter()
        if job.answer is None and job.expired(now):
            self.transport.collect()  # its deadline passed since the step's drain: time it out now
        if job.answer is not None:
            return
        if non_block:
            wait = self.budget.left()
        else:
            wait = called + self.config.timeout_s - now
        if job.deadline is not None:
            wait = min(wait, job.deadline - now)
        if wait <= 0:
            return
        self.transport.collect(wait, until=job)
        if non_block:
            self.budget.spend(time.perf_counter() - now)
        if job.sent_at is not None:  # what the wait took: the share of the round trip not spent on other work
            if job.answer is not None and job.rec.t_answer is not None:
                self.budget.observe(job.rec.t_answer - max(now, job.sent_at))
            else:
                self.budget.observe(None)  # the wait ran out first
        if job.answer is None and job.expired(time.perf_counter()):
            self.transport.collect()  # the deadline passed while waiting: let the transport time it out

    def _settle(self, req_id: str, entry: _Entry, answer: Answer) -> LookupResult:
        """The caller has its answer: record it, feed the breaker, hold it if it is worth holding."""
        rec = entry.rec
        if answer.result.hit_length >= rec.num_tokens > 0:
            answer = Answer(Outcome.ERROR, error=f"the server claimed {answer.result.hit_length} cached tokens of a "
                                                 f"{rec.num_tokens}-token prompt; the last token must be computed")
        rec.outcome = answer.outcome
        rec.hit_tokens = answer.result.hit_length
        rec.error = answer.error
        rec.t_consume = time.perf_counter()
        job = entry.job
        if answer.evidence and job is not None and job.sent_at is not None:  # refusals teach nothing: busy is no wipe
            self.breaker.record(not answer.failed)
            rec.valid_until = self.store_view.valid_until(job)
            if answer.failed:
                self.store_view.failed(answer.outcome is Outcome.ERROR)  # the master may have restarted
            else:
                self.store_view.remember(job, answer.result.hit_length)
        elif entry.probe:  # a probe turned away busy says nothing: let the next one through at once
            self.breaker.probe_abandoned()
        self._open -= 1
        self.observers.consumed(rec)
        entry.final = answer
        entry.job = None
        if answer.kept:
            self._hold(req_id)
        else:  # failed or refused: not held, the next call asks again
            del self._entries[req_id]
        return answer.result

    def _hold(self, req_id: str) -> None:
        self._held[req_id] = None
        while len(self._held) > self.config.lookup_max_held:  # the oldest go first
            old, _ = self._held.popitem(last=False)
            entry = self._entries.pop(old, None)
            if entry is not None:
                self.observers.answer_dropped(entry.rec, "evicted")

    def _drop(self, req_id: str, entry: _Entry) -> None:
        del self._entries[req_id]
        if entry.final is not None:
            self._held.pop(req_id, None)
            return
        job = entry.job
        if job is not None:
            self.transport.forget(job)
            if job.answer is not None and job.sent_at is not None:
                self.breaker.record(not job.answer.failed)
            elif entry.probe:
                self.breaker.probe_abandoned()
        rec = entry.rec
        rec.outcome = Outcome.DISCARDED
        rec.t_consume = time.perf_counter()
        self._open -= 1
        self.observers.discarded(rec)


__all__ = ["LookupClient"]

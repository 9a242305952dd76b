"""LookupClient: vLLM's ``LookupKeyClient`` calls, bounded in time, in memory and in trust.

What the scheduler can count on:

* ``lookup(..., non_block=True)`` never waits longer than ``lookup_wait_us`` (default 0); ``non_block=False``
  never longer than ``lookup_timeout_ms``. Past the deadline the answer is a miss, counted as a timeout.
* After ``lookup_breaker_failures`` consecutive failures, lookups answer a miss at once for
  ``lookup_breaker_cooldown_s``, then one probe decides.
* At most ``lookup_max_pending`` lookups wait for an answer; past it a lookup is a miss at once (rejected).
* An answer is served only for the request it was asked for (same ``num_tokens``, same hashes) and the
  current generation (``reset`` bumps it). It is kept until ``discard`` so a retry costs no round trip.
* Store errors and timeouts are reported as such to observers, never as plain misses.

All bookkeeping lives on the caller's thread; the transport's thread only writes a job's answer.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from mooncake_lookout.connector.breaker import CircuitBreaker
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.events import LookupObserver, LookupRecord, ObserverSet, Outcome
from mooncake_lookout.connector.job import Answer, LookupJob, LookupResult
from mooncake_lookout.connector.transport.base import Transport, TransportClosed

_Key = tuple[int, int, bytes]


class _Entry:
    """One request's lookup as the client tracks it."""

    __slots__ = ("rec", "job", "key", "final", "probe")

    def __init__(self, rec: LookupRecord, key: _Key, job: LookupJob | None, final: Answer | None,
                 probe: bool) -> None:
        self.rec = rec
        self.key = key
        self.job = job
        self.final = final  # set once the caller has the answer
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
            transport.on_late_reply = self.observers.late_reply
        self.breaker = CircuitBreaker(
            config.lookup_breaker_failures, config.lookup_breaker_cooldown_s,
            probe_timeout_s=config.timeout_s, on_change=self.observers.breaker_changed)
        self.generation = 0
        self.pending = 0
        # How long a non-blocking lookup may wait for its answer; the scheduler adapter lowers it as a step's
        # budget is spent.
        self.wait_s = config.wait_s
        # A hit is never the whole prompt: the last token must be computed (vLLM #55113). The scheduler
        # adapter sets its block size so a capped hit stays block-aligned.
        self.hit_block_size = 1
        self._entries: dict[str, _Entry] = {}
        self._answered: OrderedDict[str, None] = OrderedDict()  # answered entries kept for retries, oldest first
        self._closed = False

    @classmethod
    def from_vllm_config(cls, vllm_config: Any, *, observer: LookupObserver | None = None) -> LookupClient:
        """Build the client the way vLLM's connector would: config from ``kv_connector_extra_config``."""
        from mooncake_lookout.connector.addresses import lookup_address
        from mooncake_lookout.connector.transport import make_transport

        config = LookupConfig.from_extra_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        return cls(config, make_transport(config, lookup_address(vllm_config, config)), observer=observer)

    # -- the scheduler's calls ---------------------------------------------------------------------------
    def lookup(self, req_id: str, num_tokens: int, block_hashes: Sequence[bytes], non_block: bool = False,
               *, wait_s: float | None = None) -> LookupResult | None:
        """The hit for ``req_id``, or ``None`` while it is pending (``non_block``: ask again on a later step).

        A non-blocking call may wait ``wait_s`` (default: :attr:`wait_s`, from ``lookup_wait_us``) for an
        almost-ready answer before deferring; a blocking one waits until the deadline at most.
        """
        if wait_s is None:
            wait_s = self.wait_s
        entry = self.start(req_id, num_tokens, block_hashes)
        if entry.final is None:
            job = entry.job
            assert job is not None
            answer = job.answer
            if answer is None:
                wait = job.remaining() if not non_block else min(wait_s, job.remaining())
                if wait > 0:
                    job.done.wait(wait)
                    answer = job.answer
                if answer is None:
                    if non_block and job.remaining() > 0:
                        entry.rec.deferrals += 1
                        self.observers.deferred(entry.rec)
                        return None
                    answer = Answer(Outcome.TIMEOUT, error="no answer before the deadline")
            self._settle(req_id, entry, answer)
        return entry.final.result  # type: ignore[union-attr]


    def start(self, req_id: str, num_tokens: int, block_hashes: Sequence[bytes]) -> _Entry:
        """Make sure a current lookup exists for this request (e.g. at admission); never waits."""
        key = _key(num_tokens, block_hashes)
        entry = self._entries.get(req_id)
        if entry is not None and (entry.key != key or entry.rec.generation != self.generation):
            self._drop(req_id, entry)  # the request changed, or a reset came: its answer is stale
            entry = None
        if entry is None:
            entry = self._submit(req_id, num_tokens, block_hashes, key)
        return entry

    def discard(self, req_id: str) -> None:
        """Forget ``req_id``'s lookup (finished, aborted, preempted); an unsent one is never sent."""
        entry = self._entries.get(req_id)
        if entry is not None:
            self._drop(req_id, entry)

    def reset(self) -> bool:
        """Invalidate every answer held or in flight, then ask the server to wipe the store (fenced behind them)."""
        self.generation += 1
        for req_id, entry in list(self._entries.items()):
            self._drop(req_id, entry)
        if self._closed:
            return False
        return self.transport.reset(max(self.config.timeout_s, 1.0))

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
    def _submit(self, req_id: str, num_tokens: int, block_hashes: Sequence[bytes], key: _Key) -> _Entry:
        now = time.perf_counter()
        rec = LookupRecord(req_id, num_tokens, len(block_hashes), self.transport.name, self.generation, now)
        refused: Outcome | None = None
        probe = False
        if self._closed:
            refused = Outcome.ERROR
        elif self.pending >= self.config.lookup_max_pending:
            refused = Outcome.REJECTED
        elif not self.breaker.allow():
            refused = Outcome.BREAKER_OPEN
        else:
            probe = self.breaker.is_open
        entry = _Entry(rec, key, None, None, probe)
        self._entries[req_id] = entry
        self.pending += 1
        self.observers.submitted(rec)
        if refused is None:
            job = LookupJob(rec, list(block_hashes), now + self.config.timeout_s, self.observers)
            try:
                self.transport.submit(job)
                entry.job = job
            except TransportClosed:
                refused = Outcome.ERROR
        if refused is not None:
            self._settle(req_id, entry, Answer(refused, error=refused.value))
        return entry

    def _settle(self, req_id: str, entry: _Entry, answer: Answer) -> None:
        """The caller has its answer: record it, feed the breaker, keep it for retries."""
        rec = entry.rec
        if answer.result.hit_length >= rec.num_tokens > 0:
            capped = (rec.num_tokens - 1) // self.hit_block_size * self.hit_block_size
            answer = Answer.from_result(dataclasses.replace(answer.result, hit_length=capped))
        entry.final = answer
        rec.outcome = answer.outcome
        rec.hit_tokens = answer.result.hit_length
        rec.error = answer.error
        rec.t_consume = time.perf_counter()
        if entry.job is not None:
            self.breaker.record(not answer.failed)
        self.pending -= 1
        self.observers.consumed(rec)
        self._answered[req_id] = None
        # Answers kept for retries are bounded too: the oldest go first.
        while len(self._answered) > self.config.lookup_max_pending:
            old, _ = self._answered.popitem(last=False)
            self._entries.pop(old, None)

    def _drop(self, req_id: str, entry: _Entry) -> None:
        del self._entries[req_id]
        if entry.final is not None:
            self._answered.pop(req_id, None)
            return
        job = entry.job
        if job is not None:
            job.cancelled = True
            if job.answer is not None:
                self.breaker.record(not job.answer.failed)
            elif entry.probe:
                self.breaker.probe_abandoned()
        rec = entry.rec
        rec.outcome = Outcome.DISCARDED
        rec.t_consume = time.perf_counter()
        self.pending -= 1
        self.observers.discarded(rec)


__all__ = ["LookupClient"]

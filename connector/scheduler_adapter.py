"""The scheduler side: vLLM's ``MooncakeStoreScheduler`` with our lookup client in place of its own.

Upstream's logic (load specs, store jobs, block pinning) is inherited unchanged; this class only changes
how a lookup is started, waited for, timed and forgotten:

* an async lookup starts on vLLM's input thread as the request is built, during the model step, if
  ``lookup_on_arrival`` (:mod:`.input_thread`, :mod:`.arrivals`): its answer is usually in by the first call;
  only requests of this adapter's own engine core (the one whose scheduler holds its connector) reach it;
* else a lookup starts when the request arrives (``on_new_request``) if ``lookup_on_admission``; the lookups of
  a step leave together at the step's first call for a pending lookup (answers that came are served first;
  with the socket on this thread, a step's first few admissions leave at once), and
  :meth:`build_connector_meta` (once per step) tells the client the step is over (it sends what is left
  and sets the next step's wait budget);
* the connector binds vLLM's per-request and per-step calls straight to this class's methods (one call less
  each, every one of them cold after the model step);
* ``get_num_new_matched_tokens`` keeps vLLM's ``(None, False)`` = "ask again later" contract; it and
  ``on_new_request`` are timed as time the scheduler spent in the lookup path (``scheduler_call`` events);
* an answer is kept until the request is allocated, so a failed allocation costs no second round trip;
* lookups of finished, aborted and preempted requests are discarded.
* telemetry costs the scheduler an append per lookup: vLLM's stats record is wrapped from the client's step log
  at most every ``RECORD_EVERY_S`` (metrics/vllm_stats.py), and at once when the last request vLLM holds
  finishes (the engine may then go idle, and an idle engine asks for no record); spans only for lookups the
  ``OTEL_TRACES_SAMPLER`` keeps (the request's ``trace_headers`` ride on its lookup, so its span joins the
  request's trace), built on a thread of their own, handed over with each record.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.scheduler import MooncakeStoreScheduler

from mooncake_lookout.connector import input_thread
from mooncake_lookout.connector.addresses import lookup_address
from mooncake_lookout.connector.client import LookupClient
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.events import LookupObserver
from mooncake_lookout.connector.transport import PIPELINED, make_transport

_clock = time.perf_counter


def _one_block_per_hash(kv_cache_config: Any, scheduler: Any) -> bool:
    """True for the layout the prefix cache answers for itself: one full-attention cache group, one hash per
    block (then a hit is a count of leading blocks and its tail boundary is the hit itself)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    return (len(groups) == 1 and type(groups[0].kv_cache_spec).__name__ == "FullAttentionSpec"
            and not scheduler.enable_partial_hash_hits and scheduler._block_size == scheduler._hash_block_size)


def retire_upstream_client(client: Any) -> None:
    """Close a vLLM ``LookupKeyClient`` that never sent anything, context included (its ``close`` leaves the
    ZMQ context to the garbage collector, whose ``term()`` can then hang)."""
    client.close()
    client.ctx.term()


class LookoutMooncakeStoreScheduler(MooncakeStoreScheduler):
    """Upstream's scheduler-side connector logic over a deadline-bound, observable lookup client."""

    client: Any  # upstream's LookupKeyClient until __init__ replaces it with our LookupClient

    def __init__(self, vllm_config: Any, kv_cache_config: Any, *, owner: Any = None,
                 observer: LookupObserver | None = None) -> None:
        """``owner``: the KV connector vLLM's scheduler holds (``LookoutMooncakeStoreConnector``): requests its
        engine core builds reach this adapter on vLLM's input thread (:mod:`.input_thread`), and only those; with
        none, lookups start at admission."""
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        config = LookupConfig.from_extra_config(extra)  # fail on a bad key before anything starts
        if config.lookup_on_arrival and (owner is None or not input_thread.available()):  # no input-thread hook
            config = dataclasses.replace(config, lookup_on_arrival=False)  # the transport is chosen for admission
        super().__init__(vllm_config, kv_cache_config)
        # Upstream built its own LookupKeyClient; ours replaces it (it never sent anything).
        retire_upstream_client(self.client)
        self.lookup_config = config
        self.lookup_async = config.lookup_async
        self.client = LookupClient(config, make_transport(config, lookup_address(vllm_config, config)),
                                   observer=observer)
        if config.lookup_transport == PIPELINED and _one_block_per_hash(kv_cache_config, self):
            self.client.enable_prefix_cache(self._block_size)
        self.observers = self.client.observers
        self._mode = config.mode
        # vLLM's stats pipeline (served on vLLM's own /metrics), from the client's step log, and, if OTEL_* asks
        # for it, spans for the lookups the sampler keeps, built on a thread of their own.
        from mooncake_lookout.metrics.deployed import DeployedTelemetry

        self.telemetry = DeployedTelemetry.from_env(self.client)
        self._stats = self.telemetry.stats
        self._unfinished: set[str] = set()  # requests vLLM has and has not finished: none left, a record at once
        # Fixed once upstream's __init__ has run; read on every admission and every first call (each a cold call).
        self._align = self._hash_block_size if self.enable_partial_hash_hits else self._block_size
        self._start_at_admission = config.lookup_on_admission and self.enable_lookup
        # Async lookups start on vLLM's input thread as the request is built, when the transport allows it.
        self._arrivals = self.client.arrivals if self.enable_lookup else None
        self._owner = weakref.ref(owner) if owner is not None else None  # weakly: input_thread holds this adapter
        if self._arrivals is not None and not input_thread.listen(owner, self._request_built):
            self._arrivals = None

    def _request_built(self, request: Any) -> None:
        """vLLM's input thread built ``request``: send its lookup now (arrivals.py)."""
        arrivals = self._arrivals
        if arrivals is not None and request.num_tokens >= self._align:
            arrivals.send(request.request_id, request.num_tokens, request.block_hashes, request.trace_headers)

    def on_new_request(self, request: Any) -> None:
        """Start the lookup at admission, so its answer is usually ready by the first scheduling attempt."""
        req_id = request.request_id
        self._unfinished.add(req_id)
        num_tokens = request.num_tokens
        if not self._start_at_admission or num_tokens < self._align:
            return
        t0 = _clock()
        client = self.client
        client.start(req_id, num_tokens, request.block_hashes, trace_headers=request.trace_headers, admission=True)
        client.scheduler_call(self._mode, _clock() - t0)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Upstream's answer (``(None, False)`` while pending), timed as time spent blocking the scheduler.

        A request whose every hashed block vLLM has already computed is answered ``(0, False)`` at once: the store
        cannot add a token to it, whatever it holds, so asking (and deferring the request a step for it) buys
        nothing. A lookup started at admission is kept: should vLLM's count fall on a later try, it still serves.
        """
        t0 = _clock()
        if num_computed_tokens >= len(request.block_hashes) * self._hash_block_size:
            self.client.scheduler_call(self._mode, _clock() - t0)
            return 0, False
        if request.trace_headers and not self.lookup_config.lookup_on_admission and self.enable_lookup \
                and request.num_tokens >= self._align:  # started here: with the request's trace
            self.client.start(request.request_id, request.num_tokens, request.block_hashes,
                              trace_headers=request.trace_headers)
        answer = super().get_num_new_matched_tokens(request, num_computed_tokens)
        self.client.scheduler_call(self._mode, _clock() - t0)
        return answer

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """The answer has been used for an allocation: it need not be kept any longer."""
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        self.client.discard(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """The step is over: forget lookups of requests preempted this step (their prompt grew), and let the
        client send what is left and set the next step's wait budget."""
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self.client.discard(req_id)
        self.client.end_step()
        return super().build_connector_meta(scheduler_output)

    def request_finished(self, request: Any) -> None:
        """A finished or aborted request: drop its lookup, sent or not (most were dropped at allocation)."""
        req_id = request.request_id
        self._unfinished.discard(req_id)
        if req_id in self.client.by_request:
            self.client.discard(req_id)

    def take_stats(self) -> Any:
        """The lookup figures for vLLM's stats pipeline, or ``None`` (called once per step): vLLM finishes requests
        before it asks, so with none left this is the engine's last step before it idles, and the record is made
        now rather than at the next request."""
        stats = self._stats
        if self._unfinished and stats.clock() < stats.due:  # most steps: no record due, nothing else to do
            return None
        return self.telemetry.take(flush=not self._unfinished)

    def close(self) -> None:
        """Stop the lookup client and its transport, then flush spans (safe to call twice)."""
        if self._arrivals is not None:
            self._arrivals = None
            owner = self._owner() if self._owner is not None else None
            if owner is not None:  # (a collected connector left no listener behind)
                input_thread.stop(owner, self._request_built)
        self.client.close()
        self.telemetry.close()


__all__ = ["LookoutMooncakeStoreScheduler", "retire_upstream_client"]

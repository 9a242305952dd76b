"""Lookups sent from vLLM's input thread as a request arrives, and taken over by the client at admission.

Why: vLLM's engine core builds each request, block hashes and all, on its input thread while the model runs,
and its scheduler sees the request only at the next step. A lookup sent from the input thread has its round
trip overlap the model step, so its answer is usually in by the first ``schedule()`` that asks: the request is
not deferred a step for it. A lookup sent at admission (the step's start) cannot be answered in that step.

Threads: :meth:`Arrivals.send` runs on the input thread; everything else on the scheduler's thread. They share
one dict, under one lock, and the transport's hand-over (a deque append and an eventfd write, safe from any
thread). The input thread makes the :class:`Lookup` and hands it to the transport; the scheduler's thread
reads it only once :meth:`Arrivals.take` has taken it out of the dict. The input thread also reads the prefix
cache, as one ``(epoch, cache)`` snapshot (:class:`StoreView`): the blocks it marks known carry the epoch they
were found in, whatever the scheduler's thread hears meanwhile; the generation is read before it, so a reset
in between is caught at :meth:`Arrivals.take`.

What it must not break (docs/reliability.md, "No stale hit"): a lookup is taken only for the request it was
made for (same prompt, same generation), and only if it was sent after the last reset was handed over, so the
server answered it after the wipe. Its answer is then judged as any other: its trust starts at its send.

Every lookup sent ends with an outcome: taken over, it is the client's like any other; else it is dropped, on the
scheduler's thread, as ``discarded`` with a reason (:data:`DROP_REASONS`, reported through ``dropped``): its
request never claimed it before its deadline (``unclaimed``: aborted before admission, or not asked about in
time), claimed it with another prompt (``prompt_changed``), was fenced by a reset (``reset``), or the client
closed (``closed``). Its reply, in time, is then no late reply (transport/base.py, ``forget``): the server was not
slow, the request went away.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mooncake_lookout.connector.lookup import Lookup
from mooncake_lookout.connector.prefix_cache import StoreView
from mooncake_lookout.connector.transport.base import Transport, TransportClosed

_clock = time.perf_counter

# Why a lookup sent at arrival was dropped (the ``reason`` label of metrics/catalogue.py's ``arrivals_dropped``).
UNCLAIMED, PROMPT_CHANGED, RESET, CLOSED = "unclaimed", "prompt_changed", "reset", "closed"
DROP_REASONS: tuple[str, ...] = (UNCLAIMED, PROMPT_CHANGED, RESET, CLOSED)


class Arrivals:
    """Lookups sent at arrival and not yet taken (at most ``max_pending`` counting the client's open ones)."""

    def __init__(self, transport: Transport, *, timeout_s: float, max_pending: int,
                 generation: Callable[[], int], open_lookups: Callable[[], int],
                 breaker_closed: Callable[[], bool], store_view: StoreView | None = None,
                 dropped: Callable[[Lookup, str], None] | None = None) -> None:
        self._transport = transport
        self._dropped = dropped  # told of each lookup dropped, and why (scheduler's thread)
        self._timeout_s = timeout_s
        self._max_pending = max_pending
        self._generation = generation
        self._open_lookups = open_lookups
        self._breaker_closed = breaker_closed
        self._view = store_view
        self._lock = threading.Lock()
        self._sent: dict[str, Lookup] = {}  # request id -> its lookup, oldest first
        self._not_before = float("-inf")  # a lookup sent before this (the last reset's hand-over) is never taken
        self._closed = False

    def __len__(self) -> int:
        return len(self._sent)

    # -- vLLM's input thread ----------------------------------------------------------------------------------
    def send(self, req_id: str, num_tokens: int, block_hashes: Sequence[bytes],
             trace_headers: Mapping[str, str] | None = None) -> bool:
        """Send ``req_id``'s lookup now, without the blocks the prefix cache knows (as an admission would); False
        when none is sent (closed, breaker open, at the pending bound, or the cache alone answers it)."""
        if self._closed or not block_hashes or not self._breaker_closed() \
                or len(self._sent) + self._open_lookups() >= self._max_pending:
            return False
        with self._lock:
            if req_id in self._sent:
                return False
        lk = Lookup(req_id, num_tokens, block_hashes, self._transport.name, self._generation(), _clock(),
                    self._timeout_s, trace_headers)
        lk.adopted = False
        lk.t_queued = lk.t_submit
        view = self._view
        if view is not None and view.cache is not None \
                and view.plan(lk, num_tokens, lk.t_submit, touch=False) is not None:
            return False  # the prefix cache answers it at admission, with no round trip
        try:
            self._transport.send([lk])  # sets its send time and deadline, then hands it over
        except TransportClosed:
            return False
        with self._lock:  # listed once sent: what the scheduler's thread takes has every field set
            self._sent[req_id] = lk
        return True

    # -- the scheduler's thread -------------------------------------------------------------------------------
    def take(self, req_id: str, num_tokens: int, block_hashes: Sequence[bytes], generation: int) -> Lookup | None:
        """``req_id``'s lookup if one was sent for this very prompt in this generation since the last reset,
        else ``None`` (one that does not fit is dropped: ``reset`` or ``prompt_changed``)."""
        with self._lock:
            lk = self._sent.pop(req_id, None)
        if lk is None:
            return None
        fenced = lk.generation != generation or (lk.t_start or 0.0) <= self._not_before
        if not fenced and lk.asks_for(num_tokens, block_hashes, generation):
            lk.adopted = True
            return lk
        self._drop(lk, RESET if fenced else PROMPT_CHANGED)
        return None

    def sweep(self, now: float, reason: str = UNCLAIMED) -> None:
        """Drop lookups of requests that never claimed them (aborted before admission, say) once past their
        deadline."""
        sent = self._sent
        if not sent:
            return
        horizon = now - self._timeout_s
        with self._lock:
            stale = [r for r, lk in sent.items() if lk.t_submit < horizon]
            gone = [sent.pop(r) for r in stale]
        for lk in gone:
            self._drop(lk, reason)

    def reset(self) -> None:
        """A reset was handed over: every lookup sent before it is dropped, now or when it is taken."""
        self._not_before = _clock()
        self.sweep(float("inf"), RESET)

    def close(self) -> None:
        """Send nothing more; drop what was sent."""
        self._closed = True
        self.sweep(float("inf"), CLOSED)

    def _drop(self, lk: Lookup, reason: str) -> None:
        """Nobody will take ``lk``: its reply is not waited for, and it ends ``discarded`` for ``reason``."""
        self._transport.forget(lk)
        if self._dropped is not None:
            self._dropped(lk, reason)


def arrivals_for(client: Any, transport: Transport, *, enabled: bool) -> Arrivals | None:
    """The client's :class:`Arrivals`, when on and the transport can take a hand-over from any thread."""
    if not enabled or not getattr(transport, "sends_from_any_thread", False):
        return None
    return Arrivals(transport, timeout_s=client.config.timeout_s, max_pending=client.config.lookup_max_pending,
                    generation=lambda: client.generation, open_lookups=lambda: client.pending,
                    breaker_closed=lambda: client.breaker.closed, store_view=client.store_view,
                    dropped=client.arrival_dropped)


__all__ = ["Arrivals", "CLOSED", "DROP_REASONS", "PROMPT_CHANGED", "RESET", "UNCLAIMED", "arrivals_for"]

"""An answer's end on the scheduler's thread: served while trusted, held until allocation, or dropped.

Why apart from the asking (client.py): what may be served is the product's promise (docs/reliability.md, "No
stale hit"), and it reads best in one place. A mixin of :class:`~mooncake_lookout.connector.client.LookupClient`,
which owns the fields.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from mooncake_lookout.connector.lookup import ERROR, HIT, MISS, TIMEOUT, Lookup, Outcome

if TYPE_CHECKING:
    from mooncake_lookout.connector.breaker import CircuitBreaker
    from mooncake_lookout.connector.config import LookupConfig
    from mooncake_lookout.connector.events import ObserverSet
    from mooncake_lookout.connector.prefix_cache import StoreView
    from mooncake_lookout.connector.step_log import StepLog
    from mooncake_lookout.connector.transport.base import Transport

_clock = time.perf_counter


class Answers:
    """Serving, holding and dropping answers (the client's fields, declared for the type checker)."""

    config: LookupConfig
    transport: Transport
    breaker: CircuitBreaker
    store_view: StoreView
    log: StepLog | None
    _ev: ObserverSet | None
    _open: int
    _lookups: dict[str, Lookup]
    _held: dict[str, None]

    if TYPE_CHECKING:  # the client's and Reporting's (declared only: a stub here would hide them at run time)
        def _ask(self, req_id: str, num_tokens: int, block_hashes: Sequence[bytes], non_block: bool,
                 trace_headers: Mapping[str, str] | None, called: float, lk: Lookup | None) -> Lookup | None: ...

        def _dropped(self, lk: Lookup, reason: str, *, forget: bool = True) -> None: ...

        def _ended(self, lk: Lookup) -> None: ...

    def _serve(self, lk: Lookup, non_block: bool, called: float) -> Lookup | None:
        """Serve ``lk``'s answer if it may be served now (docs/reliability.md, "No stale hit"), else drop it."""
        view = self.store_view
        if lk.outcome is HIT and not (lk.local or lk.refused) and lk.t_start is not None:
            lk.valid_until = view.valid_until(lk)  # a hit is trusted no longer than the checks behind it
        why = view.untrusted(lk, _clock())
        if why is None:
            return self._settle(lk)
        # Wiped (or a store error) since, or past its blocks' trust: ask again (a blocking call within its bound).
        self._dropped(lk, why)
        return None if non_block else self._ask(lk.req_id, lk.num_tokens, lk.block_hashes, False, lk.trace_headers,
                                                called, None)

    def _settle(self, lk: Lookup) -> Lookup:
        """The caller has its answer: record it, feed the breaker, hold it if it is worth holding."""
        now = _clock()
        if lk.hit_length >= lk.num_tokens > 0:
            lk.error = (f"the server claimed {lk.hit_length} cached tokens of a {lk.num_tokens}-token prompt; "
                        f"the last token must be computed")
            lk.outcome, lk.hit_length, lk.tail_key_boundaries = ERROR, 0, ()
        lk.t_consume, outcome = now, lk.outcome
        if not (lk.local or lk.refused) and lk.t_start is not None:  # refusals teach nothing: busy is no wipe
            self.breaker.record(not (failed := outcome is ERROR or outcome is TIMEOUT))
            lk.valid_until = lk.valid_until or self.store_view.valid_until(lk)
            if failed:
                self.store_view.failed(lk.outcome is ERROR, lk.t_answer or now)  # the master may have restarted
            elif self.store_view.cache is not None:
                self.store_view.remember(lk, lk.hit_length)
        elif lk.probe:  # a probe turned away busy says nothing: let the next one through at once
            self.breaker.probe_abandoned()
        self._open -= 1
        if self.log is not None:
            self._ended(lk)
        if self._ev is not None:
            self._ev.consumed(lk)
        if not (outcome is MISS or outcome is HIT and self.store_view.proven):
            # Failed or refused: not held, the next call asks again. A hit while the lease is unproven (no store
            # epoch named: the server has not shown the master's lease covers lookup_answer_ttl_ms) is served to
            # this call only, as upstream's client serves it: held, it could outlive a lease shorter than the ttl.
            del self._lookups[lk.req_id]
            return lk
        lk.held, held = True, self._held
        held[lk.req_id] = None
        while len(held) > self.config.lookup_max_held:  # the oldest go first
            if (gone := self._lookups.pop(old := next(iter(held)), None)) is not None:
                self._dropped(gone, "evicted", forget=False)
            del held[old]
        return lk

    def _drop(self, lk: Lookup) -> None:
        if self._lookups.get(req_id := lk.req_id) is lk:
            del self._lookups[req_id]
        if lk.held or lk.t_consume is not None:  # answered (held, or failed and not held): counted already
            self._held.pop(req_id, None)
            return
        self.transport.forget(lk)
        if lk.evidence and lk.t_start is not None:
            self.breaker.record(not lk.failed)
        elif lk.probe:
            self.breaker.probe_abandoned()
        lk.outcome, lk.t_consume = Outcome.DISCARDED, _clock()
        self._open -= 1
        self._ended(lk)
        if self._ev is not None:
            self._ev.discarded(lk)


__all__ = ["Answers"]

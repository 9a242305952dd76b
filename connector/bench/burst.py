"""Bench scenario (b): a burst of N new requests, time until every answer is ready.

Why: vLLM's lookup channel carries one lookup at a time, so a burst of N new requests needs about N round
trips before the last answer, while one ``batch_is_exist`` of all their keys takes a few milliseconds.
:func:`burst` measures the scheduler's view: every request is asked once (``non_block=True``) in the
first step, then each pending one is asked again once per ``step_s`` until all have an answer. Any client
with vLLM's ``lookup(req_id, num_tokens, block_hashes, non_block)`` call fits (ours, or vLLM's
``LookupKeyClient``). Ours is driven as our scheduler adapter drives it: each request's lookup is started
when it arrives (``start(admission=True)``, vLLM's ``on_new_request``), every step ends with ``end_step``
(``build_connector_meta``), and an answered request is discarded (allocated).

:func:`run` does it for upstream's client and ours with each transport, the same requests, the same
server process and store. Our client gets a deadline long enough that no answer in the burst is a timeout
(checked: the hit tokens of every client must agree). Ours is wired as in production (:mod:`.wiring`); one
more row with every span recorded shows what a span per lookup costs a burst.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mooncake_lookout.connector.bench.call import CLIENTS, make_client
from mooncake_lookout.connector.bench.rig import ClientMaker
from mooncake_lookout.connector.bench.wiring import ALWAYS_ON, PRODUCTION, label
from mooncake_lookout.connector.rigs.workload import WorkloadRequest, shared_prefix_workload


class PollingClient(Protocol):
    """vLLM's lookup client calls, as the scheduler uses them."""

    def lookup(self, req_id: str, num_tokens: int, block_hashes: list[bytes], non_block: bool = False) -> Any: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class BurstResult:
    """What one burst took: wall time until the last answer, scheduler steps, answers and total hit tokens."""

    n: int
    seconds: float
    steps: int
    hit_tokens: int


def burst(client_factory: Callable[[], PollingClient], n: int = 256, step_s: float = 0.001, *,
          requests: Sequence[WorkloadRequest] | None = None, timeout_s: float = 30.0) -> BurstResult:
    """Ask ``n`` lookups in one step, then poll the pending ones once per ``step_s``; time until all answered.

    ``requests`` defaults to ``n`` requests of 8 blocks with 4 shared ones (``shared_prefix_workload``).
    """
    reqs = list(requests) if requests is not None else shared_prefix_workload(n)
    client = client_factory()
    ours = hasattr(client, "end_step")  # our client: started at arrival, told when a step ends
    try:
        pending = {r.req_id: r for r in reqs}
        hit_tokens = 0
        steps = 0
        t0 = time.perf_counter()
        if ours:
            for r in reqs:
                client.start(r.req_id, r.num_tokens, list(r.block_hashes), admission=True)  # type: ignore[attr-defined]
        while pending:
            for req_id, r in list(pending.items()):
                result = client.lookup(req_id, r.num_tokens, list(r.block_hashes), non_block=True)
                if result is not None:
                    hit_tokens += result.hit_length
                    del pending[req_id]
                    if ours:
                        client.discard(req_id)  # type: ignore[attr-defined]
            if ours:
                client.end_step()  # type: ignore[attr-defined]
            if not pending:
                break
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(f"{len(pending)} of {len(reqs)} lookups unanswered after {timeout_s} s")
            steps += 1
            time.sleep(step_s)
        return BurstResult(len(reqs), time.perf_counter() - t0, steps, hit_tokens)
    finally:
        client.close()


class _Closing:
    """Gives a client the ``close`` that :func:`burst` calls, with a safe close for upstream's."""

    def __init__(self, client: Any, close: Any) -> None:
        self.client, self._close = client, close

    def lookup(self, *args: Any, **kwargs: Any) -> Any:
        return self.client.lookup(*args, **kwargs)

    def close(self) -> None:
        self._close()

    def __getattr__(self, name: str) -> Any:  # the client's other calls (ours: start, end_step, discard)
        return getattr(self.client, name)


def run(rig: ClientMaker, requests: Sequence[WorkloadRequest], *, repeats: int = 3, step_s: float = 0.001,
        names: Sequence[str] = CLIENTS) -> dict[str, Any]:
    """Scenario (b): per client of ``names``, the median of ``repeats`` bursts (seconds, steps, hit tokens)."""
    n = len(requests)
    out: dict[str, Any] = {"n": n}
    # The always-on row is a diagnosis, not a target: ours pipelined with a span recorded for every lookup.
    rows = [(name, PRODUCTION) for name in names] + ([("ours/pipelined", ALWAYS_ON)] if "ours/pipelined" in names
                                                     else [])
    for name, wiring in rows:
        runs = []
        for i in range(repeats):
            tagged = [type(r)(f"b{i}-{r.req_id}", r.num_tokens, r.block_hashes) for r in requests]

            def factory(name: str = name, wiring: str = wiring) -> _Closing:
                return _Closing(*make_client(rig, name, wiring, timeout_ms=30_000.0, max_pending=max(1024, 2 * n),
                                             lookup_async=True))

            runs.append(burst(factory, n, step_s, requests=tagged, timeout_s=60.0))
        out[label(name, wiring)] = {"seconds": statistics.median(r.seconds for r in runs),
                                    "all_seconds": [r.seconds for r in runs],
                                    "steps": statistics.median(r.steps for r in runs),
                                    "hit_tokens": runs[0].hit_tokens}
    return out


__all__ = ["BurstResult", "PollingClient", "burst", "run"]

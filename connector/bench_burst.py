"""Bench scenario (b): a burst of N new requests, time until every answer is ready.

Why: upstream's channel carries one lookup at a time, so N arrivals cost about N round trips before
the last answer. Uses :func:`burst.burst` (ask all in one step, poll the pending once per step) for
upstream's client and ours with each transport, the same requests, the same server process and store.
Our client gets a deadline long enough that no answer in the burst is a timeout (checked: the hit
tokens of every client must agree). Ours runs with metrics and spans on; one more row without spans
shows what the span started on each submit costs a burst.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from mooncake_lookout.connector.bench_call import CLIENTS, NO_SPANS, make_client
from mooncake_lookout.connector.bench_rig import Rig
from mooncake_lookout.connector.burst import burst
from mooncake_lookout.connector.workload import WorkloadRequest


class _Closing:
    """Gives a client the ``close`` that :func:`burst` calls, with a safe close for upstream's."""

    def __init__(self, client: Any, close: Any) -> None:
        self.client, self._close = client, close

    def lookup(self, *args: Any, **kwargs: Any) -> Any:
        return self.client.lookup(*args, **kwargs)

    def close(self) -> None:
        self._close()


def run(rig: Rig, requests: Sequence[WorkloadRequest], *, repeats: int = 3, step_s: float = 0.001) -> dict[str, Any]:
    """Scenario (b): per client, the median of ``repeats`` bursts (seconds, steps, hit tokens)."""
    n = len(requests)
    out: dict[str, Any] = {"n": n}
    # The last row is a diagnosis, not a target: ours pipelined with metrics but no spans.
    for name in (*CLIENTS, NO_SPANS):
        runs = []
        for i in range(repeats):
            tagged = [type(r)(f"b{i}-{r.req_id}", r.num_tokens, r.block_hashes) for r in requests]

            def factory(name: str = name) -> _Closing:
                spans = name != NO_SPANS
                return _Closing(*make_client(rig, name if spans else "ours/pipelined", spans=spans,
                                             timeout_ms=30_000.0, max_pending=max(1024, 2 * n)))

            runs.append(burst(factory, n, step_s, requests=tagged, timeout_s=60.0))
        out[name] = {"seconds": statistics.median(r.seconds for r in runs), "all_seconds": [r.seconds for r in runs],
                     "steps": statistics.median(r.steps for r in runs), "hit_tokens": runs[0].hit_tokens}
    return out


__all__ = ["run"]

"""Bench scenario (a): what one lookup call costs the scheduler's thread, upstream's client vs ours.

Why: the scheduler calls the lookup path for every waiting request on every step; what that call
costs is paid by every request in the batch. Sync: the whole blocking round trip. Async: the first
call (submit) and the per-lookup total over the polls a scheduler makes once per model step until the
answer is there. Our client runs with metrics and spans on (Prometheus sink + OTel tracer), the
harder case; upstream's has neither.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from mooncake_lookout.connector.bench.rig import Rig, close_upstream_client, summary_us
from mooncake_lookout.connector.rigs.workload import WorkloadRequest
from mooncake_lookout.metrics.in_memory import observers_with_telemetry

CLIENTS = ("upstream", "ours/upstream-wire", "ours/pipelined")
NO_SPANS = "ours/pipelined, no spans"


def make_client(rig: Rig, name: str, telemetry: bool = True, *, metrics: bool = True, spans: bool = True,
                **config: Any) -> tuple[Any, Callable[[], None]]:
    """One of :data:`CLIENTS` and the function that closes it (``metrics`` / ``spans``: which telemetry)."""
    if name == "upstream":
        client = rig.upstream_client()
        return client, lambda: close_upstream_client(client)
    observers = observers_with_telemetry(metrics=metrics, spans=spans)[0] if telemetry else []
    client = rig.our_client(name.split("/")[1].replace("-wire", ""), observers, **config)
    return client, client.close


def _forget(client: Any, req_id: str) -> None:
    """What the scheduler does once an answer is used: ours keeps answers until discarded."""
    discard = getattr(client, "discard", None)
    if discard is not None and hasattr(client, "pending"):
        discard(req_id)


def time_sync(client: Any, requests: Sequence[WorkloadRequest], tag: str,
              hit_tokens: list[int] | None = None) -> list[float]:
    """Seconds of each blocking ``lookup`` call (and each answer's hit tokens into ``hit_tokens``)."""
    out = []
    for r in requests:
        req_id = f"{tag}-{r.req_id}"
        hashes = list(r.block_hashes)
        t0 = time.perf_counter()
        result = client.lookup(req_id, r.num_tokens, hashes, non_block=False)
        out.append(time.perf_counter() - t0)
        if hit_tokens is not None:
            hit_tokens.append(result.hit_length if result is not None else -1)
        _forget(client, req_id)
    return out


def time_async(client: Any, requests: Sequence[WorkloadRequest], tag: str, step_s: float,
               max_polls: int = 10_000) -> tuple[list[float], list[float], list[int]]:
    """Per lookup: the first call's seconds, all calls' seconds added up, and the polls it took."""
    first, total, polls = [], [], []
    for r in requests:
        req_id = f"{tag}-{r.req_id}"
        hashes = list(r.block_hashes)
        spent = 0.0
        for n in range(max_polls):
            t0 = time.perf_counter()
            result = client.lookup(req_id, r.num_tokens, hashes, non_block=True)
            dt = time.perf_counter() - t0
            if n == 0:
                first.append(dt)
            spent += dt
            if result is not None:
                break
            time.sleep(step_s)  # the model's step between two scheduler calls
        total.append(spent)
        polls.append(n)
        _forget(client, req_id)
    return first, total, polls


def run(rig: Rig, requests: Sequence[WorkloadRequest], *, step_s: float = 0.001) -> dict[str, Any]:
    """Scenario (a) for every client; figures in microseconds, raw seconds under ``raw`` for plots."""
    out: dict[str, Any] = {"raw": {}}
    # The last row is a diagnosis, not a target: ours with metrics but no spans.
    for name in (*CLIENTS, NO_SPANS):
        client, close = (make_client(rig, "ours/pipelined", spans=False) if name == NO_SPANS
                         else make_client(rig, name, telemetry=True))
        try:
            time_sync(client, requests[:20], "warm")
            sync = time_sync(client, requests, "sync")
            first, total, polls = time_async(client, requests, "async", step_s)
        finally:
            close()
        out[name] = {"sync_call_us": summary_us(sync), "async_first_call_us": summary_us(first),
                     "async_per_lookup_us": summary_us(total), "async_mean_polls": sum(polls) / len(polls)}
        out["raw"][name] = {"sync": sync, "async_first": first}
    return out


__all__ = ["CLIENTS", "NO_SPANS", "make_client", "run", "time_async", "time_sync"]

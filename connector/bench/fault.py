"""Bench scenario (e): the store slowed (paused in short bursts) or stopped (paused), upstream vs ours; and ours in
async mode at its default deadline with the store stopped: every poll returns at once (async never blocks).

Why: a lookup path is only safe if a sick store cannot stall the scheduler. The master is frozen with
SIGSTOP (a real stall: every store call waits), either for good ("stopped") or 20 ms of every 40 ms
("slowed"). Upstream's blocking call has no deadline: it runs on a thread with a bounded wait and is
reported as "blocked > X s (still blocked)" if it has not returned; the master is then thawed so the
call can end and be cleaned up. Ours answers a miss, counted as a timeout, by its deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from mooncake_lookout.connector.bench.call import (
    CLIENTS,
    make_client,
    time_async,
    time_sync,
)
from mooncake_lookout.connector.bench.rig import Rig, summary_us
from mooncake_lookout.connector.rigs.workload import WorkloadRequest

TIMEOUT_MS = 100.0


class _Flicker:
    """Pauses and resumes the master in a loop (``stopped_s`` frozen of every ``period_s``) until stopped."""

    def __init__(self, master: Any, stopped_s: float = 0.02, period_s: float = 0.04) -> None:
        self.master, self.stopped_s, self.period_s = master, stopped_s, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-flicker", daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.master.pause()
            self._stop.wait(self.stopped_s)
            self.master.resume()
            self._stop.wait(self.period_s - self.stopped_s)

    def __enter__(self) -> _Flicker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self.master.resume()


def slowed(rig: Rig, requests: Sequence[WorkloadRequest]) -> dict[str, Any]:
    """Blocking calls and async polls while the store flickers; ours with a 100 ms deadline."""
    out: dict[str, Any] = {}
    for name in CLIENTS:
        client, close = make_client(rig, name, timeout_ms=TIMEOUT_MS)
        try:
            time_sync(client, requests[:5], "warm-slow")
            hits: list[int] = []
            with _Flicker(rig.master):
                sync = time_sync(client, requests, "slow-sync", hits)
                _, total, polls = time_async(client, requests, "slow-async", 0.001)
        finally:
            close()
        out[name] = {"sync_call_us": summary_us(sync), "async_per_lookup_us": summary_us(total),
                     "async_mean_polls": sum(polls) / len(polls), "sync_answers": len(hits),
                     "sync_hits": sum(1 for h in hits if h > 0)}
    return out


def stopped(rig: Rig, request: WorkloadRequest, *, wait_s: float = 3.0) -> dict[str, Any]:
    """One blocking lookup per client with the master frozen: how long the scheduler's call blocks."""
    out: dict[str, Any] = {"wait_s": wait_s}
    clients = {name: make_client(rig, name, timeout_ms=TIMEOUT_MS) for name in CLIENTS}
    try:
        for name, (client, _) in clients.items():  # warm: sockets connected, threads up
            time_sync(client, [request], f"warm-{name}")
        rig.master.pause()
        try:
            for name, (client, _) in clients.items():
                result: dict[str, Any] = {}

                def call(client: Any = client, result: dict[str, Any] = result, name: str = name) -> None:
                    t0 = time.perf_counter()
                    answer = client.lookup(f"stopped-{name}", request.num_tokens, list(request.block_hashes),
                                           non_block=False)
                    result["seconds"] = time.perf_counter() - t0
                    result["hit_tokens"] = answer.hit_length if answer is not None else None

                t = threading.Thread(target=call, name=f"bench-stopped-{name}", daemon=True)
                t.start()
                t.join(wait_s)
                if t.is_alive():
                    out[name] = {"blocked_s": None, "still_blocked_after_s": wait_s, "thread": t}
                else:
                    out[name] = {"blocked_s": result["seconds"], "hit_tokens": result["hit_tokens"]}
                if name != "upstream":
                    out[name]["deadline_ms"] = TIMEOUT_MS
        finally:
            rig.master.resume()
        for res in out.values():
            thread = res.pop("thread", None) if isinstance(res, dict) else None
            if thread is not None:
                t0 = time.perf_counter()
                thread.join(60.0)
                res["returned_after_resume_s"] = time.perf_counter() - t0
    finally:
        for _, close in clients.values():
            close()
    return out


def stopped_async(rig: Rig, request: WorkloadRequest, *, step_s: float = 0.001) -> dict[str, Any]:
    """Ours in async mode at its default deadline (``lookup_timeout_ms: auto``) with the master frozen: a poll a
    step until the lookup ends (a timeout, by its deadline); the longest poll is what the scheduler paid."""
    client, close = make_client(rig, "ours/pipelined", lookup_async=True)
    calls: list[float] = []
    answer = None
    try:
        time_sync(client, [request], "warm-async")
        deadline_ms = float(client.config.lookup_timeout_ms)
        rig.master.pause()
        try:
            t0 = time.perf_counter()
            while answer is None and time.perf_counter() - t0 < 60.0:
                c0 = time.perf_counter()
                answer = client.lookup("stopped-async", request.num_tokens, list(request.block_hashes),
                                       non_block=True)
                client.end_step()
                calls.append(time.perf_counter() - c0)
                time.sleep(step_s)  # the model's step
            ended_s = time.perf_counter() - t0
        finally:
            rig.master.resume()
    finally:
        close()
    return {"deadline_ms": deadline_ms, "polls": len(calls), "longest_call_ms": max(calls) * 1e3,
            "call_us": summary_us(calls), "ended_after_s": ended_s,
            "outcome": None if answer is None else answer.outcome.value}


def run(rig: Rig, requests: Sequence[WorkloadRequest], *, wait_s: float = 3.0) -> dict[str, Any]:
    """Scenario (e): ``slowed`` over ``requests``, then ``stopped`` with one of them, blocking then async."""
    return {"slowed": slowed(rig, requests), "stopped": stopped(rig, requests[0], wait_s=wait_s),
            "stopped_async": stopped_async(rig, requests[1])}


__all__ = ["TIMEOUT_MS", "run", "slowed", "stopped", "stopped_async"]

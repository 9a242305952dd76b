"""One engine of scenario (h)'s fleet: a lookup path in a process of its own, driven at a fixed rate.

Why: in a deployment every engine's scheduler runs its own lookup client against its own lookup server (in its
worker), and all of them ask one master. This process is one engine's scheduler side: it holds our client or
vLLM's, and on a command (:mod:`.child`: JSON in, JSON out) runs one phase of the fleet:

* it builds a fresh client (ours: pipelined, ``lookup_async``, its prefix cache on and telemetry wired as in
  production, :mod:`.wiring`, a deadline of :data:`TIMEOUT_MS`; vLLM's ``LookupKeyClient``), so no phase
  inherits another's cache;
* from ``start_at`` (wall clock, the same for every engine), requests arrive ``burst`` at a time, ``rate`` a
  second in all, ``seconds`` worth of them (:meth:`~.fleet_workloads.FleetWorkload.requests_in`); every step
  (a model step of ``step_s`` between two) asks each pending lookup once, as vLLM's scheduler asks a waiting
  request (ours: started at arrival, the step ended with ``end_step``, an answered request discarded); then it
  steps until every lookup is answered (bounded by ``drain_s`` after the last arrival);
* it reports each lookup's time from arrival to answer and steps deferred, the hit tokens, and the CPU time
  this process used (``time.process_time``: every thread of it), which the fleet keeps out of the master's.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Sequence
from typing import Any

from mooncake_lookout.connector.bench.fleet_workloads import BLOCK_SIZE, FleetWorkload
from mooncake_lookout.connector.bench.per_step import ask_once
from mooncake_lookout.connector.bench.rig import ClientMaker, close_upstream_client
from mooncake_lookout.connector.rigs.workload import WorkloadRequest
from mooncake_lookout.connector.transport.names import PIPELINED

MODULE = "mooncake_lookout.connector.bench.fleet_engine"
# Our client's deadline here: 1 s, not the default 100 ms. Eight engines, their servers and the master share two
# cores in the bench; a lookup starved of a core for 100 ms would turn into a timeout (then the breaker's
# answers), which asks the master nothing, and the fleet's figure is what the master does for every lookup.
TIMEOUT_MS = 1000.0
OURS, UPSTREAM_CLIENT = "ours", "upstream"


class Engine(ClientMaker):
    """The clients one engine builds: ours to its own lookup server, vLLM's to its own ``LookupKeyServer``."""

    def __init__(self, pipelined: str, rpc_port: int) -> None:
        from mooncake_lookout.connector.rigs.vllm_lookup_server import lookup_vllm_config

        self.pipelined = pipelined
        self.lookup_vllm_config = lookup_vllm_config(rpc_port)

    @property
    def addresses(self) -> dict[str, str]:
        return {PIPELINED: self.pipelined}

    def client(self, which: str) -> tuple[Any, Any]:
        """A fresh client of ``which`` (ours wired as in production, its prefix cache on) and its closer."""
        if which == UPSTREAM_CLIENT:
            upstream = self.upstream_client()
            return upstream, lambda: close_upstream_client(upstream, timeout_s=120.0)
        from mooncake_lookout.connector.bench.wiring import PRODUCTION, Wired

        ours = self.our_client(PIPELINED, (), lookup_async=True, timeout_ms=TIMEOUT_MS)
        ours.enable_prefix_cache(BLOCK_SIZE)
        wired = Wired(ours, PRODUCTION)
        return wired, wired.close


def drive(client: Any, ours: bool, requests: Sequence[WorkloadRequest], workload: FleetWorkload, *, seconds: float,
          step_s: float, start_at: float, drain_s: float) -> dict[str, Any]:
    """One phase (see the module docstring); times in microseconds, CPU in seconds."""
    while time.time() < start_at:
        time.sleep(min(0.002, max(0.0, start_at - time.time())))
    late_s = time.time() - start_at
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    interval = workload.burst / workload.rate
    next_at, k = t0, 0
    arrived_all = t0 + seconds
    pending: dict[str, tuple[int, list[bytes]]] = {}
    arrived: dict[str, float] = {}
    deferred: dict[str, int] = {}
    delays: list[int] = []
    steps: list[int] = []
    hit_tokens = 0
    while True:
        now = time.perf_counter()
        if k < len(requests):
            while next_at <= now and k < len(requests):
                for r in requests[k:k + workload.burst]:
                    hashes = list(r.block_hashes)
                    if ours:
                        client.start(r.req_id, r.num_tokens, hashes, admission=True)
                    pending[r.req_id] = (r.num_tokens, hashes)
                    arrived[r.req_id], deferred[r.req_id] = time.perf_counter(), 0
                k += workload.burst
                next_at += interval
            if k >= len(requests):
                arrived_all = time.perf_counter()
        elif not pending or now > arrived_all + drain_s:
            break
        answered = ask_once(client, ours, pending)
        done = time.perf_counter()
        for req_id, result in answered.items():
            delays.append(round((done - arrived.pop(req_id)) * 1e6))
            steps.append(deferred.pop(req_id))
            hit_tokens += result.hit_length
        for req_id in pending:
            deferred[req_id] += 1
        time.sleep(step_s)
    return {"arrived": min(k, len(requests)), "answered": len(delays), "unanswered": len(pending),
            "arrivals_s": arrived_all - t0,
            "delay_us": delays, "deferred_steps": steps, "hit_tokens": hit_tokens,
            "cpu_s": time.process_time() - cpu0, "seconds": time.perf_counter() - t0, "late_s": late_s}


def _handle(engine: Engine, index: int, command: dict[str, Any]) -> dict[str, Any]:
    workload = FleetWorkload(**command["workload"])
    count = workload.requests_in(command["seconds"])
    requests = workload.requests(count, index, command["tag"])
    which = command["client"]
    client, close = engine.client(which)
    try:
        return drive(client, which == OURS, requests, workload, seconds=command["seconds"],
                     step_s=command["step_s"], start_at=command["start_at"], drain_s=command["drain_s"])
    finally:
        close()


def main(argv: Sequence[str] | None = None) -> int:
    """The engine's process: build and drop one client of each kind (imports, warm-up), then serve phases."""
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    p.add_argument("--pipelined", required=True, help="this engine's lookup server (ours)")
    p.add_argument("--rpc-port", type=int, required=True, help="vLLM's lookup_rpc_port of this engine's server")
    p.add_argument("--index", type=int, required=True, help="the engine's number in the fleet")
    args = p.parse_args(argv)
    from mooncake_lookout.connector.bench.child import serve

    engine = Engine(args.pipelined, args.rpc_port)
    for which in (OURS, UPSTREAM_CLIENT):
        _, close = engine.client(which)
        close()
    gc.freeze()  # as vLLM's engine core does once started: no full collection of the start-up heap mid-phase
    return serve(lambda command: _handle(engine, args.index, command))


__all__ = ["MODULE", "OURS", "TIMEOUT_MS", "UPSTREAM_CLIENT", "Engine", "drive", "main"]

if __name__ == "__main__":
    sys.exit(main())

"""Bench scenario (j): contention, no fault. A healthy store on a busy machine must not turn into misses.

Why (issue 49, item 5): with nothing broken, a busy host made lookups late; a 100 ms deadline turned them into
timeouts, and a breaker that counted a slow frame's 16 timeouts as 16 failures turned those into seconds of
all-miss. A miss on a block the store holds is a recompute, so this scenario holds the lookup path to what the
store holds while the machine is contended, in two ways, each with a healthy real master:

* ``cpu hogs``: one pure-Python busy process per core (``os.cpu_count()``), at the same priority as everything
  else, so the lookup server, the master and the "scheduler" (this process) queue for CPU;
* ``gil loop``: a lookup server whose own process runs a pure-Python busy thread beside it (it holds the GIL
  but for the switch interval), as a model runner's Python thread does in vLLM's rank-0 worker.

Each client runs the same steps: :data:`ARRIVALS` new requests per step (their lookups start at admission), every
pending one asked again once a step, a :data:`MODEL_STEP_S` model step between steps (the issue's
``demo --model-step-ms 10``). Ours with its defaults (``lookup_timeout_ms: auto``, the breaker's defaults) runs
beside ours with no deadline worth the name (60 s, breaker off): the hit tokens a deadline may cost are the
difference; and, in async mode, ours with the 100 ms deadline async had before issue 49, with the round trips of
answered lookups (p99, p99.9, max): the measurements behind the per-mode defaults (docs/tuning.md). Upstream's
client (no deadline at all) runs beside them. Targets: :mod:`.targets` (j1..).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from mooncake_lookout.connector.bench.rig import ClientMaker, close_upstream_client, quantile, summary_us
from mooncake_lookout.connector.events import Outcome, OutcomeCounter
from mooncake_lookout.connector.rigs.processes import ChildProcess
from mooncake_lookout.connector.rigs.workload import WorkloadRequest
from mooncake_lookout.connector.transport.names import PIPELINED, UPSTREAM

MODEL_STEP_S = 0.01
ARRIVALS = 4
NO_DEADLINE = {"lookup_timeout_ms": 60_000.0, "lookup_breaker_failures": 10_000}  # the key's maximum; breaker off
FAILED = (Outcome.TIMEOUT, Outcome.BREAKER_OPEN, Outcome.ERROR)  # ended without the store's answer
# (label, client, lookup_async, config): ours at its defaults, ours with no deadline, upstream beside them.
VARIANTS: tuple[tuple[str, str, bool, dict[str, Any]], ...] = (
    ("ours async", "ours", True, {}),
    ("ours async, no deadline", "ours", True, NO_DEADLINE),
    ("ours async, 100 ms", "ours", True, {"lookup_timeout_ms": 100.0}),  # the async default before issue 49
    ("upstream async", "upstream", True, {}),
    ("ours sync", "ours", False, {}),
    ("ours sync, no deadline", "ours", False, NO_DEADLINE),
    ("upstream sync", "upstream", False, {}),
)
CONDITIONS = ("cpu hogs", "gil loop")
HOG = "while True: pass"


class CpuHogs:
    """One pure-Python busy process per core, started and stopped by pid (a context manager)."""

    def __init__(self, n: int | None = None) -> None:
        self.n = n or os.cpu_count() or 1
        self.children: list[ChildProcess] = []

    def __enter__(self) -> CpuHogs:
        try:
            for i in range(self.n):
                self.children.append(ChildProcess([sys.executable, "-c", HOG], name=f"cpu-hog-{i}"))
        except BaseException:
            self.__exit__()
            raise
        return self

    @property
    def pids(self) -> list[int]:
        """The hogs' pids."""
        return [c.pid for c in self.children]

    def __exit__(self, *exc: object) -> None:
        for child in self.children:
            child.kill()
        self.children = []


class _Beside(ClientMaker):
    """Clients of a second server process (the GIL-loop one) on the rig's master."""

    def __init__(self, servers: Any, lookup_vllm_config: Any) -> None:
        self.servers = servers
        self.lookup_vllm_config = lookup_vllm_config

    @property
    def addresses(self) -> dict[str, str]:
        """Transport -> address of the GIL-loop server process's servers."""
        return dict(self.servers.addresses)


def drive(maker: ClientMaker, label: str, name: str, lookup_async: bool, config: dict[str, Any],
          requests: Sequence[WorkloadRequest], steps: int) -> dict[str, Any]:
    """``steps`` scheduler steps of one client; its outcomes, hit tokens and the longest call."""
    counter = OutcomeCounter(keep=1_000_000)
    if name == "upstream":
        client: Any = maker.upstream_client()
    else:
        client = maker.our_client(PIPELINED, [counter], lookup_async=lookup_async, **config)
    calls: list[float] = []
    hit_tokens = answered = 0
    pending: dict[str, WorkloadRequest] = {}
    n = 0
    end_step = getattr(client, "end_step", None)
    start = getattr(client, "start", None)
    t0 = time.perf_counter()
    try:
        for step in range(steps + 1000):  # past ``steps``: only the lookups still pending, until all are answered
            if step < steps:
                for _ in range(ARRIVALS):
                    r = requests[n % len(requests)]
                    rid = f"j-{label}-{n}"
                    n += 1
                    pending[rid] = r
                    if start is not None and lookup_async:
                        start(rid, r.num_tokens, r.block_hashes, admission=True)
            elif not pending:
                break
            for rid, r in list(pending.items()):
                c0 = time.perf_counter()
                result = client.lookup(rid, r.num_tokens, list(r.block_hashes), non_block=lookup_async)
                calls.append(time.perf_counter() - c0)
                if result is None:
                    continue
                del pending[rid]
                answered += 1
                hit_tokens += result.hit_length
                if hasattr(client, "discard"):
                    client.discard(rid)
            if end_step is not None:
                end_step()
            time.sleep(MODEL_STEP_S)
    finally:
        late = getattr(getattr(client, "transport", None), "late_replies", None)
        if name == "upstream":
            close_upstream_client(client)
        else:
            client.close()
    out: dict[str, Any] = {"label": label, "client": name, "lookup_async": lookup_async, "lookups": n,
                           "answered": answered, "unanswered": len(pending), "hit_tokens": hit_tokens,
                           "call_us": summary_us(calls), "seconds": time.perf_counter() - t0}
    if name != "upstream":
        outcomes = {o.value: k for o, k in counter.outcomes.items() if k}
        failed = sum(counter.outcomes[o] for o in FAILED)
        # Lookups that ended, not requests: a lookup refused at admission (breaker open) ends, and the request's
        # next call starts another.
        ended = sum(k for o, k in counter.outcomes.items() if o is not Outcome.DISCARDED)
        rtt = [r.rpc_seconds for r in counter.records if r.rpc_seconds is not None and r.store_answered]
        out.update(outcomes=outcomes, failed=failed, ended=ended, failed_share=failed / ended if ended else None,
                   breaker_opened=True in counter.breaker_changes, late_replies=late,
                   timeout_ms=maker_timeout_ms(lookup_async, config), answered_rpc_us=summary_us(rtt),
                   answered_rpc_p999_us=quantile(rtt, 0.999) * 1e6 if rtt else None)
    return out


def maker_timeout_ms(lookup_async: bool, config: dict[str, Any]) -> float:
    """The deadline a variant ran with (``auto`` resolved as the config resolves it)."""
    from mooncake_lookout.connector.config import LookupConfig

    return float(LookupConfig(lookup_async=lookup_async, **config).lookup_timeout_ms)


def _variants(maker: ClientMaker, requests: Sequence[WorkloadRequest], steps: int,
              log: Any) -> list[dict[str, Any]]:
    rows = []
    for label, name, lookup_async, config in VARIANTS:
        rows.append(drive(maker, label, name, lookup_async, config, requests, steps))
        log(f"    {label}: {rows[-1].get('failed', '-')} failed of {rows[-1]['lookups']}, "
            f"{rows[-1]['hit_tokens']} hit tokens")
    return rows


def run(rig: Any, requests: Sequence[WorkloadRequest], *, steps: int, log: Any = print) -> dict[str, Any]:
    """Scenario (j): every variant under CPU hogs on the rig's server, then beside a GIL loop in the server."""
    from mooncake_lookout.connector.bench.rig import next_lookup_port
    from mooncake_lookout.connector.rigs.server_process import ServerProcess
    from mooncake_lookout.connector.rigs.vllm_lookup_server import lookup_vllm_config

    out: dict[str, Any] = {"steps": steps, "arrivals_per_step": ARRIVALS, "model_step_ms": MODEL_STEP_S * 1e3,
                           "cores": os.cpu_count(), "conditions": {}}
    with CpuHogs() as hogs:
        log(f"  (j) cpu hogs: {len(hogs.pids)} busy processes")
        out["conditions"]["cpu hogs"] = {"hogs": len(hogs.pids), "variants": _variants(rig, requests, steps, log)}
    port = next_lookup_port()
    with ServerProcess((UPSTREAM, PIPELINED), rig.master.rpc_address, namespace=rig.namespace,
                       rpc_port=port, rpc_base_path=rig.rpc_base_path, store_rpc_timeout_ms=rig.rpc_timeout_ms,
                       start_timeout_s=120.0, standby=False, keep_epoch=rig.keep_epoch, gil_busy=True) as servers:
        log("  (j) gil loop: a busy Python thread in the lookup server's process")
        out["conditions"]["gil loop"] = {"variants": _variants(_Beside(servers, lookup_vllm_config(port)),
                                                               requests, steps, log)}
    return out


__all__ = ["ARRIVALS", "CONDITIONS", "CpuHogs", "FAILED", "MODEL_STEP_S", "NO_DEADLINE", "VARIANTS", "drive", "run"]

"""Bench scenario (h): a fleet of N engines' lookup paths on ONE real Mooncake master, ours and upstream's.

Why: many vLLM engines share one master, and every new request of every engine is a ``batch_is_exist`` on it,
over every block of its prompt. How many engines one master serves for lookups, and what our client changes
about it, is a question of the master's own cost. :class:`Fleet` starts, on loopback:

* one ``mooncake_master`` (Mooncake's default key lease), a writer that fills the store with both workloads
  (:mod:`.fleet_workloads`);
* per engine, as in a deployment: a lookup server process of its own (vLLM's ``LookupKeyServer`` and ours, over
  a store client of its own; ours keeps the store's epoch, so our clients' prefix caches are on) and an engine
  process of its own (:mod:`.fleet_engine`) holding the client.

:func:`run` then runs, for each workload and N in ``ns``, a phase of the first N engines with vLLM's client and
one with ours (the order alternating): every engine at the same fixed rate, for the same seconds. Per phase:

* **the master's CPU time**, read from the master process itself (:mod:`~..rigs.cpu`), net of its own idle
  rate (measured over ``idle_s`` with every engine waiting, right before the phase), per 1,000 lookups: the
  only figure that carries to another machine;
* **keys and store calls per lookup at the master**, from its own counters
  (``master_batch_exist_key_items_total``, ``master_batch_exist_key_requests_total`` and the single-key
  ``master_exist_key_requests_total``);
* the time from a request's arrival to its answer, p50 and p99 over every lookup of the phase, and the steps
  deferred; the N where the p99 first doubles from N = 1;
* the engines' own CPU and the lookup servers' CPU beside the master's, kept out of it (on this 2-core machine
  they compete with the master for the cores).

:func:`calibrate` measures the master's CPU per store call of K keys, for a few K, calls back to back on the same
keys: its cost at its most favourable, reported beside the phases. The sizing model (:mod:`.fleet_model`) is
fitted to the phases themselves.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from mooncake_lookout.connector.bench.fleet_engine import MODULE as ENGINE_MODULE
from mooncake_lookout.connector.bench.fleet_engine import OURS, UPSTREAM_CLIENT
from mooncake_lookout.connector.bench.fleet_workloads import BLOCK_SIZE, MULTI_TURN, SHARED_PREFIX, FleetWorkload
from mooncake_lookout.connector.bench.rig import next_lookup_port, quantile
from mooncake_lookout.connector.rigs.cpu import CLOCK_SOURCE, CpuMeter

NAMESPACE = "fleet"
CLIENTS = (UPSTREAM_CLIENT, OURS)
COUNTERS = {"calls": "master_batch_exist_key_requests_total", "keys": "master_batch_exist_key_items_total",
            "single_calls": "master_exist_key_requests_total"}
CALIBRATION_KEYS = (1, 16, 128, 1024)


@dataclass(frozen=True)
class FleetSizes:
    """How much scenario (h) does: fleet sizes, seconds per phase, the idle window, the workloads."""

    ns: tuple[int, ...]
    seconds: float
    idle_s: float
    workloads: tuple[FleetWorkload, ...]
    step_s: float = 0.0015
    calibration_s: float = 0.6  # master time spent per calibration point, about

    @property
    def engines(self) -> int:
        """Engines started: the largest N."""
        return max(self.ns)


# Rates a 2-core machine sustains at N = 8 with both clients (upstream's lookup server spends ~3 ms of CPU on a
# 2,200-block lookup): the figures are per lookup, the rate only has to load the master above its idle noise.
FULL = FleetSizes((1, 2, 4, 8), 15.0, 2.0, (FleetWorkload(SHARED_PREFIX, 200.0, 4), FleetWorkload(MULTI_TURN, 10.0)))
QUICK = FleetSizes((1, 2), 1.5, 0.6, (FleetWorkload(SHARED_PREFIX, 200.0, 4), FleetWorkload(MULTI_TURN, 10.0)),
                   calibration_s=0.2)
QUIET_S = 0.5  # the master counted no existence check for this long: the phase's traffic is over


def counters(metrics_url: str) -> dict[str, float]:
    """The master's existence-check counters (:data:`COUNTERS`), from its own ``/metrics``."""
    from mooncake_lookout.connector.rigs.master import read_metrics

    metrics = read_metrics(metrics_url)
    return {name: metrics.get(series, 0.0) for name, series in COUNTERS.items()}


@dataclass
class Fleet:
    """A master, a filled store and ``engines`` engines (a server process and an engine process each); a context
    manager that stops them all by pid."""

    engines: int
    workloads: Sequence[FleetWorkload]
    seconds: float  # of a phase: how many requests an engine asks at each workload's rate
    log: Callable[[str], None] = print
    master: Any = None
    index: Any = None
    servers: list[Any] = field(default_factory=list)
    clients: list[Any] = field(default_factory=list)
    _stack: ExitStack = field(default_factory=ExitStack)

    def __enter__(self) -> Fleet:
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def _start(self) -> None:
        from mooncake_lookout.connector.bench.child import JsonChild
        from mooncake_lookout.connector.rigs.master import MOONCAKE_LEASE_MS, EmbeddedMaster
        from mooncake_lookout.connector.rigs.rpc_base_path import private_rpc_base_path
        from mooncake_lookout.connector.rigs.server_process import ServerProcess
        from mooncake_lookout.connector.server.prefix_index import PrefixIndex
        from mooncake_lookout.connector.server.store import open_writer_store
        from mooncake_lookout.connector.transport.names import PIPELINED, UPSTREAM

        stack = self._stack
        self.master = stack.enter_context(EmbeddedMaster(kv_lease_ttl_ms=MOONCAKE_LEASE_MS))
        base_path = stack.enter_context(private_rpc_base_path())
        ports = [next_lookup_port() for _ in range(self.engines)]
        servers = [ServerProcess((UPSTREAM, PIPELINED), self.master.rpc_address, namespace=NAMESPACE,
                                 block_size=BLOCK_SIZE, rpc_port=port, rpc_base_path=base_path,
                                 store_rpc_timeout_ms=30_000, start_timeout_s=300.0, standby=False, keep_epoch=True)
                   for port in ports]
        for server in servers:
            stack.callback(server.close)
            server.prepare()  # every server imports at once
        writer = open_writer_store(self.master.rpc_address, global_segment_size=512 << 20)
        stack.callback(writer.close)
        self.index = PrefixIndex(writer, BLOCK_SIZE, namespace=NAMESPACE)
        keys = sum(self.index.store_prefixes(w.stored(w.requests_in(self.seconds))) for w in self.workloads)
        self.log(f"    the store holds {keys:,} keys; starting {self.engines} lookup server and engine processes ...")
        for server in servers:
            server.start()
        self.servers = servers
        self.clients = [stack.enter_context(JsonChild(
            ENGINE_MODULE, ["--pipelined", server.addresses[PIPELINED], "--rpc-port", str(port), "--index", str(i)],
            name=f"engine {i}", wait=False)) for i, (server, port) in enumerate(zip(servers, ports))]
        for client in self.clients:
            client.wait_ready(300.0)

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def wait_quiet(self, last: dict[str, float], timeout_s: float = 120.0) -> None:
        """Return once the master has counted no existence check for :data:`QUIET_S` (nothing of a phase is left
        in any client's queue to spill into the next one); bounded by ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < QUIET_S:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the master still answered existence checks {timeout_s:g} s after a phase")
            time.sleep(0.1)
            now = counters(self.master.metrics_url)
            if now != last:
                last, quiet_since = now, time.monotonic()

    def phase(self, n: int, workload: FleetWorkload, client: str, *, seconds: float, idle_s: float, step_s: float,
              tag: str, margin_s: float = 0.5) -> dict[str, Any]:
        """The first ``n`` engines with ``client`` for ``seconds`` at ``workload``'s rate; the figures of the phase."""
        engines = self.clients[:n]
        master = CpuMeter(self.master.pid)
        servers = [CpuMeter(s.pid) for s in self.servers[:n]]
        before = counters(self.master.metrics_url)
        start_at = time.time() + margin_s + idle_s
        command = {"client": client, "workload": {"kind": workload.kind, "rate": workload.rate,
                                                  "burst": workload.burst},
                   "seconds": seconds, "step_s": step_s, "start_at": start_at, "drain_s": 60.0, "tag": tag}
        sent = [engine.send(command) for engine in engines]
        _sleep_until(start_at - idle_s)
        master.mark()
        t_idle = time.perf_counter()
        _sleep_until(start_at)
        idle = master.used()
        idle_window = time.perf_counter() - t_idle
        master.mark()
        for meter in servers:
            meter.mark()
        t0 = time.perf_counter()
        results = [engine.result(token, seconds + 180.0) for engine, token in zip(engines, sent)]
        used = master.used()
        window = time.perf_counter() - t0
        servers_s = sum(meter.used().threads_s for meter in servers)
        after = counters(self.master.metrics_url)
        self.wait_quiet(after)
        return _phase_figures(n, workload, client, seconds, results, used, idle, idle_window, window, servers_s,
                              {k: after[k] - before[k] for k in COUNTERS})


def _sleep_until(t: float) -> None:
    while (left := t - time.time()) > 0:
        time.sleep(min(left, 0.05))


def _phase_figures(n: int, workload: FleetWorkload, client: str, seconds: float, results: list[dict[str, Any]],
                   used: Any, idle: Any, idle_window: float, window: float, servers_s: float,
                   delta: dict[str, float]) -> dict[str, Any]:
    lookups = sum(r["answered"] for r in results)
    delays = sorted(d for r in results for d in r["delay_us"])
    steps = [s for r in results for s in r["deferred_steps"]]
    idle_rate = idle.threads_s / idle_window if idle_window > 0 else 0.0
    net_s = used.threads_s - idle_rate * window
    calls = delta["calls"] + delta["single_calls"]
    keys = delta["keys"] + delta["single_calls"]
    clients_s = sum(r["cpu_s"] for r in results)
    per_k = 1000.0 / lookups if lookups else None
    return {
        "n": n, "workload": workload.kind, "client": client, "lookups": lookups,
        "arrived": sum(r["arrived"] for r in results), "unanswered": sum(r["unanswered"] for r in results),
        "lookups_per_s": lookups / seconds, "arrivals_s": max(r["arrivals_s"] for r in results),
        "window_s": window, "late_s": max(r["late_s"] for r in results),
        "hit_tokens": sum(r["hit_tokens"] for r in results),
        "hit_tokens_per_lookup": sum(r["hit_tokens"] for r in results) / lookups if lookups else None,
        "master": {"cpu_ms": used.threads_s * 1e3, "ticks_ms": used.ticks_s * 1e3, "threads_exited": used.exited,
                   "idle_ms_per_s": idle_rate * 1e3, "net_ms": net_s * 1e3,
                   "per_1000_ms": net_s * 1e3 * per_k if per_k else None,
                   "cpu_share": net_s / window if window > 0 else None,
                   "calls": calls, "keys": keys,
                   "calls_per_lookup": calls / lookups if lookups else None,
                   "keys_per_lookup": keys / lookups if lookups else None},
        "delay_ms": {"n": len(delays), "p50": quantile(delays, 0.5) / 1e3, "p90": quantile(delays, 0.9) / 1e3,
                     "p99": quantile(delays, 0.99) / 1e3, "max": delays[-1] / 1e3 if delays else None},
        "mean_deferred_steps": statistics.fmean(steps) if steps else None,
        "clients_cpu_ms": clients_s * 1e3, "clients_cpu_per_1000_ms": clients_s * 1e3 * per_k if per_k else None,
        "servers_cpu_ms": servers_s * 1e3, "servers_cpu_per_1000_ms": servers_s * 1e3 * per_k if per_k else None,
    }


def calibrate(fleet: Fleet, keys: Sequence[str], *, sizes: Sequence[int] = CALIBRATION_KEYS,
              seconds: float = 0.6, idle_s: float = 1.0) -> dict[str, Any]:
    """The master's CPU per store call of K keys (existing keys, the same ones call after call, calls back to back
    from one client), for each K of ``sizes``, net of its idle rate: its cost at its most favourable, beside what
    the fleet's phases show."""
    from mooncake_lookout.connector.server.store import open_store

    store = open_store(fleet.master.rpc_address)
    try:
        meter = CpuMeter(fleet.master.pid)
        t0 = time.perf_counter()
        time.sleep(idle_s)
        idle_rate = meter.used().threads_s / (time.perf_counter() - t0)
        points = []
        for k in sizes:
            batch = list(keys[:k])
            store.batch_is_exist(batch)  # warm
            meter.mark()
            t0 = time.perf_counter()
            calls = 0
            while time.perf_counter() - t0 < seconds or calls < 20:
                store.batch_is_exist(batch)
                calls += 1
            window = time.perf_counter() - t0
            net = meter.used().threads_s - idle_rate * window
            points.append({"keys": len(batch), "calls": calls, "per_call_us": net / calls * 1e6,
                           "wall_per_call_us": window / calls * 1e6})
    finally:
        store.close()
    return {"points": points, "idle_ms_per_s": idle_rate * 1e3}


def summarize(phases: list[dict[str, Any]], workloads: Sequence[FleetWorkload]) -> dict[str, Any]:
    """Per workload and client, over every N: the master's CPU per 1,000 lookups (all phases together), the p99
    by N and the N where it first doubles from the smallest N; ours / upstream."""
    out: dict[str, Any] = {}
    for w in workloads:
        entry: dict[str, Any] = {}
        for client in CLIENTS:
            mine = sorted((p for p in phases if p["workload"] == w.kind and p["client"] == client),
                          key=lambda p: p["n"])
            lookups = sum(p["lookups"] for p in mine)
            net = sum(p["master"]["net_ms"] for p in mine)
            p99 = {p["n"]: p["delay_ms"]["p99"] for p in mine}
            base = p99.get(mine[0]["n"]) if mine else None
            doubled = next((n for n, v in p99.items() if base and v is not None and v >= 2 * base), None)
            entry[client] = {"lookups": lookups, "master_per_1000_ms": net / lookups * 1000 if lookups else None,
                             "p99_ms_by_n": p99, "p99_doubles_at": doubled}
        ours, up = entry[OURS]["master_per_1000_ms"], entry[UPSTREAM_CLIENT]["master_per_1000_ms"]
        entry["ratio"] = ours / up if ours is not None and up else None
        out[w.kind] = entry
    return out


def run(sizes: FleetSizes = FULL, *, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Scenario (h): start the fleet, calibrate the master, run every phase; the figures, for ``bench.json``."""
    phases: list[dict[str, Any]] = []
    with Fleet(sizes.engines, sizes.workloads, sizes.seconds, log=log) as fleet:
        kind = MULTI_TURN if any(w.kind == MULTI_TURN for w in sizes.workloads) else SHARED_PREFIX
        w0 = next(w for w in sizes.workloads if w.kind == kind)
        hashes = w0.stored(w0.requests_in(sizes.seconds))[0]
        calibration = calibrate(fleet, fleet.index.keys(hashes, len(hashes)), seconds=sizes.calibration_s)
        order = 0
        for w in sizes.workloads:
            for n in sizes.ns:
                clients = CLIENTS if order % 2 == 0 else CLIENTS[::-1]
                order += 1
                for client in clients:
                    log(f"    {w.kind}, N = {n}, {client} ...")
                    phases.append(fleet.phase(n, w, client, seconds=sizes.seconds, idle_s=sizes.idle_s,
                                              step_s=sizes.step_s, tag=f"{w.kind}-{n}-{client}"))
    return {"ns": list(sizes.ns), "seconds": sizes.seconds, "idle_s": sizes.idle_s, "step_ms": sizes.step_s * 1e3,
            "workloads": [w.as_dict() for w in sizes.workloads], "clock": CLOCK_SOURCE,
            "calibration": calibration, "phases": phases, "summary": summarize(phases, sizes.workloads)}


__all__ = ["CALIBRATION_KEYS", "CLIENTS", "COUNTERS", "FULL", "Fleet", "FleetSizes", "NAMESPACE", "QUICK",
           "calibrate", "counters", "run", "summarize"]

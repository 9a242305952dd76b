"""What security costs and buys on the lookup path, measured in one run against one real Mooncake master.

1. **CURVE overhead**: blocking lookups (8 blocks, found) through our client over loopback TCP, plain and
   CURVE, interleaved one by one so both see the same machine; round trip p50/p99 of each, and of a frame
   of 256 lookups (where encryption works on more bytes).
2. **A flooding peer**: a flooder (:mod:`.flood`, a process of its own) keeps a window of lookups in flight at
   one server (*shared*); another peer (the *other*) makes blocking lookups one at a time, alternately at that
   server and at a *control* server (a separate process on the same machine and master, which the flood does not
   reach): both see the same flood on the same cores, lookup by lookup, so the control shows what the flood costs
   the other through the machine alone, and the shared server's share on top of it. First both without the
   flood (unloaded), then with it; in several rounds, each with fresh servers and a fresh flooder. Verdict per
   round: the other was served every lookup, and its p99 at the shared server is at most
   :data:`BOUND_P99_RATIO` x the control's. Then once with the server's bounds off (huge), so what the bounds
   buy shows: the other's lookups wait behind the flood's backlog.

Every server is a separate process (:class:`~..rigs.server_process.ServerProcess`), as in production.
``python -m mooncake_lookout.connector.bench.security [--quick] [--out DIR]`` prints a table and writes
``security.json`` (commit it as ``docs/bench/security.json``: docs/security.md's figures are generated from it).
Numbers depend on the machine: on 2 shared cores the flooder, the servers, the master and the measured client
compete for the CPU, which a real deployment spreads over hosts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from mooncake_lookout.connector.bench.rig import summary_us
from mooncake_lookout.connector.rigs.machine import load_average, machine
from mooncake_lookout.connector.server.limits import DEFAULT_LIMITS, UNBOUNDED

BLOCKS = 8
BLOCK_SIZE = 16
BOUNDS_OFF = dataclasses.asdict(UNBOUNDED)  # server options: no bound at all
BOUND_P99_RATIO = 1.5  # the other's p99 at the flooded server, at most this times its p99 at the control
FLOOD = {"frame_lookups": 32, "hashes": 8}  # the flooder's frames (bench/flood.py's defaults)


@dataclass(frozen=True)
class Sizes:
    """How much each part does: lookups of the other per server and round, rounds, and the flooder's window."""

    curve_lookups: int
    curve_bursts: int
    flood_lookups: int
    flood_window: int
    flood_rounds: int = 1
    bounds_off_lookups: int = 50


QUICK = Sizes(200, 10, 300, 8192, flood_rounds=1, bounds_off_lookups=50)
FULL = Sizes(2000, 50, 2000, 32_768, flood_rounds=3, bounds_off_lookups=200)


class Bench:
    """The master, the prefix index, key files and the server processes of one run."""

    def __init__(self, stack: ExitStack, log: Callable[[str], None]) -> None:
        from mooncake_lookout.connector.curve import create_key_files
        from mooncake_lookout.connector.rigs.master import EmbeddedMaster
        from mooncake_lookout.connector.rigs.workload import unique_hashes
        from mooncake_lookout.connector.server.prefix_index import PrefixIndex
        from mooncake_lookout.connector.server.store import open_writer_store

        self.stack, self.log = stack, log
        self.master = stack.enter_context(EmbeddedMaster())
        store = open_writer_store(self.master.rpc_address)
        stack.callback(store.close)
        self.namespace = "security-bench"
        self.index = PrefixIndex(store, BLOCK_SIZE, self.namespace)
        self.prompts = [unique_hashes(BLOCKS, seed=5000 + i) for i in range(256)]
        self.index.store_prefixes(self.prompts)
        self.keys = tempfile.mkdtemp(prefix="lookout-keys-")
        stack.callback(shutil.rmtree, self.keys, True)
        self.server_public, self.server_secret = create_key_files(self.keys, "server")
        self.client_public, self.client_secret = create_key_files(self.keys, "client")

    def server(self, **options: Any) -> Any:
        """A lookup server process on loopback TCP with ``options`` (LookupServer settings)."""
        from mooncake_lookout.connector.rigs.server_process import ServerProcess

        return self.stack.enter_context(ServerProcess("pipelined", self.master.rpc_address, namespace=self.namespace,
                                                      block_size=BLOCK_SIZE, address="tcp://127.0.0.1:0",
                                                      standby=False, server_options=options))

    def curve_options(self) -> dict[str, str]:
        return {"curve_secret_key": self.server_secret, "curve_allowed_clients": self.client_public}

    def client(self, address: str, curve: bool) -> Any:
        """Our client (pipelined), CURVE or plain, blocking lookups with a generous deadline."""
        from mooncake_lookout.connector.client import LookupClient
        from mooncake_lookout.connector.config import LookupConfig
        from mooncake_lookout.connector.transport import make_transport

        keys = {"lookup_curve_server_public_key": self.server_public,
                "lookup_curve_client_secret_key": self.client_secret} if curve else {}
        config = LookupConfig(lookup_timeout_ms=5000, lookup_breaker_failures=10**4, lookup_prefix_cache_blocks=0,
                              **keys)
        return LookupClient(config, make_transport(config, address))


def _timed_lookup(client: Any, req_id: str, hashes: Sequence[bytes]) -> float:
    seconds, served = _answered(client, req_id, hashes)
    if not served:
        raise RuntimeError(f"lookup {req_id} was not a hit: the bench measures answered lookups")
    return seconds


def _burst(transport: Any, prompts: Sequence[Sequence[bytes]]) -> float:
    """Seconds from sending one frame of ``len(prompts)`` lookups until every one is answered."""
    from mooncake_lookout.connector.lookup import Lookup

    lookups = [Lookup(f"b{i}", BLOCKS * BLOCK_SIZE + 1, h, "pipelined", 0, time.perf_counter(), 5.0)
               for i, h in enumerate(prompts)]
    t0 = time.perf_counter()
    transport.send(lookups)
    for lk in lookups:
        while lk.outcome is None:
            transport.collect(1.0, until=lk)
    seconds = time.perf_counter() - t0
    if any(lk.hit_length != BLOCKS * BLOCK_SIZE for lk in lookups):
        raise RuntimeError("a burst lookup was not a hit")
    return seconds


def curve_overhead(bench: Bench, sizes: Sizes) -> dict[str, Any]:
    """Blocking lookups and 256-lookup frames, plain TCP and CURVE interleaved, against two server processes."""
    plain_server, curve_server = bench.server(), bench.server(**bench.curve_options())
    clients = {"plain": bench.client(plain_server.address, False), "curve": bench.client(curve_server.address, True)}
    single: dict[str, list[float]] = {"plain": [], "curve": []}
    burst: dict[str, list[float]] = {"plain": [], "curve": []}
    try:
        for name, client in clients.items():  # warm: connections, handshakes, the servers' first store calls
            for i in range(20):
                _timed_lookup(client, f"warm-{name}-{i}", bench.prompts[i])
        for i in range(sizes.curve_lookups):
            for name in (("plain", "curve") if i % 2 else ("curve", "plain")):
                single[name].append(_timed_lookup(clients[name], f"{name}-{i}", bench.prompts[i % 256]))
        for i in range(sizes.curve_bursts):
            for name in (("plain", "curve") if i % 2 else ("curve", "plain")):
                burst[name].append(_burst(clients[name].transport, bench.prompts))
    finally:
        for client in clients.values():
            client.close()
    out: dict[str, Any] = {name: {"single_us": summary_us(single[name]), "frame256_us": summary_us(burst[name])}
                           for name in single}
    for part in ("single_us", "frame256_us"):
        out[f"{part}_added_p50"] = out["curve"][part]["p50"] - out["plain"][part]["p50"]
    return out


def _answered(client: Any, req_id: str, hashes: Sequence[bytes]) -> tuple[float, bool]:
    """Seconds of one blocking lookup, and whether it was served (a hit: every prompt is stored)."""
    t0 = time.perf_counter()
    result = client.lookup(req_id, BLOCKS * BLOCK_SIZE + 1, hashes)
    seconds = time.perf_counter() - t0
    client.discard(req_id)
    return seconds, result.hit_length == BLOCKS * BLOCK_SIZE


def _alternate(bench: Bench, clients: dict[str, Any], n: int, tag: str) -> dict[str, list[tuple[float, bool]]]:
    """``n`` lookups of each client, alternating lookup by lookup (the first one alternates too)."""
    names = list(clients)
    out: dict[str, list[tuple[float, bool]]] = {name: [] for name in names}
    for i in range(n):
        for name in (names if i % 2 else names[::-1]):
            out[name].append(_answered(clients[name], f"{tag}-{name}-{i}", bench.prompts[i % 256]))
    return out


def _flooder(address: str, window: int) -> Any:
    """The flooding peer's process, in its steady state (its whole first window answered)."""
    from mooncake_lookout.connector.bench.flood import STEADY
    from mooncake_lookout.connector.rigs.processes import ChildProcess

    flooder = ChildProcess([sys.executable, "-m", "mooncake_lookout.connector.bench.flood", "--address", address,
                            "--window", str(window), "--frame-lookups", str(FLOOD["frame_lookups"]),
                            "--hashes", str(FLOOD["hashes"])], env=dict(os.environ, PYTHONUNBUFFERED="1"),
                           name="flooder")
    try:
        flooder.wait_line(STEADY, 120.0, "flood in its steady state")
    except Exception:
        flooder.kill()
        raise
    return flooder


def _stop(flooder: Any) -> dict[str, Any]:
    """Stop the flooder; its counts (lookups answered ok, busy, otherwise; frames; seconds), with its busy share and
    the lookups it got answered per second."""
    try:
        os.kill(flooder.pid, signal.SIGTERM)
        line = flooder.wait_line(lambda ln: ln.startswith("{"), 30.0, "flooder counts")
        flooder.wait_exit(30.0)
    finally:
        flooder.kill()
    counts: dict[str, Any] = json.loads(line)
    answered = counts["ok"] + counts["busy"] + counts["other"]
    counts["busy_share"] = counts["busy"] / answered if answered else None
    counts["ok_per_s"] = counts["ok"] / counts["seconds"] if counts["seconds"] else None
    return counts


def _summary(lookups: list[tuple[float, bool]]) -> dict[str, Any]:
    return {**summary_us([seconds for seconds, _ in lookups]), "served": sum(ok for _, ok in lookups)}


def flood_round(bench: Bench, sizes: Sizes, number: int) -> dict[str, Any]:
    """One round: the other alternately at the shared and the control server, unloaded then under the flood."""
    shared, control = bench.server(), bench.server()
    clients = {"shared": bench.client(shared.address, False), "control": bench.client(control.address, False)}
    try:
        _alternate(bench, clients, 20, f"r{number}-warm")  # connections, the servers' first store calls
        unloaded = _alternate(bench, clients, sizes.flood_lookups, f"r{number}-alone")
        flooder = _flooder(shared.address, sizes.flood_window)
        try:
            flooded = _alternate(bench, clients, sizes.flood_lookups, f"r{number}-flood")
        finally:
            counts = _stop(flooder)
    finally:
        for client in clients.values():
            client.close()
        shared.close()
        control.close()
    row: dict[str, Any] = {"lookups": sizes.flood_lookups, "flooder": counts, "load": load_average()[0],
                           "unloaded_us": {k: _summary(v) for k, v in unloaded.items()},
                           "flood_us": {k: _summary(v) for k, v in flooded.items()}}
    flood = row["flood_us"]
    row["p99_ratio"] = flood["shared"]["p99"] / flood["control"]["p99"]
    row["p50_ratio"] = flood["shared"]["p50"] / flood["control"]["p50"]
    row["served_every_lookup"] = flood["shared"]["served"] == sizes.flood_lookups
    row["met"] = row["served_every_lookup"] and row["p99_ratio"] <= BOUND_P99_RATIO
    return row


def bounds_off(bench: Bench, sizes: Sizes) -> dict[str, Any]:
    """The other at a server with no bounds, unloaded then under the flood (what the bounds buy)."""
    server = bench.server(**BOUNDS_OFF)
    client = bench.client(server.address, False)
    try:
        _alternate(bench, {"off": client}, 20, "off-warm")
        unloaded = _alternate(bench, {"off": client}, sizes.bounds_off_lookups, "off-alone")["off"]
        flooder = _flooder(server.address, sizes.flood_window)
        try:
            flooded = _alternate(bench, {"off": client}, sizes.bounds_off_lookups, "off-flood")["off"]
        finally:
            counts = _stop(flooder)
    finally:
        client.close()
        server.close()
    return {"lookups": sizes.bounds_off_lookups, "flooder": counts, "unloaded_us": _summary(unloaded),
            "flood_us": _summary(flooded)}


def flood_fairness(bench: Bench, sizes: Sizes) -> dict[str, Any]:
    """The rounds with the server's bounds at their defaults, then the run with them off; and the verdict."""
    out: dict[str, Any] = {"window": sizes.flood_window, **FLOOD, "limits": dataclasses.asdict(DEFAULT_LIMITS),
                           "bound_p99_ratio": BOUND_P99_RATIO, "rounds": []}
    for number in range(1, sizes.flood_rounds + 1):
        bench.log(f"  round {number} of {sizes.flood_rounds}: the other at the shared and the control server, "
                  "alone then under the flood ...")
        out["rounds"].append(flood_round(bench, sizes, number))
    bench.log("  the bounds off: the other alone, then under the flood ...")
    out["bounds_off"] = bounds_off(bench, sizes)
    out["met"] = all(r["met"] for r in out["rounds"])
    return out


def table(results: dict[str, Any]) -> str:
    """The results as the printed table."""
    c, f = results["curve"], results["flood"]
    lines = ["CURVE overhead (loopback TCP, our client, blocking lookups of 8 blocks; same run, interleaved)",
             f"{'':24}{'p50 us':>10}{'p99 us':>10}{'256-lookup frame p50 us':>26}{'p99 us':>10}"]
    for name in ("plain", "curve"):
        s, b = c[name]["single_us"], c[name]["frame256_us"]
        lines.append(f"{name:24}{s['p50']:>10.0f}{s['p99']:>10.0f}{b['p50']:>26.0f}{b['p99']:>10.0f}")
    lines.append(f"{'added by CURVE (p50)':24}{c['single_us_added_p50']:>10.0f}{'':10}"
                 f"{c['frame256_us_added_p50']:>26.0f}")
    lines += ["", f"A flooding peer (window {f['window']} lookups in frames of {f['frame_lookups']}, "
                  f"{f['hashes']} blocks each) vs another peer's blocking lookups, at the flooded server (shared) "
                  "and at a control server, alternately",
              f"{'':14}{'alone p50':>10}{'p99':>8}{'flood p50':>10}{'p99':>9}{'served':>8}"
              f"{'flooder busy':>14}{'flooder ok/s':>14}"]

    def row(name: str, alone: dict[str, Any], flood: dict[str, Any], counts: dict[str, Any] | None) -> str:
        busy = f"{counts['busy_share']:>14.1%}{counts['ok_per_s']:>14.0f}" if counts else ""
        return (f"{name:14}{alone['p50']:>10.0f}{alone['p99']:>8.0f}{flood['p50']:>10.0f}{flood['p99']:>9.0f}"
                f"{flood['served']:>8}{busy}")

    for number, r in enumerate(f["rounds"], 1):
        lines.append(row(f"{number} shared", r["unloaded_us"]["shared"], r["flood_us"]["shared"], r["flooder"]))
        lines.append(row(f"{number} control", r["unloaded_us"]["control"], r["flood_us"]["control"], None))
        lines.append(f"{'':14}p99 shared / control {r['p99_ratio']:.2f} (bound {f['bound_p99_ratio']:g}), p50 "
                     f"{r['p50_ratio']:.2f}, served every lookup: {r['served_every_lookup']}, load {r['load']:.1f}: "
                     f"{'met' if r['met'] else 'MISSED'}")
    off = f["bounds_off"]
    lines.append(row("bounds off", off["unloaded_us"], off["flood_us"], off["flooder"]))
    return "\n".join(lines)


def run(out_dir: str, *, quick: bool = False, log: Callable[[str], None] = print,
        sizes: Sizes | None = None) -> dict[str, Any]:
    """Both parts; writes ``security.json`` and ``security.txt`` to ``out_dir``; returns the results."""
    sizes = sizes or (QUICK if quick else FULL)
    t0 = time.perf_counter()
    results: dict[str, Any] = {"quick": quick, "machine": machine()}
    with ExitStack() as stack:
        log("starting a Mooncake master ...")
        bench = Bench(stack, log)
        log("CURVE overhead ...")
        results["curve"] = curve_overhead(bench, sizes)
        log("a flooding peer ...")
        results["flood"] = flood_fairness(bench, sizes)
    results["seconds"] = time.perf_counter() - t0
    results["machine"]["loadavg_at_end"] = load_average()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "security.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = table(results)
    with open(os.path.join(out_dir, "security.txt"), "w") as f:
        f.write(text + "\n")
    log(text)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mooncake_lookout.connector.bench.security``."""
    p = argparse.ArgumentParser(prog="python -m mooncake_lookout.connector.bench.security",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller runs (about a minute)")
    p.add_argument("--out", default="out", help="folder for security.json and security.txt (default out)")
    args = p.parse_args(argv)
    run(args.out, quick=args.quick)
    return 0


__all__ = ["BOUND_P99_RATIO", "FULL", "QUICK", "Sizes", "bounds_off", "curve_overhead", "flood_fairness",
           "flood_round", "main", "run", "table"]

if __name__ == "__main__":
    sys.exit(main())

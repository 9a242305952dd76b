"""What security costs and buys on the lookup path, measured in one run against one real Mooncake master.

1. **CURVE overhead**: blocking lookups (8 blocks, found) through our client over loopback TCP, plain and
   CURVE, interleaved one by one so both see the same machine; round trip p50/p99 of each, and of a frame
   of 256 lookups (where encryption works on more bytes).
2. **A flooding peer**: one client (the *other*) makes blocking lookups one at a time, first alone
   (unloaded), then while a flooding peer (:mod:`.flood`, a process of its own) keeps a window of lookups
   in flight at the same server. Run with the server's per-peer bounds (``max_peer_lookups``,
   ``share_keys``) at their defaults, and with them off (huge), so the difference is the bounds' doing;
   and once with the flood sent to a *neighbour* server (same machine, same master), which shows what the
   flood costs the other through the CPU alone. Reports the other's p50/p99 unloaded and under the flood,
   their ratios, the flooder's busy share and the lookups it got answered per second.

Every server is a separate process (:class:`~..rigs.server_process.ServerProcess`), as in production.
``python -m mooncake_lookout.connector.bench.security [--quick] [--out DIR]`` prints a table and writes
``security.json``. Numbers depend on the machine: on 2 shared cores the flooder, the server, the master and
the measured client compete for the CPU, which a real deployment spreads over hosts.
"""

from __future__ import annotations

import argparse
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

BLOCKS = 8
BLOCK_SIZE = 16
BOUNDS_OFF = {"max_peer_lookups": 10**9, "share_keys": 10**9}
NEIGHBOUR = "neighbour"  # the flood hits another server process on the same machine and master
CASES: tuple[tuple[str, dict[str, Any]], ...] = (("bounds on", {}), ("bounds off", BOUNDS_OFF), (NEIGHBOUR, {}))


@dataclass(frozen=True)
class Sizes:
    """How much each part does."""

    curve_lookups: int
    curve_bursts: int
    flood_lookups: int
    flood_window: int


QUICK = Sizes(200, 10, 200, 8192)
FULL = Sizes(2000, 50, 1000, 32_768)


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
    t0 = time.perf_counter()
    result = client.lookup(req_id, BLOCKS * BLOCK_SIZE + 1, hashes)
    seconds = time.perf_counter() - t0
    client.discard(req_id)
    if result.hit_length != BLOCKS * BLOCK_SIZE:
        raise RuntimeError(f"lookup {req_id} was not a hit ({result}): the bench measures answered lookups")
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


def _other(bench: Bench, address: str, n: int, tag: str) -> list[float]:
    client = bench.client(address, False)
    try:
        for i in range(20):
            _timed_lookup(client, f"{tag}-warm-{i}", bench.prompts[i])
        return [_timed_lookup(client, f"{tag}-{i}", bench.prompts[i % 256]) for i in range(n)]
    finally:
        client.close()


def _flooded(bench: Bench, address: str, sizes: Sizes, tag: str,
             flood_address: str | None = None) -> tuple[list[float], dict[str, Any]]:
    """The other's lookups at ``address`` while the flooder floods ``flood_address`` (default: the same server),
    and the flooder's counts."""
    from mooncake_lookout.connector.bench.flood import STEADY
    from mooncake_lookout.connector.rigs.processes import ChildProcess

    flooder = ChildProcess([sys.executable, "-m", "mooncake_lookout.connector.bench.flood",
                            "--address", flood_address or address, "--window", str(sizes.flood_window)],
                           env=dict(os.environ, PYTHONUNBUFFERED="1"), name="flooder")
    try:
        flooder.wait_line(STEADY, 120.0, "flood in its steady state")
        seconds = _other(bench, address, sizes.flood_lookups, tag)
        os.kill(flooder.pid, signal.SIGTERM)
        line = flooder.wait_line(lambda ln: ln.startswith("{"), 30.0, "flooder counts")
        flooder.wait_exit(30.0)
    finally:
        flooder.kill()
    return seconds, json.loads(line)


def flood_fairness(bench: Bench, sizes: Sizes) -> dict[str, Any]:
    """The other's latency alone and under a flood, with the server's per-peer bounds on (defaults) and off."""
    from mooncake_lookout.connector.server.admission import DEFAULT_MAX_PEER_LOOKUPS, DEFAULT_SHARE_KEYS

    defaults = {"max_peer_lookups": DEFAULT_MAX_PEER_LOOKUPS, "share_keys": DEFAULT_SHARE_KEYS}
    out: dict[str, Any] = {"window": sizes.flood_window, "frame_lookups": 32, "hashes": 8, "bounds_on": defaults}
    for case, options in CASES:
        bench.log(f"  {case}: the other alone, then under the flood ...")
        server = bench.server(**options)
        neighbour = bench.server() if case == NEIGHBOUR else None
        unloaded = _other(bench, server.address, sizes.flood_lookups, f"{case}-alone")
        flooded, counts = _flooded(bench, server.address, sizes, f"{case}-flood",
                                   neighbour.address if neighbour is not None else None)
        for s in (server, neighbour):
            if s is not None:
                s.close()
        answered = counts["ok"] + counts["busy"] + counts["other"]
        row = {"unloaded_us": summary_us(unloaded), "flood_us": summary_us(flooded), "flooder": counts,
               "flooder_busy_share": counts["busy"] / answered if answered else float("nan"),
               "flooder_ok_per_s": counts["ok"] / counts["seconds"] if counts["seconds"] else float("nan")}
        row["p99_ratio"] = row["flood_us"]["p99"] / row["unloaded_us"]["p99"]
        row["p50_ratio"] = row["flood_us"]["p50"] / row["unloaded_us"]["p50"]
        out[case] = row
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
                  f"{f['hashes']} blocks each) vs another peer's blocking lookups",
              f"{'':12}{'alone p50':>10}{'p99':>8}{'flood p50':>10}{'p99':>9}{'p50 x':>8}{'p99 x':>8}"
              f"{'flooder busy':>14}{'flooder ok/s':>14}"]
    for case, _ in CASES:
        r = f[case]
        lines.append(f"{case:12}{r['unloaded_us']['p50']:>10.0f}{r['unloaded_us']['p99']:>8.0f}"
                     f"{r['flood_us']['p50']:>10.0f}{r['flood_us']['p99']:>9.0f}"
                     f" {r['p50_ratio']:>7.1f} {r['p99_ratio']:>7.1f}"
                     f"{r['flooder_busy_share']:>14.1%}{r['flooder_ok_per_s']:>14.0f}")
    return "\n".join(lines)


def run(out_dir: str, *, quick: bool = False, log: Callable[[str], None] = print,
        sizes: Sizes | None = None) -> dict[str, Any]:
    """Both parts; writes ``security.json`` and ``security.txt`` to ``out_dir``; returns the results."""
    sizes = sizes or (QUICK if quick else FULL)
    t0 = time.perf_counter()
    results: dict[str, Any] = {"quick": quick}
    with ExitStack() as stack:
        log("starting a Mooncake master ...")
        bench = Bench(stack, log)
        log("CURVE overhead ...")
        results["curve"] = curve_overhead(bench, sizes)
        log("a flooding peer ...")
        results["flood"] = flood_fairness(bench, sizes)
    results["seconds"] = time.perf_counter() - t0
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


__all__ = ["FULL", "QUICK", "Sizes", "curve_overhead", "flood_fairness", "main", "run", "table"]

if __name__ == "__main__":
    sys.exit(main())

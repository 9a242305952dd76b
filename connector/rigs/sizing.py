"""Memory a Mooncake store costs, measured on a real master and client: the figures behind docs/operations.md.

Two measurements, both with the non-CUDA Mooncake wheel over TCP on this machine:

* the master: its resident memory before and after ``--keys`` keys shaped like vLLM's (a model name, the rank
  fields and 64 hex digits, ~120 characters), in steps, so the growth per key shows;
* a client: its resident memory (anonymous), and how much of ``/dev/shm`` is used, before set-up, after it
  mounts ``--segment-mib`` of segment and ``--buffer-mib`` of local buffer, and after it holds data.

``python -m mooncake_lookout.connector.rigs.sizing --keys 100000`` prints both (``--json`` for scripts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from mooncake_lookout.connector.rigs.master import EmbeddedMaster, read_metrics
from mooncake_lookout.connector.server.store import open_store

KEY_PREFIX = "Qwen2.5-7B-Instruct@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@"  # the shape of vLLM's keys
BATCH = 1000
SETTLE_S = 0.3  # lets the master finish the batch's bookkeeping before its memory is read


def resident_bytes(pid: int | str = "self", field: str = "VmRSS") -> int:
    """A process's resident memory (``/proc/PID/status``; ``RssAnon`` for anonymous memory only), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def shm_used_bytes() -> int:
    """Bytes in use on ``/dev/shm``."""
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def shared_mappings() -> list[str]:
    """This process's mappings of ``/dev/shm`` files or memfds: where shared memory would show."""
    with open("/proc/self/maps") as f:
        return [line.split()[-1] for line in f if "/dev/shm/" in line or "memfd:" in line]


def master_key_count(master: EmbeddedMaster) -> int:
    """``master_key_count`` from the master's own ``/metrics``."""
    return int(read_metrics(master.metrics_url)["master_key_count"])


def measure_master(keys: int, value_bytes: int = 64, steps: int = 4) -> dict[str, Any]:
    """Master RSS growth while ``keys`` keys of ``value_bytes`` each are put, read ``steps`` times."""
    with EmbeddedMaster(kv_lease_ttl_ms=1000) as master:
        segment = max(64 << 20, 2 * keys * max(value_bytes, 64))
        client = open_store(master.rpc_address, global_segment_size=segment, local_buffer_size=64 << 20)
        try:
            time.sleep(SETTLE_S)
            base = resident_bytes(master.pid)
            marks = []
            done = 0
            every = max(BATCH, keys // steps)
            while done < keys:
                batch = [KEY_PREFIX + f"{i:064x}" for i in range(done, min(keys, done + BATCH))]
                code = client.put_batch(batch, [b"x" * value_bytes] * len(batch))
                if code != 0:
                    raise RuntimeError(f"put_batch failed with {code} after {done} keys")
                done += len(batch)
                if done % every == 0 or done == keys:
                    time.sleep(SETTLE_S)
                    grown = resident_bytes(master.pid) - base
                    marks.append({"keys": done, "grown_bytes": grown, "bytes_per_key": grown / done})
            stored = master_key_count(master)
        finally:
            client.close()
    return {"base_bytes": base, "key_chars": len(KEY_PREFIX) + 64, "value_bytes": value_bytes, "keys": stored,
            "marks": marks}


def measure_client(segment_mib: int, buffer_mib: int, fill_mib: int) -> dict[str, Any]:
    """A client's anonymous memory and ``/dev/shm`` use: before set-up, after it, after holding ``fill_mib``."""
    with EmbeddedMaster() as master:
        points = {"before": (resident_bytes(field="RssAnon"), shm_used_bytes())}
        client = open_store(master.rpc_address, global_segment_size=segment_mib << 20,
                            local_buffer_size=buffer_mib << 20)
        try:
            points["after_setup"] = (resident_bytes(field="RssAnon"), shm_used_bytes())
            value = b"x" * (100 << 10)
            for b in range(fill_mib * 1024 // 100 // 10):
                code = client.put_batch([f"sizing-{b}-{i}" for i in range(10)], [value] * 10)
                if code != 0:
                    raise RuntimeError(f"put_batch failed with {code}")
            points["after_fill"] = (resident_bytes(field="RssAnon"), shm_used_bytes())
            mappings = shared_mappings()
        finally:
            client.close()
    return {"segment_mib": segment_mib, "buffer_mib": buffer_mib, "fill_mib": fill_mib, "shared_mappings": mappings,
            **{name: {"anon_bytes": anon, "shm_bytes": shm} for name, (anon, shm) in points.items()}}


def main(argv: Sequence[str] | None = None) -> int:
    """Print both measurements; exit 0."""
    p = argparse.ArgumentParser(prog="python -m mooncake_lookout.connector.rigs.sizing", description=__doc__)
    p.add_argument("--keys", type=int, default=100_000, help="keys to put on the master (default 100000)")
    p.add_argument("--value-bytes", type=int, default=64, help="bytes of each key's value (default 64)")
    p.add_argument("--segment-mib", type=int, default=1024, help="the client's global segment (default 1024)")
    p.add_argument("--buffer-mib", type=int, default=256, help="the client's local buffer (default 256)")
    p.add_argument("--fill-mib", type=int, default=400, help="data the client then holds (default 400)")
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    report = {"master": measure_master(args.keys, args.value_bytes),
              "client": measure_client(args.segment_mib, args.buffer_mib, args.fill_mib)}
    if args.json:
        print(json.dumps(report))
        return 0
    m = report["master"]
    print(f"master: {m['base_bytes'] / 2**20:.0f} MiB before any key; keys of {m['key_chars']} characters, "
          f"values of {m['value_bytes']} bytes; master_key_count {m['keys']}")
    for mark in m["marks"]:
        print(f"  {mark['keys']:>9} keys: +{mark['grown_bytes'] / 2**20:.1f} MiB, {mark['bytes_per_key']:.0f} B/key")
    c = report["client"]
    print(f"client: segment {c['segment_mib']} MiB, local buffer {c['buffer_mib']} MiB, then {c['fill_mib']} MiB held; "
          f"mappings of /dev/shm or memfds: {len(c['shared_mappings'])}")
    for name in ("before", "after_setup", "after_fill"):
        print(f"  {name:<12} anonymous {c[name]['anon_bytes'] / 2**20:.0f} MiB, /dev/shm used "
              f"{c[name]['shm_bytes'] / 2**20:.0f} MiB")
    return 0


__all__ = ["main", "master_key_count", "measure_client", "measure_master", "resident_bytes", "shared_mappings",
           "shm_used_bytes"]

if __name__ == "__main__":
    sys.exit(main())

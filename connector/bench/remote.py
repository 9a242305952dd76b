"""``bench --master HOST:PORT`` / ``--server ADDRESS``: a user's own store or lookup server, measured read-only.

Why: the figures that should set a deployment's lookup settings are that deployment's own: how far its
master is from this host, what one ``batch_is_exist`` of its keys costs, what each client pays. The bench
measures them against the real thing, and changes nothing in it.

Against a master (``--master``), in vLLM's key layout for ``--model`` (with its ``cache_prefix``,
tensor-parallel size and block size: :class:`~mooncake_lookout.connector.rigs.vllm_layout.Layout`):

* **server side** (:mod:`.backends`): one lookup of a cold prompt of 8 to 4,096 blocks, in this process:
  the store call alone, upstream's worker lookup and our in-vLLM backend;
* **floors** (:mod:`.floors`): the round-trip floor against that master, and the touch floor;
* a lookup-server process on this host answering from upstream's own ``MooncakeStoreWorker`` for that
  layout, both vLLM's ``LookupKeyServer`` and ours; then scenarios (a), (a4) and (b) with vLLM's client
  and ours, and the targets they decide;
* **found**: prompts you name (``--prompts FILE``: one prompt a line, its block hashes in hex) or blocks
  sampled from the master (``--sample-keys N`` with ``--master-http URL``: keys of the layout read from
  the master's ``/get_all_keys``, each looked up as a one-block prompt), asked by every client: the hits
  found show the layout is right and the stored prefixes are reachable.

Against a lookup server (``--server``): our client alone (``--server-wire`` says which protocol the server
speaks), scenarios (a), (a4), (b); the floors too when ``--master`` is also given.

Read-only, by construction: every store client (here, in the server process, in the floor's process) is
lookup-only (it lends no segment and has no buffer to stage puts, so Mooncake refuses any put from it), and
where this package calls the store through the layout it is a
:class:`~mooncake_lookout.connector.rigs.vllm_layout.ReadOnlyStore` (only ``batch_is_exist`` and
``is_exist`` pass). Our server here keeps no epoch marker (that would be a put), so our client's prefix
cache stays off in these figures. No reset is ever sent, and the servers listen on private IPC paths
(0700 folders).
The scenarios' prompts are random block hashes, so they ask for keys no store holds. What the store sees
is existence checks, a few thousand at most (each one leases the keys it finds for the master's
``default_kv_lease_ttl``, as vLLM's own lookups do). With ``--master-http``, ``master_key_count`` is read
before and after the run and reported.
"""

from __future__ import annotations

import json
import os
import random
import time
import urllib.request
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from mooncake_lookout.connector.bench import backends, burst, call, per_step
from mooncake_lookout.connector.bench.rig import ClientMaker
from mooncake_lookout.connector.rigs.vllm_layout import Layout
from mooncake_lookout.connector.rigs.workload import WorkloadRequest, shared_prefix_workload
from mooncake_lookout.connector.transport.names import PIPELINED, UPSTREAM

MAX_KEYS_READ_BYTES = 64 << 20  # the most of /get_all_keys read while sampling keys
HTTP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RemoteSizes:
    """How much each measurement does against a user's deployment (it is their store: keep it small)."""

    call_requests: int
    per_step_rounds: int
    ks: tuple[int, ...]
    burst_n: int
    burst_repeats: int
    store_rounds: int
    store_blocks: tuple[int, ...]


QUICK = RemoteSizes(60, 4, (1, 4, 16), 64, 1, 10, (8, 64, 512))
FULL = RemoteSizes(300, 20, (1, 4, 16, 64), 256, 3, 50, (8, 64, 512, 4096))


class RemoteRig(ClientMaker):
    """The clients and floor of the scenarios, pointed at a user's master (through a local server process
    over vLLM's layout) or at a user's own lookup server; a context manager that stops what it started."""

    def __init__(self, layout: Layout, *, master: str | None = None, server: str | None = None,
                 server_wire: str = PIPELINED, rpc_timeout_ms: int = 5000) -> None:
        if master is None and server is None:
            raise ValueError("give a master (--master) or a lookup server (--server)")
        self.layout = layout
        self.master = master
        self.server = server
        self.server_wire = server_wire
        self.rpc_timeout_ms = rpc_timeout_ms
        self.store: Any = None  # a ReadOnlyStore over a lookup-only client, with a master
        self.worker: Any = None  # upstream's MooncakeStoreWorker for the layout, over ``store``
        self.floor: Any = None
        self.servers: Any = None
        self.names: tuple[str, ...] = ()
        self._addresses: dict[str, str] = {}
        self._stack = ExitStack()

    @property
    def addresses(self) -> dict[str, str]:
        """Transport -> where our client connects (the user's server, or the local server process)."""
        if self.servers is not None:
            return dict(self.servers.addresses)
        return dict(self._addresses)

    def start(self) -> RemoteRig:
        """Connect and start what is needed; on failure stop what started."""
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        from mooncake_lookout.connector.bench.call import CLIENTS
        from mooncake_lookout.connector.bench.floors import FloorServer
        from mooncake_lookout.connector.rigs.vllm_layout import ReadOnlyStore, layout_worker
        from mooncake_lookout.connector.server.store import open_store

        stack = self._stack
        if self.master is not None:
            client = open_store(self.master, rpc_timeout_ms=self.rpc_timeout_ms)  # sizes 0/0: no puts possible
            stack.callback(client.close)
            self.store = ReadOnlyStore(client)
            self.worker = layout_worker(self.store, self.layout)
            self.floor = stack.enter_context(FloorServer(self.master, rpc_timeout_ms=self.rpc_timeout_ms))
        if self.server is not None:
            self._addresses = {self.server_wire: self.server}
            self.names = ("ours/pipelined",) if self.server_wire == PIPELINED else ("ours/upstream-wire",)
            return
        from mooncake_lookout.connector.bench.rig import next_lookup_port
        from mooncake_lookout.connector.rigs.rpc_base_path import private_rpc_base_path
        from mooncake_lookout.connector.rigs.server_process import ServerProcess
        from mooncake_lookout.connector.rigs.vllm_lookup_server import lookup_vllm_config

        assert self.master is not None
        port = next_lookup_port()
        base = stack.enter_context(private_rpc_base_path())
        self.servers = stack.enter_context(ServerProcess(
            (UPSTREAM, PIPELINED), self.master, namespace="unused", block_size=self.layout.block_size,
            rpc_port=port, rpc_base_path=base, store_rpc_timeout_ms=self.rpc_timeout_ms, start_timeout_s=120.0,
            standby=False, layout=self.layout))
        self.lookup_vllm_config = lookup_vllm_config(port)
        self.names = CLIENTS

    def floor_frame(self, request: Any) -> bytes:
        """The keys vLLM's lookup asks for ``request`` in the layout (every rank namespace), as a floor request."""
        from mooncake_lookout.connector.bench.floors import key_frame
        from mooncake_lookout.connector.rigs.vllm_layout import lookup_keys

        return key_frame(lookup_keys(self.worker, request.num_tokens, request.block_hashes))

    def close(self) -> None:
        """Stop the server and floor processes (by pid) and close the store client."""
        self._stack.close()

    def __enter__(self) -> RemoteRig:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- what a master tells over HTTP ---------------------------------------------------------------------------

def master_key_count(http_url: str) -> int:
    """``master_key_count`` from the master's ``/metrics`` (its HTTP port, e.g. ``http://host:9003``)."""
    with urllib.request.urlopen(http_url.rstrip("/") + "/metrics", timeout=HTTP_TIMEOUT_S) as resp:
        for raw in resp:
            line = raw.decode(errors="replace")
            if line.startswith("master_key_count "):
                return int(float(line.split()[1]))
    raise ValueError(f"{http_url}/metrics has no master_key_count")


def sample_hashes(http_url: str, prefix: str, n: int) -> list[bytes]:
    """Up to ``n`` block hashes of keys that start with ``prefix``, read from the master's ``/get_all_keys``.

    Reads at most :data:`MAX_KEYS_READ_BYTES` of the listing and stops as soon as ``n`` are found.
    """
    found: list[bytes] = []
    read = 0
    with urllib.request.urlopen(http_url.rstrip("/") + "/get_all_keys", timeout=HTTP_TIMEOUT_S) as resp:
        for raw in resp:
            read += len(raw)
            key = raw.decode(errors="replace").strip()
            if key.startswith(prefix):
                try:
                    found.append(bytes.fromhex(key[len(prefix):]))
                except ValueError:
                    continue
                if len(found) >= n:
                    break
            if read >= MAX_KEYS_READ_BYTES:
                break
    return found


def read_prompts(path: str, block_size: int) -> list[WorkloadRequest]:
    """Prompts from a file: one a line, its block hashes in hex separated by spaces or commas ('#' comments)."""
    out = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            text = line.split("#", 1)[0].replace(",", " ").split()
            if not text:
                continue
            try:
                hashes = tuple(bytes.fromhex(h) for h in text)
            except ValueError as e:
                raise ValueError(f"{path}:{number}: not hex block hashes: {e}") from None
            out.append(WorkloadRequest(f"prompt-{number}", len(hashes) * block_size + 1, hashes))
    return out


# -- measurements ------------------------------------------------------------------------------------------

MAX_ANSWERS_KEPT = 1000


def found(rig: RemoteRig, prompts: Sequence[WorkloadRequest], expected: Sequence[int | None]) -> dict[str, Any]:
    """Every client's blocking lookup of ``prompts``: hits found, and how many match ``expected`` (hit tokens
    known in advance, or None)."""
    from mooncake_lookout.connector.bench.call import make_client
    from mooncake_lookout.connector.bench.wiring import NONE

    out: dict[str, Any] = {"prompts": len(prompts), "clients": {}}
    for name in rig.names:
        client, close = make_client(rig, name, NONE, timeout_ms=5000.0)
        try:
            hits: list[int] = []
            call.time_sync(client, prompts, "found", hits)
        finally:
            close()
        known = [(h, e) for h, e in zip(hits, expected) if e is not None]
        out["clients"][name] = {"hits": sum(1 for h in hits if h > 0), "hit_tokens": sum(h for h in hits if h > 0),
                                "expected": len(known), "as_expected": sum(1 for h, e in known if h == e),
                                "answers": hits[:MAX_ANSWERS_KEPT]}
    return out


def run_remote(out_dir: str, layout: Layout, *, master: str | None = None, server: str | None = None,
               server_wire: str = PIPELINED, master_http: str | None = None, prompts_file: str | None = None,
               sample_keys: int = 0, quick: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure a user's master or server read-only; write ``bench.json`` and ``bench.txt``; return the results."""
    from mooncake_lookout.connector.bench.run import machine, targets

    if sample_keys and (master_http is None or master is None):
        raise ValueError("--sample-keys needs --master (the layout) and --master-http (where keys are listed)")
    sizes = QUICK if quick else FULL
    t_start = time.perf_counter()
    results: dict[str, Any] = {"quick": quick, "machine": machine(), "remote": {
        "master": master, "server": server, "server_wire": server_wire if server else None,
        "layout": {"model": layout.model, "cache_prefix": layout.cache_prefix, "tp_size": layout.tp_size,
                   "block_size": layout.block_size}}}
    remote = results["remote"]
    if master_http is not None:
        remote["key_count_before"] = master_key_count(master_http)
    prompts = read_prompts(prompts_file, layout.block_size) if prompts_file else []
    seed = random.getrandbits(30)  # random block hashes: keys no store holds
    requests = shared_prefix_workload(sizes.call_requests, block_size=layout.block_size, num_prefixes=4, seed=seed)
    burst_reqs = shared_prefix_workload(sizes.burst_n, block_size=layout.block_size, num_prefixes=4, seed=seed + 1)
    log(f"connecting to {master or server} ...")
    with RemoteRig(layout, master=master, server=server, server_wire=server_wire) as rig:
        if rig.worker is not None:
            from mooncake_lookout.connector.rigs.vllm_layout import key_prefix

            remote["key_prefix"] = key_prefix(rig.worker)
            log("server side: one lookup per backend ...")
            results["backends"] = backends.run(rig.store, rig.worker, blocks=sizes.store_blocks,
                                               rounds=sizes.store_rounds, block_size=layout.block_size)
        log("(a) one lookup call" + (", with the floors" if rig.floor is not None else "") + " ...")
        a = call.run(rig, requests, rig.floor, names=rig.names)
        a.pop("raw")
        if "floors" in a:
            results["floors"] = a.pop("floors")
        results["a"] = a
        log("(a4) k lookups arriving in one step ...")
        results["a4"] = per_step.run(rig, requests, ks=sizes.ks, rounds=sizes.per_step_rounds, names=rig.names)
        log(f"(b) burst of {sizes.burst_n} ...")
        results["b"] = burst.run(rig, burst_reqs, repeats=sizes.burst_repeats, names=rig.names)
        expected: list[int | None] = [None] * len(prompts)  # a named prompt: how much of it is stored is unknown
        if sample_keys:
            hashes = sample_hashes(master_http or "", remote["key_prefix"], sample_keys)
            prompts += [WorkloadRequest(f"sampled-{i}", layout.block_size + 1, (h,)) for i, h in enumerate(hashes)]
            expected += [layout.block_size] * len(hashes)  # a sampled block is stored: a one-block hit
            remote["sampled_keys"] = len(hashes)
        if prompts:
            log(f"found: {len(prompts)} prompts ...")
            results["found"] = found(rig, prompts, expected)
        if rig.store is not None:
            remote["store_calls_here"] = rig.store.calls
    if master_http is not None:
        remote["key_count_after"] = master_key_count(master_http)
    results["machine"]["loadavg_at_end"] = list(os.getloadavg())
    results["targets"] = targets(results)
    results["seconds"] = time.perf_counter() - t_start
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    table = format_remote_report(results)
    with open(os.path.join(out_dir, "bench.txt"), "w") as f:
        f.write(table + "\n")
    log(table)
    return results


def format_remote_report(r: dict[str, Any]) -> str:
    """The report of ``bench --master`` / ``--server``: what was measured where, the figures, the targets."""
    from mooncake_lookout.connector.bench.report import (
        a4_block,
        a_block,
        b_block,
        backends_block,
        floors_block,
        targets_block,
    )

    remote, machine = r["remote"], r["machine"]
    layout = remote["layout"]
    where = " and ".join(x for x in (f"master {remote['master']}" if remote["master"] else "",
                                     f"server {remote['server']} ({remote['server_wire']})" if remote["server"] else "")
                         if x)
    lines = [f"mooncake-lookout bench, read-only, against {where} ({'quick' if r['quick'] else 'full'}; "
             f"{machine['cpus']} CPUs, load average {machine['loadavg_at_start'][0]:.2f} at start, "
             f"{machine.get('loadavg_at_end', [float('nan')])[0]:.2f} at end)",
             f"  vLLM key layout: model {layout['model']}, cache_prefix {layout['cache_prefix']!r}, "
             f"tp_size {layout['tp_size']}, block_size {layout['block_size']}"
             + (f"; keys look like {remote['key_prefix']}<hash>" if "key_prefix" in remote else "")]
    writes = "no writes: lookup-only store clients, only existence checks"
    if "key_count_before" in remote:
        writes += f"; master_key_count {remote['key_count_before']} before, {remote['key_count_after']} after"
    if "store_calls_here" in remote:
        writes += f"; {remote['store_calls_here']} existence checks from this process"
    lines += [f"  {writes}", ""]
    blocks = [a_block(r), a4_block(r), b_block(r)]
    if "backends" in r:
        blocks.insert(0, backends_block(r))
    if "floors" in r:
        blocks.insert(0, floors_block(r))
    for block in blocks:
        lines += block + [""]
    if "found" in r:
        fd = r["found"]
        lines.append(f"found: {fd['prompts']} prompts you named or sampled ({remote.get('sampled_keys', 0)} sampled "
                     "keys, each a one-block prompt), asked by every client")
        for name, v in fd["clients"].items():
            extra = f"; sampled blocks found: {v['as_expected']} of {v['expected']}" if v["expected"] else ""
            lines.append(f"  {name:26} {v['hits']} hit ({v['hit_tokens']} tokens){extra}; first answers "
                         f"{v['answers'][:10]}")
        lines.append("")
    return "\n".join(lines + targets_block(r["targets"]))


__all__ = ["FULL", "QUICK", "RemoteRig", "RemoteSizes", "format_remote_report", "found", "master_key_count",
           "read_prompts", "run_remote", "sample_hashes"]

"""A real master failover, driven by the chart's own HA flags, seen through our lookup client, with the operation log
off and on (``master.ha.oplog``, the masters' ``--enable_oplog``).

On 127.0.0.1: Debian's etcd started with the flags the chart renders for its etcd StatefulSet
(ci/ha-values.yaml, one member), two ``mooncake_master`` processes with the flags it renders for the HA
masters (``--enable_ha``, ``--etcd_endpoints``, ``--cluster_id``, and ``--enable_oplog`` when asked; pod IP and
ports moved to loopback), our ``LookupServer`` in a child process whose store client takes the master address the
chart writes into ``mooncake.json`` (``etcd://...``) with the engine's ``MC_STORE_CLUSTER_ID``, and our
``LookupClient`` asking it. :data:`BEFORE_CHAINS` prefixes are stored, then the leader is killed (SIGKILL) while
lookups run. Lookups must come back, with no wrong hit: a cold chain never hits, a hit is whole, a prefix stored
after the failover hits in full. What happens to the prefixes stored before it is what the operation log changes,
and the test counts their keys once the new leader serves: without it none is found (the index died with the old
leader), with it every one is (the standby replayed the leader's log from etcd). Those counts, with the size of
the log in etcd, are the figures docs/helm.md quotes from docs/bench/ha-failover.json
(``LOOKOUT_RECORD_FAILOVER=1`` rewrites it; otherwise the test fails if a count differs from it).

The bound on recovery is what Mooncake promises, not this machine's speed: the old leader's election key expires
after its lease (5 s, DEFAULT_MASTER_VIEW_LEASE_TTL_SEC), the new leader then waits one more lease before serving
(its warm-up), plus a stated margin of 20 s for its 1 s acquire retries, the clients' re-resolution through etcd
and a loaded machine. Every process is stopped by pid.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import failover_doc  # helm/tools/failover_doc.py
from mooncake_lookout.connector.client import LookupClient
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.events import Outcome, OutcomeCounter
from mooncake_lookout.connector.rigs.master import find_master_binary
from mooncake_lookout.connector.rigs.processes import die_with_parent, stop_process
from mooncake_lookout.connector.rigs.workload import unique_hashes
from mooncake_lookout.connector.server.prefix_index import PrefixIndex, StoreError
from mooncake_lookout.connector.server.store import open_writer_store
from mooncake_lookout.connector.transport.pipelined import PipelinedTransport

import chart  # helm/tools/chart.py (conftest puts helm/tools on sys.path)

BLOCK = 16
BLOCKS = 4
FULL_HIT = BLOCKS * BLOCK
BEFORE_CHAINS = 64  # prefixes stored before the failover: BEFORE_CHAINS * BLOCKS keys
ELECTION_LEASE_S = 5.0  # Mooncake's DEFAULT_MASTER_VIEW_LEASE_TTL_SEC (etcd backend)
RECOVERY_BOUND_S = 2 * ELECTION_LEASE_S + 20.0  # lease expiry + warm-up, plus the stated margin
START_BOUND_S = 30.0
# After a prefix stored after the kill hits in full, how long the earlier prefixes may take to show: the standby's
# log replay is done before it serves, but a store client re-mounts its segment with the new leader on its own
# ping; one election lease covers it (the figure is a count, not a time).
SETTLE_S = ELECTION_LEASE_S

# The engine's lookup server: our LookupServer over a PrefixIndex whose store client takes the chart's
# master address. Prints its address, serves until stdin closes.
SERVER = r"""
import sys
from mooncake_lookout.connector.server import LookupServer
from mooncake_lookout.connector.server.prefix_index import PrefixIndex
from mooncake_lookout.connector.server.store import open_store
master, namespace, block = sys.argv[1], sys.argv[2], int(sys.argv[3])
store = open_store(master, rpc_timeout_ms=3000)
with LookupServer(PrefixIndex(store, block, namespace=namespace), "tcp://127.0.0.1:0") as server:
    print("ADDRESS " + server.address, flush=True)
    sys.stdin.read()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=1) as reply:
            return json.loads(reply.read())
    except (OSError, ValueError):
        return None


def poll(check, bound_s: float, what: str):
    """``check()`` until it returns something truthy, at most ``bound_s``."""
    deadline = time.monotonic() + bound_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {bound_s} s")
        time.sleep(0.05)


def rendered_ha(oplog: bool) -> dict[str, Any]:
    """The etcd, master and engine parts the chart renders for ci/ha-values.yaml (one etcd member here), with the
    operation log as asked, as release lookout-oplog-on or -off (so each run's store has a cluster id of its own)."""
    objects = chart.template([chart.ci_value_sets()["ha"]], release=f"lookout-oplog-{'on' if oplog else 'off'}",
                             sets={"master.ha.etcd.replicas": "1", "master.ha.oplog": json.dumps(oplog)})
    (etcd,) = chart.one(objects, "StatefulSet", "-etcd")["spec"]["template"]["spec"]["containers"]
    (master,) = chart.one(objects, "Deployment", "-master")["spec"]["template"]["spec"]["containers"]
    (engine,) = chart.one(objects, "Deployment", "-engine")["spec"]["template"]["spec"]["containers"]
    mooncake = json.loads(chart.one(objects, "ConfigMap", "-engine")["data"]["mooncake.json"])
    service = chart.one(objects, "Service", "-etcd")
    port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "client")
    return {"etcd": etcd["args"], "master": master["args"],
            "engine_env": {e["name"]: e.get("value") for e in engine["env"]},
            "address": mooncake["master_server_address"],
            "etcd_service": f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc:{port}"}


def etcd_args(args: list[str], client: int, peer: int, data: Path) -> list[str]:
    """The rendered etcd flags on loopback: every member URL at 127.0.0.1, the chart's ports moved to free ones."""
    name = next(a.split("=", 1)[1] for a in args if a.startswith("--initial-cluster=")).split("=", 1)[0]
    out = []
    for a in args:
        a = a.replace("$(POD_NAME)", name) if a.startswith("--name=") else a
        a = re.sub(r"http://[^:,=]+:2379", f"http://127.0.0.1:{client}", a)
        a = re.sub(r"http://[^:,=]+:2380", f"http://127.0.0.1:{peer}", a)
        if a.startswith("--data-dir="):
            a = f"--data-dir={data}"
        out.append(a)
    return out


def master_args(args: list[str], rendered_service: str, etcd: str, rpc: int, metrics: int) -> list[str]:
    """The rendered HA master flags on loopback (the pod IP is 127.0.0.1; each master gets its own ports)."""
    out = []
    for a in args:
        key = a.split("=", 1)[0]
        if key == "--etcd_endpoints":
            assert a == f"--etcd_endpoints={rendered_service}", a
            a = f"--etcd_endpoints={etcd}"
        a = {"--rpc_port": f"--rpc_port={rpc}", "--metrics_port": f"--metrics_port={metrics}",
             "--metrics_host": "--metrics_host=127.0.0.1"}.get(key, a)
        out.append(a.replace("$(POD_IP)", "127.0.0.1"))
    return out


class Processes:
    """Child processes started by this test, stopped by pid (SIGKILL if SIGTERM is not enough)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str], **kw: Any) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "wb") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(argv, stdout=kw.pop("stdout", log), stderr=log, preexec_fn=die_with_parent(),
                                    **kw)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.stdin is not None:
                proc.stdin.close()
            stop_process(proc, timeout_s=5.0)
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.stop_all()


def first_line(proc: subprocess.Popen, prefix: str, bound_s: float) -> str:
    """The first stdout line of ``proc`` that starts with ``prefix``, read on a thread, waited for ``bound_s``."""
    found: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            if line.startswith(prefix):
                found.append(line.strip())
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(bound_s)
    assert found, f"no {prefix!r} line from pid {proc.pid} within {bound_s} s (exit code {proc.poll()})"
    return found[0]


def health(metrics: int) -> dict[str, Any] | None:
    return get_json(f"http://127.0.0.1:{metrics}/health")


def oplog_in_etcd(client_port: int, cluster_id: str) -> tuple[int, int]:
    """(records, bytes) under the masters' operation-log prefix in etcd (its v3 JSON gateway on loopback)."""
    prefix = f"/oplog/{cluster_id}/".encode()
    body = {"key": base64.b64encode(prefix).decode(),
            "range_end": base64.b64encode(prefix[:-1] + bytes([prefix[-1] + 1])).decode()}
    request = urllib.request.Request(f"http://127.0.0.1:{client_port}/v3/kv/range", data=json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=5) as reply:
        kvs = json.loads(reply.read()).get("kvs", [])
    return len(kvs), sum(len(base64.b64decode(kv.get("value", ""))) for kv in kvs)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory, require_tool) -> Iterator[int]:
    """Debian's etcd with the rendered flags, shared by both runs: Mooncake's client keeps one etcd connection per
    process, so a second etcd could not be reached from this one. Each run names its own store (release), so they
    share nothing else. Yields its client port."""
    folder = tmp_path_factory.mktemp("etcd")
    procs = Processes(folder)
    try:
        ha = rendered_ha(False)
        client_port, peer_port = free_port(), free_port()
        procs.start("etcd", [require_tool("etcd"), *etcd_args(ha["etcd"], client_port, peer_port, folder / "data")])
        poll(lambda: (get_json(f"http://127.0.0.1:{client_port}/health") or {}).get("health") == "true",
             START_BOUND_S, "healthy etcd")
        yield client_port
    finally:
        procs.stop_all()


@pytest.mark.parametrize("oplog", [False, True], ids=["oplog-off", "oplog-on"])
def test_failover_under_lookups_through_our_client(processes: Processes, etcd: int,
                                                   monkeypatch: pytest.MonkeyPatch, oplog: bool) -> None:
    ha = rendered_ha(oplog)
    assert ha["address"] == f"etcd://{ha['etcd_service']}"  # engines take the etcd form
    cluster_id = ha["engine_env"]["MC_STORE_CLUSTER_ID"]
    assert f"--cluster_id={cluster_id}" in ha["master"]
    assert ("--enable_oplog=true" in ha["master"]) is oplog
    client_port = etcd
    endpoint = f"127.0.0.1:{client_port}"
    masters: dict[str, int] = {}
    for name in ("master-a", "master-b"):
        metrics = free_port()
        processes.start(name, [str(find_master_binary()),
                               *master_args(ha["master"], ha["etcd_service"], endpoint, free_port(), metrics)])
        masters[name] = metrics
        if name == "master-a":  # the first one leads: wait until it serves before the standby starts
            poll(lambda m=metrics: (health(m) or {}).get("service_ready") is True, START_BOUND_S, "serving leader")
    poll(lambda: (health(masters["master-b"]) or {}).get("role") == "standby", START_BOUND_S, "standby")

    # Store clients take the chart's address form, pointed at this etcd, with the engines' cluster id.
    address = ha["address"].replace(ha["etcd_service"], endpoint)
    monkeypatch.setenv("MC_STORE_CLUSTER_ID", cluster_id)
    namespace = f"ha-{uuid.uuid4().hex[:8]}"
    writer = open_writer_store(address, rpc_timeout_ms=3000)
    try:
        result = _run_failover(processes, masters, writer, address, namespace, oplog,
                               lambda: oplog_in_etcd(client_port, cluster_id)[0])
    finally:
        writer.close()
    result["oplog_records_in_etcd"], result["oplog_bytes_in_etcd"] = oplog_in_etcd(client_port, cluster_id)
    print(f"\noplog {'on' if oplog else 'off'}: {result}")
    # What the operation log changes: every key written before the failover, or none, is found after it.
    assert result["keys_found_after"] == (result["keys_written"] if oplog else 0), result
    assert (result["oplog_records_in_etcd"] > 0) is oplog
    # The log stays in etcd: no record was removed, not even by the failover (docs/helm.md: size etcd for it).
    assert result["oplog_records_in_etcd"] >= result.pop("oplog_records_before_kill")
    failover_doc.check_or_record(result)


def _run_failover(processes: Processes, masters: dict[str, int], writer: Any, address: str, namespace: str,
                  oplog: bool, oplog_records: Any) -> dict[str, Any]:
    index = PrefixIndex(writer, BLOCK, namespace=namespace)
    chains = [unique_hashes(BLOCKS, seed=1000 + i) for i in range(BEFORE_CHAINS)]
    before = chains[0]
    cold, after = (unique_hashes(BLOCKS, seed=s) for s in (102, 103))
    index.store_prefixes(chains)
    server = processes.start("lookup-server", [sys.executable, "-c", SERVER, address, namespace, str(BLOCK)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "MC_LOG_LEVEL": "ERROR"})
    server_address = first_line(server, "ADDRESS ", START_BOUND_S).split(" ", 1)[1]
    # The breaker stays closed (a very high threshold), so every answer shows the store's state.
    config = LookupConfig(lookup_async=True, lookup_transport="pipelined", lookup_timeout_ms=1000.0,
                          lookup_breaker_failures=10_000)
    outcomes = OutcomeCounter()
    client = LookupClient(config, PipelinedTransport(server_address, timeout_s=config.timeout_s), observer=outcomes)
    counter = iter(range(10**9))

    def ask(hashes: list[bytes]) -> tuple[int, Outcome]:
        req = f"r{next(counter)}"
        result = client.lookup(req, FULL_HIT + 1, hashes)
        (outcome,) = [rec.outcome for rec in outcomes.records[-3:] if rec.req_id == req]
        client.discard(req)
        return result.hit_length, outcome

    try:
        assert ask(before) == (FULL_HIT, Outcome.HIT) and ask(cold) == (0, Outcome.MISS)
        leader = next(n for n, m in masters.items() if (health(m) or {}).get("role") == "leader")
        standby = next(n for n in masters if n != leader)
        stored_after: list[float] = []

        def write_after() -> None:  # keep trying until the new leader takes the put
            while not stored_after and time.monotonic() - killed_at < RECOVERY_BOUND_S:
                try:
                    index.store_prefixes([after])
                    stored_after.append(time.monotonic() - killed_at)
                except StoreError:
                    time.sleep(0.2)  # pacing between put retries while no leader serves

        records_before_kill = oplog_records()
        os.kill(processes.procs[leader].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        writer_thread = threading.Thread(target=write_after, daemon=True)
        writer_thread.start()
        answers: list[tuple[float, str, int, Outcome]] = []
        first_answer = full_recovery = None
        while full_recovery is None and time.monotonic() - killed_at < RECOVERY_BOUND_S:
            for name, hashes in (("before", before), ("cold", cold), ("after", after)):
                hit, outcome = ask(hashes)
                now = time.monotonic() - killed_at
                answers.append((now, name, hit, outcome))
                if first_answer is None and outcome in (Outcome.HIT, Outcome.MISS):
                    first_answer = now
                if name == "after" and hit == FULL_HIT:
                    full_recovery = now
            time.sleep(0.05)  # pacing between probe rounds
        writer_thread.join(RECOVERY_BOUND_S)
        found = count_found(ask, chains, full_recovery is not None)
    finally:
        client.close()

    summary = {o.value: n for o in Outcome if (n := sum(1 for a in answers if a[3] is o))}
    assert full_recovery is not None and first_answer is not None, (
        f"no full recovery within {RECOVERY_BOUND_S} s: {answers[-6:]}")
    print(f"\nfailover: leader {leader} killed; lookups answered by the store again after {first_answer:.2f} s; "
          f"a prefix stored after the kill hit in full after {full_recovery:.2f} s (its put succeeded after "
          f"{stored_after[0]:.2f} s); {len(answers)} lookups meanwhile: {summary}")
    assert first_answer <= full_recovery
    # No wrong hit: a cold chain is never found, a hit is whole, and without the log the old index is gone.
    wrong = [a for a in answers if (a[1] == "cold" and a[2] != 0) or a[2] not in (0, FULL_HIT)
             or (a[1] == "before" and a[2] != 0 and not oplog)]
    assert not wrong, wrong
    assert ask_after_recovery_is_consistent(masters[standby])
    # Errors and timeouts while no leader served are reported as such, never as plain misses.
    assert summary["error"] + summary["timeout"] > 0
    return {"oplog": oplog, "keys_written": BEFORE_CHAINS * BLOCKS, "keys_found_after": found,
            "oplog_records_before_kill": records_before_kill,
            "lookups_answered_after_s": round(first_answer, 2), "new_prefix_hit_after_s": round(full_recovery, 2)}


def count_found(ask: Any, chains: list[list[bytes]], recovered: bool) -> int:
    """Keys of ``chains`` the new leader finds (hit blocks; a lookup stops at the first missing one), polled for
    SETTLE_S after recovery until all are found (the same wait with and without the log)."""
    if not recovered:
        return 0
    deadline = time.monotonic() + SETTLE_S
    while True:
        found = sum(ask(chain)[0] // BLOCK for chain in chains)
        if found == len(chains) * BLOCKS or time.monotonic() > deadline:
            return found
        time.sleep(0.2)  # pacing between counts while segments re-mount


def ask_after_recovery_is_consistent(metrics: int) -> bool:
    """The standby took over: it reports itself leader and serving."""
    state = health(metrics) or {}
    return state.get("role") == "leader" and state.get("service_ready") is True


def test_the_k8s_backend_needs_a_mooncake_built_with_it(tmp_path: Path, processes: Processes) -> None:
    """What ci/ha-k8s-values.yaml and docs/helm.md say: the rendered k8s-backend flags make the master of the
    0.3.13.post1 wheels (the chart's default image) exit, as its k8s lease support is not compiled in."""
    objects = chart.template([chart.ci_value_sets()["ha-k8s"]])
    (master,) = chart.one(objects, "Deployment", "-master")["spec"]["template"]["spec"]["containers"]
    args = master_args(master["args"], "", "", free_port(), free_port())
    assert "--ha_backend_type=k8s" in args
    proc = processes.start("k8s-master", [str(find_master_binary()), *args],
                           env={**os.environ, "POD_NAME": "m-0", "POD_NAMESPACE": "serving"})
    try:
        code = proc.wait(timeout=START_BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail("the master kept running with the k8s backend: update docs/helm.md and ci/ha-k8s-values.yaml")
    assert code != 0 and "UNAVAILABLE_IN_CURRENT_MODE" in processes.log("k8s-master")


def test_docs_quote_the_committed_failover_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/helm.md's block is what docs/bench/ha-failover.json renders (python helm/tools/failover_doc.py), one row
    per mode with its counts; a run whose counts differ from the record fails, naming how to re-record."""
    assert not failover_doc.stale(), "run: python helm/tools/failover_doc.py"
    record = failover_doc.load()
    block = failover_doc.render(record)
    for run in record["runs"].values():
        assert f"| `{str(run['oplog']).lower()}` | {run['keys_written']} | {run['keys_found_after']} |" in block
    monkeypatch.delenv("LOOKOUT_RECORD_FAILOVER", raising=False)
    copy = tmp_path / "ha-failover.json"
    copy.write_text(json.dumps(record))
    changed = {**record["runs"]["oplog-on"], "keys_found_after": 0}
    with pytest.raises(AssertionError, match="LOOKOUT_RECORD_FAILOVER=1"):
        failover_doc.check_or_record(changed, copy)
    failover_doc.check_or_record(dict(record["runs"]["oplog-on"]), copy)  # the same counts pass

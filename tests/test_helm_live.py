"""The chart's commands run for real: the master container's flags start a real mooncake_master (for every value
set that deploys one, with the key lease the engines are told about), the store pods' flags start a real
mooncake_client that lends its memory to that master, the engines' tracing variables send lookup spans to an
OTLP/HTTP receiver, and the `helm test` hook's script checks a real /metrics endpoint and that master (all on
127.0.0.1).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import MetricsHandler

from mooncake_lookout.metrics.catalogue import CATALOGUE, MetricSpec

import chart  # helm/tools/chart.py (conftest puts helm/tools on sys.path)

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
CHECK_SCRIPT = ROOT / "helm" / "mooncake-lookout" / "files" / "helm-test" / "check_lookout.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poll(check, timeout_s: float = 15.0, what: str = "condition"):
    """Call check() until it returns a truthy value or timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False


def master_binary() -> str:
    for candidate in (VENV_BIN / "mooncake_master", Path(sys.prefix) / "bin" / "mooncake_master"):
        if candidate.exists():
            return str(candidate)
    raise AssertionError("mooncake_master not found in the venv: run scripts/setup.sh")


def master_args_from_chart(rpc_port: int, metrics_port: int) -> list[str]:
    """The master container's args as the chart renders them, moved to 127.0.0.1 and free ports."""
    objects = chart.template(sets={"master.rpcPort": str(rpc_port), "master.metricsPort": str(metrics_port)})
    (container,) = chart.one(objects, "Deployment", "-master")["spec"]["template"]["spec"]["containers"]
    return [a.replace("=0.0.0.0", "=127.0.0.1") for a in container["args"]]


@pytest.fixture(scope="module")
def master() -> Iterator[dict[str, int]]:
    """A real mooncake_master started with the chart's flags; killed by pid at the end."""
    rpc_port, metrics_port = free_port(), free_port()
    args = master_args_from_chart(rpc_port, metrics_port)
    env = dict(os.environ, MC_LOG_LEVEL="ERROR")
    proc = subprocess.Popen([master_binary(), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                            start_new_session=True)
    try:
        poll(lambda: proc.poll() is not None or http_ok(f"http://127.0.0.1:{metrics_port}/health"),
             what="mooncake_master /health")
        if proc.poll() is not None:
            raise AssertionError(f"mooncake_master rejected the chart's flags {args}: {proc.stderr.read().decode()}")
        yield {"rpc": rpc_port, "metrics": metrics_port, "pid": proc.pid}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        proc.stderr.close()


def metrics_server(specs: list[MetricSpec]) -> tuple[ThreadingHTTPServer, str]:
    """A real /metrics endpoint exporting the given families (a stand-in for vLLM's, same text format)."""
    registry = CollectorRegistry()
    kinds = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
    for spec in specs:
        labels = ("model_name", "engine", *spec.labels)
        kwargs = {"buckets": spec.buckets} if spec.kind == "histogram" else {}
        kinds[spec.kind](spec.name, spec.help, labels, registry=registry, **kwargs)
    server = ThreadingHTTPServer(("127.0.0.1", 0), MetricsHandler.factory(registry))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/metrics"


def run_check(env: dict[str, str], timeout_s: float = 1.0) -> subprocess.CompletedProcess:
    full = {**os.environ, "TIMEOUT_S": str(timeout_s), "MASTER_HEALTH_URL": "", "MASTER_ADDRESS": "", **env}
    return subprocess.run([sys.executable, str(CHECK_SCRIPT)], env=full, capture_output=True, text=True,
                          timeout=timeout_s + 30)


CLIENT_SPECS = [s for s in CATALOGUE if s.side == "client"]


def test_the_charts_master_flags_start_a_real_master_that_serves_metrics(master):
    with urllib.request.urlopen(f"http://127.0.0.1:{master['metrics']}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    assert "master_" in text
    with socket.create_connection(("127.0.0.1", master["rpc"]), timeout=5):
        pass


def test_helm_test_script_passes_on_a_healthy_release(master):
    server, url = metrics_server(CLIENT_SPECS)
    try:
        done = run_check({"ENGINE_METRICS_URL": url,
                          "MASTER_HEALTH_URL": f"http://127.0.0.1:{master['metrics']}/health"})
        assert done.returncode == 0, done.stderr
        assert f"{len(CLIENT_SPECS)} lookup families" in done.stdout
        # External master without a health URL: the RPC port must accept a connection.
        done = run_check({"ENGINE_METRICS_URL": url, "MASTER_ADDRESS": f"127.0.0.1:{master['rpc']}"})
        assert done.returncode == 0, done.stderr
    finally:
        server.shutdown()
        server.server_close()


def test_helm_test_script_fails_naming_a_missing_family(master):
    missing = CLIENT_SPECS[0]
    server, url = metrics_server([s for s in CLIENT_SPECS if s is not missing])
    try:
        done = run_check({"ENGINE_METRICS_URL": url,
                          "MASTER_HEALTH_URL": f"http://127.0.0.1:{master['metrics']}/health"})
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 1
    assert missing.name in done.stderr


def test_helm_test_script_fails_when_the_master_is_down(master):
    server, url = metrics_server(CLIENT_SPECS)
    dead = free_port()
    try:
        by_health = run_check({"ENGINE_METRICS_URL": url, "MASTER_HEALTH_URL": f"http://127.0.0.1:{dead}/health"})
        by_rpc = run_check({"ENGINE_METRICS_URL": url, "MASTER_ADDRESS": f"127.0.0.1:{dead}"})
    finally:
        server.shutdown()
        server.server_close()
    assert by_health.returncode == 1 and f"127.0.0.1:{dead}/health" in by_health.stderr
    assert by_rpc.returncode == 1 and f"127.0.0.1:{dead}" in by_rpc.stderr


def test_helm_test_script_reaches_an_ha_store_through_its_first_etcd_endpoint(master):
    server, url = metrics_server(CLIENT_SPECS)
    with socket.create_server(("127.0.0.1", 0)) as etcd:  # a listening endpoint in the etcd:// form's first slot
        port = etcd.getsockname()[1]
        try:
            ok = run_check({"ENGINE_METRICS_URL": url,
                            "MASTER_ADDRESS": f"etcd://127.0.0.1:{port};127.0.0.1:{free_port()}"})
            dead = free_port()
            down = run_check({"ENGINE_METRICS_URL": url, "MASTER_ADDRESS": f"etcd://127.0.0.1:{dead}"})
        finally:
            server.shutdown()
            server.server_close()
    assert ok.returncode == 0, ok.stderr
    assert down.returncode == 1 and f"127.0.0.1:{dead}" in down.stderr


def test_helm_test_script_fails_when_the_engine_is_unreachable(master):
    dead = free_port()
    done = run_check({"ENGINE_METRICS_URL": f"http://127.0.0.1:{dead}/metrics",
                      "MASTER_HEALTH_URL": f"http://127.0.0.1:{master['metrics']}/health"})
    assert done.returncode == 1 and "unreachable" in done.stderr


# -- every value set's master, and the lease the engines are told about -------------------------------------

def start_master(args: list[str]) -> tuple[subprocess.Popen, str]:
    """A master with these flags until /health answers; returns it and its log so far (stopped by the caller)."""
    metrics = next(int(a.split("=", 1)[1]) for a in args if a.startswith("--metrics_port="))
    log = []
    proc = subprocess.Popen([master_binary(), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, MC_LOG_LEVEL="INFO"), start_new_session=True)

    def pump() -> None:
        for line in proc.stderr:
            log.append(line)

    threading.Thread(target=pump, daemon=True).start()
    poll(lambda: proc.poll() is not None or http_ok(f"http://127.0.0.1:{metrics}/health"),
         what="mooncake_master /health")
    return proc, log


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _runs_one_master(path: Path) -> bool:
    import yaml

    master = (yaml.safe_load(path.read_text()) or {}).get("master", {})
    return master.get("enabled", True) and not master.get("ha", {}).get("enabled", False)


SINGLE_MASTER_SETS = sorted(n for n, p in chart.ci_value_sets().items() if _runs_one_master(p)) + ["default"]


@pytest.mark.parametrize("name,lease", [(n, "10s") for n in SINGLE_MASTER_SETS]
                         + [("default", "1500ms"), ("default", "7000")])
def test_every_sets_master_starts_with_the_lease_the_engines_are_told(name, lease):
    rpc, metrics = free_port(), free_port()
    path = chart.ci_value_sets().get(name)
    objects = chart.template([path] if path else [], sets={
        "master.rpcPort": str(rpc), "master.metricsPort": str(metrics), "master.defaultKvLeaseTtl": json.dumps(lease)})
    (container,) = chart.one(objects, "Deployment", "-master")["spec"]["template"]["spec"]["containers"]
    args = [a.replace("=0.0.0.0", "=127.0.0.1") for a in container["args"]]
    told = chart.one(objects, "Deployment", "-engine")["spec"]["template"]["metadata"]["annotations"][
        "mooncake-lookout/master-lease-ms"]
    proc, log = start_master(args)
    try:
        assert proc.poll() is None, f"mooncake_master rejected the chart's flags {args}: {''.join(log)[-2000:]}"
        # The master states the lease it runs with (in ms) when it starts.
        line = poll(lambda: next((x for x in list(log) if "default_kv_lease_ttl=" in x), None),
                    what="the master's start-up line")
        running = int(line.split("default_kv_lease_ttl=", 1)[1].split(",", 1)[0])
        assert running == int(told), (lease, running, told)
    finally:
        stop(proc)


# -- store-only pods ----------------------------------------------------------------------------------------

def master_capacity(metrics_port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return int(float(next(x.split()[1] for x in text.splitlines() if x.startswith("master_total_capacity_bytes"))))


def store_pod(master: dict[str, int], http_port: int, port: int) -> tuple[dict[str, Any], list[str]]:
    """A store pod's container as the chart renders it (a 64 MB segment), and its args moved to loopback and this
    master."""
    objects = chart.template(sets={"store.enabled": "true", "store.globalSegmentSize": '"64MB"',
                                   "store.localBufferSize": '"0"', "store.httpPort": str(http_port),
                                   "store.port": str(port), "master.rpcPort": str(master["rpc"])})
    (c,) = chart.one(objects, "Deployment", "-store")["spec"]["template"]["spec"]["containers"]
    rendered = json.loads(chart.one(objects, "ConfigMap", "-engine")["data"]["mooncake.json"])["master_server_address"]
    return c, [a.replace("$(POD_IP)", "127.0.0.1").replace(rendered, f"127.0.0.1:{master['rpc']}") for a in c["args"]]


def test_the_charts_store_pod_lends_its_segment_to_the_master(master):
    """A store pod's rendered flags (master address, segment, P2P handshake) mount its memory on a real master."""
    http_port, port = free_port(), free_port()
    c, args = store_pod(master, http_port, port)
    assert f"--master_server_address=127.0.0.1:{master['rpc']}" in args  # the engines' address, moved here
    binary = Path(master_binary()).with_name(c["command"][0])
    before = master_capacity(master["metrics"])
    proc = subprocess.Popen([str(binary), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=dict(os.environ, MC_LOG_LEVEL="ERROR"), start_new_session=True)
    try:
        poll(lambda: proc.poll() is not None or master_capacity(master["metrics"]) == before + 64 * 1024**2,
             what="the store pod's segment on the master")
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        # Its probes answer on the port the chart names (its HTTP server may come up a little after the segment is
        # mounted: polled, within poll's bound; CI once asked in between).
        probe = c["readinessProbe"]["httpGet"]
        assert probe["port"] == "http" and {"name": "http", "containerPort": http_port, "protocol": "TCP"} in c["ports"]
        poll(lambda: http_ok(f"http://127.0.0.1:{http_port}{probe['path']}"), what="the store pod's readiness probe")
    finally:
        stop(proc)
        proc.stderr.close()


def established_to(ports: range) -> set[tuple[int, int]]:
    """(local port, remote port) of every established TCP connection of this host whose local port is in ``ports``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, remote, state = line.split()[1:4]
            port = int(local.rsplit(":", 1)[1], 16)
            if state == "01" and port in ports:
                found.add((port, int(remote.rsplit(":", 1)[1], 16)))
    return found


@pytest.fixture
def own_master() -> Iterator[dict[str, int]]:
    """A master of the test's own, with the chart's flags: the module's master may still list the segments of store
    pods other tests stopped (until their client TTL), and a put placed there would fail."""
    rpc_port, metrics_port = free_port(), free_port()
    proc, _ = start_master(master_args_from_chart(rpc_port, metrics_port))
    try:
        yield {"rpc": rpc_port, "metrics": metrics_port}
    finally:
        stop(proc)
        proc.stderr.close()


def test_a_client_that_lends_nothing_is_never_connected_to(own_master, monkeypatch):
    """Why a release whose engines lend nothing (engine.mooncake.mode standalone-store) needs no ingress on its
    transfer ports: a store pod (the chart's flags) lends its segment, a client with segment 0 and a local buffer puts
    and gets through it, and no connection ever lands on that client's ports (pinned to a range of their own); every
    connection it has, it opened."""
    master = own_master
    port = free_port()
    _, args = store_pod(master, free_port(), port)
    before = master_capacity(master["metrics"])
    lender = subprocess.Popen([str(Path(master_binary()).with_name("mooncake_client")), *args],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                              env=dict(os.environ, MC_LOG_LEVEL="ERROR", MC_MIN_RPC_PORT="16200",
                                       MC_MAX_RPC_PORT="16220"))
    consumer = None
    ours = range(16300, 16321)  # the consumer's transfer ports
    try:
        poll(lambda: lender.poll() is not None or master_capacity(master["metrics"]) == before + 64 * 1024**2,
             what="the store pod's segment on the master")
        assert lender.poll() is None, lender.stderr.read().decode()[-2000:]
        from mooncake_lookout.connector.server.store import open_store

        monkeypatch.setenv("MC_MIN_RPC_PORT", str(ours.start))
        monkeypatch.setenv("MC_MAX_RPC_PORT", str(ours.stop - 1))
        consumer = open_store(f"127.0.0.1:{master['rpc']}", global_segment_size=0, local_buffer_size=16 << 20)
        assert master_capacity(master["metrics"]) == before + 64 * 1024**2  # it lent nothing
        seen: set[tuple[int, int]] = set()
        to_lender: set[tuple[int, int]] = set()
        for i in range(16):
            value = bytes([i]) * 4096
            assert consumer.put(f"lends-nothing-{i}", value) == 0
            assert consumer.get(f"lends-nothing-{i}") == value  # the bytes came from the store pod's segment
            seen |= established_to(ours)
            to_lender |= established_to(range(16200, 16221)) | established_to(range(port, port + 1))
        assert seen == set(), f"connections landed on the client that lends nothing: {seen}"
        assert to_lender, "the control: the consumer's connections to the store pod were not seen"
    finally:
        if consumer is not None:
            consumer.close()
        stop(lender)
        lender.stderr.close()


# -- lookup spans with the chart's tracing variables --------------------------------------------------------

SPANS = r"""
import time
from mooncake_lookout.connector.events import LookupRecord, ObserverSet, Outcome
from mooncake_lookout.metrics.tracing import tracing_observer_from_env
observer = tracing_observer_from_env()
assert observer is not None, "tracing is off with the chart's variables"
obs = ObserverSet([observer])
rec = LookupRecord("cmpl-1", 64, [b"h" * 32] * 4, "pipelined", 0, time.perf_counter())
obs.submitted(rec)
rec.t_start = time.perf_counter(); obs.started(rec)
rec.t_answer = time.perf_counter(); obs.answered(rec)
rec.outcome, rec.hit_length, rec.t_consume = Outcome.HIT, 48, time.perf_counter()
obs.consumed(rec)
observer.shutdown()
print("SENT")
"""


def test_the_charts_tracing_variables_send_lookup_spans_over_otlp_http():
    from http.server import BaseHTTPRequestHandler

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    received: list[tuple[str, ExportTraceServiceRequest]] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            msg = ExportTraceServiceRequest()
            msg.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
            received.append((self.path, msg))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    objects = chart.template([chart.ci_value_sets()["async-budget"]],
                             sets={"engine.tracing.samplerArg": '"1.0"'})  # sample every lookup here
    (c,) = chart.one(objects, "Deployment", "-engine")["spec"]["template"]["spec"]["containers"]
    otel = {e["name"]: e["value"] for e in c["env"] if e["name"].startswith("OTEL_")}
    rendered = otel["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    otel["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = re.sub(r"^https?://[^/]+", f"http://127.0.0.1:{server.server_address[1]}",
                                                        rendered)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | otel
    try:
        done = subprocess.run([sys.executable, "-c", SPANS], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "SENT" in done.stdout, done.stderr[-2000:]
        poll(lambda: received, what="spans at the receiver")
    finally:
        server.shutdown()
        server.server_close()
    paths = {path for path, _ in received}
    assert paths == {urllib.parse.urlparse(rendered).path} == {"/v1/traces"}
    services = {a.value.string_value for _, msg in received for rs in msg.resource_spans
                for a in rs.resource.attributes if a.key == "service.name"}
    assert services == {otel["OTEL_SERVICE_NAME"]}
    assert sum(len(ss.spans) for _, msg in received for rs in msg.resource_spans for ss in rs.scope_spans) >= 2

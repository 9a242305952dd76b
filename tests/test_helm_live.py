"""The chart's commands run for real: the master container's flags start a real mooncake_master, and the
`helm test` hook's script checks a real /metrics endpoint and that master (all on 127.0.0.1).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import MetricsHandler

from mooncake_lookout.metrics.catalogue import CATALOGUE, MetricSpec

import chart  # helm/tools/chart.py (conftest puts helm/tools on sys.path)

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


def test_helm_test_script_fails_when_the_engine_is_unreachable(master):
    dead = free_port()
    done = run_check({"ENGINE_METRICS_URL": f"http://127.0.0.1:{dead}/metrics",
                      "MASTER_HEALTH_URL": f"http://127.0.0.1:{master['metrics']}/health"})
    assert done.returncode == 1 and "unreachable" in done.stderr

"""`helm test` check: the engine's /metrics carries the lookup families and the Mooncake master is healthy.

Runs in the engine image, so the family names come from the installed mooncake-lookout's catalogue (one
source). Retries until TIMEOUT_S, then exits 1 naming what is wrong. Environment:
ENGINE_METRICS_URL (required), MASTER_HEALTH_URL (GET must answer 200) or, if empty, MASTER_ADDRESS
(host:port that must accept a TCP connection; for HA masters etcd://host:port[;...], whose first etcd endpoint
must), TIMEOUT_S (default 120).
"""

from __future__ import annotations

import os
import socket
import sys
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from mooncake_lookout.metrics.catalogue import CATALOGUE


def required_families() -> set[str]:
    """Families the scheduler side of the connector exports on vLLM's /metrics."""
    return {spec.name for spec in CATALOGUE if spec.side == "client"}


def engine_problem(url: str) -> str | None:
    """None when the engine's /metrics has every required family, else what is wrong."""
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode("utf-8")
    except OSError as exc:
        return f"engine metrics {url} unreachable: {exc}"
    names = {family.name for family in text_string_to_metric_families(text)}
    missing = sorted(required_families() - names)
    return f"engine metrics {url} lack {', '.join(missing)}" if missing else None


def master_problem(health_url: str, address: str) -> str | None:
    """None when the master answers its /health with 200 (or, without a URL, accepts a connection)."""
    if health_url:
        try:
            with urllib.request.urlopen(health_url, timeout=5) as reply:
                return None if reply.status == 200 else f"master {health_url} answered {reply.status}"
        except OSError as exc:
            return f"master {health_url} unhealthy: {exc}"
    if "://" in address:  # HA form: the store clients reach the masters through this etcd
        address = address.split("://", 1)[1].split(";", 1)[0]
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            return None
    except OSError as exc:
        return f"master RPC {address} unreachable: {exc}"


def main() -> int:
    engine_url = os.environ["ENGINE_METRICS_URL"]
    health_url = os.environ.get("MASTER_HEALTH_URL", "")
    address = os.environ.get("MASTER_ADDRESS", "")
    deadline = time.monotonic() + float(os.environ.get("TIMEOUT_S", "120"))
    while True:
        problems = [p for p in (engine_problem(engine_url), master_problem(health_url, address)) if p]
        if not problems:
            print(f"ok: {engine_url} carries {len(required_families())} lookup families; master healthy")
            return 0
        if time.monotonic() >= deadline:
            print("FAILED: " + "; ".join(problems), file=sys.stderr)
            return 1
        time.sleep(1.0)  # retry pacing between probes, not a wait for a condition


__all__ = ["engine_problem", "master_problem", "required_families"]

if __name__ == "__main__":
    sys.exit(main())

"""``mooncake-lookout size --prometheus`` against a real Prometheus scraping a real master and a real engine's client.

On 127.0.0.1: a Mooncake master (its own ``/metrics``), our lookup server in a process of its own (keeping the
store's epoch, so the client's prefix cache is on, as in vLLM), our client with the Prometheus sink on an
endpoint of its own (the series an engine serves), and a ``prometheus`` scraping both every second. Once
Prometheus holds the run's last figures, ``size`` runs as a user runs it (the console script, ``--json``), and its
reading is checked against the master's own counters read directly and against the workload's known shape.
Every wait is bounded; every process is stopped by pid.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mooncake_lookout.connector.bench.fleet import counters
from mooncake_lookout.connector.rigs.master import EmbeddedMaster, read_metrics
from mooncake_lookout.connector.rigs.workload import shared_prefix_workload
from mooncake_lookout.metrics import catalogue as cat

from live_stack import Prometheus  # noqa: E402 - dashboards/ is on sys.path (conftest)

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

SCRIPT = Path(sys.executable).parent / "mooncake-lookout"
LOOKUPS = 200
SCRAPED_TIMEOUT_S = 30.0
# Prometheus' increase() extrapolates each series to the window's edges by up to half a scrape interval at the
# series' average rate: over a span of SPAN_SCRAPES samples that is a few percent of the total, not a quarter.
SPAN_SCRAPES = 20


def _latest(prom: Prometheus, expr: str) -> float | None:
    result = prom.api("query", query=expr)["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def _wait_for(prom: Prometheus, expr: str, value: float, timeout_s: float = SCRAPED_TIMEOUT_S) -> None:
    """Until Prometheus' newest sample of ``expr`` is ``value`` (bounded; polled at half the scrape interval)."""
    deadline = time.monotonic() + timeout_s
    while (seen := _latest(prom, expr)) != value:
        if time.monotonic() > deadline:
            raise AssertionError(f"Prometheus holds {seen} for {expr}, the target serves {value}")
        time.sleep(0.5)


@pytest.mark.slow
def test_size_reads_the_engines_and_what_the_master_was_asked(tmp_path: Path, prometheus_binary: str) -> None:
    from mooncake_lookout.connector.client import LookupClient
    from mooncake_lookout.connector.config import LookupConfig
    from mooncake_lookout.connector.events import ObserverSet
    from mooncake_lookout.connector.rigs.server_process import ServerProcess
    from mooncake_lookout.connector.server.prefix_index import PrefixIndex
    from mooncake_lookout.connector.server.store import open_writer_store
    from mooncake_lookout.connector.transport import make_transport
    from mooncake_lookout.metrics.exporter import new_registry, serve_metrics
    from mooncake_lookout.metrics.prometheus_sink import PrometheusSink

    requests = shared_prefix_workload(LOOKUPS, num_prefixes=4, seed=9)
    with EmbeddedMaster(kv_lease_ttl_ms=10_000) as master, \
            ServerProcess("pipelined", master.rpc_address, namespace="size-live", keep_epoch=True,
                          standby=False) as server:
        writer = open_writer_store(master.rpc_address)
        try:
            PrefixIndex(writer, 16, namespace="size-live").store_prefixes(
                [r.block_hashes if i % 2 == 0 else r.block_hashes[:4] for i, r in enumerate(requests)])
            config = LookupConfig(lookup_async=False, lookup_transport="pipelined", lookup_timeout_ms=5000)
            registry = new_registry()
            client = LookupClient(config, make_transport(config, server.address),
                                  observer=ObserverSet([PrometheusSink(config, registry)]))
            client.enable_prefix_cache(16)
            endpoint = serve_metrics(0, registry=registry)
            prom = Prometheus({"engine": [f"127.0.0.1:{endpoint.port}"],
                               "master": [f"127.0.0.1:{master.metrics_port}"]}, tmp_path, prometheus_binary).start()
            try:
                _wait_for(prom, 'sum(up{job=~"engine|master"})', 2.0)  # both scraped before the first lookup
                before = counters(master.metrics_url)
                for r in requests:
                    assert client.lookup(r.req_id, r.num_tokens, list(r.block_hashes)) is not None
                    client.discard(r.req_id)
                after = counters(master.metrics_url)
                _wait_for(prom, f"sum({cat.REQUESTS.sample_names[0]})", float(LOOKUPS))
                _wait_for(prom, "sum(master_batch_exist_key_items_total)",
                          read_metrics(master.metrics_url)["master_batch_exist_key_items_total"])
                for job in ("engine", "master"):  # samples spanning long enough that the window's edges matter little
                    _wait_for(prom, f'count_over_time(up{{job="{job}"}}[5m]) >= bool {SPAN_SCRAPES}', 1.0)
                done = subprocess.run(
                    [str(SCRIPT), "size", "--prometheus", prom.url, "--selector", '{job="engine"}',
                     "--master-selector", '{job="master"}', "--window", "5m", "--json"],
                    capture_output=True, text=True, timeout=120)
                missing = subprocess.run(
                    [str(SCRIPT), "size", "--prometheus", prom.url, "--selector", '{job="nothing"}'],
                    capture_output=True, text=True, timeout=120)
            finally:
                prom.stop()
                endpoint.stop()
                client.close()
        finally:
            writer.close()
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    live = answer["live"]
    assert live["engines"] == 1
    # Blocks a lookup could count: 8 a prompt, read from the engine's own counters (Prometheus' increase() extrapolates
    # each series to the window's edges on its own: a percent or two apart).
    assert live["blocks_per_lookup"] == pytest.approx(8.0, rel=0.02)
    # What the master was asked per lookup, from its own counters, as read directly around the run.
    direct_keys = (after["keys"] + after["single_calls"] - before["keys"] - before["single_calls"]) / LOOKUPS
    direct_calls = (after["calls"] + after["single_calls"] - before["calls"] - before["single_calls"]) / LOOKUPS
    keys_per_lookup = live["master_keys_per_s"] / live["lookups_per_s"]
    assert keys_per_lookup == pytest.approx(direct_keys, rel=0.1)
    assert live["master_calls_per_s"] / live["lookups_per_s"] == pytest.approx(direct_calls, rel=0.1)
    loads, model = answer["loads"], answer["model"]
    assert loads["upstream"]["keys_per_s"] == pytest.approx(live["blocks_per_lookup"] * live["lookups_per_s"])
    assert loads["ours"]["keys_per_s"] < loads["upstream"]["keys_per_s"]  # the cache skipped known prefixes
    assert loads["ours"]["per_lookup_us"] == pytest.approx(
        direct_calls * model["per_call_us"] + direct_keys * model["per_key_us"], rel=0.1)  # no --workload: the fit
    assert missing.returncode == 3 and "no vllm:mooncake_lookup_info series" in missing.stderr

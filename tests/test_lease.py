"""The master's key lease and the trust it allows (issue 49, items 2 and 6), against real Mooncake masters.

A ``lookup_answer_ttl_ms`` the lease cannot cover is refused where the lease is known (the lookup server's probe,
``serve``, ``doctor``: docs/troubleshooting.md), no hit is held while the lease is unproven (docs/reliability.md,
"No stale hit"), and a probe that cannot run at start-up (no memory lent to the store yet) is tried again until
it passes, with a gauge saying why the prefix cache is off meanwhile.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mooncake_lookout.connector.client import LookupClient
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.rigs.workload import unique_hashes
from mooncake_lookout.connector.server import LookupServer
from mooncake_lookout.connector.server.prefix_index import PrefixIndex
from mooncake_lookout.connector.server.store import MARKER_LOCAL_BUFFER, open_store, open_writer_store
from mooncake_lookout.connector.transport import make_transport
from mooncake_lookout.metrics import catalogue as cat
from mooncake_lookout.metrics.exporter import new_registry
from mooncake_lookout.metrics.prometheus_sink import PrometheusSink
from mooncake_lookout.metrics.server_sink import ServerMetrics

pytestmark = pytest.mark.timed  # waits out real leases, each bounded: runs alone (scripts/test.sh)

BLOCK = 16
SCRIPT = Path(sys.executable).parent / "mooncake-lookout"  # the console script, as a user runs it


def _until(cond: Callable[[], bool], bound_s: float, what: str) -> None:
    end = time.monotonic() + bound_s
    while not cond():
        assert time.monotonic() < end, f"{what}: not within {bound_s:g} s"
        time.sleep(0.01)


def _state(registry: Any, spec: cat.MetricSpec, state: str) -> float | None:
    return registry.get_sample_value(spec.name, {"state": state})


def test_a_held_hit_is_not_served_past_a_lease_shorter_than_the_ttl(private_master: Any) -> None:
    """The issue's case: the master leases keys for 500 ms, clients trust a found block for 3000 ms. A hit is
    answered, its request is not allocated (it waits), the master evicts block 0 once its lease ends, and the
    scheduler asks again: the old client served the held 8-block hit (blocks gone), before and after the probe's
    verdict. Now no hit is held until the server names a store epoch (the lease proven), which this server never
    does: the probe sees the lease end and refuses, naming about how long it is."""
    writer = open_writer_store(private_master.rpc_address, rpc_timeout_ms=2000)  # lends the store memory
    server_store = open_store(private_master.rpc_address, local_buffer_size=MARKER_LOCAL_BUFFER, rpc_timeout_ms=2000)
    registry = new_registry()
    server = LookupServer(PrefixIndex(server_store, BLOCK, "ttl"), lease_window_s=3.0,
                          observers=[ServerMetrics(registry)]).start()
    config = LookupConfig(lookup_async=True, lookup_transport="pipelined", lookup_timeout_ms=2000,
                          lookup_answer_ttl_ms=3000)
    client = LookupClient(config, make_transport(config, server.address), observer=PrometheusSink(config, registry))
    filler = PrefixIndex(writer, BLOCK, "ttl")
    try:
        assert client.enable_prefix_cache(BLOCK)
        hashes = unique_hashes(8, seed=4901)
        filler.store_prefixes([hashes])
        assert client.lookup("r", 8 * BLOCK + 1, hashes).hit_length == 8 * BLOCK  # found: leased for 500 ms
        block0 = filler.key(hashes[0])
        _until(lambda: writer.remove(block0, False) == 0, 5.0, "block 0's lease never ended")  # evicted
        again = client.lookup("r", 8 * BLOCK + 1, hashes)  # the scheduler asks again: it could not allocate
        assert again is not None and again.hit_length == 0, f"a {again.hit_length // BLOCK}-block hit served " \
                                                            "from hold after its block 0 was evicted"
        server.lease_probe.join(10.0)
        assert server.lease_probe.passed is False and server.epoch == 0
        refusal = server.lease_probe.refusal or ""
        assert "lookup_answer_ttl_ms 3000 ms" in refusal and "--default_kv_lease_ttl" in refusal, refusal
        lease_ms = float(re.search(r"the lease is about (\d+) ms", refusal).group(1))  # type: ignore[union-attr]
        assert 450 <= lease_ms <= 3600, refusal  # about the master's 500 ms (polled every 90 ms, on a busy host)
        assert _state(registry, cat.SERVER_PREFIX_CACHE_STATE, "lease_too_short") == 1
        assert _state(registry, cat.SERVER_PREFIX_CACHE_STATE, "on") == 0
        assert _state(registry, cat.PREFIX_CACHE_STATE, "unproven") == 1  # what the alert reads
        client.discard("r")
        filler.store_prefixes([hashes])
        assert client.lookup("r2", 8 * BLOCK + 1, hashes).hit_length == 8 * BLOCK  # served once, fresh
        assert not client.has("r2") and len(client.cache or ()) == 0  # not held, nothing cached
    finally:
        client.close()
        server.close()
        filler.remove_all(force=True)
        writer.close()
        server_store.close()


def test_a_probe_that_cannot_run_at_start_is_tried_again_until_the_store_has_memory(
        private_master: Any, caplog: pytest.LogCaptureFixture) -> None:
    """An engine in ``standalone-store`` mode starts before the store pods: nobody lends the store memory, the
    probe cannot put its key. The old server tried once and left the prefix cache off until a restart; now it
    tries again (backing off) and the cache turns on once a memory owner joins. The window (200 ms) fits in the
    master's 500 ms lease."""
    caplog.set_level(logging.WARNING, logger="mooncake_lookout.connector.server.lease")
    server_store = open_store(private_master.rpc_address, local_buffer_size=MARKER_LOCAL_BUFFER, rpc_timeout_ms=2000)
    registry = new_registry()
    server = LookupServer(PrefixIndex(server_store, BLOCK, "late"), lease_window_s=0.2,
                          observers=[ServerMetrics(registry)]).start()
    config = LookupConfig(lookup_transport="pipelined", lookup_timeout_ms=2000, lookup_answer_ttl_ms=200)
    client = LookupClient(config, make_transport(config, server.address), observer=PrometheusSink(config, registry))
    writer = None
    try:
        assert client.enable_prefix_cache(BLOCK)
        _until(lambda: any("could not check the master's key lease" in r.getMessage() for r in caplog.records),
               10.0, "the probe never failed for want of memory")
        assert client.lookup("before", 4 * BLOCK + 1, unique_hashes(4, seed=4902)).hit_length == 0
        assert client.store_view.epoch == 0  # no epoch, nothing cached
        writer = open_writer_store(private_master.rpc_address, rpc_timeout_ms=2000)  # a store pod comes up
        filler = PrefixIndex(writer, BLOCK, "late")
        hashes = unique_hashes(8, seed=4903)
        filler.store_prefixes([hashes])
        asked = [0]

        def cache_on() -> bool:  # the server puts its marker at its next batch once trusted: keep asking
            asked[0] += 1
            client.lookup(f"r{asked[0]}", 8 * BLOCK + 1, hashes)
            client.discard(f"r{asked[0]}")
            return bool(client.store_view.epoch)

        _until(cache_on, 20.0, "the prefix cache never turned on after memory was lent to the store")
        client.lookup("after", 8 * BLOCK + 1, hashes)
        assert len(client.cache or ()) > 0  # found blocks are remembered now
        assert server.lease_probe.passed is True and server.lease_probe.attempts >= 2
        assert _state(registry, cat.SERVER_PREFIX_CACHE_STATE, "on") == 1
        assert _state(registry, cat.SERVER_PREFIX_CACHE_STATE, "store_refused") == 0
        assert _state(registry, cat.PREFIX_CACHE_STATE, "on") == 1
        assert _state(registry, cat.PREFIX_CACHE_STATE, "unproven") == 0
    finally:
        client.close()
        server.close()
        server_store.close()
        if writer is not None:
            PrefixIndex(writer, BLOCK, "late").remove_all(force=True)
            writer.close()


def test_the_probe_stops_retrying_on_close(private_master: Any) -> None:
    """A probe waiting to try again ends with the server (no thread left behind)."""
    server_store = open_store(private_master.rpc_address, local_buffer_size=MARKER_LOCAL_BUFFER, rpc_timeout_ms=2000)
    server = LookupServer(PrefixIndex(server_store, BLOCK, "stop"), lease_window_s=0.2).start()
    try:
        _until(lambda: server.prefix_cache_state == "store_refused", 10.0, "the probe never failed")
    finally:
        server.close()
        server_store.close()
    assert server.lease_probe is not None and not server.lease_probe.running


def _serve(*args: str, bound_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), "serve", *args], capture_output=True, text=True, timeout=bound_s)


def test_serve_refuses_a_window_its_embedded_masters_lease_cannot_cover() -> None:
    out = _serve("--embedded-master", "--lease-window-ms", "9000")
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("mooncake-lookout serve: --lease-window-ms (the clients' lookup_answer_ttl_ms) 9000 ms")
    assert "at least 10800 ms" in line and "the lease is 10000 ms" in line and "at most half" in line, line


def test_serve_refuses_a_window_the_masters_lease_cannot_cover_once_its_probe_sees_the_lease_end(
        private_master: Any) -> None:
    writer = open_writer_store(private_master.rpc_address, rpc_timeout_ms=2000)  # lends the probe memory
    try:
        out = _serve("--master", private_master.rpc_address, "--lease-window-ms", "2000")
    finally:
        writer.close()
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    line = out.stderr.strip().splitlines()[-1]  # the last line: after the server's own ERROR log
    assert line.startswith("mooncake-lookout serve: lookup_answer_ttl_ms 2000 ms needs"), out.stderr
    assert "--default_kv_lease_ttl" in line and "the lease is about" in line and "--lease-window-ms" in line, line

"""``doctor`` against real parts: our lookup server, vLLM's LookupKeyServer, a real master, nothing at all."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mooncake_lookout.connector.cli.doctor import check_config, check_master, probe_server
from mooncake_lookout.connector.rigs.processes import ChildProcess

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

SCRIPT = Path(sys.executable).parent / "mooncake-lookout"  # the console script, as a user runs it


@pytest.fixture
def our_server(prefix_index: Any) -> Iterator[str]:
    from mooncake_lookout.connector.server import LookupServer

    with LookupServer(prefix_index, "tcp://127.0.0.1:0") as server:
        yield server.address


def test_our_server_answers_both_wires_with_a_latency(our_server: str) -> None:
    for wire in ("upstream", "pipelined"):
        finding = probe_server(our_server, wire, samples=5)
        assert finding.ok, finding.detail
        assert "5/5 answered" in finding.detail and "round trip p50" in finding.detail


def test_vllms_own_server_is_told_apart(upstream_server: str) -> None:
    assert probe_server(upstream_server, "upstream", samples=3).ok
    finding = probe_server(upstream_server, "pipelined", samples=3, timeout_ms=200)
    assert not finding.ok
    assert "lookup_transport=upstream" in finding.detail


def test_nothing_listening_is_a_clear_failure() -> None:
    path = os.path.join(tempfile.mkdtemp(prefix="doctor-"), "nobody.sock")
    finding = probe_server(f"ipc://{path}", "upstream", samples=3, timeout_ms=100)
    assert not finding.ok
    assert "no answer within 100 ms" in finding.detail and "nothing answers there" in finding.detail
    os.rmdir(os.path.dirname(path))


def test_master_health_and_metrics(mooncake_master: Any) -> None:
    findings = check_master(mooncake_master.metrics_url)
    assert [f.check for f in findings] == ["master /health", "master /metrics"]
    assert all(f.ok for f in findings), [f.line() for f in findings]
    assert "key_count=" in findings[1].detail


def test_unreachable_master_is_reported() -> None:
    from mooncake_lookout.connector.rigs.master import free_port

    findings = check_master(f"http://127.0.0.1:{free_port()}", timeout_s=0.5)
    assert len(findings) == 1 and not findings[0].ok
    assert "unreachable" in findings[0].detail


def test_a_dead_address_gets_one_verdict_and_no_stray_lines() -> None:
    """The command against nothing: each wire's verdict on stdout, and nothing on stderr (the transport's socket
    rebuilds are said in the verdict, once, not printed before it). A TCP port nobody listens on: an ipc:// socket
    that is not there is named before any probe (tests/test_doctor_config.py)."""
    from mooncake_lookout.connector.rigs.master import free_port

    done = subprocess.run([str(SCRIPT), "doctor", "--server", f"tcp://127.0.0.1:{free_port()}", "--samples", "2",
                           "--timeout-ms", "100"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr == ""
    verdicts = [line for line in done.stdout.splitlines() if line.startswith("FAIL  server")]
    assert len(verdicts) == 2 and all("socket was rebuilt once" in v for v in verdicts), done.stdout


def test_the_config_line_names_auto_without_a_unit() -> None:
    finding, config = check_config('{"lookup_async": true, "lookup_wait_us": "auto"}')
    assert finding.ok and config is not None
    assert finding.detail.endswith("wait auto"), finding.detail
    assert check_config('{"lookup_wait_us": 300}')[0].detail.endswith("wait 300 us")


def test_serve_with_an_embedded_master_names_the_url_doctor_needs() -> None:
    """``serve --embedded-master`` prints its master's metrics URL; ``doctor --master-metrics`` on it passes."""
    serve = ChildProcess([str(SCRIPT), "serve", "--embedded-master", "--log-level", "WARNING"], name="serve")
    try:
        line = serve.wait_line(lambda text: "embedded Mooncake master on" in text, 60.0, "the master's line")
        url = re.search(r"doctor --master-metrics (http://127\.0\.0\.1:\d+)", line)
        assert url, line
        serve.wait_line("listening on ", 60.0, "serve")
        done = subprocess.run([str(SCRIPT), "doctor", "--master-metrics", url.group(1)], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "ok    master /health" in done.stdout
    finally:
        serve.kill()


def test_doctor_refuses_a_ttl_the_masters_lease_cannot_cover_and_names_the_lease(private_master: Any) -> None:
    """``doctor --master`` runs the lookup server's lease probe: with the private master's 500 ms lease, a
    2000 ms lookup_answer_ttl_ms fails in one line naming the key, about how long the lease is and the rule; a
    200 ms one (240 ms with the load's margin) passes."""
    import json

    from mooncake_lookout.connector.server.store import open_writer_store

    writer = open_writer_store(private_master.rpc_address, rpc_timeout_ms=2000)  # lends the probe's key memory
    try:
        done = subprocess.run([str(SCRIPT), "doctor", "--master", private_master.rpc_address, "--config",
                               json.dumps({"lookup_answer_ttl_ms": 2000})], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 1, done.stdout + done.stderr
        (line,) = [x for x in done.stdout.splitlines() if x.startswith("FAIL  master lease")]
        assert "lookup_answer_ttl_ms 2000 ms needs" in line and "at least 2400 ms" in line, line
        assert re.search(r"the lease is about \d+ ms: set lookup_answer_ttl_ms to at most half", line), line
        done = subprocess.run([str(SCRIPT), "doctor", "--master", private_master.rpc_address, "--config",
                               json.dumps({"lookup_answer_ttl_ms": 200})], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "ok    master lease: the key lease covers 240 ms" in done.stdout, done.stdout
    finally:
        writer.close()

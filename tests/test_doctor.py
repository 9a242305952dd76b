"""``doctor`` against real parts: our lookup server, vLLM's LookupKeyServer, a real master, nothing at all."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from mooncake_lookout.connector.cli.doctor import check_master, probe_server


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

"""Operators read logs: breaker transitions and socket rebuilds are logged at WARNING, and never flood."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from mooncake_lookout.connector.client import LookupClient
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.logs import RateLimit
from mooncake_lookout.connector.transport.pipelined import PipelinedTransport


def test_rate_limit_allows_one_line_per_interval() -> None:
    limit = RateLimit(10.0)
    assert limit.allow(100.0)
    assert not limit.allow(100.1) and not limit.allow(109.9)
    assert limit.allow(110.0)
    assert limit.suppressed == 2


@pytest.fixture
def silent_router(tmp_path: Path) -> Iterator[str]:
    """A real ROUTER that reads requests and never answers: a wedged server."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    address = f"ipc://{tmp_path}/silent.sock"
    sock.bind(address)
    yield address
    ctx.destroy(linger=0)


def test_breaker_transitions_and_rebuilds_are_logged_at_warning_without_flooding(
        silent_router: str, caplog: pytest.LogCaptureFixture) -> None:
    config = LookupConfig(lookup_transport="pipelined", lookup_timeout_ms=20, lookup_breaker_failures=2,
                          lookup_breaker_cooldown_s=60)
    client = LookupClient(config, PipelinedTransport(silent_router, timeout_s=config.timeout_s))
    caplog.set_level(logging.WARNING, logger="mooncake_lookout")
    try:
        for i in range(30):  # two timeouts open the breaker; the rest are answered at once
            assert client.lookup(f"r{i}", 33, [bytes([i]) * 32] * 2).hit_length == 0
    finally:
        client.close()
    lines = [r for r in caplog.records if r.levelno == logging.WARNING]
    opened = [r for r in lines if "breaker OPEN" in r.getMessage()]
    rebuilt = [r for r in lines if "rebuilding the socket" in r.getMessage()]
    assert len(opened) == 1 and "60.0 s" in opened[0].getMessage()
    assert 1 <= len(rebuilt) <= 2 and len(lines) <= 4  # one line per kind, not one per lookup

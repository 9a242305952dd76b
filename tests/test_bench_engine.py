"""Bench scenario (i)'s parts that need no engine: the lookup-timing hook patches vLLM's scheduler (in the engine
venv, ``scripts/setup-engine.sh``) only when asked, and engines take turns ABBA. Scenario (i) itself runs at its
quick size on real engines in tests/test_engine_modes.py (beside the other engine tests, on their engines).
"""

from __future__ import annotations

import collections
import subprocess
from pathlib import Path

from mooncake_lookout.connector.bench import real_engine
from mooncake_lookout.connector.rigs import engine_timing
from mooncake_lookout.connector.rigs.engine import engine_python


def test_the_timing_hook_patches_vllms_scheduler_only_when_asked(tmp_path: Path) -> None:
    python = engine_python()
    probe = "import vllm.v1.core.sched.scheduler as s; print(s.Scheduler.schedule.__name__)"
    env = {"PYTHONPATH": str(engine_timing.FOLDER), "HF_HUB_OFFLINE": "1"}
    on = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120,
                        env={**env, engine_timing.ENV: str(tmp_path)})
    off = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert on.stdout.split() == ["patched_schedule"], on.stderr[-2000:]
    assert off.stdout.split() == ["schedule"], off.stderr[-2000:]


def test_engines_of_a_wave_take_turns_forwards_then_backwards() -> None:
    assert [real_engine.seats(2, k) for k in range(4)] == [[0, 1], [1, 0], [0, 1], [1, 0]]  # ABBA
    for n in (2, 3, 4, 5):  # every engine in every seat, after every other engine, equally often
        rows = [real_engine.seats(n, k) for k in range(len(real_engine.williams_rows(n)))]
        assert all(sorted(row) == list(range(n)) for row in rows)
        seat_counts = {(row[i], i) for row in rows for i in range(n)}
        assert len(seat_counts) == n * n and len(rows) % n == 0
        follows = collections.Counter((a, b) for row in rows for a, b in zip(row, row[1:]))
        assert set(follows) == {(a, b) for a in range(n) for b in range(n) if a != b}
        assert len(set(follows.values())) == 1, (n, follows)
    assert real_engine.seats(3, 6) == real_engine.seats(3, 0) != real_engine.seats(3, 1)


def test_round_trips_read_ours_rpc_histogram_from_a_real_metrics_page() -> None:
    """(i) reports ours' lookup round trips from the engine's page (what ``lookup_timeout_ms: auto`` is chosen
    from): a real prometheus_client page served on loopback, scraped twice, the deltas read."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

    from mooncake_lookout.connector.bench.http_load import delta, scrape
    from mooncake_lookout.metrics.catalogue import LATE_REPLIES, RPC_SECONDS

    registry = CollectorRegistry()
    rpc = Histogram(RPC_SECONDS.name, "round trips", buckets=RPC_SECONDS.buckets, registry=registry)
    late = Counter(LATE_REPLIES.name, "late replies", registry=registry)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        rpc.observe(9.0)  # before the workload: not counted
        before = scrape(url)
        for seconds in [0.002] * 98 + [0.3, 1.7]:
            rpc.observe(seconds)
        late.inc(2)
        trips = real_engine.round_trips([delta(scrape(url), before)])
    finally:
        server.shutdown()
        thread.join(timeout=10)
    assert trips == {"lookups": 100, "p50_le_ms": 2.5, "p99_le_ms": 500.0, "max_le_ms": 2500.0, "late_replies": 2}
    assert real_engine.round_trips([{}])["p50_le_ms"] is None

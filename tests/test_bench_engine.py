"""Bench scenario (i)'s parts that need no engine: the lookup-timing hook patches vLLM's scheduler (in the engine
venv, ``scripts/setup-engine.sh``) only when asked; engines take turns (ABBA for two); ours' round trips and the
identical engines' noise floor are read right. Scenario (i) itself runs at its quick size on real engines in
tests/test_engine_modes.py (beside the other engine tests, on their engines).
"""

from __future__ import annotations

import collections
import subprocess
from pathlib import Path
from typing import Any

import pytest

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


def test_engines_of_a_wave_take_every_seat_and_follow_every_other_equally_often() -> None:
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


def _engine(label: str, ours: bool, p50: float, per_step: float) -> dict[str, Any]:
    """An engine's figures as measure_wave reports them (only what the targets and the table read)."""
    return {"label": label, "ours": ours, "requests": 10, "failed": 0, "ttft_ms": {"p50": p50, "p99": 2 * p50},
            "hit_tokens": 640.0, "prompt_tokens": 900.0, "lookup_us_per_step": per_step, "steps": 50.0,
            "lookup_us_per_request": 5 * per_step, "exported_blocked_us_per_step": per_step if ours else None,
            "ready_s": 30.0, "workloads": {}}


def test_identical_engines_are_the_noise_floor_beside_each_ratio() -> None:
    """The twins' wave (FULL only) puts beside i1-i4 how far apart identical engines of the same run landed."""
    from mooncake_lookout.connector.bench.report import i_block, targets_block
    from mooncake_lookout.connector.bench.targets import targets

    assert real_engine.FULL.twins == ("upstream async", 3) and real_engine.QUICK.twins is None
    specs = real_engine.twin_specs("upstream async", 3)
    assert [s.label for s in specs] == ["upstream async A", "upstream async B", "upstream async C"]
    assert {(s.connector, tuple(s.extra.items())) for s in specs} == {
        (real_engine.ENGINES["upstream async"].connector, (("lookup_async", True),))}
    assert len({s.slug for s in specs}) == 3  # keys and folders apart
    wave = {"upstream": _engine("upstream async", False, 80.0, 4.0), "ours": [_engine("ours async", True, 88.0, 1.0)]}
    twins = [_engine(s.label, False, p50, step) for s, p50, step in zip(specs, (84.0, 102.0, 113.4), (2.0, 8.0, 6.0))]
    r = {"i": real_engine.summary(real_engine.FULL, [wave], twins)}
    found = {t["id"]: t for t in targets(r)}
    assert found["i2"]["ratio"] == pytest.approx(1.1) and found["i2"]["met"] is False
    assert found["i2"]["same_engines"]["spread"] == pytest.approx(1.35)
    assert found["i4"]["same_engines"]["figures"] == [2.0, 8.0, 6.0] and found["i4"]["same_engines"]["spread"] == 4
    assert found["i1"]["same_engines"]["spread"] == 1
    lines = targets_block(list(found.values()))
    assert any("3 identical engines of the same run (upstream async A, upstream async B, upstream async C): "
               "84.00, 102.00, 113.40 ms, largest / smallest 1.35" in line for line in lines), lines
    table = i_block(r)
    assert [line.split()[:3] for line in table[-3:]] == [["upstream", "async", "A"], ["upstream", "async", "B"],
                                                          ["upstream", "async", "C"]]
    assert "twins" not in real_engine.summary(real_engine.QUICK, [wave])

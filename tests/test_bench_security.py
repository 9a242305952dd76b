"""``python -m mooncake_lookout.connector.bench.security`` runs to the end and writes its outputs; the flood it
measures is a real one (the flooder's window exceeds the server's bound, so it is told ``busy``; with the bounds
off, never). Not a speed test: its figures are in docs/security.md, generated from docs/bench/security.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncake_lookout.connector.bench import security


@pytest.mark.slow
def test_security_bench_writes_its_figures(tmp_path: Path) -> None:
    sizes = security.Sizes(curve_lookups=40, curve_bursts=2, flood_lookups=40, flood_window=8192, flood_rounds=1,
                           bounds_off_lookups=10)
    results = security.run(str(tmp_path), sizes=sizes, log=lambda line: None)
    curve = results["curve"]
    for name in ("plain", "curve"):
        assert curve[name]["single_us"]["n"] == 40 and curve[name]["frame256_us"]["n"] == 2
    flood = results["flood"]
    (only,) = flood["rounds"]
    for where in ("shared", "control"):  # the other, alternately at both servers, alone and under the flood
        assert only["unloaded_us"][where]["n"] == only["flood_us"][where]["n"] == 40
        assert only["unloaded_us"][where]["served"] == 40
    assert only["flooder"]["busy"] > 0 and only["flooder"]["ok"] > 0 and only["flooder"]["other"] == 0, only
    assert only["met"] == (only["served_every_lookup"] and only["p99_ratio"] <= security.BOUND_P99_RATIO)
    assert flood["met"] == only["met"]
    off = flood["bounds_off"]
    assert off["flooder"]["busy"] == 0 and off["flood_us"]["n"] == 10, off  # no bound: never busy
    assert results["machine"]["loadavg_at_end"] and results["machine"]["commit"]
    assert json.loads((tmp_path / "security.json").read_text())["flood"]["window"] == 8192
    assert (tmp_path / "security.txt").read_text().strip() == security.table(results).strip()

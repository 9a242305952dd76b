"""``python -m mooncake_lookout.connector.bench.security`` runs to the end and writes its outputs; the flood it
measures is a real one (the flooder's window exceeds the server's bound, so it is told ``busy``; with the bounds
off, never). Not a speed test: its figures are in docs/bench-results.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncake_lookout.connector.bench import security


@pytest.mark.slow
def test_security_bench_writes_its_figures(tmp_path: Path) -> None:
    sizes = security.Sizes(curve_lookups=40, curve_bursts=2, flood_lookups=40, flood_window=8192)
    results = security.run(str(tmp_path), sizes=sizes, log=lambda line: None)
    curve = results["curve"]
    for name in ("plain", "curve"):
        assert curve[name]["single_us"]["n"] == 40 and curve[name]["frame256_us"]["n"] == 2
    flood = results["flood"]
    on, off = flood["bounds on"], flood["bounds off"]
    assert on["unloaded_us"]["n"] == on["flood_us"]["n"] == off["flood_us"]["n"] == 40  # every lookup a hit
    assert on["flooder"]["busy"] > 0 and on["flooder"]["ok"] > 0, on["flooder"]
    assert off["flooder"]["busy"] == 0 and off["flooder"]["other"] == on["flooder"]["other"] == 0
    assert flood["neighbour"]["flood_us"]["n"] == 40 and flood["neighbour"]["flooder"]["busy"] > 0
    assert json.loads((tmp_path / "security.json").read_text())["flood"]["window"] == 8192
    assert (tmp_path / "security.txt").read_text().strip() == security.table(results).strip()

"""``mooncake-lookout bench --quick`` runs to the end and writes its outputs (not a speed test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake_lookout.connector.bench.run import format_report

SCRIPT = Path(sys.executable).parent / "mooncake-lookout"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_quick_bench_writes_json_table_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run([str(SCRIPT), "bench", "--quick", "--out", str(out)], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    results = json.loads((out / "bench.json").read_text())
    assert results["quick"] is True
    for client in ("upstream", "ours/upstream-wire", "ours/pipelined"):
        assert results["a"][client]["sync_call_us"]["n"] == 100
        assert results["b"][client]["hit_tokens"] > 0
    hits = {results["b"][c]["hit_tokens"] for c in ("upstream", "ours/upstream-wire", "ours/pipelined")}
    assert len(hits) == 1, "the clients disagree on what the store holds"
    modes = {m["label"]: m for m in results["c"]["modes"]}
    assert {"upstream sync", "upstream async", "ours sync", "ours async"} <= set(modes)
    assert all(m["finished"] == m["requests"] > 0 for m in modes.values())
    assert modes["upstream sync"]["mean_deferred_steps"] == 0 == modes["ours sync"]["mean_deferred_steps"]
    assert results["e"]["stopped"]["ours/pipelined"]["blocked_s"] is not None
    assert {t["id"] for t in results["targets"]} == {"a", "b", "c1", "c2", "c3", "d", "e"}

    table = (out / "bench.txt").read_text()
    assert table.strip() == format_report(results).strip()
    assert "targets (ratio = ours / upstream)" in table
    for name in ("latency.png", "modes.png", "burst.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name

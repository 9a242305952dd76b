"""``mooncake-lookout bench --quick`` runs to the end and writes its outputs (not a speed test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake_lookout.connector.bench.run import AUTO, TARGET_IDS, format_report

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
    floors = results["floors"]
    assert floors["round_trip_us"]["n"] == 100 and floors["touch_us"]["n"] > 0
    # The touch floor is the caller's side only: it cannot take longer than a whole round trip.
    assert floors["touch_us"]["p50"] < floors["round_trip_us"]["p50"]
    a4 = results["a4"]["clients"]
    for client in ("upstream", "ours/pipelined"):
        assert set(a4[client]) == {"1", "4", "16", "64"}
        assert a4[client]["16"]["hit_tokens"] == a4["upstream"]["16"]["hit_tokens"] > 0
    modes = {m["label"]: m for m in results["c"]["modes"]}
    assert {"upstream sync", "upstream async", "ours sync", "ours async", AUTO} <= set(modes)
    assert all(m["finished"] == m["requests"] > 0 for m in modes.values())
    assert modes["upstream sync"]["mean_deferred_steps"] == 0 == modes["ours sync"]["mean_deferred_steps"]
    assert results["e"]["stopped"]["ours/pipelined"]["blocked_s"] is not None
    lengths = results["f"]["lengths"]
    assert [length["blocks"] for length in lengths] == [8, 64, 512, 4096]
    for length in lengths:
        for m in length["modes"].values():
            assert m["finished"] == m["requests"] > 0 and m["schedule_us"]["n"] > 0
    assert [t["id"] for t in results["targets"]] == list(TARGET_IDS)
    for t in results["targets"]:
        assert {"id", "what", "ours", "ratio", "bound", "met"} <= set(t) and ("upstream" in t or "floor" in t)
    load = results["machine"]
    assert len(load["loadavg_at_start"]) == 3 == len(load["loadavg_at_end"])

    table = (out / "bench.txt").read_text()
    assert table.strip() == format_report(results).strip()
    assert "targets (ratio = ours / reference" in table
    for name in ("latency.png", "modes.png", "burst.png", "per_step.png", "long_prompts.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name

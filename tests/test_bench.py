"""``mooncake-lookout bench --quick`` runs to the end and writes its outputs (not a speed test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mooncake_lookout.connector.bench import multi_turn
from mooncake_lookout.connector.bench.conversations import Shape
from mooncake_lookout.connector.bench.run import AUTO, QUICK, TARGET_IDS, format_report

SCRIPT = Path(sys.executable).parent / "mooncake-lookout"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick_bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One ``bench --quick`` run for the tests of this module: its output folder and its bench.json."""
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run([str(SCRIPT), "bench", "--quick", "--out", str(out)], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "bench.json").read_text())


@pytest.mark.slow
def test_quick_bench_writes_json_table_and_plots(quick_bench: tuple[Path, dict[str, Any]]) -> None:
    out, results = quick_bench
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
    for name in ("latency.png", "modes.png", "burst.png", "per_step.png", "long_prompts.png", "multi_turn.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name


@pytest.mark.slow
def test_quick_bench_multi_turn_counts_the_store_keys_each_turn_sent(quick_bench: tuple[Path, dict[str, Any]]) -> None:
    """Scenario (g) through vLLM's scheduler: keys counted at the server's store client, turn by turn."""
    _, results = quick_bench
    g = results["g"]
    assert g["lease_ms"] >= 2 * g["answer_ttl_ms"], "the master's lease must cover what the cache trusts"
    assert set(g["backends"]) == {multi_turn.INDEX}, "--quick runs the prefix index only"
    shapes = g["backends"][multi_turn.INDEX]
    assert [Shape(**entry["shape"]) for entry in shapes] == list(QUICK.conversations)
    for entry in shapes:
        shape = Shape(**entry["shape"])
        runs = entry["runs"]
        assert set(runs) == {m.label for m in multi_turn.MODES}
        for label, run in runs.items():
            assert [t["lookups"] for t in run["turns"]] == [shape.conversations] * shape.turns, label
        for mode in ("sync", "async"):
            up, ours = runs[f"upstream {mode}"], runs[f"ours {mode}"]
            # Upstream's server asks every block that can count, every turn: one key per block.
            assert [t["keys_per_lookup"] for t in up["turns"]] == [shape.blocks(t) for t in range(shape.turns)]
            assert up["from_turn_2"]["known_share"] is None
            # Ours: the first turn asks everything (and the marker); from the second on, the cache knew most.
            assert ours["turns"][0]["keys_per_lookup"] >= shape.context_blocks
            later = ours["from_turn_2"]
            assert later["keys_per_lookup"] < up["from_turn_2"]["keys_per_lookup"], (mode, later)
            assert later["known_share"] > 0, (mode, later)
            assert later["path_us"]["n"] == later["lookups"] == shape.conversations * (shape.turns - 1)
    targets = {t["id"]: t for t in results["targets"]}
    keys = shapes[0]["runs"]
    assert targets["g1"]["ours"] == keys["ours sync"]["from_turn_2"]["keys_per_lookup"]
    assert targets["g1"]["upstream"] == keys["upstream sync"]["from_turn_2"]["keys_per_lookup"]
    assert targets["g2"]["scheduler_path_us"]["ours"] > 0 and "4096-block context" in targets["g2"]["what"]

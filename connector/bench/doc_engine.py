"""The ``bench-engine`` block of docs/bench-results.md: scenario (i) on real engines, from its committed run.

Why its own file: scenario (i) needs the engine venv and several minutes of engines' start-up, so it is
published from a run of its own (``mooncake-lookout bench --only i``, its ``bench.json`` committed as
``docs/bench/engine-i.json``) rather than inside the three full runs the other blocks read. The block is that
run's (i) table and its targets i1-i4, as ``bench`` printed them, under a line saying when and where it ran.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mooncake_lookout.connector.bench.records import RUNS_DIR
from mooncake_lookout.connector.bench.report import i_block, targets_block
from mooncake_lookout.connector.bench.targets import targets

ENGINE_RUN_FILE = RUNS_DIR / "engine-i.json"


def load_engine_run(root: Path) -> dict[str, Any]:
    """The committed scenario (i) run; ValueError naming the command that makes it when missing."""
    path = root / ENGINE_RUN_FILE
    if not path.exists():
        raise ValueError(f"no committed scenario (i) run: expected {ENGINE_RUN_FILE} (mooncake-lookout bench --only i "
                         "--out DIR, then copy DIR/bench.json there)")
    data: dict[str, Any] = json.loads(path.read_text())
    if "i" not in data:
        raise ValueError(f"{ENGINE_RUN_FILE} holds no scenario (i)")
    return data


def render_engine_run(r: dict[str, Any]) -> str:
    """Where and when the run ran, its (i) table and its targets, fenced."""
    m = r["machine"]
    seconds = (r.get("scenario_seconds") or {}).get("i")
    head = (f"`mooncake-lookout bench --only i` ({'quick' if r['quick'] else 'full'}; {m['date'][:10]}, commit "
            f"`{m['commit']}`, {m['cpus']} CPUs, load average (1 min) {m['loadavg_at_start'][0]:.2f} -> "
            f"{m['loadavg_at_end'][0]:.2f}" + (f", {seconds:.0f} s" if seconds is not None else "")
            + f"; `{ENGINE_RUN_FILE}`):")
    found = [t for t in targets(r) if t["id"].startswith("i")]  # judged by this code, from the run's figures
    return head + "\n\n```\n" + "\n".join(i_block(r) + [""] + targets_block(found)) + "\n```\n"


__all__ = ["ENGINE_RUN_FILE", "load_engine_run", "render_engine_run"]

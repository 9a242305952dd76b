"""The ``bench-engine`` block of docs/bench-results.md: scenario (i) on real engines, from its committed run.

Why apart from the other blocks: scenario (i) needs the engine venv and several minutes of engines' start-up, so
it may be published from a run of its own (``mooncake-lookout bench --only i``, its ``bench.json`` committed as
``docs/bench/engine-i.json``) or come in a whole run (``run-N.json``): the newest committed run that has it
(:func:`~.records.newest_with`). The block is that run's (i) table and its targets i1-i4, as ``bench`` printed
them, under a line saying which run, when and where.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mooncake_lookout.connector.bench.records import RUNS_DIR, command_of, newest_with
from mooncake_lookout.connector.bench.report import i_block, targets_block
from mooncake_lookout.connector.bench.targets import targets

ENGINE_RUN_FILE = RUNS_DIR / "engine-i.json"


def load_engine_run(root: Path) -> tuple[Path, dict[str, Any]]:
    """The newest committed run with scenario (i), and its path; ValueError naming the command when none."""
    return newest_with(root, ("i",), ENGINE_RUN_FILE)


def render_engine_run(run: tuple[Path, dict[str, Any]]) -> str:
    """Which run, where and when it ran, its (i) table and its targets, fenced."""
    path, r = run
    m = r["machine"]
    seconds = (r.get("scenario_seconds") or {}).get("i")
    head = (f"`{command_of(r)}` ({'quick' if r['quick'] else 'full'}; {m['date'][:10]}, commit "
            f"`{m['commit']}`, {m['cpus']} CPUs, load average (1 min) {m['loadavg_at_start'][0]:.2f} -> "
            f"{m['loadavg_at_end'][0]:.2f}" + (f", {seconds:.0f} s" if seconds is not None else "")
            + f"; `{path}`):")
    found = [t for t in targets(r) if t["id"].startswith("i")]  # judged by this code, from the run's figures
    return head + "\n\n```\n" + "\n".join(i_block(r) + [""] + targets_block(found)) + "\n```\n"


__all__ = ["ENGINE_RUN_FILE", "load_engine_run", "render_engine_run"]

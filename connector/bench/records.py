"""The committed bench runs the docs quote: ``docs/bench/run-N.json``, each a ``bench.json`` as ``bench`` wrote it.

Why: a figure a user reads must come from a run anyone can look at, not from a hand. The doc generator
(:mod:`..cli.docs`) draws every measured figure of README.md, docs/tuning.md and docs/bench-results.md from
these files (:mod:`.doc_tables`), and its ``--check`` fails when a doc drifts from them. One run or many:
every figure is shown per run, beside that run's load average, because the machine the runs come from may be
shared and its figures move from run to run.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RUNS_DIR = Path("docs/bench")  # relative to the repository's root
RUN_FILE = re.compile(r"^run-(\d+)\.json$")
DEMO_FILE = RUNS_DIR / "demo.txt"  # the whole output of `bash scripts/demo.sh --duration small` (cli.record)
ENGINE_DEMO_FILE = RUNS_DIR / "engine-demo.txt"  # the whole output of `bash scripts/demo.sh --engine` (cli.record)
SOAK_FILE = re.compile(r"^soak-([\w-]+)\.json$")  # `python -m ...rigs.soak --transport T --json` printed
MISSING = "-"


class _MachineLoad:
    """The 1-minute load average a committed run or soak recorded at its start and end."""

    results: dict[str, Any]

    def load(self, when: str) -> float | None:
        """The 1-minute load average at ``start`` or ``end``."""
        values = self.results.get("machine", {}).get(f"loadavg_at_{when}")
        return float(values[0]) if values else None

    @property
    def load_text(self) -> str:
        """``a -> b``: the 1-minute load average at the start and at the end."""
        return f"{num(self.load('start'), 2)} -> {num(self.load('end'), 2)}"


@dataclass(frozen=True)
class Run(_MachineLoad):
    """One committed run: its number (from ``run-N.json``), its path from the repository root, its results."""

    number: int
    path: str
    results: dict[str, Any]

    @property
    def kind(self) -> str:
        """``quick`` or ``full``: how much each scenario did."""
        return "quick" if self.results.get("quick") else "full"


def _committed(root: Path, pattern: re.Pattern[str], required: Sequence[str], what: str,
               none_found: str) -> list[tuple[str, str, dict[str, Any]]]:
    """``(name from the pattern, path from the root, its JSON)`` of each committed file under ``root /
    RUNS_DIR`` that ``pattern`` names; ValueError when there is none, or one lacks a ``required`` key."""
    found = sorted((m.group(1), p) for p in (root / RUNS_DIR).glob("*.json") if (m := pattern.match(p.name)))
    if not found:
        raise ValueError(none_found)
    out = []
    for name, path in found:
        results = json.loads(path.read_text())
        missing = [k for k in required if k not in results]
        if missing:
            raise ValueError(f"{RUNS_DIR / path.name} is not {what}: no {', '.join(missing)}")
        out.append((name, str(RUNS_DIR / path.name), results))
    return out


def load_runs(root: Path) -> list[Run]:
    """Every ``run-N.json`` under ``root / RUNS_DIR``, by N; ValueError when there is none or one is not a run."""
    found = _committed(root, RUN_FILE, ("machine", "targets", "quick"), "a bench.json",
                       f"no committed bench run: expected {RUNS_DIR}/run-1.json (a bench.json of "
                       "`mooncake-lookout bench --out DIR`)")
    return sorted((Run(int(n), path, results) for n, path, results in found), key=lambda r: r.number)


@dataclass(frozen=True)
class Soak(_MachineLoad):
    """One committed soak: its transport (from ``soak-T.json``), its path, its report."""

    transport: str
    path: str
    results: dict[str, Any]


def load_soaks(root: Path) -> list[Soak]:
    """Every ``soak-T.json`` under ``root / RUNS_DIR``, by transport; ValueError when there is none."""
    found = _committed(root, SOAK_FILE, ("lookups", "calls_over_bound", "machine"),
                       "a soak report with its machine",
                       f"no committed soak: expected {RUNS_DIR}/soak-pipelined.json (what `python -m "
                       "mooncake_lookout.connector.rigs.soak --transport pipelined --json` printed)")
    return [Soak(transport, path, results) for transport, path, results in found]


def newest_with(root: Path, scenarios: Sequence[str], own: Path) -> tuple[Path, dict[str, Any]]:
    """The newest committed run (by its machine's date) that ran every one of ``scenarios``: ``own`` (a run of
    those alone, ``bench --only``) or a whole run ``run-N.json``. Returns its path from the root and its JSON;
    ValueError naming both places when none has them."""
    found = []
    for path in [own, *(RUNS_DIR / p.name for p in sorted((root / RUNS_DIR).glob("run-*.json")))]:
        if (root / path).exists():
            results = json.loads((root / path).read_text())
            if "machine" in results and all(s in results for s in scenarios):
                found.append((str(results["machine"].get("date", "")), path, results))
    if not found:
        raise ValueError(f"no committed run of scenario {', '.join(scenarios)}: expected {own} (the bench.json of "
                         f"`mooncake-lookout bench --only {','.join(scenarios)} --out DIR`) or a whole run "
                         f"{RUNS_DIR}/run-N.json that has it")
    _, path, results = max(found, key=lambda f: f[0])
    return path, results


def command_of(results: dict[str, Any]) -> str:
    """The ``bench`` command that wrote ``results``: with ``--only`` when it ran some scenarios alone."""
    only = results.get("only")
    return "mooncake-lookout bench" + (f" --only {','.join(only)}" if only else "")


def load_demo(root: Path, file: Path = DEMO_FILE) -> str:
    """The committed output of one ``demo`` run, or of ``file`` (README shows its closing table)."""
    path = root / file
    if not path.exists():
        what = "engine-demo" if file == ENGINE_DEMO_FILE else "demo"
        raise ValueError(f"no committed demo output: expected {file} (python -m "
                         f"mooncake_lookout.connector.cli.record {what})")
    return path.read_text()


def get(results: Any, *path: str | int) -> Any:
    """``results[p0][p1]...``, or None when any step is missing (a run that lacks a scenario)."""
    for key in path:
        indexable = isinstance(results, list) and isinstance(key, int) and -len(results) <= key < len(results)
        if not (isinstance(results, dict) and key in results) and not indexable:
            return None
        results = results[key]
    return results


def mode(results: dict[str, Any], label: str) -> dict[str, Any] | None:
    """Scenario (c)'s figures for the mode called ``label``, or None."""
    return next((m for m in get(results, "c", "modes") or () if m.get("label") == label), None)


def num(value: Any, digits: int | None = None) -> str:
    """A figure for a table: ``-`` when missing; ``digits`` decimals, or by size (0 from 1,000 on, 1 from 10)."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return MISSING if value is None else str(value)
    if isinstance(value, float) and math.isnan(value):
        return MISSING
    if digits is None:
        digits = 0 if abs(value) >= 1000 else 1 if abs(value) >= 10 else 2
    return f"{value:,.{digits}f}"


def across(runs: Sequence[Run], figure: Callable[[dict[str, Any]], Any], digits: int | None = None,
           unit: str = "") -> str:
    """One cell: the figure of every run, ``run 1 / run 2 / ...`` (``-`` where a run lacks it), then ``unit``."""
    cells = [num(figure(r.results), digits) for r in runs]
    if all(c == MISSING for c in cells):
        return MISSING
    return " / ".join(cells) + (f" {unit}" if unit else "")


def ordered_union(lists: Iterable[Iterable[str]]) -> list[str]:
    """Every item of ``lists``, once, in the order first seen (targets or clients of several runs)."""
    seen: dict[str, None] = {}
    for items in lists:
        for item in items:
            seen.setdefault(item, None)
    return list(seen)


__all__ = ["DEMO_FILE", "ENGINE_DEMO_FILE", "MISSING", "RUNS_DIR", "RUN_FILE", "SOAK_FILE", "Run", "Soak", "across",
           "command_of", "get", "load_demo", "load_runs", "load_soaks", "mode", "newest_with", "num", "ordered_union"]

"""The demo's closing table: one row per mode, a legend for every column, and a two-line reading of the run.

Why its own module: the table is what a newcomer reads first, so every column is named in the legend
(a test checks that against the header) and the run's figures are read out in plain words, computed from
the same rows (nothing is written by hand).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from typing import Any

# Columns: (header, unit line, legend). The legend names each column by its header's first word(s).
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("requests", "", "requests: arrived during the mode's run, a fixed number at each scheduler step (--rate), so a "
                     "mode whose steps are shorter admits more in its share of the run: a count, not a speed"),
    ("steps/s", "", "steps/s: scheduler steps a second (the model step included), what the requests follow"),
    ("blocked/step", "(us)", "blocked/step: time per scheduler step spent inside lookup calls"),
    ("call p99", "(us)", "call p99: the 99th percentile of one lookup call"),
    ("deferred/req", "(steps)", "deferred/req: steps a request waited for its answer"),
    ("lookup p50", "(ms)", "lookup p50, p90, p99: from a request's arrival to its answer being used"),
    ("p90", "(ms)", ""),
    ("p99", "(ms)", ""),
    ("hit ratio", "(store)", "hit ratio (store): prompt tokens the store held / tokens asked, as our client counts "
                             "them (upstream's client reports none: -)"),
)
CACHE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("known", "(share)", "known: share of the blocks that could count which the prefix cache knew present (not "
                         "asked of the store)"),
    ("keys/lookup", "(store)", "keys/lookup: store keys the server sent per lookup (upstream's client: per request "
                               "answered), counted at its store client, first turns included (each asks its whole "
                               "context; bench scenario g1 counts from the second turn on)"),
    ("no-RTT", "(answers)", "no-RTT: lookups answered with no round trip (lookup_prefix_cache_confirm_ms > 0 only)"),
)
LABEL_WIDTH = 18
WRAP = 118  # the table's own width: legend and reading lines wrap there


def _num(value: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None or not math.isfinite(value) else f"{value:{width}.{digits}f}"


def _row(r: Any, prefix_cache: bool) -> str:
    d = r.as_dict()
    delay = d["answer_delay_us"]
    steps_per_s = r.steps / r.seconds if r.seconds else None
    cells = [f"{r.label:{LABEL_WIDTH}}", f"{r.requests:8d}", _num(steps_per_s, 7, 0),
             _num(d["blocked_per_step_us"].get("mean"), 12, 1),
             _num(d["call_us"].get("p99"), 9, 1), _num(r.mean_deferred_steps, 12, 2)]
    cells += [_num(delay[q] / 1e3 if q in delay else None, w, 2) for q, w in (("p50", 10), ("p90", 7), ("p99", 7))]
    cells.append(_num(r.store_hit_ratio, 9, 2))
    if prefix_cache:
        keys = r.keys_per_lookup
        if keys is None and r.store_keys is not None and r.deferred_steps:  # upstream's: one lookup per request
            keys = r.store_keys / len(r.deferred_steps)
        cells += [_num(r.known_share, 6, 3), _num(keys, 11, 1),
                  f"{r.cache_answers:6d}" if r.label.startswith("ours") else f"{'-':>6}"]
    return " ".join(cells)


def format_table(runs: Sequence[Any], *, prefix_cache: bool = False) -> str:
    """The closing table: header, units, one row per run, the legend, failures, then the reading."""
    columns = COLUMNS + (CACHE_COLUMNS if prefix_cache else ())
    widths = (8, 7, 12, 9, 12, 10, 7, 7, 9) + ((6, 11, 6) if prefix_cache else ())
    head = f"{'mode':{LABEL_WIDTH}} " + " ".join(f"{c[0]:>{w}}" for c, w in zip(columns, widths))
    units = f"{'':{LABEL_WIDTH}} " + " ".join(f"{c[1]:>{w}}" for c, w in zip(columns, widths))
    lines = [head, units] + [_row(r, prefix_cache) for r in runs]
    lines += textwrap.wrap("; ".join(c[2] for c in columns if c[2]) + ".", WRAP)
    for r in runs:
        failed = {o: n for o, n in sorted(r.outcomes.items()) if o not in ("hit", "miss", "discarded")}
        if failed:
            lines.append(f"  {r.label}: lookups that ended without the store's answer: "
                         + ", ".join(f"{n} {o}" for o, n in failed.items())
                         + f" (lookups, not requests: a request whose lookup failed asks again at its next scheduling "
                           f"attempt, so these may exceed the {r.requests} requests)")
    lines += reading(runs)
    return "\n".join(lines)


def _blocked(r: Any) -> float:
    """The mean blocked time per step as the table shows it (one decimal), so the reading rounds what a user sees."""
    return round(float(r.as_dict()["blocked_per_step_us"].get("mean", float("nan"))), 1)


def reading(runs: Sequence[Any]) -> list[str]:
    """Two plain lines on what the run shows: what lookup_async changed for each client, and what auto did."""
    by = {r.label: r for r in runs}
    parts = []
    for client, name in (("upstream", "upstream's client"), ("ours", "ours")):
        sync, on = by.get(f"{client} sync"), by.get(f"{client} async")
        if sync is not None and on is not None:
            parts.append(f"{_blocked(sync):.0f} -> {_blocked(on):.0f} us per step and {on.mean_deferred_steps:.2f} "
                         f"steps of wait per request with {name}")
    if parts:
        first = "Reading: lookup_async on moved the scheduler's lookup time " + "; ".join(parts) + "."
    else:
        first = (f"Reading: only {', '.join(r.label for r in runs) or 'nothing'} ran; without --mode the demo runs "
                 "both clients blocking and async, and ours with auto, side by side.")
    caveat = "Figures of this machine under its load: measure yours (bench, or advise on a deployment)."
    auto = by.get("ours auto")
    if auto is None:
        return [first, caveat]
    return [first, f"ours auto waited for answers that fit its budget: {auto.mean_deferred_steps:.2f} steps per "
                   f"request at {_blocked(auto):.0f} us per step. " + caveat]


__all__ = ["CACHE_COLUMNS", "COLUMNS", "format_table", "reading"]

"""The demo's closing table and its reading: the reading quotes the figures the table shows.

The runs are the bench's own :class:`SchedRun` records, filled with chosen step times (a formatter's test: no
scheduler runs here; ``tests/test_demo.py`` runs the whole demo)."""

from __future__ import annotations

import re

from mooncake_lookout.connector.bench.sched import SchedRun
from mooncake_lookout.connector.cli.demo_table import format_table


def _run(label: str, blocked_us: float, deferred: list[int]) -> SchedRun:
    return SchedRun(label=label, requests=len(deferred), blocked_per_step=[blocked_us / 1e6], calls=[1e-5],
                    deferred_steps=deferred, answer_delay=[2e-3] * len(deferred))


def test_the_reading_rounds_the_figures_the_table_shows() -> None:
    # 847.46 us shows as 847.5 in the table; its whole-us reading is 848 (the table's), not 847 (the raw mean's).
    runs = [_run("upstream sync", 1716.04, [0, 0]), _run("upstream async", 66.2, [3, 2]),
            _run("ours sync", 847.46, [0, 0]), _run("ours async", 115.96, [1, 1])]
    text = format_table(runs)
    shown = {m: float(re.search(rf"^{m} +\d+ +([\d.]+)", text, re.M).group(1)) for m in
             ("upstream sync", "upstream async", "ours sync", "ours async")}
    assert shown["ours sync"] == 847.5
    assert f"{shown['ours sync']:.0f} -> {shown['ours async']:.0f} us" in text, text
    assert f"{shown['upstream sync']:.0f} -> {shown['upstream async']:.0f} us" in text, text

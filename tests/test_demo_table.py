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
    shown = {m: float(re.search(rf"^{m} +\d+ +[\d-]+ +([\d.]+)", text, re.M).group(1)) for m in
             ("upstream sync", "upstream async", "ours sync", "ours async")}
    assert shown["ours sync"] == 847.5
    assert f"{shown['ours sync']:.0f} -> {shown['ours async']:.0f} us" in text, text
    assert f"{shown['upstream sync']:.0f} -> {shown['upstream async']:.0f} us" in text, text


def test_requests_come_with_the_steps_a_second_they_follow_and_failures_are_counted_as_lookups() -> None:
    """The requests column is a count that follows the scheduler's pace (a fixed number arrive each step): the table
    shows that pace (steps/s) beside it and says so; lookups that failed are lookups, not requests (a request asks
    again at each scheduling attempt, so a breaker's count may exceed the requests)."""
    slow = SchedRun(label="upstream sync", requests=40, steps=10, seconds=2.0, blocked_per_step=[1e-3], calls=[1e-3],
                    deferred_steps=[0] * 40, answer_delay=[2e-3] * 40)
    fast = SchedRun(label="ours async", requests=160, steps=40, seconds=2.0, blocked_per_step=[1e-5], calls=[1e-5],
                    deferred_steps=[1] * 160, answer_delay=[2e-3] * 160, outcomes={"hit": 100, "breaker_open": 230})
    text = format_table([slow, fast])
    head = text.splitlines()[0].split()
    assert head[:3] == ["mode", "requests", "steps/s"], head
    assert re.search(r"^upstream sync +40 +5 ", text, re.M) and re.search(r"^ours async +160 +20 ", text, re.M), text
    legend = " ".join(text.splitlines())
    assert "a fixed number at each scheduler step" in legend and "steps/s: scheduler steps a second" in legend
    assert "ours async: lookups that ended without the store's answer: 230 breaker_open (lookups, not requests" in \
        text and "may exceed the 160 requests" in text, text

"""``advise`` keeps a setting when the evidence is noise: a handful of timeouts among tens of thousands of lookups
(the trial's 4 in 53,097) does not ask for a new deadline, which would restart every engine of the fleet. The
threshold is a stated constant of advise_rules.py (:data:`NOISE_TIMEOUTS_MIN` timeouts and
:data:`NOISE_TIMEOUT_SHARE` of the lookups); above it the deadline rule acts as before."""

from __future__ import annotations

import math
from typing import Any

from mooncake_lookout.connector.cli import advise_rules
from mooncake_lookout.connector.cli.advise_prom import Figures
from mooncake_lookout.connector.cli.advise_rules import decide
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.metrics import catalogue as cat
from mooncake_lookout.metrics.prometheus_sink import info_labels

LOOKUPS = 53_097


def _window(timeouts: int, near_deadline: int) -> Figures:
    """An async deployment's hour: answers within a few ms, ``near_deadline`` of them in (50, 100] ms of the 100 ms
    deadline, ``timeouts`` lookups timed out."""
    config = LookupConfig(lookup_async=True)
    f = Figures(url="http://prometheus", selector="{}", window="1h", window_s=3600, configs=[info_labels(config)],
                configs_in_window=1)
    f.outcomes = {"hit": float(LOOKUPS - timeouts), "timeout": float(timeouts)}
    f.steps, f.step_mean_s, f.step_p50_s = 20_000.0, 0.010, 0.010
    f.blocked_s, f.blocked_calls = 1.0, 40_000.0
    per_bucket = {0.001: LOOKUPS - timeouts - near_deadline, 0.1: near_deadline, math.inf: timeouts}
    total, f.rpc_buckets = 0.0, []
    for le in (*cat.SECONDS_BUCKETS, math.inf):
        total += per_bucket.get(le, 0.0)
        f.rpc_buckets.append((le, total))
    f.deferred_count, f.deferred_sum, f.deferred_p90 = float(LOOKUPS), float(LOOKUPS), 1.0
    f.pending_peak, f.max_pending = 8.0, float(config.lookup_max_pending)
    f.held_peak, f.max_held = 10.0, float(config.lookup_max_held)
    return f


def _timeout_advice(f: Figures) -> Any:
    (advice,) = [a for a in decide(f)[2] if a.key == "lookup_timeout_ms"]
    return advice


def test_four_timeouts_in_53097_lookups_keep_the_deadline() -> None:
    advice = _timeout_advice(_window(timeouts=4, near_deadline=3))
    assert not advice.changed and advice.value == 100.0
    assert "noise" in advice.reason and "4 timeouts in 53097 lookups" in advice.reason, advice.reason


def test_above_the_threshold_the_deadline_rule_acts() -> None:
    timeouts = max(advise_rules.NOISE_TIMEOUTS_MIN, math.ceil(advise_rules.NOISE_TIMEOUT_SHARE * LOOKUPS))
    advice = _timeout_advice(_window(timeouts=timeouts, near_deadline=timeouts))
    assert advice.changed and advice.value == 200.0, advice.reason
    below = _timeout_advice(_window(timeouts=timeouts - 1, near_deadline=timeouts))
    assert not below.changed and "noise" in below.reason

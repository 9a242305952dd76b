"""``lookup_wait_us: auto`` (WaitBudget) on given step times and wait outcomes: what it waits, and when it stops.

The budget is pure arithmetic on the times it is handed (``new_step(now)``) and the waits it is told about
(``observe``), so most tests here drive it step by step with chosen numbers; the last one checks what our
client tells it, against a real lookup server; the scheduler tests run it for real.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pytest

from mooncake_lookout.connector.client import LookupClient
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.rigs.faults import InjectedDelayBackend
from mooncake_lookout.connector.rigs.workload import unique_hashes
from mooncake_lookout.connector.server import LookupServer
from mooncake_lookout.connector.transport.pipelined import PipelinedTransport
from mooncake_lookout.connector.wait_budget import MARGIN_S, PROBE_EVERY, WaitBudget

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

STEP_S = 0.010  # a 10 ms step: auto may wait up to 2.5 ms at the default share


def _steps(budget: WaitBudget, n: int, t0: float, rtt_s: float | None | Sequence[float]
           ) -> tuple[float, list[float]]:
    """``n`` steps of STEP_S; in each, one wait that is answered after ``rtt_s`` (a sequence: its round trips in
    turn, from the first step), or runs out if ``None`` or longer than the budget. Returns the clock and the
    budgets in force."""
    rtts = rtt_s if isinstance(rtt_s, Sequence) else [rtt_s]
    budgets = []
    t = t0
    for i in range(n):
        in_force = budget.new_step(t)
        budgets.append(in_force)
        if in_force > 0:
            rtt = rtts[i % len(rtts)]
            budget.observe(rtt if rtt is not None and rtt <= in_force else None)
        t += STEP_S
    return t, budgets


def test_auto_waits_about_the_round_trip_when_it_fits_in_the_cap() -> None:
    budget = WaitBudget(None, share=0.25)
    _, budgets = _steps(budget, 40, 0.0, 0.0006)
    assert budgets[0] == budget.share * 0.010  # nothing measured: wait up to the cap to learn
    assert budgets[-1] == 0.0006 + MARGIN_S
    assert budget.last_interval_s is not None and abs(budget.last_interval_s - STEP_S) < 1e-9


def test_auto_stops_waiting_when_no_answer_ever_comes_within_the_cap() -> None:
    """A round trip longer than the cap: every wait runs out and no round trip is ever measured. Auto must not
    keep waiting the whole cap every step (it did: with no measured p90 it stayed in "learning" forever)."""
    budget = WaitBudget(None, share=0.25)
    _, budgets = _steps(budget, 4 * PROBE_EVERY, 0.0, 0.004)  # 4 ms > 2.5 ms cap
    later = budgets[PROBE_EVERY:]
    assert budget.rtt_p90_s is None
    waited = [b for b in later if b > 0]
    assert len(waited) <= len(later) // PROBE_EVERY + 1, "auto kept waiting on a store that never answers in time"


def test_auto_waits_up_to_the_cap_when_the_p90_is_past_it_but_most_answers_land_within_it() -> None:
    """Round trips spread around the cap (2.5 ms): 8 in 10 land within it, so the p90 of the answered ones plus the
    margin passes the cap. Auto must keep waiting, at the cap: it gave up instead, deferring every arrival of
    every step but one in :data:`PROBE_EVERY` (in the bench's scenario c, 18-54% of steps went without a wait)."""
    budget = WaitBudget(None, share=0.25)
    cap = budget.share * STEP_S
    rtts = [0.0018, 0.0020, 0.0022, 0.0023, 0.0024, 0.00246, 0.00248, 0.00249, 0.0026, 0.0030]  # 8 of 10 in time
    _, budgets = _steps(budget, 4 * PROBE_EVERY, 0.0, rtts)
    assert budget.rtt_p90_s is not None and budget.rtt_p90_s + MARGIN_S > cap, "the case under test: p90 past the cap"
    assert all(b > 0 for b in budgets), f"auto stopped waiting though 8 in 10 answers land in time: {budgets}"
    # Waits that ran out count at their budget, so the budget climbs (by the margin a refresh) to the cap.
    last = budgets[-PROBE_EVERY:]
    assert all(abs(b - cap) < 1e-9 for b in last), f"auto waits less than the cap though 2 in 10 need more: {last}"


def test_auto_keeps_waiting_when_only_a_steps_later_waits_run_out() -> None:
    """A step's first wait has the whole budget; a later one has what the first left. Later waits running out say
    nothing of whether the cap is enough: auto gave up on them (here 2 of 3 waits a step ran out, each after the
    first had been answered within the cap)."""
    budget = WaitBudget(None, share=0.25)
    t, budgets = 0.0, []
    for _ in range(4 * PROBE_EVERY):
        in_force = budget.new_step(t)
        budgets.append(in_force)
        if in_force > 0:
            budget.observe(0.0015)  # answered well within the 2.5 ms cap
            budget.spend(in_force)  # the rest of the step's budget went on two waits that ran out
            budget.observe(None)
            budget.observe(None)
        t += STEP_S
    assert all(b > 0 for b in budgets), f"auto stopped waiting though every step's first wait was answered: {budgets}"


def test_a_fixed_budget_is_what_it_says() -> None:
    budget = WaitBudget(0.0002)
    _, budgets = _steps(budget, 5, 0.0, None)
    assert budgets == [0.0002] * 5


def test_auto_waits_again_once_a_probe_finds_the_store_close_after_a_slow_start() -> None:
    """Round trips measured during a slow start (long steps, slow answers) must not keep auto from waiting
    once steps are short and the store is close: while auto does not wait only probes add samples, so the
    slow ones stayed in its history for thousands of steps (the bench's scenario c deferred ~1 step per
    request in 2 of 3 runs for this reason)."""
    budget = WaitBudget(None, share=0.25)
    t = 0.0
    for _ in range(70):  # a slow start: 10 ms steps, answers after 2 ms (within the 2.5 ms cap)
        if budget.new_step(t) > 0:
            budget.observe(0.002)
        t += 0.010
    fast_step_s, rtt_s = 0.002, 0.0003  # then 2 ms steps (cap 0.5 ms), answers after 0.3 ms
    budgets = []
    for _ in range(4 * PROBE_EVERY):
        in_force = budget.new_step(t)
        budgets.append(in_force)
        if in_force > 0:
            budget.observe(rtt_s if rtt_s <= in_force else None)
        t += fast_step_s
    last = budgets[-PROBE_EVERY:]
    assert all(b > 0 for b in last), f"auto stopped waiting for a store that answers well within the cap: {last}"
    assert abs(last[-1] - (rtt_s + MARGIN_S)) < 1e-9


def test_our_client_times_a_wait_from_when_it_began_not_from_the_send(prefix_index: Any) -> None:
    """The step's first call sends every lookup of the step; the scheduler then works before the call that
    waits. That work covers part of the round trip: auto must learn how long the *wait* took (it learnt the
    whole round trip, and so gave up on waits it could afford). INJECTED FAULT: the server's store call is
    delayed 150 ms, so the round trip is long enough to time with a plain sleep for the scheduler's work."""
    server = LookupServer(InjectedDelayBackend(prefix_index, 0.150)).start()
    config = LookupConfig(lookup_transport="pipelined", lookup_async=True, lookup_wait_us="auto",
                          lookup_wait_auto_share=0.9, lookup_timeout_ms=5000)
    client = LookupClient(config, PipelinedTransport(server.address, timeout_s=5.0))
    try:
        for _ in range(3):  # two 400 ms steps: the cap (0.9 x the step interval) reaches ~135 ms
            client.end_step()
            time.sleep(0.4)
        hashes = unique_hashes(4, seed=11)
        client.start("a", 65, hashes, admission=True)  # admitted after the step's calls (vLLM's add_request)
        client.end_step()  # the step ends: what is unsent goes out; the answer is 150 ms away
        assert client.budget.left() > 0.125
        time.sleep(0.075)  # the scheduler's work between the send and the call that waits
        assert client.lookup("a", 65, hashes, non_block=True) is not None  # waited ~75 ms of its budget
        waited = client.budget.rtt_p90_s
        assert waited is not None and waited < 0.125, f"auto learnt {waited} s: the round trip, not the wait"
    finally:
        client.close()
        server.close()

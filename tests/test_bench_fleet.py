"""Scenario (h)'s parts that need no fleet: the CPU meter, the workloads, the sizing model's arithmetic.

The fleet itself runs in ``tests/test_bench.py`` (``bench --quick`` runs a fleet of 1 and 2 engines); here:

* a process's CPU is read from that process's own ``/proc`` entry: a child that burns CPU shows it, a child that
  sleeps does not, and both clocks (the scheduler's per-thread nanoseconds, the whole-process ticks) agree;
* the workloads are what the module says (scenario c's shared prefixes, scenario g's conversations turn by
  turn), and the store holds every block an engine asks;
* the model's fit recovers the per-call and per-key costs that made a set of figures, and its projection adds
  up over engines, rate and blocks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from mooncake_lookout.connector.bench import fleet_model
from mooncake_lookout.connector.bench.fleet_workloads import (
    ACTIVE,
    CONTEXT_BLOCKS,
    MULTI_TURN,
    SHARED_PREFIX,
    TURN_BLOCKS,
    TURNS,
    FleetWorkload,
)
from mooncake_lookout.connector.rigs.cpu import CLOCK_TICKS, CpuMeter, thread_cpu_s, tick_cpu_s

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

BURN_S = 0.3  # CPU seconds the busy child uses, by its own clock (not wall time: the machine may be loaded)
# The busy child starts two threads, says so, and waits for a line on stdin; then both spin until its own CPU time
# reaches BURN_S, and stay (as the master's threads do) or, with EXIT, end; then it says so and sleeps.
BUSY = """
import sys, threading, time
go, done = threading.Event(), threading.Event()
def spin():
    go.wait()
    while time.process_time() < {burn}:
        pass
    done.set()
    if "{exit}" != "exit":
        time.sleep(60)
threads = [threading.Thread(target=spin, daemon=True) for _ in range(2)]
for t in threads: t.start()
print("started", flush=True)
sys.stdin.readline()
go.set()
done.wait()
if "{exit}" == "exit":
    for t in threads: t.join()
print("done", time.process_time(), flush=True)
time.sleep(60)
"""


def _child(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _go(child: subprocess.Popen[str]) -> None:
    assert child.stdin is not None
    child.stdin.write("go\n")
    child.stdin.flush()


def test_a_process_cpu_is_read_from_that_process_alone() -> None:
    busy, idle = _child(BUSY.format(burn=BURN_S, exit="")), _child("import time; print('done', flush=True); "
                                                                    "time.sleep(60)")
    try:
        assert idle.stdout is not None and busy.stdout is not None
        assert idle.stdout.readline().startswith("done")
        idle_meter = CpuMeter(idle.pid)
        assert busy.stdout.readline().startswith("started")
        busy_meter = CpuMeter(busy.pid)
        _go(busy)
        line = busy.stdout.readline()  # blocks until the child's own clock passed BURN_S
        assert line.startswith("done"), line
        own = float(line.split()[1])
        threads, ticks = thread_cpu_s(busy.pid), tick_cpu_s(busy.pid)
        # The scheduler's per-thread clock, summed over the threads, is what the child's own
        # CLOCK_PROCESS_CPUTIME_ID said (it went on a little after, to print); the tick clock agrees within a few
        # ticks (one per thread and reading, rounding).
        assert own >= BURN_S and own - 1 / CLOCK_TICKS <= threads <= own + 0.05
        assert abs(ticks - threads) <= 6 / CLOCK_TICKS
        window = busy_meter.used()
        assert window.exited == 0 and 0 < window.threads_s <= threads
        # The sleeping child used next to nothing meanwhile, whatever the other one burnt.
        assert idle_meter.used().threads_s < 0.05 < BURN_S
    finally:
        for child in (busy, idle):
            child.kill()
            child.wait(10)


def test_threads_that_end_within_a_window_are_counted_as_such() -> None:
    busy = _child(BUSY.format(burn=BURN_S, exit="exit"))
    try:
        assert busy.stdout is not None and busy.stdout.readline().startswith("started")
        meter = CpuMeter(busy.pid)  # both spinning threads are alive now
        _go(busy)
        assert busy.stdout.readline().startswith("done")
        # A joined thread's kernel task may linger a moment after Python's join: wait (bounded) until it is gone.
        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{busy.pid}/task")) > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        window = meter.used()
        # Their time left with them (the per-thread clock is short by it); the tick clock kept it.
        assert window.exited == 2
        assert window.ticks_s >= BURN_S - 6 / CLOCK_TICKS > window.threads_s
    finally:
        busy.kill()
        busy.wait(10)


def test_a_meter_of_a_process_that_is_gone_says_so() -> None:
    child = _child("pass")
    child.wait(10)
    with pytest.raises((ProcessLookupError, FileNotFoundError)):
        thread_cpu_s(child.pid)


def test_the_shared_prefix_workload_is_scenario_cs() -> None:
    w = FleetWorkload(SHARED_PREFIX, rate=200.0, burst=4)
    requests = w.requests(64, engine=1, tag="t")
    assert all(len(r.block_hashes) == 8 and r.num_tokens == 8 * 16 + 1 for r in requests)
    assert len({r.block_hashes[:4] for r in requests}) == 4  # four shared prefixes
    assert len({r.block_hashes for r in requests}) == 64 and len({r.req_id for r in requests}) == 64
    other = w.requests(64, engine=2, tag="t")
    assert {r.block_hashes for r in other} != {r.block_hashes for r in requests}  # engines start apart
    stored = {h for blocks in w.stored(w.requests_in(1.0)) for h in blocks}
    for i, r in enumerate(requests):  # every other prompt whole, the rest up to its prefix
        assert set(r.block_hashes[:4]) <= stored
        whole = set(r.block_hashes) <= stored
        assert whole or not set(r.block_hashes[4:]) & stored, i


def test_the_multi_turn_workload_is_scenario_gs_conversations_turn_by_turn() -> None:
    w = FleetWorkload(MULTI_TURN, rate=10.0)
    count = w.requests_in(9.0)
    requests = w.requests(count, engine=0, tag="t")
    assert count == 90 and w.conversations(count) == ACTIVE * 2
    first = [r for r in requests if r.req_id.endswith("-t0")]
    assert len(first) == ACTIVE * 2 and all(len(r.block_hashes) == CONTEXT_BLOCKS for r in first)
    by_conversation: dict[str, list[tuple[int, ...]]] = {}
    for r in requests:
        conversation = r.req_id.split("-")[2]
        by_conversation.setdefault(conversation, []).append(r.block_hashes)
    for turns in by_conversation.values():
        for t, (before, after) in enumerate(zip(turns, turns[1:])):
            assert after[:len(before)] == before and len(after) == len(before) + TURN_BLOCKS, t
    assert max(len(t) for t in by_conversation.values()) == TURNS
    stored = {h for blocks in w.stored(count) for h in blocks}
    assert all(set(r.block_hashes) <= stored for r in requests)
    with pytest.raises(ValueError, match="kind"):
        FleetWorkload("chat", 1.0)
    with pytest.raises(ValueError, match="rate"):
        FleetWorkload(MULTI_TURN, 0.0)


def test_the_fit_recovers_the_cost_per_call_and_per_key_behind_the_figures() -> None:
    """The least-squares fit of the one cost per key (and per call, for traffic of no known workload)."""
    per_call, per_key = 40.0, 0.5
    points = [(c, k, c * per_call + k * per_key) for c, k in ((1, 8), (0.25, 4.3), (1, 2200), (1, 118))]
    call, key = fleet_model.fit(points)
    assert call == pytest.approx(per_call) and key == pytest.approx(per_key)
    with pytest.raises(ValueError, match="separate"):
        fleet_model.fit([(1, 8, 44.0), (2, 16, 88.0)])
    with pytest.raises(ValueError, match="two"):
        fleet_model.fit([(1, 8, 44.0)])


def test_the_projection_adds_up_over_engines_rate_and_blocks() -> None:
    shape = {"upstream": fleet_model.Shape(1.0, 1.0, 40.0), "ours": fleet_model.Shape(0.05, 0.25, 40.0)}
    model = fleet_model.Model(40.0, 0.5, {"w": shape}, {"w": {"blocks": 100, "rate": 10, "burst": 1}}, 1)
    one = fleet_model.project(model, "w", engines=1, rate=10, blocks=100)
    assert one["upstream"].per_lookup_us == pytest.approx(40 + 100 * 0.5)
    assert one["ours"].per_lookup_us == pytest.approx(0.25 * 40 + 5 * 0.5)
    assert one["upstream"].master_cores == pytest.approx(10 * 90e-6)
    four = fleet_model.project(model, "w", engines=4, rate=10, blocks=100)
    assert four["ours"].master_cores == pytest.approx(4 * one["ours"].master_cores)
    assert four["ours"].keys_per_s == pytest.approx(4 * 10 * 5) and four["ours"].calls_per_s == pytest.approx(10)
    assert one["ours"].engines_per_core(1) == pytest.approx(1 / one["ours"].master_cores)
    with pytest.raises(ValueError, match="no measured workload"):
        fleet_model.project(model, "chat", engines=1, rate=1, blocks=1)
    with pytest.raises(ValueError, match="engines must be"):
        fleet_model.project(model, "w", engines=0, rate=1, blocks=1)


def test_the_clock_is_monotonic_per_process() -> None:
    before = thread_cpu_s(_self())
    t0 = time.process_time()
    while time.process_time() - t0 < 0.05:
        pass
    assert thread_cpu_s(_self()) > before


def _self() -> int:
    return os.getpid()


def test_a_keys_cost_comes_from_the_two_clients_that_make_the_same_calls() -> None:
    per_key, lone_call, burst_call = 2.0, 130.0, 50.0
    means = {("multi-turn", "upstream"): (1.0, 2176.0, lone_call + 2176 * per_key),
             ("multi-turn", "ours"): (1.0, 269.0, lone_call + 269 * per_key),
             ("shared-prefix", "upstream"): (1.0, 8.0, burst_call + 8 * per_key),
             ("shared-prefix", "ours"): (0.25, 4.3, 0.25 * 117 + 4.3 * per_key)}
    assert fleet_model.key_cost(means) == pytest.approx(per_key)
    # No workload whose clients make the same calls: no figure (the model falls back to its least-squares fit).
    del means[("multi-turn", "ours")]
    assert fleet_model.key_cost(means) is None

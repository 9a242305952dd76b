"""The bench's scheduler loop (``sched.run_mode``) drives vLLM's real V1 scheduler the way vLLM's engine does.

vLLM builds (and hashes) a request on its input thread (``EngineCoreProc.preprocess_add_request``), then the
engine core adds the queued requests one after another, just before ``schedule()``. The bench must add a step's
arrivals back to back too: hashing between the adds put about 180 us between a step's first arrival and its last,
time a lookup sent at admission does not have in vLLM. Real parts: vLLM's scheduler, our connector, a real
lookup server over the real store.
"""

from __future__ import annotations

from typing import Any

from mooncake_lookout.connector.bench import sched
from mooncake_lookout.connector.server import LookupServer
from mooncake_lookout.connector.server.prefix_index import PrefixIndex
from mooncake_lookout.connector.transport.names import PIPELINED


class _Rig:
    """What ``run_mode`` needs of a rig: the prefix index to fill, and the scheduler's wiring to a server."""

    def __init__(self, index: PrefixIndex, address: str) -> None:
        self.index, self.address = index, address

    def scheduler_extra(self, ours: bool, transport: str = PIPELINED, **config: Any) -> dict[str, Any]:
        return {"load_async": False, "lookup_transport": transport, "lookup_server_address": self.address, **config}


def test_a_steps_arrivals_are_built_first_then_added_back_to_back(prefix_index: PrefixIndex) -> None:
    calls: list[str] = []

    def watch(driver: Any) -> None:
        make, add = driver.make_request, driver.add
        driver.make_request = lambda *a, **k: (calls.append("make"), make(*a, **k))[1]
        driver.add = lambda request: (calls.append("add"), add(request))[1]

    with LookupServer(prefix_index) as server:
        run = sched.run_mode(_Rig(prefix_index, server.address), sched.Workload(),
                             sched.mode("ours async", True, lookup_async=True, lookup_timeout_ms=5000), steps=3,
                             drain_s=5.0, prepare=watch)
    n = sched.ARRIVALS_PER_STEP
    steps = calls[-2 * n * 3:]  # before them, filling the store builds requests of its own (for their hashes)
    assert calls.count("add") == 3 * n
    assert steps == (["make"] * n + ["add"] * n) * 3, f"a step's arrivals were not added back to back: {steps}"
    assert run.requests == 3 * n and run.finished == 3 * n


def test_scenario_fs_recurring_prompts_are_each_looked_up(prefix_index: PrefixIndex) -> None:
    """(f)'s requests recur over a few prompts, so vLLM's own prefix cache soon holds them; a prompt it holds
    whole is answered with no lookup, which would leave (f) timing nothing of the lookup path. Each request's
    own last block keeps every lookup asked."""
    from mooncake_lookout.connector.bench.long_prompts import Length
    from mooncake_lookout.connector.bench.rig import BLOCK_SIZE

    length = Length(8, steps=6, arrivals_per_step=2, fill=2)
    with LookupServer(prefix_index) as server:
        run = sched.run_mode(_Rig(prefix_index, server.address), length.workload(),
                             sched.mode("ours async", True, lookup_async=True, lookup_timeout_ms=5000,
                                        lookup_on_admission=False),  # a lookup is started only when asked for
                             steps=length.steps, arrivals_per_step=length.arrivals_per_step, drain_s=5.0)
    assert run.finished == 12
    assert sum(run.outcomes.values()) == 12, f"a request was answered without a lookup: {run.outcomes}"
    first, again = length.workload().request(0)[1], length.workload().request(length.fill)[1]
    end = length.blocks * BLOCK_SIZE
    assert first[:end - BLOCK_SIZE] == again[:end - BLOCK_SIZE] and first[end - BLOCK_SIZE:] != again[end - BLOCK_SIZE:]


def test_arriving_in_the_model_step_hands_each_request_to_the_input_thread_hook_then_admits_it_at_the_next_step(
        prefix_index: PrefixIndex) -> None:
    """(f)'s arrivals, as in a live engine: each request reaches the engine at a moment of the model step before
    the step that admits it (``driver.arrive``, what vLLM's input thread hands the connector), never at a step's
    start; its answer delay counts from then. A step's requests arrive one after the other, each handed on as soon
    as it is built, as vLLM's input thread takes them (this failed before: a step's requests were all built, and
    hashed, before the first was handed on, so its lookup left late)."""
    events: list[tuple[str, str, int]] = []

    def watch(driver: Any) -> None:
        arrive, add, make = driver.arrive, driver.add, driver.make_request
        driver.arrive = lambda r: (events.append(("arrive", r.request_id, driver.stats.steps)), arrive(r))[1]
        driver.add = lambda r: (events.append(("add", r.request_id, driver.stats.steps)), add(r))[1]
        driver.make_request = lambda rid, *a: (events.append(("build", rid, driver.stats.steps)), make(rid, *a))[1]

    with LookupServer(prefix_index) as server:
        run = sched.run_mode(_Rig(prefix_index, server.address), sched.Workload(),
                             sched.mode("ours async", True, lookup_async=True, lookup_timeout_ms=5000), steps=4,
                             arrivals_per_step=2, drain_s=5.0, prepare=watch, arrive_in_step=True)
    assert run.requests == 8 and run.finished == 8
    arrived = {rid: step for kind, rid, step in events if kind == "arrive"}
    added = {rid: step for kind, rid, step in events if kind == "add"}
    assert arrived.keys() == added.keys() and len(arrived) == 8
    # the first step's requests arrive before it; every later step's during the step before (its model step)
    assert all(added[r] == (0 if arrived[r] == 0 and r in ("q0", "q1") else arrived[r] + 1) for r in arrived)
    assert [events.index(("arrive", r, arrived[r])) < events.index(("add", r, added[r])) for r in arrived] == [True] * 8
    assert len(run.answer_delay) == 8 and min(run.answer_delay) > 0
    in_step = [(kind, rid) for kind, rid, _ in events
               if kind in ("build", "arrive") and rid.startswith("q") and rid not in ("q0", "q1")]
    assert in_step == [(kind, f"q{k}") for k in range(2, 8) for kind in ("build", "arrive")]

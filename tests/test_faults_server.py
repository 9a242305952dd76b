"""The lookup server process killed, hung (SIGSTOP) and restarted, for both transports; resets in flight,
reused request ids and abort storms. Real parts only: a Mooncake master, a lookup server in a child process
(our LookupServer for ``pipelined``, vLLM's LookupKeyServer for ``upstream``), our client, real ZMQ.

Guarantees checked after every fault: no ``lookup()`` call blocks past the deadline + 5 ms; every lookup is
answered (never "ask again" past its deadline); no hit above the store's true contents; pending lookups
back to 0; lookups succeed again within 5 s of the server's return, with the same client.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from mooncake_lookout.connector.events import Outcome
from mooncake_lookout.connector.rigs.soak import FaultRig
from mooncake_lookout.connector.rigs.workload import shared_prefix_workload

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

TIMEOUT_MS = 100.0
RECOVERY_BOUND_S = 5.0
CONFIG = dict(lookup_timeout_ms=TIMEOUT_MS, lookup_breaker_failures=1000, lookup_breaker_cooldown_s=0.2)


@pytest.fixture(scope="module", params=["pipelined", "upstream"])
def rig(request) -> Iterator[FaultRig]:
    """One rig per transport for the module (an upstream server process imports vLLM: ~10 s)."""
    with FaultRig(request.param, config=CONFIG) as r:
        yield r


@pytest.fixture
def work(rig: FaultRig) -> Any:
    """32 requests over 4 shared prefixes; 0-8 of their 8 blocks stored (the truth)."""
    reqs = shared_prefix_workload(32, prefix_blocks=4, unique_blocks=4, num_prefixes=4,
                                  seed=int(time.time_ns() % 1_000_000))
    rig.store(reqs, lambda r: (hash(r.req_id) % 5) * 2)
    rig.reset_checks()  # each test judges its own violations and call times
    yield reqs
    assert rig.violations.empty(), rig.violations
    assert rig.budget.problems() is None, rig.budget.problems()


def ask_all(rig: FaultRig, reqs: list[Any], prefix: str, *, blocking_every: int = 4,
            bound_s: float = 10.0, others_pending: int = 0) -> dict[str, Any]:
    """Start every lookup, then poll each once per 1 ms step (some blocking) until all are answered.

    Checks each call's time and every answer against the truth; returns the answers by request id.
    """
    client, timeout_s = rig.client, TIMEOUT_MS / 1000
    recs: dict[str, Any] = {}
    for i, r in enumerate(reqs):
        recs[f"{prefix}{i}"] = client.start(f"{prefix}{i}", r.num_tokens, r.block_hashes)
    t_sub = {rid: rec.t_submit for rid, rec in recs.items()}
    answers: dict[str, Any] = {}
    end = time.monotonic() + bound_s
    while len(answers) < len(reqs):
        assert time.monotonic() < end, "a lookup was never answered"
        for i, r in enumerate(reqs):
            rid = f"{prefix}{i}"
            if rid in answers:
                continue
            t0 = time.perf_counter()
            res = client.lookup(rid, r.num_tokens, r.block_hashes, non_block=(i % blocking_every != 0))
            spent = time.perf_counter() - t0
            rig.budget.record(spent)  # judged at the end of the test
            if res is None:
                # The deadline runs from when the lookup was sent; one still queued ends with the lookup sent
                # ahead of it, or a deadline after it was queued if none was sent since (upstream's one thread
                # sends them in turn).
                rec = recs[rid]
                if rec.t_start is not None or rec.t_queued is not None:
                    start = rec.t_start if rec.t_start is not None else max(rec.t_queued, rig.last_sent)
                    assert t0 < start + timeout_s, "told to ask again after the deadline"
                continue
            rig.check(rid, r.num_tokens, r.block_hashes, res, t_sub[rid])
            answers[rid] = res
            client.discard(rid)
        time.sleep(0.001)  # one scheduler step: the model's forward pass
    assert client.pending == others_pending
    return answers


def test_healthy_baseline_serves_exactly_the_truth(rig: FaultRig, work: list[Any]) -> None:
    answers = ask_all(rig, work, "base-")
    for i, r in enumerate(work):
        assert answers[f"base-{i}"].hit_length == rig.truth(r.num_tokens, r.block_hashes)


def test_the_rig_knows_when_the_transport_last_sent(rig: FaultRig, work: list[Any]) -> None:
    """``ask_all``'s bound for a queued lookup ("it ends with the one sent ahead of it") needs that one's send time.
    With ``upstream`` the transport's thread sends after the client's hand-over, whose ``started`` event cannot
    say when: the rig reads the thread's own record (failed before: the bound fell back to the time queued, stricter
    than the rule by the thread's send lag, and the killed-server test failed in CI by 0.5 ms)."""
    r = work[0]
    answer = rig.client.lookup("sent-0", r.num_tokens, r.block_hashes, non_block=False)
    assert answer is not None and answer.t_start is not None
    assert rig.last_sent >= answer.t_start
    rig.client.discard("sent-0")


def test_server_killed_with_lookups_in_flight_then_restarted(rig: FaultRig, work: list[Any]) -> None:
    client = rig.client
    for i, r in enumerate(work):
        client.start(f"k-{i}", r.num_tokens, r.block_hashes)
    rig.server.kill()
    # In flight and new lookups against a dead server: each answered by its deadline, as a miss.
    answers = ask_all(rig, work, "dead-", others_pending=len(work))
    assert all(a.hit_length == 0 for a in answers.values())
    for i in range(len(work)):
        client.discard(f"k-{i}")
    assert client.pending == 0
    rig.server.start()
    took = rig.assert_recovers(work, RECOVERY_BOUND_S)
    answers = ask_all(rig, work, "back-")
    served = sum(a.hit_length for a in answers.values())
    assert served == sum(rig.truth(r.num_tokens, r.block_hashes) for r in work), "hits lost after restart"
    print(f"server kill -> recovery {took:.3f} s")


def test_server_hung_then_resumed_serves_no_late_answer(rig: FaultRig, work: list[Any]) -> None:
    client = rig.client
    rig.server.pause()
    try:
        t0 = time.perf_counter()
        blocked = client.lookup("hung-sync", work[0].num_tokens, work[0].block_hashes)
        rig.budget.record(time.perf_counter() - t0)
        assert blocked.hit_length == 0
        client.discard("hung-sync")
        answers = ask_all(rig, work, "hung-")
        assert all(a.hit_length == 0 for a in answers.values())
    finally:
        rig.server.resume()
    # The thawed server now answers the old requests; those replies must be dropped, not served.
    took = rig.assert_recovers(work, RECOVERY_BOUND_S)
    answers = ask_all(rig, work, "thawed-")
    for i, r in enumerate(work):
        assert answers[f"thawed-{i}"].hit_length == rig.truth(r.num_tokens, r.block_hashes)
    print(f"server SIGSTOP -> recovery {took:.3f} s")


def test_reset_with_lookups_in_flight_serves_nothing_stale(rig: FaultRig, work: list[Any]) -> None:
    client = rig.client
    for i, r in enumerate(work):
        client.start(f"pre-{i}", r.num_tokens, r.block_hashes)
    gen = client.generation
    assert rig.wipe(), "the server did not acknowledge the reset"
    assert client.generation == gen + 1 and client.pending == 0
    # Same ids asked again after the reset: a fresh lookup each, and the store is empty now.
    answers = ask_all(rig, work, "pre-")
    assert all(a.hit_length == 0 for a in answers.values())
    rig.restore(work)
    answers = ask_all(rig, work, "post-")
    assert sum(a.hit_length for a in answers.values()) == sum(rig.truth(r.num_tokens, r.block_hashes) for r in work)


def test_abort_storm_and_reused_ids(rig: FaultRig, work: list[Any]) -> None:
    client = rig.client
    ids = [f"storm-{i}" for i in range(400)]
    for n, rid in enumerate(ids):
        r = work[n % len(work)]
        client.start(rid, r.num_tokens, r.block_hashes)
    for rid in ids:  # every request aborted at once, answered or not
        client.discard(rid)
    assert client.pending == 0
    # The same ids come back carrying other prompts: each gets the truth of its new prompt, not the old answer.
    shifted = [work[(n + 7) % len(work)] for n in range(len(work))]
    first = ask_all(rig, work, "reuse-")
    second = ask_all(rig, shifted, "reuse-")
    # Each answer the store gave is the truth of the new prompt (a loaded machine may time one out: a miss
    # counted as such, never the old prompt's answer; every answer is checked against the truth above).
    answered = [i for i in range(len(shifted)) if rig.outcome(f"reuse-{i}") in (Outcome.HIT, Outcome.MISS)]
    assert answered, "the store answered none of the reused ids"
    for i in answered:
        r = shifted[i]
        assert second[f"reuse-{i}"].hit_length == rig.truth(r.num_tokens, r.block_hashes)
    assert len(first) == len(second) == len(work)


def test_no_process_is_left_behind(rig: FaultRig) -> None:
    import os

    pids = rig.server.pids()
    assert pids and all(os.path.exists(f"/proc/{p}") for p in pids)
    # (The module fixture closes the rig; ServerProcess.close kills the server and its standby by pid.)

"""Store faults under a real lookup server process, both transports: the Mooncake master killed mid-run and
restarted (all keys lost), paused (SIGSTOP) and resumed, and a slow store around the deadline.

The slow store is the one injected fault (``InjectedDelayBackend`` in the server process): a healthy but slow
store cannot be produced for real on demand. Everything else is a real signal to a real process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from mooncake_lookout.connector.client import LookupClient
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.events import Outcome, OutcomeCounter
from mooncake_lookout.connector.rigs.soak import FaultRig, poll_until
from mooncake_lookout.connector.rigs.workload import shared_prefix_workload
from mooncake_lookout.connector.transport import make_transport

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

TIMEOUT_MS = 100.0
RECOVERY_BOUND_S = 5.0
DELAY_MS = 200.0  # the injected store delay: twice the deadline above
CONFIG = dict(lookup_timeout_ms=TIMEOUT_MS, lookup_breaker_failures=3, lookup_breaker_cooldown_s=0.2)


@pytest.fixture(scope="module", params=["pipelined", "upstream"])
def rig(request) -> Iterator[FaultRig]:
    """One rig per transport: its own master (killed and paused here), a server process with a delay ready."""
    with FaultRig(request.param, config=CONFIG, server_kwargs=dict(delay_ms=DELAY_MS)) as r:
        yield r


@pytest.fixture
def work(rig: FaultRig) -> Iterator[list[Any]]:
    reqs = shared_prefix_workload(16, prefix_blocks=4, unique_blocks=4, num_prefixes=2,
                                  seed=int(time.time_ns() % 1_000_000))
    rig.store(reqs, lambda r: 8 if hash(r.req_id) % 2 else 4)
    rig.reset_checks()  # each test judges its own violations and call times
    yield reqs
    assert rig.violations.empty(), rig.violations
    assert rig.budget.problems() is None, rig.budget.problems()


def ask_blocking(rig: FaultRig, client: LookupClient, reqs: list[Any], prefix: str,
                 others_pending: int = 0) -> list[Any]:
    """One blocking lookup per request (vLLM's sync mode): each bounded, each checked against the truth."""
    out = []
    timeout_s = client.config.timeout_s
    for i, r in enumerate(reqs):
        rid = f"{prefix}{i}"
        t0 = time.perf_counter()
        res = client.lookup(rid, r.num_tokens, r.block_hashes)
        spent = time.perf_counter() - t0
        if client.config.timeout_s == TIMEOUT_MS / 1000:
            rig.budget.record(spent)  # judged at the end of the test
        assert spent <= 2 * timeout_s, f"lookup() wedged for {spent * 1000:.1f} ms"
        rig.check(rid, r.num_tokens, r.block_hashes, res, t0)
        client.discard(rid)
        out.append(res)
    assert client.pending == others_pending
    return out


def test_master_killed_mid_run_and_restarted(rig: FaultRig, work: list[Any]) -> None:
    client = rig.client
    for i, r in enumerate(work):
        client.start(f"inflight-{i}", r.num_tokens, r.block_hashes)
    rig.master.kill()
    rig.empty_since = time.perf_counter()  # every key died with the master
    dead = ask_blocking(rig, client, work, "dead-", others_pending=len(work))
    assert all(a.hit_length == 0 for a in dead)
    t_back = time.perf_counter()
    rig.master.start()  # same ports, empty index
    # Before the truth is stored again, nothing may hit (a hit now would be stale).
    ask_blocking(rig, client, work, "empty-", others_pending=len(work))
    for i in range(len(work)):
        client.discard(f"inflight-{i}")
    assert client.pending == 0
    rig.restore(work)
    took = rig.assert_recovers(work, RECOVERY_BOUND_S)
    answers = ask_blocking(rig, client, work, "back-")
    assert [a.hit_length for a in answers] == [rig.truth(r.num_tokens, r.block_hashes) for r in work]
    print(f"master kill -> lookups hit {time.perf_counter() - t_back:.3f} s after the master returned "
          f"(probe {took:.3f} s after the re-store)")


def test_master_paused_and_resumed(rig: FaultRig, work: list[Any]) -> None:
    client = rig.client
    rig.master.pause()
    try:
        hung = ask_blocking(rig, client, work, "paused-")
        assert all(a.hit_length == 0 for a in hung)
        assert client.breaker.is_open, "consecutive timeouts did not open the breaker"
        t0 = time.perf_counter()
        fast = client.lookup("while-open", work[0].num_tokens, work[0].block_hashes)
        assert time.perf_counter() - t0 < TIMEOUT_MS / 1000 and fast.hit_length == 0
        client.discard("while-open")
    finally:
        rig.master.resume()
    took = rig.assert_recovers(work, RECOVERY_BOUND_S)
    assert not client.breaker.is_open
    answers = ask_blocking(rig, client, work, "resumed-")
    assert [a.hit_length for a in answers] == [rig.truth(r.num_tokens, r.block_hashes) for r in work]
    print(f"master SIGSTOP -> recovery {took:.3f} s")


def test_slow_store_around_the_deadline(rig: FaultRig, work: list[Any]) -> None:
    """INJECTED delay of 200 ms in the server's store calls: a 100 ms client times out, a 500 ms one waits."""
    counter = OutcomeCounter()
    patient = LookupClient(LookupConfig(**{**rig.config.as_extra_config(), "lookup_timeout_ms": 5 * DELAY_MS,
                                           "lookup_block_ms": 5 * DELAY_MS, "lookup_breaker_failures": 1000}),
                           make_transport(rig.config, rig.server.address), observer=counter)
    rig.server.set_delay(True)
    try:
        hurried = ask_blocking(rig, rig.client, work[:4], "hurried-")
        assert all(a.hit_length == 0 for a in hurried)
        waited = ask_blocking(rig, patient, work[:4], "patient-")
        assert [a.hit_length for a in waited] == [rig.truth(r.num_tokens, r.block_hashes) for r in work[:4]]
        assert counter.count(Outcome.TIMEOUT) == 0
    finally:
        rig.server.set_delay(False)
        patient.close()
    rig.assert_recovers(work, RECOVERY_BOUND_S)
    # Replies the slow store sent after the 100 ms deadline were dropped, never served to a later lookup.
    answers = ask_blocking(rig, rig.client, work, "after-")
    assert [a.hit_length for a in answers] == [rig.truth(r.num_tokens, r.block_hashes) for r in work]


def test_lookups_in_flight_across_a_master_pause_all_end(rig: FaultRig, work: list[Any]) -> None:
    client = rig.client
    for i, r in enumerate(work):
        client.start(f"p-{i}", r.num_tokens, r.block_hashes)
    rig.master.pause()
    try:
        answered = {}

        def all_answered() -> bool:
            for i, r in enumerate(work):
                rid = f"p-{i}"
                if rid not in answered:
                    res = client.lookup(rid, r.num_tokens, r.block_hashes, non_block=True)
                    if res is not None:
                        answered[rid] = res
                        rig.check(rid, r.num_tokens, r.block_hashes, res, 0.0)
            return len(answered) == len(work)

        assert poll_until(all_answered, 5 * TIMEOUT_MS / 1000, 0.001) is not None, "a lookup was never answered"
    finally:
        rig.master.resume()
    for rid in answered:
        client.discard(rid)
    assert client.pending == 0
    rig.assert_recovers(work, RECOVERY_BOUND_S)

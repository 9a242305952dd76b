"""Slow is not dead: the breaker against a real slow lookup server and a real hung one (issue 49, item 5).

Real parts: a Mooncake master, our lookup server in a child process, the pipelined transport, real ZMQ. The
client is driven as vLLM's async scheduler drives it: a step every 10 ms, 16 new requests a step (one frame),
every pending request asked again (``non_block``) each step.

* Slow but live: the server's store call is slowed to 90 ms against a 100 ms deadline (INJECTED: a store that
  is slow but healthy cannot be produced on demand,
  :class:`~mooncake_lookout.connector.rigs.faults.InjectedDelayBackend`),
  so a frame that lands while the server is busy with the previous batch times out and its reply comes late.
  The breaker must stay closed (before issue 49 a single such frame of 16 opened it: "16 consecutive failures").
* Dead (hung, SIGSTOP: real): nothing is heard; the breaker opens, but only once 5 distinct sends have failed,
  not at the first frame's 16 timeouts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from mooncake_lookout.connector.events import Outcome, OutcomeCounter
from mooncake_lookout.connector.rigs.soak import FaultRig
from mooncake_lookout.connector.rigs.workload import shared_prefix_workload

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

TIMEOUT_MS = 100.0
DELAY_MS = 90.0
FRAME = 16
STEP_S = 0.01


class Watch(OutcomeCounter):
    """Counts outcomes; at each breaker change, how many distinct sends had timed out by then."""

    def __init__(self) -> None:
        super().__init__()
        self.failed_sends_at_change: list[int] = []

    def breaker_changed(self, is_open: bool) -> None:
        super().breaker_changed(is_open)
        sends = {r.t_start for r in self.records if r.outcome is Outcome.TIMEOUT and r.t_start is not None}
        self.failed_sends_at_change.append(len(sends))


@pytest.fixture(scope="module")
def rig() -> Iterator[FaultRig]:
    """A rig whose server can be slowed on demand (the delay is off until a test switches it on)."""
    config = dict(lookup_async=True, lookup_timeout_ms=TIMEOUT_MS)  # the breaker's keys at their defaults
    with FaultRig("pipelined", config=config, server_kwargs=dict(delay_ms=DELAY_MS, delay_on=False)) as r:
        yield r


def drive(client: Any, reqs: list[Any], prefix: str, steps: int, *, stop: Any = None) -> None:
    """``steps`` scheduler steps of async lookups: 16 new requests a step, every pending one asked again."""
    pending: dict[str, Any] = {}
    n = 0
    for _ in range(steps):
        for _ in range(FRAME):
            r = reqs[n % len(reqs)]
            rid = f"{prefix}{n}"
            n += 1
            client.start(rid, r.num_tokens, r.block_hashes, admission=True)
            pending[rid] = r
        for rid, r in list(pending.items()):
            if client.lookup(rid, r.num_tokens, r.block_hashes, non_block=True) is not None:
                client.discard(rid)
                del pending[rid]
        client.end_step()
        if stop is not None and stop():
            break
        time.sleep(STEP_S)  # the model step
    end = time.monotonic() + 5.0
    while pending and time.monotonic() < end:  # every lookup ends by its deadline: drain what is left
        for rid, r in list(pending.items()):
            if client.lookup(rid, r.num_tokens, r.block_hashes, non_block=True) is not None:
                client.discard(rid)
                del pending[rid]
        client.end_step()
        time.sleep(STEP_S)
    assert not pending, "lookups left unanswered past their deadline"


def test_a_slow_but_live_server_does_not_open_the_breaker(rig: FaultRig) -> None:
    reqs = shared_prefix_workload(64, prefix_blocks=4, unique_blocks=4, num_prefixes=4, seed=3)
    rig.store(reqs, lambda r: 8)
    watch = Watch()
    client = rig.new_client(observer=watch)
    rig.server.set_delay(True)
    try:
        drive(client, reqs, "slow-", steps=150)
    finally:
        rig.server.set_delay(False)
    timeouts, hits = watch.outcomes[Outcome.TIMEOUT], watch.outcomes[Outcome.HIT]
    assert timeouts > 0 and client.transport.late_replies > 0, (
        f"the server was not slow enough to test anything: {timeouts} timeouts, "
        f"{client.transport.late_replies} late replies")
    assert hits > 0, watch.outcomes
    assert watch.breaker_changes == [], (f"a slow but live server opened the breaker ({timeouts} timeouts, "
                                         f"{client.transport.late_replies} late replies, {hits} hits)")
    assert watch.outcomes[Outcome.BREAKER_OPEN] == 0


def test_a_hung_server_opens_the_breaker_after_five_failed_sends_not_one_frame(rig: FaultRig) -> None:
    reqs = shared_prefix_workload(64, prefix_blocks=4, unique_blocks=4, num_prefixes=4, seed=4)
    rig.store(reqs, lambda r: 8)
    watch = Watch()
    client = rig.new_client(observer=watch)
    drive(client, reqs, "warm-", steps=3)
    rig.server.pause()
    try:
        drive(client, reqs, "hung-", steps=200, stop=lambda: client.breaker.is_open)
        assert client.breaker.is_open, "a hung server did not open the breaker"
        t0 = time.perf_counter()
        fast = client.lookup("while-open", reqs[0].num_tokens, reqs[0].block_hashes, non_block=True)
        assert fast is not None and fast.outcome is Outcome.BREAKER_OPEN
        assert time.perf_counter() - t0 < TIMEOUT_MS / 1000
    finally:
        rig.server.resume()
    assert watch.breaker_changes[0] is True
    # Five distinct sends failed when it opened: the lookups of one frame that timed out together are one event.
    # (The lookup whose timeout opens it is recorded just after the change: four sends are on record by then.)
    assert watch.failed_sends_at_change[0] >= 4, watch.failed_sends_at_change

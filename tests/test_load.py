"""Right under load and over time, on a healthy store: bursts, held answers, bounds and slow resets.

Each case was measured to be worse than upstream's client before it was fixed, on a store that was never
sick: a burst tripped the breaker by itself, a held answer outlived the prefix it promised, a deep waiting
queue turned into refusals, a slow wipe was reported as failed. Real parts throughout: a Mooncake master,
our lookup server or vLLM's own ``LookupKeyServer`` in a child process, vLLM's real scheduler. The only
fakes are the injected delays of :class:`InjectedDelayBackend` (a healthy store that is slow on purpose
cannot be produced on demand), named as such.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from mooncake_lookout.connector.client import LookupClient
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.events import NullObserver, Outcome, OutcomeCounter
from mooncake_lookout.connector.rigs.scheduler_driver import SchedulerDriver, make_vllm_config
from mooncake_lookout.connector.rigs.soak import CallBudget, FaultRig, collector_held
from mooncake_lookout.connector.rigs.workload import shared_prefix_workload
from mooncake_lookout.connector.server import LookupServer
from mooncake_lookout.connector.transport.pipelined import PipelinedTransport

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

BLOCK = 16
TRANSPORTS = ("pipelined", "upstream")


@pytest.fixture(params=TRANSPORTS)
def slow_rig(request: pytest.FixtureRequest, rpc_base_path: str) -> Iterator[FaultRig]:
    """A healthy store behind an INJECTED 1 ms per store call (vLLM's server: per lookup), default settings."""
    with FaultRig(request.param, config={"lookup_async": True},
                  server_kwargs=dict(delay_ms=1.0, delay_on=True, rpc_base_path=rpc_base_path)) as rig:
        yield rig


def _drive(client: LookupClient, reqs: list[Any], budget: CallBudget, bound_s: float = 30.0) -> dict[str, int]:
    """Ask every request once per 1 ms step (non-blocking) until all are answered, as the scheduler does."""
    answers: dict[str, int] = {}
    end = time.monotonic() + bound_s
    while len(answers) < len(reqs):
        assert time.monotonic() < end, f"{len(reqs) - len(answers)} lookups unanswered after {bound_s} s"
        for r in reqs:
            if r.req_id in answers:
                continue
            with collector_held():
                t0 = time.perf_counter()
                result = client.lookup(r.req_id, r.num_tokens, r.block_hashes, non_block=True)
                budget.record(time.perf_counter() - t0)
            if result is not None:
                answers[r.req_id] = result.hit_length
        client.end_step()
        time.sleep(0.001)  # the model's forward pass
    return answers


def test_a_burst_on_a_healthy_store_is_answered_in_full_and_never_trips_the_breaker(slow_rig: FaultRig) -> None:
    """300 admissions at once (``LLM.generate`` with a few hundred prompts), then 5 fresh requests."""
    reqs = shared_prefix_workload(305, prefix_blocks=4, unique_blocks=4, num_prefixes=4, seed=13)
    slow_rig.store(reqs, lambda r: 8)
    counter = OutcomeCounter()
    # A 1 s deadline (the default is 100 ms): a loaded test machine must not starve the server past it. It
    # changes nothing under test: time queued in the client never counts against the deadline.
    client = slow_rig.new_client(counter, lookup_timeout_ms=1000.0)
    burst, fresh = reqs[:300], reqs[300:]
    for r in burst:
        client.start(r.req_id, r.num_tokens, r.block_hashes, admission=True)
    budget = CallBudget(client.config.timeout_s)
    answers = _drive(client, burst, budget)
    assert sum(1 for r in burst if answers[r.req_id] == 8 * BLOCK) == 300, "true hits of the burst"
    assert not client.breaker.is_open and counter.breaker_changes == []
    assert _drive(client, fresh, budget) == {r.req_id: 8 * BLOCK for r in fresh}, "fresh requests after it"
    assert counter.count(Outcome.TIMEOUT, Outcome.ERROR, Outcome.REJECTED, Outcome.BREAKER_OPEN) == 0
    assert budget.problems() is None, budget.problems()


class DropCounter(NullObserver):
    def __init__(self) -> None:
        self.dropped: list[str] = []

    def answer_dropped(self, rec: Any, reason: str) -> None:
        self.dropped.append(reason)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_held_answer_older_than_its_ttl_is_asked_again(transport: str, prefix_index: Any, lookup_vllm_config: Any,
                                                        make_hashes: Any) -> None:
    """128 hit tokens at admission; the prefix is evicted while the request waits; asked again after
    500 ms it gets the store's current answer, not the one held since admission."""
    from mooncake_lookout.connector.rigs.vllm_lookup_server import UpstreamLookupServer

    extra = lookup_vllm_config.kv_transfer_config.kv_connector_extra_config
    extra.update(lookup_transport=transport, lookup_answer_ttl_ms=200)
    if transport == "pipelined":
        server: Any = LookupServer(prefix_index, "tcp://127.0.0.1:0").start()
        extra["lookup_server_address"] = server.address
        stop = server.close
    else:
        server = UpstreamLookupServer(prefix_index, lookup_vllm_config).start()
        stop = server.stop
    drops = DropCounter()
    client = LookupClient.from_vllm_config(lookup_vllm_config, observer=drops)
    try:
        hashes = make_hashes(9, seed=77)
        prefix_index.store_prefixes([hashes[:8]])
        assert client.lookup("waiting", 9 * BLOCK, hashes).hit_length == 8 * BLOCK
        # Held (no second ask) only where a store epoch proves the master's lease covers the ttl: our server names
        # one; vLLM's own server names none, so its hit is served once and the next call asks the store again.
        assert client.lookup("waiting", 9 * BLOCK, hashes).hit_length == 8 * BLOCK
        assert client.has("waiting") == (transport == "pipelined")
        prefix_index.remove_all(force=True)  # evicted while the request waits for KV space
        time.sleep(0.5)  # the request waits this long: the scenario itself, not a wait for a condition
        assert client.lookup("waiting", 9 * BLOCK, hashes).hit_length == 0
        assert drops.dropped == (["expired"] if transport == "pipelined" else [])
    finally:
        client.close()
        stop()


def test_a_deep_waiting_queue_against_an_idle_store_is_never_refused(prefix_index: Any) -> None:
    """5,000 requests wait in vLLM's real scheduler; lookups in flight stay bounded, none is refused."""
    reqs = 5000
    with LookupServer(prefix_index, "tcp://127.0.0.1:0") as server:
        driver = SchedulerDriver(make_vllm_config({
            "lookup_async": True, "lookup_transport": "pipelined", "lookup_server_address": server.address,
            "lookup_timeout_ms": 5000}), num_blocks=256)
        counter = OutcomeCounter(keep=0)
        client = driver.connector.lookup_client
        client.observers.add(counter)
        try:
            prompts = [[(i * 7919 + j) % 50000 + 1 for j in range(65)] for i in range(reqs)]
            cached = driver.block_hashes(prompts[0])[:3]
            prefix_index.store_prefixes([cached])
            for i, prompt in enumerate(prompts):
                # Even requests: a 3-block prefix the store holds, then a block of their own (a prompt vLLM has
                # computed whole would be answered without a lookup).
                shared = prompt if i % 2 else prompts[0][:3 * BLOCK] + prompt[3 * BLOCK:]
                driver.add(driver.make_request(f"w{i}", shared, max_tokens=8))
            assert client.pending <= client.config.lookup_max_pending
            peak = 0
            for _ in range(120):
                driver.step()
                peak = max(peak, client.pending)
            assert driver.scheduler.get_num_unfinished_requests() > 0, "the queue should still be deep"
        finally:
            driver.close()
    assert counter.count(Outcome.REJECTED) == 0
    assert peak <= client.config.lookup_max_pending
    assert counter.count(Outcome.HIT) > 100 and counter.count(Outcome.TIMEOUT, Outcome.ERROR) == 0


def test_pending_and_held_answers_are_bounded_separately(prefix_index: Any, make_hashes: Any) -> None:
    config = LookupConfig(lookup_transport="pipelined", lookup_max_pending=8, lookup_max_held=16,
                          lookup_timeout_ms=5000)
    with LookupServer(prefix_index, "tcp://127.0.0.1:0") as server:
        drops = DropCounter()
        counter = OutcomeCounter()
        client = LookupClient(config, PipelinedTransport(server.address, timeout_s=5.0), observer=drops)
        client.observers.add(counter)
        try:
            hashes = make_hashes(3, seed=90)
            for i in range(40):  # answered one at a time: none waits, so the pending bound is never reached
                assert client.lookup(f"h{i}", 3 * BLOCK + 1, hashes) is not None
            assert counter.count(Outcome.REJECTED) == 0
            assert client.held == 16 and drops.dropped == ["evicted"] * 24  # the oldest answers went first
            assert not client.has("h0") and client.has("h39")
            for i in range(12):  # 12 started at admission: 8 may wait, the rest are not started yet
                client.start(f"a{i}", 3 * BLOCK + 1, hashes, admission=True)
            assert client.pending == 8 and counter.count(Outcome.REJECTED) == 0
            # Past the bound, a non-blocking ask defers without starting a lookup; a blocking one cannot wait.
            assert client.lookup("over", 3 * BLOCK + 1, hashes, non_block=True) is None
            assert client.pending == 8 and not client.has("over") and counter.deferrals == 1
            assert client.lookup("over", 3 * BLOCK + 1, hashes).hit_length == 0
            assert counter.count(Outcome.REJECTED) == 1
        finally:
            client.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_reset_waits_for_a_slow_wipe_through_vllms_scheduler(transport: str, rpc_base_path: str) -> None:
    """``reset_prefix_cache`` (vLLM's scheduler -> connector -> our client) with a server whose wipe takes 2 s."""
    with FaultRig(transport, server_kwargs=dict(reset_delay_ms=2000, rpc_base_path=rpc_base_path,
                                                rpc_port=4242)) as rig:
        extra = {"lookup_transport": transport, "lookup_rpc_port": 4242, "lookup_async": True}
        if transport == "pipelined":
            extra["lookup_server_address"] = rig.server.address
        driver = SchedulerDriver(make_vllm_config(extra))
        try:
            reqs = shared_prefix_workload(4, prefix_blocks=0, unique_blocks=4, seed=21)
            rig.store(reqs, lambda r: 4)
            t0 = time.perf_counter()
            assert driver.scheduler.reset_connector_cache() is True
            assert time.perf_counter() - t0 >= 2.0  # it really waited for the wipe
            client = driver.connector.lookup_client
            r = reqs[0]
            assert client.lookup(r.req_id, r.num_tokens, r.block_hashes).hit_length == 0  # the store was wiped
            assert not client.breaker.is_open
        finally:
            driver.close()

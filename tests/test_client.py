"""LookupClient over vLLM 0.33's real LookupKeyServer (from the wheel), a real Mooncake master, real ZMQ."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from mooncake_lookout.connector.client import LookupClient
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.events import Outcome, OutcomeCounter
from mooncake_lookout.connector.transport.upstream import UpstreamTransport

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

BLOCK = 16


def make_client(address: str, **config: Any) -> tuple[LookupClient, OutcomeCounter]:
    counter = OutcomeCounter()
    client = LookupClient(LookupConfig(**config), UpstreamTransport(address), observer=counter)
    return client, counter


def poll(client: LookupClient, req_id: str, num_tokens: int, hashes: list[bytes], *, bound_s: float = 5.0) -> Any:
    """Ask non-blocking until an answer comes, as the scheduler does once per step (bounded)."""
    end = time.monotonic() + bound_s
    while time.monotonic() < end:
        result = client.lookup(req_id, num_tokens, hashes, non_block=True)
        if result is not None:
            return result
        time.sleep(0.0005)
    raise AssertionError(f"no answer for {req_id} within {bound_s}s")


@pytest.fixture
def client(upstream_server: str) -> Iterator[tuple[LookupClient, OutcomeCounter]]:
    c, counter = make_client(upstream_server, lookup_timeout_ms=500)
    yield c, counter
    c.close()


def test_hit_partial_hit_and_miss(client, prefix_index, make_hashes) -> None:
    c, counter = client
    full = make_hashes(8, seed=1)
    prefix_index.store_prefixes([full[:5]])
    tokens = 8 * BLOCK + 3
    assert c.lookup("partial", tokens, full).hit_length == 5 * BLOCK
    prefix_index.store_prefixes([full])
    assert c.lookup("full", tokens, full).hit_length == 8 * BLOCK
    assert c.lookup("miss", tokens, make_hashes(8, seed=2)).hit_length == 0
    assert counter.outcomes[Outcome.HIT] == 2 and counter.outcomes[Outcome.MISS] == 1
    assert c.pending == 0


def test_full_prompt_hit_leaves_the_last_token_to_compute(client, prefix_index, make_hashes) -> None:
    c, _ = client
    hashes = make_hashes(4, seed=3)
    prefix_index.store_prefixes([hashes])
    assert c.lookup("exact", 4 * BLOCK, hashes).hit_length < 4 * BLOCK


def test_non_blocking_defers_then_answers_and_holds_no_hit_without_a_proven_lease(client, prefix_index,
                                                                                 make_hashes) -> None:
    c, counter = client
    hashes = make_hashes(6, seed=4)
    prefix_index.store_prefixes([hashes])
    first = c.lookup("r", 6 * BLOCK + 1, hashes, non_block=True)
    assert first is None and c.pending == 1
    assert poll(c, "r", 6 * BLOCK + 1, hashes).hit_length == 6 * BLOCK
    assert counter.deferrals >= 1 and c.pending == 0
    # vLLM's own server names no store epoch: nothing shows the master's lease covers lookup_answer_ttl_ms, so the
    # hit is served once, not held (the old client served it again from hold after the store was wiped). A retry
    # (say the allocation failed) asks the store again.
    prefix_index.remove_all(force=True)
    assert not c.has("r")
    assert poll(c, "r", 6 * BLOCK + 1, hashes).hit_length == 0
    assert counter.outcomes[Outcome.HIT] == 1 and counter.outcomes[Outcome.MISS] == 1


def test_discard_pending_and_finished(client, prefix_index, make_hashes) -> None:
    c, counter = client
    hashes = make_hashes(4, seed=5)
    prefix_index.store_prefixes([hashes])
    assert c.lookup("pending", 4 * BLOCK + 1, hashes, non_block=True) is None
    c.discard("pending")
    assert c.pending == 0 and not c.has("pending")
    assert counter.outcomes[Outcome.DISCARDED] == 1
    assert c.lookup("done", 4 * BLOCK + 1, hashes).hit_length == 4 * BLOCK
    c.discard("done")
    assert not c.has("done")
    c.discard("never-seen")  # harmless
    # The id can be reused after discard and is asked afresh.
    prefix_index.remove_all(force=True)
    assert c.lookup("done", 4 * BLOCK + 1, hashes).hit_length == 0


def test_changed_num_tokens_for_the_same_request_is_requeried(client, prefix_index, make_hashes) -> None:
    c, _ = client
    hashes = make_hashes(8, seed=6)
    prefix_index.store_prefixes([hashes[:8]])
    assert c.lookup("r", 4 * BLOCK + 1, hashes[:4]).hit_length == 4 * BLOCK
    # Same id, longer prompt (e.g. resumed after preemption): a new lookup, not the old answer.
    assert c.lookup("r", 8 * BLOCK + 1, hashes).hit_length == 8 * BLOCK


def test_reset_while_lookups_are_in_flight_serves_nothing_stale(client, prefix_index, make_hashes) -> None:
    c, counter = client
    lists = [make_hashes(4, seed=100 + i) for i in range(32)]
    prefix_index.store_prefixes(lists)
    for i, h in enumerate(lists):
        assert c.lookup(f"r{i}", 4 * BLOCK + 1, h, non_block=True) is None
    assert c.reset()  # fenced behind the lookups already sent; wipes the index's namespace
    assert counter.outcomes[Outcome.DISCARDED] == 32 and c.pending == 0
    for i, h in enumerate(lists):
        assert poll(c, f"r{i}", 4 * BLOCK + 1, h).hit_length == 0, "a pre-reset answer was served"


def test_pending_bound_never_waits_past_it(client, upstream_server, prefix_index, make_hashes) -> None:
    """Past the bound nothing new is started: a non-blocking ask defers (asked again next step), a blocking
    ask, which cannot wait, gets a miss at once (rejected)."""
    c, counter = make_client(upstream_server, lookup_max_pending=4)
    try:
        hashes = make_hashes(2, seed=7)
        prefix_index.store_prefixes([hashes])
        for i in range(4):
            c.lookup(f"r{i}", 2 * BLOCK + 1, hashes, non_block=True)
        assert c.lookup("over", 2 * BLOCK + 1, hashes, non_block=True) is None and not c.has("over")
        t0 = time.perf_counter()
        over = c.lookup("over", 2 * BLOCK + 1, hashes)
        assert over is not None and over.hit_length == 0 and time.perf_counter() - t0 < 0.05
        assert counter.outcomes[Outcome.REJECTED] == 1
        assert c.pending <= 4
    finally:
        c.close()


def test_close_while_a_lookup_is_in_flight(upstream_server, make_hashes) -> None:
    c, counter = make_client(upstream_server)
    hashes = make_hashes(4, seed=8)
    assert c.lookup("r", 4 * BLOCK + 1, hashes, non_block=True) is None
    c.close()
    c.close()
    assert c.pending == 0 and counter.outcomes[Outcome.DISCARDED] == 1
    after = c.lookup("late", 4 * BLOCK + 1, hashes, non_block=True)
    assert after is not None and after.hit_length == 0


# -- faults with real processes ----------------------------------------------------------------------------
@pytest.fixture
def private_stack(private_master, lookup_vllm_config) -> Iterator[Any]:
    """A master of its own (free to pause or kill), a store client, an index and vLLM's LookupKeyServer."""
    from mooncake_lookout.connector.rigs.vllm_lookup_server import UpstreamLookupServer
    from mooncake_lookout.connector.server.prefix_index import PrefixIndex
    from mooncake_lookout.connector.server.store import open_writer_store

    store = open_writer_store(private_master.rpc_address, rpc_timeout_ms=3000)
    index = PrefixIndex(store, BLOCK, namespace="fault")
    server = UpstreamLookupServer(index, lookup_vllm_config).start()
    stack = type("Stack", (), {})()
    stack.master, stack.index, stack.server, stack.store, stack.config = (
        private_master, index, server, store, lookup_vllm_config)
    yield stack
    private_master.resume() if private_master.running else None
    server.stop()
    store.close()


def test_stalled_store_answers_a_miss_within_the_deadline_then_recovers(private_stack, make_hashes) -> None:
    hashes = make_hashes(4, seed=9)
    private_stack.index.store_prefixes([hashes])
    c, counter = make_client(private_stack.server.address, lookup_timeout_ms=100, lookup_breaker_failures=100)
    try:
        assert c.lookup("warm", 4 * BLOCK + 1, hashes).hit_length == 4 * BLOCK
        private_stack.master.pause()  # SIGSTOP: batch_is_exist now hangs inside vLLM's server
        t0 = time.perf_counter()
        stalled = c.lookup("stalled", 4 * BLOCK + 1, hashes)
        blocked = time.perf_counter() - t0
        assert stalled.hit_length == 0 and counter.outcomes[Outcome.TIMEOUT] == 1
        assert blocked < 1.0, f"blocked {blocked:.3f}s with a 100 ms deadline"
        private_stack.master.resume()
        # The server finishes the stalled call; the rebuilt socket reaches it again.
        end = time.monotonic() + 10
        while time.monotonic() < end:
            c.discard("again")
            if c.lookup("again", 4 * BLOCK + 1, hashes).hit_length == 4 * BLOCK:
                break
        else:
            raise AssertionError("lookups did not recover after the store came back")
    finally:
        c.close()


def test_a_blocking_call_slower_than_its_bound_defers_and_its_late_answer_is_still_a_hit(private_stack,
                                                                                          make_hashes) -> None:
    """Sync mode at the defaults: a store slower than ``lookup_block_ms`` (the master stopped for real, then let go)
    costs the step at most the block bound, and the request its hit not at all (it failed before ``lookup_block_ms``:
    the blocking call's deadline was the lookup's, and a slow answer was a timeout, a recompute)."""
    hashes = make_hashes(4, seed=19)
    private_stack.index.store_prefixes([hashes])
    c, counter = make_client(private_stack.server.address)  # sync, lookup_timeout_ms and lookup_block_ms auto
    block_s = c.config.block_s
    try:
        assert c.lookup("warm", 4 * BLOCK + 1, hashes).hit_length == 4 * BLOCK
        c.discard("warm")
        private_stack.master.pause()  # SIGSTOP: the store call hangs inside vLLM's server
        t0 = time.perf_counter()
        first = c.lookup("slow", 4 * BLOCK + 1, hashes)
        blocked = time.perf_counter() - t0
        assert first is None, f"a slow answer ended as {first!r} at the block bound"
        assert blocked < block_s + 0.05, f"blocked {blocked * 1e3:.1f} ms against a {block_s * 1e3:g} ms bound"
        time.sleep(3 * block_s)
        private_stack.master.resume()
        end = time.monotonic() + c.config.timeout_s + 2
        while (answer := c.lookup("slow", 4 * BLOCK + 1, hashes)) is None:  # vLLM asks again each step
            assert time.monotonic() < end, "the late answer never came"
            time.sleep(0.002)
        assert answer.hit_length == 4 * BLOCK, answer
        assert counter.outcomes[Outcome.TIMEOUT] == 0 and counter.outcomes[Outcome.HIT] == 2
    finally:
        private_stack.master.resume() if private_stack.master.running else None
        c.close()


def test_server_restarted_with_a_request_in_flight(private_stack, make_hashes) -> None:
    from mooncake_lookout.connector.rigs.vllm_lookup_server import UpstreamLookupServer

    hashes = make_hashes(4, seed=10)
    private_stack.index.store_prefixes([hashes])
    c, counter = make_client(private_stack.server.address, lookup_timeout_ms=200, lookup_breaker_failures=100)
    try:
        private_stack.master.pause()
        assert c.lookup("inflight", 4 * BLOCK + 1, hashes, non_block=True) is None
        private_stack.master.resume()
        assert private_stack.server.stop()
        private_stack.server = UpstreamLookupServer(private_stack.index, private_stack.config).start()
        answer = poll(c, "inflight", 4 * BLOCK + 1, hashes)
        assert answer.hit_length in (0, 4 * BLOCK)
        end = time.monotonic() + 10
        while time.monotonic() < end:
            c.discard("after")
            if c.lookup("after", 4 * BLOCK + 1, hashes).hit_length == 4 * BLOCK:
                break
        else:
            raise AssertionError("client did not reach the restarted server")
    finally:
        c.close()


def test_breaker_opens_after_failures_and_closes_after_a_good_probe(private_stack, make_hashes) -> None:
    hashes = make_hashes(4, seed=11)
    private_stack.index.store_prefixes([hashes])
    c, counter = make_client(private_stack.server.address, lookup_timeout_ms=50, lookup_breaker_failures=3,
                             lookup_breaker_cooldown_s=0.2)
    try:
        private_stack.master.pause()
        # Three lookups SENT and unanswered open it. One that a busy machine kept from being sent within its
        # call's bound is the client's own timeout: it neither counts nor breaks the run (so: ask until open).
        sent_failures = 0
        for i in range(12):  # bounded: each call ends by its 50 ms bound
            c.lookup(f"f{i}", 4 * BLOCK + 1, hashes)
            (rec,) = [r for r in counter.records if r.req_id == f"f{i}"]
            assert rec.outcome is Outcome.TIMEOUT
            sent_failures += rec.t_start is not None
            if c.breaker.is_open:
                break
        assert c.breaker.is_open and sent_failures == 3 and counter.breaker_changes == [True]
        t0 = time.perf_counter()
        fast = c.lookup("fast", 4 * BLOCK + 1, hashes)
        assert fast.hit_length == 0 and counter.outcomes[Outcome.BREAKER_OPEN] == 1
        assert time.perf_counter() - t0 < 0.05
        private_stack.master.resume()
        end = time.monotonic() + 10
        i = 0
        while c.breaker.is_open and time.monotonic() < end:
            c.lookup(f"probe{i}", 4 * BLOCK + 1, hashes)
            i += 1
            time.sleep(0.01)
        assert not c.breaker.is_open and counter.breaker_changes == [True, False]
        c.discard("ok")
        assert c.lookup("ok", 4 * BLOCK + 1, hashes).hit_length == 4 * BLOCK
    finally:
        c.close()


def test_store_errors_are_counted_as_errors_not_misses(private_master, make_hashes) -> None:
    """A dead master makes the store return error codes; our server reports them, the client counts errors."""
    from mooncake_lookout.connector.server import LookupServer
    from mooncake_lookout.connector.server.prefix_index import PrefixIndex
    from mooncake_lookout.connector.server.store import open_store

    store = open_store(private_master.rpc_address, rpc_timeout_ms=500)
    index = PrefixIndex(store, BLOCK, namespace="err")
    with LookupServer(index, "tcp://127.0.0.1:0") as server:
        c, counter = make_client(server.address, lookup_timeout_ms=8000, lookup_breaker_failures=100)
        try:
            hashes = make_hashes(4, seed=12)
            assert c.lookup("ok", 4 * BLOCK + 1, hashes).hit_length == 0
            private_master.kill()
            answer = c.lookup("err", 4 * BLOCK + 1, hashes)
            assert answer.hit_length == 0
            assert counter.outcomes[Outcome.ERROR] + counter.outcomes[Outcome.TIMEOUT] == 1
            assert counter.outcomes[Outcome.ERROR] == 1, "a store error was reported as something else"
            assert counter.outcomes[Outcome.MISS] == 1  # only the first, healthy lookup
        finally:
            c.close()
    store.close()


def test_built_from_a_vllm_config_reaches_vllms_server(upstream_server, lookup_vllm_config, prefix_index,
                                                        make_hashes) -> None:
    """The constructor vLLM's connector uses: config from kv_connector_extra_config, vLLM's own IPC path."""
    lookup_vllm_config.kv_transfer_config.kv_connector_extra_config.update(
        {"lookup_async": True, "lookup_timeout_ms": 250, "lookup_transport": "upstream"})
    c = LookupClient.from_vllm_config(lookup_vllm_config)
    try:
        assert c.config.lookup_async is True and c.config.timeout_s == 0.25
        assert c.transport.address == upstream_server
        hashes = make_hashes(3, seed=13)
        prefix_index.store_prefixes([hashes])
        assert poll(c, "r", 3 * BLOCK + 1, hashes).hit_length == 3 * BLOCK
    finally:
        c.close()


def test_a_lookup_queued_behind_a_timed_out_one_is_answered_not_deferred(tmp_path) -> None:
    """Upstream's one thread times out the lookup in flight, then ends the ones queued behind it. A caller asking
    a queued one after that must get its answer (the client's own timeout), never ``None``: it would be told to
    ask again past the deadline. The thread hands both answers back; the caller applies what was handed back
    before it decides (here: even after the step's take-in, a later call of the same step). Against a real REQ
    socket to a ROUTER that never answers."""
    import zmq

    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    address = f"ipc://{tmp_path}/silent.sock"
    silent.bind(address)
    transport = UpstreamTransport(address)
    client = LookupClient(LookupConfig(lookup_timeout_ms=50, lookup_async=True), transport)
    try:
        hashes = [bytes([1]) * 32] * 2
        assert client.lookup("head", 33, hashes, non_block=True) is None
        assert client.lookup("queued", 33, [bytes([2]) * 32] * 2, non_block=True) is None
        client.end_step()
        assert client.lookup("head", 33, hashes, non_block=True) is None  # the step's take-in: nothing yet
        end = time.monotonic() + 5.0
        while len(transport._answers) < 2:  # the head timed out, the queued one ended behind it
            assert time.monotonic() < end, "the transport's thread never ended the head"
            time.sleep(0.005)
        queued = client.lookup("queued", 33, [bytes([2]) * 32] * 2, non_block=True)  # same step: no new take-in
        assert queued is not None and queued.outcome is Outcome.TIMEOUT and queued.local  # never sent
    finally:
        client.close()
        ctx.destroy(linger=0)


def test_a_lookup_queued_behind_a_stalled_transport_thread_ends_a_deadline_after_it_was_queued(tmp_path) -> None:
    """If upstream's one thread makes no progress (starved by a loaded machine, or wedged), a queued lookup
    must not be deferred for as long as that lasts: a deadline after it was queued with nothing sent since,
    it ends as the client's own timeout. The stall is FAKED (a thread the OS does not schedule cannot be
    produced on demand): the transport's thread is held for 1 s as it takes the head."""
    import threading

    import zmq

    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    address = f"ipc://{tmp_path}/silent.sock"
    silent.bind(address)
    release, held = threading.Event(), threading.Event()

    class HeldTransport(UpstreamTransport):
        def _lookup(self, lk: Any) -> None:
            if lk.req_id == "head":
                held.set()
                release.wait(1.0)
            super()._lookup(lk)

    counter = OutcomeCounter()
    client = LookupClient(LookupConfig(lookup_timeout_ms=50, lookup_async=True), HeldTransport(address),
                          observer=counter)
    try:
        hashes = [bytes([2]) * 32] * 2
        assert client.lookup("head", 33, hashes, non_block=True) is None
        assert held.wait(5.0), "the transport's thread never took the head"
        result, end = None, time.monotonic() + 5.0
        while result is None and time.monotonic() < end:
            result = client.lookup("queued", 33, hashes, non_block=True)
            time.sleep(0.005)  # one scheduler step
        assert result is not None, "the queued lookup was deferred for 5 s"
        (rec,) = [r for r in counter.records if r.req_id == "queued"]
        assert rec.outcome is Outcome.TIMEOUT and rec.t_start is None  # never sent: the client's own timeout
        assert rec.t_consume - rec.t_queued < 0.05 + 0.4, "deferred for as long as the stall lasted"
        assert not release.is_set()  # ...which it had not ended
    finally:
        release.set()
        client.close()
        ctx.destroy(linger=0)


def test_a_blocking_call_asked_again_after_a_wipe_keeps_its_own_bound(tmp_path) -> None:
    """An answer that came before a reply naming a new store epoch (a wipe) is stale: the lookup is asked again.
    A blocking call must still return by lookup_timeout_ms after the call, not restart its bound. The server is
    a FAKE speaking our wire format on a real socket (a wipe landing between two replies cannot be produced on
    demand): it answers the blocking lookup's frame in epoch 1, then the other frame in epoch 2 (the test takes
    both in before the blocking call), and never answers again."""
    import threading

    import zmq

    from mooncake_lookout.connector.job import LookupResult
    from mooncake_lookout.connector.rigs.soak import SLACK_S, collector_held
    from mooncake_lookout.connector.transport.pipelined import PipelinedTransport
    from mooncake_lookout.connector.wire import pipelined as protocol

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    address = f"ipc://{tmp_path}/fake.sock"
    router.bind(address)
    stop = threading.Event()

    def serve() -> None:
        frames: list[tuple[bytes, Any]] = []
        while not stop.is_set() and len(frames) < 2:
            if router.poll(50):
                peer, *payload = router.recv_multipart()
                frames.append((peer, protocol.decode_request(payload)))
        if stop.is_set():
            return
        (peer, older), (_, newer) = frames  # the other lookup's frame, then the one asked again blocking
        router.send_multipart([peer, protocol.encode_reply(newer.frame_id, [protocol.result_of(
            newer.queries[0].lookup_id, LookupResult(4 * BLOCK))], epoch=1)])
        router.send_multipart([peer, protocol.encode_reply(older.frame_id, [protocol.result_of(
            older.queries[0].lookup_id, LookupResult(0))], epoch=2)])

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    config = LookupConfig(lookup_transport="pipelined", lookup_timeout_ms=300, lookup_breaker_failures=1000)
    transport = PipelinedTransport(address, timeout_s=config.timeout_s)
    client = LookupClient(config, transport)
    try:
        hashes = [bytes([3]) * 32] * 5
        assert client.lookup("other", 5 * BLOCK + 1, [bytes([4]) * 32] * 5, non_block=True) is None
        assert client.lookup("blocking", 5 * BLOCK + 1, hashes, non_block=True) is None
        end = time.monotonic() + 5.0
        while transport.in_flight:  # both replies are in: the wipe was heard after the answer
            assert time.monotonic() < end, "the fake server's replies never came"
            transport.collect()
        with collector_held():
            t0 = time.perf_counter()
            result = client.lookup("blocking", 5 * BLOCK + 1, hashes)
            took = time.perf_counter() - t0
        assert result.hit_length == 0  # the stale answer was not served; the re-ask was never answered
        assert took <= config.timeout_s + SLACK_S, f"the call waited {took * 1000:.0f} ms"
    finally:
        stop.set()
        server.join(5.0)
        client.close()
        ctx.destroy(linger=0)

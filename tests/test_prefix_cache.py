"""The lease-bounded prefix cache: long prompts ask the store only for what is new, and nothing wiped is served.

Real parts: a Mooncake master, our lookup server over a prefix index, our client. Keys asked of the store
are counted by a thin wrapper around the real store client (it forwards every call). Faults are real: a
reset by this instance, a reset by another instance sharing the master, a master killed and restarted, a
master whose lease is shorter than the cache's window.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from mooncake_lookout.connector.client import LookupClient
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.events import NullObserver, Outcome
from mooncake_lookout.connector.prefix_cache import STRIDE, PrefixCache
from mooncake_lookout.connector.rigs.workload import multi_turn_workload, unique_hashes
from mooncake_lookout.connector.server import LookupServer
from mooncake_lookout.connector.server.lease import LeaseTooShort, check_lease
from mooncake_lookout.connector.server.prefix_index import PrefixIndex
from mooncake_lookout.connector.server.store import open_writer_store
from mooncake_lookout.connector.transport import make_transport
from mooncake_lookout.connector.transport.pipelined import PipelinedTransport

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

BLOCK = 16


# -- the structure ------------------------------------------------------------------------------------------

def test_known_finds_the_longest_leased_prefix_and_prefixes_live_as_long_as_their_oldest_block() -> None:
    cache = PrefixCache(max_blocks=100)
    hashes = unique_hashes(100, seed=1)
    cache.add(hashes, 0, 40, until=100.0)
    assert cache.known(hashes, 100, now=50.0) == (40, 100.0)  # the run's last block is kept
    assert cache.known(hashes, 40, now=50.0) == (40, 100.0)
    assert cache.known(hashes, 37, now=50.0) == (37, 100.0)  # never past what can count
    assert cache.known(hashes, 100, now=100.0) == (0, 100.0)  # leases over: nothing known
    cache.add(hashes, 40, 90, until=80.0)  # found later, but capped by the prefix before it
    assert cache.known(hashes, 100, now=70.0) == (90, 80.0)
    assert cache.known(hashes, 85, now=70.0) == (85, 80.0)
    assert cache.known(hashes, 100, now=90.0)[0] == 40
    assert cache.known(unique_hashes(10, seed=2), 10, now=0.0) == (0, 0.0)


def test_a_run_keeps_every_strideth_block_and_its_last_stride_and_is_known_to_any_of_its_blocks() -> None:
    cache = PrefixCache(max_blocks=1000)
    hashes = unique_hashes(4096, seed=5)
    cache.add(hashes, 0, 4096, until=10.0)
    assert len(cache) == 4096 // STRIDE  # the 256th kept block is the last: no partial stride
    other = unique_hashes(200, seed=6)
    cache.add(other, 0, 37, until=10.0)  # a run that ends between two kept blocks
    assert len(cache) == 4096 // STRIDE + 37 // STRIDE + 37 % STRIDE  # and the 5 blocks of its last stride
    assert cache.known(other, 37, now=0.0) == (37, 10.0)
    assert cache.known(other[:37] + unique_hashes(20, seed=7), 57, now=0.0) == (37, 10.0)  # it grew past the run
    assert cache.known(other, 36, now=0.0) == (36, 10.0)
    for count in (1, 15, 16, 17, 1000, 4095):
        assert cache.known(hashes, count, now=0.0)[0] == count // STRIDE * STRIDE
    cache.add(other, 37, 50, until=5.0)  # found after the known ones: capped by them
    assert cache.known(other, 200, now=0.0) == (50, 5.0)
    assert cache.known(other, 49, now=0.0) == (49, 5.0)


def test_the_cache_is_bounded_least_recently_used_first() -> None:
    cache = PrefixCache(max_blocks=8)
    a, b = unique_hashes(6 * STRIDE, seed=3), unique_hashes(7 * STRIDE, seed=4)
    cache.add(a, 0, 6 * STRIDE, until=10.0)  # 6 kept blocks
    assert cache.known(a, 2 * STRIDE, now=0.0)[0] == 2 * STRIDE  # read: now a's most recently used
    cache.add(b, 0, 7 * STRIDE, until=10.0)  # 7 more: 5 must go
    assert len(cache) == 8
    assert cache.known(b, 7 * STRIDE, now=0.0)[0] == 7 * STRIDE
    assert cache.known(a, 2 * STRIDE, now=0.0)[0] == 2 * STRIDE  # the one read stayed
    assert cache.known(a, 6 * STRIDE, now=0.0)[0] == 0  # a's others went first (a hole only shortens the answer)


# -- against a real store -----------------------------------------------------------------------------------

class CountingStore:
    """The real store client; counts the keys each ``batch_is_exist`` asks (every call is forwarded)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.keys_asked = 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.keys_asked += len(keys)
        return self.store.batch_is_exist(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


class Clears(NullObserver):
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def cache_cleared(self, reason: str, blocks: int) -> None:
        self.reasons.append(reason)


class Instance:
    """One vLLM instance's lookup path: our server over the shared store, and its scheduler's client."""

    def __init__(self, store: Any, namespace: str, **config: Any) -> None:
        self.store = CountingStore(store)
        self.index = PrefixIndex(self.store, BLOCK, namespace)
        self.server = LookupServer(self.index).start()  # a private IPC socket: its client may reset
        self.config = LookupConfig(lookup_transport="pipelined", lookup_timeout_ms=5000, **config)
        self.clears = Clears()
        self.client = LookupClient(self.config, PipelinedTransport(self.server.address, timeout_s=5.0),
                                   observer=self.clears)
        assert self.client.enable_prefix_cache(BLOCK)

    def ask(self, req: Any, req_id: str | None = None) -> Any:
        """One blocking lookup; the scheduler forgets it once used (allocated)."""
        rid = req_id or req.req_id
        result = self.client.lookup(rid, req.num_tokens, req.block_hashes)
        self.client.discard(rid)
        return result

    def close(self) -> None:
        self.client.close()
        self.server.close()


@pytest.fixture
def instance(store: Any, prefix_index: PrefixIndex) -> Iterator[Instance]:
    inst = Instance(store, prefix_index.namespace)
    yield inst
    inst.close()


def test_later_turns_ask_the_store_only_for_their_new_blocks(instance: Instance, prefix_index: PrefixIndex) -> None:
    (conversation,) = multi_turn_workload(1, context_blocks=512, turns=6, blocks_per_turn=16, seed=7)
    prefix_index.store_prefixes([conversation[0].block_hashes])  # the context (a document) was seen before
    per_turn = []
    for turn, req in enumerate(conversation):
        before = instance.store.keys_asked
        # Found: what was saved before this turn (the context, then the previous turn's prompt).
        assert instance.ask(req).hit_length == len(conversation[max(0, turn - 1)].block_hashes) * BLOCK
        per_turn.append(instance.store.keys_asked - before)
        prefix_index.store_prefixes([req.block_hashes])  # the turn's prefill is saved after it runs
    assert per_turn[0] >= 512
    # From the second turn on: the blocks the cache did not know yet and the server's marker, not 500+ keys.
    assert all(n <= 2 * 16 + 1 for n in per_turn[1:]), per_turn
    assert all(n / len(req.block_hashes) <= 0.1 for n, req in zip(per_turn[1:], conversation[1:])), per_turn


@pytest.mark.parametrize("same_epoch", [True, False], ids=["found-in-this-epoch", "found-in-an-older-epoch"])
def test_known_blocks_count_only_in_the_epoch_they_were_found_in(instance: Instance, same_epoch: bool) -> None:
    """A lookup built before its client heard of a wipe (an older epoch) may still claim known blocks; the
    server must ask the store for them. Raw jobs on the real transport: the blocks are NOT in the store, so a
    hit can only come from trusting the claim."""
    from mooncake_lookout.connector.lookup import Lookup

    hashes = unique_hashes(8, seed=950)
    transport = PipelinedTransport(instance.server.address, timeout_s=5.0)
    try:
        job = Lookup("claim", 8 * BLOCK + 1, hashes, "pipelined", 0, time.perf_counter(), 5.0)
        job.known = 8
        job.epoch = instance.server.epoch if same_epoch else instance.server.epoch ^ 1
        assert instance.server.epoch != 0
        transport.send([job])
        transport.collect(5.0, until=job)
        assert job.outcome is not None and job.outcome in (Outcome.HIT, Outcome.MISS)
        assert job.hit_length == (8 * BLOCK if same_epoch else 0)
    finally:
        transport.close()


def test_a_reset_by_this_instance_serves_nothing_from_the_cache(instance: Instance, prefix_index: PrefixIndex,
                                                              make_hashes: Any) -> None:
    hashes = make_hashes(20, seed=8)
    prefix_index.store_prefixes([hashes])
    req = type("R", (), {"req_id": "r", "num_tokens": 20 * BLOCK + 1, "block_hashes": tuple(hashes)})
    assert instance.ask(req).hit_length == 20 * BLOCK
    assert instance.client.reset()
    assert instance.clears.reasons == ["reset"] and len(instance.client.cache or ()) == 0
    assert instance.ask(req).hit_length == 0


def test_a_reset_by_another_instance_sharing_the_master_serves_nothing_from_the_cache(
        store: Any, prefix_index: PrefixIndex, make_hashes: Any) -> None:
    a = Instance(store, prefix_index.namespace)
    b = Instance(store, prefix_index.namespace)
    try:
        hashes = make_hashes(64, seed=9)
        prefix_index.store_prefixes([hashes])
        req = type("R", (), {"req_id": "r", "num_tokens": 64 * BLOCK + 1, "block_hashes": tuple(hashes)})
        for _ in range(3):  # a's cache knows the prefix; later lookups ask only the marker
            assert a.ask(req).hit_length == 64 * BLOCK
        before = a.store.keys_asked
        assert a.ask(req).hit_length == 64 * BLOCK and a.store.keys_asked - before == 1
        assert b.client.reset()  # the other instance wipes the shared store (its namespace: a's keys too)
        assert a.ask(req).hit_length == 0  # at once: the server saw its marker gone in the same store call
        assert a.clears.reasons == ["epoch"]
        prefix_index.store_prefixes([hashes])
        assert a.ask(req).hit_length == 64 * BLOCK  # and it learns again
    finally:
        a.close()
        b.close()


def test_an_arrival_lookup_split_by_a_wipe_heard_on_the_scheduler_thread_serves_nothing_wiped(
        store: Any, prefix_index: PrefixIndex, make_hashes: Any) -> None:
    """Issue 49, item 1, forced: vLLM's input thread plans an arrival lookup (reads the prefix cache), and between
    that read and its epoch stamp the scheduler's thread (a real thread, run to its end inside a hook on the
    cache read) takes in a reply naming the new epoch after another instance's wipe. The old client read the
    epoch after the cache: it sent the old epoch's 64 blocks stamped with the new epoch, the server trusted
    them and a 64-block hit was served for blocks the store no longer held."""
    a = Instance(store, prefix_index.namespace, lookup_async=True)  # async: lookups sent at arrival
    a.client.close()
    a.client = LookupClient(a.config, make_transport(a.config, a.server.address), observer=a.clears)
    b = Instance(store, prefix_index.namespace)
    try:
        assert a.client.enable_prefix_cache(BLOCK) and a.client.arrivals is not None
        hashes = make_hashes(68, seed=12)
        prefix_index.store_prefixes([hashes[:64]])
        first = a.client.lookup("turn1", 64 * BLOCK + 1, hashes[:64])  # blocking: found, cached in this epoch
        assert first is not None and first.hit_length == 64 * BLOCK
        a.client.discard("turn1")
        old_epoch, cache = a.client.store_view.epoch, a.client.cache
        assert old_epoch and cache is not None and cache.known(hashes, 64, time.perf_counter())[0] == 64
        assert b.client.reset()  # another instance wipes the shared store: none of the 68 blocks is held

        heard: list[int | None] = []
        read = cache.known

        def scheduler_thread() -> None:  # another request's lookup: its reply names the store's new epoch
            a.client.lookup("other", 4 * BLOCK + 1, make_hashes(4, seed=13))
            heard.append(a.client.store_view.epoch)

        def hooked(*args: Any, **kwargs: Any) -> Any:
            out = read(*args, **kwargs)  # the cache as the input thread read it
            if threading.current_thread().name == "input" and not heard:
                other = threading.Thread(target=scheduler_thread, name="scheduler")
                other.start()
                other.join(10.0)
            return out

        cache.known = hooked  # type: ignore[method-assign]
        sent: list[bool] = []
        thread = threading.Thread(target=lambda: sent.append(a.client.arrivals.send(  # type: ignore[union-attr]
            "turn2", 68 * BLOCK + 1, hashes)), name="input")
        thread.start()
        thread.join(10.0)
        assert sent == [True] and heard and heard[0] not in (None, old_epoch), heard  # the split happened
        end = time.monotonic() + 10
        while (result := a.client.lookup("turn2", 68 * BLOCK + 1, hashes, True)) is None:
            assert time.monotonic() < end, "no answer"
            a.client.end_step()
            time.sleep(0.001)
        assert result.hit_length == 0, f"served a {result.hit_length // BLOCK}-block hit; the store holds none"
    finally:
        a.close()
        b.close()


def test_a_master_restart_clears_the_cache_and_serves_nothing_lost(private_master: Any, make_hashes: Any) -> None:
    writer = open_writer_store(private_master.rpc_address, rpc_timeout_ms=2000)
    server_store = open_writer_store(private_master.rpc_address, rpc_timeout_ms=2000)  # it keeps a marker key
    inst = Instance(server_store, "restart")
    try:
        filler = PrefixIndex(writer, BLOCK, "restart")
        hashes = make_hashes(32, seed=10)
        filler.store_prefixes([hashes])
        req = type("R", (), {"req_id": "r", "num_tokens": 32 * BLOCK + 1, "block_hashes": tuple(hashes)})
        assert inst.ask(req).hit_length == 32 * BLOCK
        assert len(inst.client.cache or ()) == 32 // STRIDE  # the 32-block run's kept blocks
        private_master.kill()
        private_master.start()  # every key is gone, the marker too
        answers = []
        end = time.monotonic() + 30
        while time.monotonic() < end:  # the store client reconnects in a moment: errors until then
            result = inst.ask(req, f"r{len(answers)}")
            answers.append(result.hit_length)
            if inst.clears.reasons and answers[-1] == 0 and len(answers) > 1:
                break
        assert all(hit == 0 for hit in answers), f"a lost block was served from the cache: {answers}"
        assert inst.clears.reasons and inst.clears.reasons[0] in ("epoch", "failure")  # within one failed lookup
    finally:
        inst.close()
        writer.close()
        server_store.close()


def test_a_lease_shorter_than_the_caches_window_is_refused_at_start(private_master: Any) -> None:
    store = open_writer_store(private_master.rpc_address)  # the fixture's master leases keys for 500 ms
    try:
        check_lease(store, "probe/", 0.2)  # a 200 ms window and its load margin (240 ms) fit in the lease
        with pytest.raises(LeaseTooShort, match="lookup_answer_ttl_ms"):
            check_lease(store, "probe/", 0.8)
    finally:
        store.close()


@pytest.mark.parametrize("ttl_ms,trusted", [(900, False), (200, True)], ids=["lease-too-short", "lease-covers"])
def test_the_worker_keeps_no_epoch_until_the_lease_covers_the_window(private_master: Any, tmp_path: Any,
                                                                     caplog: Any, ttl_ms: int, trusted: bool) -> None:
    """vLLM's worker (rank 0) starts our server at once; it keeps no epoch (clients cache nothing) until the
    master's lease is known to cover lookup_answer_ttl_ms, and refuses the cache for good, loudly, if not.
    The fixture's master leases keys for 500 ms."""
    from mooncake_lookout.connector.rigs.scheduler_driver import make_kv_cache_config, make_vllm_config
    from mooncake_lookout.connector.server.vllm_store_worker import lookup_worker, saved_keys
    from mooncake_lookout.connector.server.worker_backend import serve_pipelined

    store = open_writer_store(private_master.rpc_address)
    extra = {"lookup_transport": "pipelined", "lookup_answer_ttl_ms": ttl_ms, "lookup_timeout_ms": 5000,
             "lookup_server_address": f"ipc://{tmp_path}/lookup.sock"}
    vllm_config = make_vllm_config(extra)
    config = LookupConfig.from_extra_config(extra)
    worker = lookup_worker(vllm_config, make_kv_cache_config(4096), store)
    worker.lookup_server = object()  # the rank that runs upstream's server runs ours too
    hashes = unique_hashes(8, seed=900)
    keys = saved_keys(worker, 8 * BLOCK, hashes)
    assert store.upsert_batch(keys, [b"\x01"] * len(keys)) == 0
    server = serve_pipelined(vllm_config, config, worker)
    client = LookupClient(config, PipelinedTransport(server.address, timeout_s=5.0))
    try:
        assert client.enable_prefix_cache(BLOCK)
        assert server.epoch == 0  # no epoch until the probe has waited out the window
        assert client.lookup("before", 8 * BLOCK + 1, hashes).hit_length == 8 * BLOCK
        assert len(client.cache) == 0  # nothing remembered without an epoch
        server.lease_probe.join(10.0)
        assert server.lease_probe.passed is trusted
        client.discard("before")
        assert client.lookup("after", 8 * BLOCK + 1, hashes).hit_length == 8 * BLOCK
        assert (server.epoch != 0) is trusted
        assert (len(client.cache) == 8) is trusted  # remembered only under an epoch
        refused = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert any("--default_kv_lease_ttl" in m and "stays off" in m for m in refused) is not trusted, refused
    finally:
        client.close()
        server.close()
        store.remove_all(True)
        store.close()


def test_outcomes_and_cache_figures_reach_observers(instance: Instance, prefix_index: PrefixIndex) -> None:
    (conversation,) = multi_turn_workload(1, context_blocks=64, turns=3, blocks_per_turn=8, seed=11)

    class Figures(NullObserver):
        def __init__(self) -> None:
            self.known: list[tuple[int, int]] = []

        def consumed(self, rec: Any) -> None:
            assert rec.outcome in (Outcome.HIT, Outcome.MISS)
            self.known.append((rec.known_blocks, rec.countable_blocks))

    figures = Figures()
    instance.client.observers.add(figures)
    for req in conversation:
        instance.ask(req)
        prefix_index.store_prefixes([req.block_hashes])
    # The first lookup knows nothing yet (turn 0 found nothing), the second finds turn 0's prompt (saved after
    # it ran), so the third knows those 64 blocks and asks only for the rest.
    assert figures.known == [(0, 64), (0, 72), (64, 80)]

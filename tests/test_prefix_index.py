"""PrefixIndex against a real Mooncake master: hits, misses, the full-prompt cap, errors, coalescing."""

from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake_lookout.connector.job import MISS, LookupResult
from mooncake_lookout.connector.rigs.master import EmbeddedMaster
from mooncake_lookout.connector.server.prefix_index import PrefixIndex, StoreError
from mooncake_lookout.connector.server.store import open_store

BS = 16


def test_full_hit_partial_hit_and_miss(prefix_index: PrefixIndex, make_workload) -> None:
    warm, cold = make_workload(2, prefix_blocks=0, unique_blocks=6, extra_tokens=3)
    assert prefix_index.store_prefixes([warm.block_hashes]) == 6
    assert prefix_index.lookup(warm.num_tokens, warm.block_hashes) == LookupResult(6 * BS)
    assert prefix_index.lookup(cold.num_tokens, cold.block_hashes) == MISS
    # A request sharing only the first 2 blocks.
    partial = warm.block_hashes[:2] + cold.block_hashes[2:]
    assert prefix_index.lookup(cold.num_tokens, partial) == LookupResult(2 * BS)


def test_only_the_consecutive_prefix_counts(prefix_index: PrefixIndex, make_hashes) -> None:
    hashes = make_hashes(5)
    prefix_index.store_prefixes([[hashes[0], hashes[1], hashes[3], hashes[4]]])
    assert prefix_index.lookup(5 * BS + 1, hashes).hit_length == 2 * BS


def test_full_prompt_hit_leaves_one_token_to_compute(prefix_index: PrefixIndex, make_hashes) -> None:
    hashes = make_hashes(4)
    prefix_index.store_prefixes([hashes])
    # The prompt ends exactly on a block boundary: a full hit would leave nothing to compute (#55113).
    assert prefix_index.lookup(4 * BS, hashes).hit_length == 3 * BS
    assert prefix_index.lookup(4 * BS + 1, hashes).hit_length == 4 * BS
    # Hashes beyond the prompt never count; tiny prompts never hit.
    assert prefix_index.lookup(2 * BS + 5, hashes).hit_length == 2 * BS
    assert prefix_index.lookup(BS, hashes[:1]) == MISS
    assert prefix_index.lookup(0, hashes) == MISS
    assert prefix_index.lookup(100, []) == MISS


def test_no_store_call_when_no_key_can_count(prefix_index: PrefixIndex, make_hashes) -> None:
    before = prefix_index.store_calls
    prefix_index.lookup(BS, make_hashes(1))
    prefix_index.lookup(10 * BS, [])
    assert prefix_index.store_calls == before


def test_namespaces_do_not_see_each_other(prefix_index: PrefixIndex, store, make_hashes) -> None:
    other = PrefixIndex(store, BS, namespace=prefix_index.namespace + "-other")
    hashes = make_hashes(3)
    try:
        prefix_index.store_prefixes([hashes])
        assert other.lookup(3 * BS + 1, hashes) == MISS
        other.store_prefixes([hashes])
        assert prefix_index.remove_all() == 3
        assert prefix_index.lookup(3 * BS + 1, hashes) == MISS
        assert other.lookup(3 * BS + 1, hashes).hit_length == 3 * BS
        assert other.reset() is True
        assert other.lookup(3 * BS + 1, hashes) == MISS
    finally:
        other.remove_all()


def test_lookup_many_is_one_store_call(prefix_index: PrefixIndex, make_workload) -> None:
    requests = make_workload(32, prefix_blocks=4, unique_blocks=2, num_prefixes=2)
    prefix_index.store_prefixes([r.block_hashes for r in requests[:8]])
    asked = [(r.num_tokens, r.block_hashes) for r in requests] + [(BS, requests[0].block_hashes[:1])]
    before = prefix_index.store_calls
    results = prefix_index.lookup_many(asked)
    assert prefix_index.store_calls == before + 1
    # Same answers as one lookup at a time.
    assert results == [prefix_index.lookup(n, h) for n, h in asked]
    assert [r.hit_length for r in results[:8]] == [6 * BS] * 8
    assert [r.hit_length for r in results[8:32]] == [4 * BS] * 24
    assert results[32] == MISS
    assert prefix_index.lookup_many([]) == []


def test_writing_needs_a_writer_client(mooncake_master: EmbeddedMaster, make_hashes) -> None:
    reader = open_store(mooncake_master.rpc_address)
    try:
        with pytest.raises(StoreError, match="-600.*writer") as info:
            PrefixIndex(reader, BS, namespace="reader-only").store_prefixes([make_hashes(2)])
        assert info.value.code == -600
    finally:
        reader.close()


def test_a_stalled_master_is_an_error_not_a_miss(private_master: EmbeddedMaster, make_hashes) -> None:
    # A real fault: the master is frozen (SIGSTOP); the client's RPC times out after 300 ms.
    client = open_store(private_master.rpc_address, rpc_timeout_ms=300)
    index = PrefixIndex(client, BS, namespace="stall")
    hashes = make_hashes(4)
    try:
        assert index.lookup(4 * BS + 1, hashes) == MISS
        private_master.pause()
        with pytest.raises(StoreError) as info:
            index.lookup(4 * BS + 1, hashes)
        assert info.value.code is not None and info.value.code < 0
        results = index.lookup_many([(4 * BS + 1, hashes), (BS, hashes[:1]), (3 * BS + 1, hashes)])
        assert isinstance(results[0], StoreError) and isinstance(results[2], StoreError)
        assert results[1] == MISS  # needed no key, so the store was not asked
        private_master.resume()
        assert index.lookup(4 * BS + 1, hashes) == MISS
    finally:
        private_master.resume()
        client.close()


def test_concurrent_lookups_get_their_own_answers(prefix_index: PrefixIndex, make_workload) -> None:
    requests = make_workload(16, prefix_blocks=2, unique_blocks=3, num_prefixes=4)
    prefix_index.store_prefixes([r.block_hashes for r in requests[:4]])  # one request of each prefix
    expected = {r.req_id: (5 if i < 4 else 2) * BS for i, r in enumerate(requests)}
    got: dict[str, int] = {}
    errors: list[BaseException] = []

    def worker(chunk) -> None:
        try:
            for _ in range(5):
                for r in chunk:
                    got[r.req_id] = prefix_index.lookup(r.num_tokens, r.block_hashes).hit_length
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(requests[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors and not any(t.is_alive() for t in threads)
    assert got == expected
    assert prefix_index.store_calls == 16 * 5


def test_bad_arguments(store) -> None:
    with pytest.raises(ValueError, match="namespace"):
        PrefixIndex(store, BS, namespace="has space")
    with pytest.raises(ValueError, match="namespace"):
        PrefixIndex(store, BS, namespace="a.*")
    with pytest.raises(ValueError, match="block_size"):
        PrefixIndex(store, 0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(present=st.lists(st.booleans(), min_size=0, max_size=12), extra=st.integers(0, BS - 1))
def test_hit_is_the_first_absent_block_capped(prefix_index: PrefixIndex, make_hashes, present, extra) -> None:
    hashes = make_hashes(len(present), seed=len(present))
    prefix_index.remove_all()
    prefix_index.store_prefixes([[h for h, p in zip(hashes, present) if p]])
    num_tokens = len(present) * BS + extra
    run = next((i for i, p in enumerate(present) if not p), len(present))
    want = run * BS
    if want >= num_tokens:
        want = ((num_tokens - 1) // BS) * BS
    assert prefix_index.lookup(num_tokens, hashes).hit_length == max(want, 0)

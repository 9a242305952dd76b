"""The deterministic shared-prefix workload: same input, same bytes; sharing exactly where asked."""

from __future__ import annotations

import hashlib

import pytest

from mooncake_lookout.connector.rigs.workload import (
    HASH_BYTES,
    ROOT_HASH,
    chain_hashes,
    shared_prefix_workload,
    unique_hashes,
)


def test_same_arguments_same_bytes_other_seed_other_bytes() -> None:
    a = shared_prefix_workload(6, num_prefixes=2, seed=3)
    assert a == shared_prefix_workload(6, num_prefixes=2, seed=3)
    b = shared_prefix_workload(6, num_prefixes=2, seed=4)
    assert not set(a[0].block_hashes) & set(b[0].block_hashes)


def test_shapes_and_sharing() -> None:
    reqs = shared_prefix_workload(5, block_size=8, prefix_blocks=3, unique_blocks=2, num_prefixes=2,
                                  extra_tokens=5)
    assert len({r.req_id for r in reqs}) == 5
    for r in reqs:
        assert r.num_tokens == 5 * 8 + 5 and len(r.block_hashes) == 5
        assert all(len(h) == HASH_BYTES for h in r.block_hashes)
    assert reqs[0].block_hashes[:3] == reqs[2].block_hashes[:3] == reqs[4].block_hashes[:3]
    assert reqs[0].block_hashes[:3] != reqs[1].block_hashes[:3]
    own = [r.block_hashes[3:] for r in reqs]
    assert len({h for tail in own for h in tail}) == 10  # tails are never shared


def test_hashes_chain_like_vllm() -> None:
    first, second = chain_hashes([b"x", b"y"])
    assert first == hashlib.sha256(ROOT_HASH + b"x").digest()
    assert second == hashlib.sha256(first + b"y").digest()
    # The same content under another parent is another block.
    assert chain_hashes([b"y"], parent=ROOT_HASH)[0] != second
    assert len(unique_hashes(7)) == 7 and unique_hashes(7) != unique_hashes(7, seed=1)


def test_bad_sizes() -> None:
    with pytest.raises(ValueError):
        shared_prefix_workload(1, block_size=0)
    with pytest.raises(ValueError):
        shared_prefix_workload(-1)

"""The lookup server process of the rigs: the store keys it sends are counted, and our server keeps the store's
epoch only when asked to (``keep_epoch``), so a client's prefix cache is on there as it is inside vLLM.

Real parts: a Mooncake master with Mooncake's default 10 s key lease (twice the default
``lookup_answer_ttl_ms``, the rule the cache relies on), the server in a child process, our client over the
pipelined transport, vLLM's own ``MooncakeStoreWorker`` key code for the layout case.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from mooncake_lookout.connector.bench.conversations import LayoutSaver
from mooncake_lookout.connector.bench.rig import MOONCAKE_LEASE_MS
from mooncake_lookout.connector.client import LookupClient
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.rigs.master import EmbeddedMaster
from mooncake_lookout.connector.rigs.server_process import ServerProcess, parse_counts_line
from mooncake_lookout.connector.rigs.vllm_layout import Layout, layout_worker
from mooncake_lookout.connector.rigs.workload import multi_turn_workload
from mooncake_lookout.connector.server.prefix_index import PrefixIndex
from mooncake_lookout.connector.server.store import open_writer_store
from mooncake_lookout.connector.transport.pipelined import PipelinedTransport

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

BLOCK = 16
CONTEXT = 64


@pytest.fixture(scope="module")
def leased_master() -> Iterator[EmbeddedMaster]:
    with EmbeddedMaster(kv_lease_ttl_ms=MOONCAKE_LEASE_MS) as master:
        yield master


@pytest.fixture(scope="module")
def writer(leased_master: EmbeddedMaster) -> Iterator[Any]:
    """A writer client: it lends the memory the values (and the server's marker key) live in."""
    client = open_writer_store(leased_master.rpc_address, rpc_timeout_ms=5000)
    yield client
    client.close()


@pytest.fixture
def conversation() -> list[Any]:
    (turns,) = multi_turn_workload(1, context_blocks=CONTEXT, turns=3, blocks_per_turn=16,
                                   seed=uuid.uuid4().int % 10_000)
    return turns


def client_of(servers: ServerProcess) -> LookupClient:
    config = LookupConfig(lookup_transport="pipelined", lookup_timeout_ms=5000)
    assert MOONCAKE_LEASE_MS >= 2 * config.lookup_answer_ttl_ms
    client = LookupClient(config, PipelinedTransport(servers.address, timeout_s=5.0))
    assert client.enable_prefix_cache(BLOCK)
    return client


def keys_per_turn(servers: ServerProcess, client: LookupClient, turns: list[Any]) -> list[tuple[int, int]]:
    """Each turn's blocking lookup: (store keys the server sent for it, hit blocks)."""
    out = []
    for req in turns:
        before = servers.store_counts()
        hit = client.lookup(req.req_id, req.num_tokens, req.block_hashes).hit_length
        client.discard(req.req_id)
        out.append((servers.store_counts()[1] - before[1], hit // BLOCK))
    return out


@pytest.fixture
def index(writer: Any) -> PrefixIndex:
    return PrefixIndex(writer, BLOCK, namespace=f"counts-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def index_servers(leased_master: EmbeddedMaster, index: PrefixIndex, request: Any) -> Iterator[ServerProcess]:
    with ServerProcess("pipelined", leased_master.rpc_address, namespace=index.namespace, standby=False,
                       keep_epoch=request.param) as servers:
        yield servers


@pytest.mark.parametrize("index_servers", [False, True], indirect=True, ids=["lookup-only", "keep-epoch"])
def test_the_prefix_cache_is_on_only_where_the_server_keeps_the_epoch(index_servers: ServerProcess,
                                                                       index: PrefixIndex,
                                                                       conversation: list[Any]) -> None:
    index.store_prefixes([conversation[0].block_hashes])  # the context is in the store
    client = client_of(index_servers)
    try:
        counted = keys_per_turn(index_servers, client, conversation)
        epoch = client.store_view.epoch
    finally:
        client.close()
    assert [hit for _, hit in counted] == [CONTEXT] * 3
    if index_servers.keep_epoch:  # the context once (and the marker), then only what the cache did not know
        assert epoch and [keys for keys, _ in counted] == [CONTEXT + 1, 16 + 1, 32 + 1]
    else:  # a lookup-only store client cannot put the marker: epoch 0, nothing cached, every block asked
        assert not epoch and [keys for keys, _ in counted] == [CONTEXT, CONTEXT + 16, CONTEXT + 32]


def test_in_vllms_key_layout_the_worker_path_asks_only_the_new_blocks(leased_master: EmbeddedMaster, writer: Any,
                                                                     conversation: list[Any]) -> None:
    layout = Layout(f"counts-{uuid.uuid4().hex[:8]}", block_size=BLOCK)
    LayoutSaver(layout_worker(writer, layout), writer).save(conversation[0].block_hashes, 0, CONTEXT)
    with ServerProcess("pipelined", leased_master.rpc_address, namespace="unused", standby=False,
                       layout=layout, keep_epoch=True) as servers:
        client = client_of(servers)
        try:
            counted = keys_per_turn(servers, client, conversation)
        finally:
            client.close()
    # Upstream's own lookup runs on the prompt after the known prefix: its new blocks, and the marker.
    assert counted == [(CONTEXT + 1, CONTEXT), (16 + 1, CONTEXT), (32 + 1, CONTEXT)]


def test_a_counts_line_reads_back() -> None:
    assert parse_counts_line("store calls=3 keys=164\n") == (3, 164)

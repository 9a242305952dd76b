"""The worker side of ``lookup_transport: pipelined``: our server over what vLLM's worker offers.

On a GPU worker, ``LookoutMooncakeStoreConnector`` serves our ``LookupServer`` over upstream's
``MooncakeStoreWorker.lookup`` (:class:`WorkerBackend`). No GPU here, so the worker is the same stand-in
vLLM's real ``LookupKeyServer`` is tested with: ``PrefixIndexStoreWorker`` (``lookup``, ``kv_send_thread``,
``store.remove_all``) over a real Mooncake master.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from mooncake_lookout.connector.client import LookupClient
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.rigs.vllm_lookup_server import PrefixIndexStoreWorker
from mooncake_lookout.connector.server import LookupServer
from mooncake_lookout.connector.server.worker_backend import WorkerBackend, serve_pipelined
from mooncake_lookout.connector.transport.pipelined import PipelinedTransport

BLOCK = 16


def _poll(client: LookupClient, req_id: str, num_tokens: int, hashes: list[bytes]) -> int:
    end = time.monotonic() + 5
    while time.monotonic() < end:
        result = client.lookup(req_id, num_tokens, hashes, non_block=True)
        if result is not None:
            return result.hit_length
        time.sleep(0.001)
    raise AssertionError("no answer within 5 s")


def test_our_server_answers_and_resets_through_the_workers_own_lookup(prefix_index, make_hashes) -> None:
    worker = PrefixIndexStoreWorker(prefix_index)
    hashes = make_hashes(6, seed=21)
    prefix_index.store_prefixes([hashes[:4]])
    with LookupServer(WorkerBackend(worker), "tcp://127.0.0.1:0") as server:
        config = LookupConfig(lookup_async=True, lookup_transport="pipelined", lookup_timeout_ms=2000)
        client = LookupClient(config, PipelinedTransport(server.address, timeout_s=config.timeout_s))
        try:
            assert _poll(client, "a", 6 * BLOCK + 1, hashes) == 4 * BLOCK
            assert worker.lookups == 1  # answered by the worker's lookup, not around it
            assert client.reset()
            assert _poll(client, "a", 6 * BLOCK + 1, hashes) == 0  # the wipe reached the store
        finally:
            client.close()


def test_pipelined_server_starts_only_on_the_rank_that_serves_lookups(prefix_index, lookup_vllm_config,
                                                                      tmp_path) -> None:
    config = LookupConfig(lookup_transport="pipelined", lookup_server_address=f"ipc://{tmp_path}/lookup.sock")
    worker = PrefixIndexStoreWorker(prefix_index)
    # Upstream starts its LookupKeyServer on one rank only (worker.lookup_server is None elsewhere).
    other_rank = SimpleNamespace(lookup_server=None, lookup=worker.lookup)
    assert serve_pipelined(lookup_vllm_config, config, other_rank) is None
    worker.lookup_server = object()  # this rank runs upstream's server, so it runs ours too
    server = serve_pipelined(lookup_vllm_config, config, worker)
    try:
        assert server is not None and server.address == config.lookup_server_address
    finally:
        server.close()

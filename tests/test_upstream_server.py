"""vLLM 0.33's real LookupKeyServer over a PrefixIndex, spoken to with vLLM's own wire format."""

from __future__ import annotations

import os
import stat
import time

import pytest
import zmq

from mooncake_lookout.connector.rigs.master import EmbeddedMaster
from mooncake_lookout.connector.server.prefix_index import PrefixIndex
from mooncake_lookout.connector.server.store import open_store

vllm_worker = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker")
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.protocol import (  # noqa: E402
    decode_lookup_response,
)

from mooncake_lookout.connector.rigs.vllm_lookup_server import UpstreamLookupServer  # noqa: E402

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

BS = 16
TIMEOUT_MS = 5000


class Req:
    """A plain REQ socket speaking the upstream lookup channel's frames (docs/protocol.md), with a deadline."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def lookup(self, num_tokens: int, hashes: list[bytes], timeout_ms: int = TIMEOUT_MS) -> bytes | None:
        hash_len = len(hashes[0]) if hashes else 0
        self.sock.send_multipart([b"lookup", num_tokens.to_bytes(4, "big"), hash_len.to_bytes(2, "big"),
                                  b"".join(hashes)])
        return self.sock.recv() if self.sock.poll(timeout_ms) else None

    def reset(self) -> bytes | None:
        self.sock.send(b"reset")
        return self.sock.recv() if self.sock.poll(TIMEOUT_MS) else None

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def req(upstream_server: str):
    client = Req(upstream_server)
    yield client
    client.close()


def test_answers_in_vllms_wire_format(req: Req, prefix_index: PrefixIndex, make_workload) -> None:
    warm, cold = make_workload(2, prefix_blocks=3, unique_blocks=2, extra_tokens=7)
    prefix_index.store_prefixes([warm.block_hashes])
    reply = req.lookup(warm.num_tokens, list(warm.block_hashes))
    assert reply == (5 * BS).to_bytes(4, "big")  # hit_length u32 BE, no tail boundaries
    assert decode_lookup_response(reply).hit_length == 5 * BS
    # The other request shares the 3-block prefix only.
    assert int.from_bytes(req.lookup(cold.num_tokens, list(cold.block_hashes)), "big") == 3 * BS
    assert req.lookup(BS * 2 + 1, []) == (0).to_bytes(4, "big")


def test_full_prompt_hit_is_capped_through_the_server(req: Req, prefix_index: PrefixIndex, make_hashes) -> None:
    hashes = make_hashes(4)
    prefix_index.store_prefixes([hashes])
    assert int.from_bytes(req.lookup(4 * BS, hashes), "big") == 3 * BS


def test_reset_wipes_the_namespace(req: Req, prefix_index: PrefixIndex, make_hashes) -> None:
    hashes = make_hashes(3)
    prefix_index.store_prefixes([hashes])
    assert int.from_bytes(req.lookup(3 * BS + 1, hashes), "big") == 3 * BS
    assert req.reset() == b"\x01"
    assert int.from_bytes(req.lookup(3 * BS + 1, hashes), "big") == 0


def test_vllms_own_client_gets_answers(upstream_server: str, lookup_vllm_config, prefix_index: PrefixIndex,
                                       make_workload) -> None:
    requests = make_workload(4, prefix_blocks=2, unique_blocks=2)
    prefix_index.store_prefixes([requests[0].block_hashes])
    client = vllm_worker.LookupKeyClient(lookup_vllm_config)  # derives the same ipc path from the config
    try:
        assert client.lookup("a", requests[0].num_tokens, list(requests[0].block_hashes)).hit_length == 4 * BS
        # Async mode: None until ready; poll with a bound, then the answer.
        deadline = time.perf_counter() + 10
        result = None
        while result is None and time.perf_counter() < deadline:
            result = client.lookup("b", requests[1].num_tokens, list(requests[1].block_hashes), non_block=True)
            time.sleep(0.001)
        assert result is not None and result.hit_length == 2 * BS
        assert client.reset() is True
    finally:
        client.close()


def test_address_is_vllms_path_in_a_private_folder(upstream_lookup_server, lookup_vllm_config,
                                                   rpc_base_path: str) -> None:
    address = upstream_lookup_server.address
    assert address == vllm_worker.get_zmq_rpc_path_lookup(lookup_vllm_config)
    assert address.startswith(f"ipc://{rpc_base_path}/lookup_rpc_port_")
    assert stat.S_IMODE(os.stat(rpc_base_path).st_mode) == 0o700
    assert os.path.exists(address.removeprefix("ipc://"))


def test_stop_joins_the_thread_and_removes_the_socket(prefix_index: PrefixIndex, lookup_vllm_config) -> None:
    server = UpstreamLookupServer(prefix_index, lookup_vllm_config).start()
    thread, path = server.server.thread, server.address.removeprefix("ipc://")
    assert server.alive and os.path.exists(path)
    assert server.stop() is True
    assert not thread.is_alive() and not server.alive
    assert not os.path.exists(path)
    assert server.stop() is True  # idempotent


def test_store_errors_look_like_misses_upstream(private_master: EmbeddedMaster, lookup_vllm_config,
                                                make_hashes) -> None:
    # Upstream weakness #2, reproduced with a real fault (master frozen, 300 ms RPC timeout):
    # vLLM's worker answers a failed store call with 0 hits, indistinguishable from a miss.
    client = open_store(private_master.rpc_address, rpc_timeout_ms=300)
    index = PrefixIndex(client, BS, namespace="upstream-miss")
    hashes = make_hashes(3)
    server = UpstreamLookupServer(index, lookup_vllm_config, on_store_error="miss").start()
    req = Req(server.address)
    try:
        private_master.pause()
        assert req.lookup(3 * BS + 1, hashes) == (0).to_bytes(4, "big")
        assert server.worker.store_errors == 1 and server.alive
    finally:
        private_master.resume()
        req.close()
        assert server.stop()
        client.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_raising_backend_kills_the_upstream_server(private_master: EmbeddedMaster, lookup_vllm_config,
                                                     make_hashes) -> None:
    # Upstream's LookupKeyServer has no guard around its backend: one exception ends its thread,
    # and every later request goes unanswered. Our client has to survive exactly this.
    client = open_store(private_master.rpc_address, rpc_timeout_ms=300)
    index = PrefixIndex(client, BS, namespace="upstream-raise")
    hashes = make_hashes(3)
    server = UpstreamLookupServer(index, lookup_vllm_config, on_store_error="raise").start()
    req = Req(server.address)
    try:
        private_master.pause()
        assert req.lookup(3 * BS + 1, hashes, timeout_ms=0) is None
        server.server.thread.join(10)  # the store call fails after 300 ms and the exception ends the thread
        assert not server.alive
        assert req.sock.poll(0) == 0  # and the request it was serving is never answered
        assert server.worker.store_errors == 1
        private_master.resume()
        second = Req(server.address)
        try:
            assert second.lookup(3 * BS + 1, hashes, timeout_ms=300) is None  # nobody answers any more
        finally:
            second.close()
    finally:
        private_master.resume()
        req.close()
        assert server.stop()
        client.close()


def test_stop_leaves_a_wedged_thread_alone(private_master: EmbeddedMaster, lookup_vllm_config, make_hashes) -> None:
    # The server thread is stuck inside a store call (master frozen, 10 s RPC timeout): stop() must
    # not close the socket under it; it reports False, removes the IPC path, and the thread ends by
    # itself once the store answers.
    client = open_store(private_master.rpc_address, rpc_timeout_ms=10_000)
    index = PrefixIndex(client, BS, namespace="upstream-wedge")
    hashes = make_hashes(3)
    server = UpstreamLookupServer(index, lookup_vllm_config).start()
    inner, path = server.server, server.address.removeprefix("ipc://")
    req = Req(server.address)
    try:
        private_master.pause()
        assert req.lookup(3 * BS + 1, hashes, timeout_ms=0) is None
        deadline = time.perf_counter() + 10
        while server.worker.lookups == 0 and time.perf_counter() < deadline:
            time.sleep(0.005)
        assert server.worker.lookups == 1  # the thread is inside the backend now
        assert server.stop(timeout_s=0.2) is False
        assert inner.thread.is_alive() and not os.path.exists(path)
        private_master.resume()
        assert req.sock.poll(10_000)  # the store answers, the server replies, then sees it must stop
        assert req.sock.recv() == (0).to_bytes(4, "big")
        inner.thread.join(10)
        assert not inner.thread.is_alive()
    finally:
        private_master.resume()
        req.close()
        inner.socket.close(linger=0)
        inner.ctx.term()
        client.close()

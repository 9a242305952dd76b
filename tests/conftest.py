"""Shared fixtures: a real Mooncake master, real store clients, prefix indexes, vLLM's lookup server.

Everything here is real and local: ``mooncake_master`` on 127.0.0.1, Mooncake clients, ZMQ over
``ipc://`` in a private 0700 folder. vLLM is imported lazily, only by tests that ask for a vLLM
fixture (a cold ``import vllm`` costs 8-10 s).

Costs measured here, which shape the scopes: a master starts in ~0.1 s and stops in ~1 s; a client
sets up in 0.03-0.15 s but closes in ~1 s. So the master and one writer client live for the session,
and each test gets isolation from a fresh key namespace instead of a fresh store.

Fixtures
--------
mooncake_master      session  the shared EmbeddedMaster; never pause or kill it (use private_master)
store                function the session's writer client (64 MiB segment); shared, do not close it
prefix_index         function PrefixIndex over ``store``, block size 16, a namespace of its own
private_master       function a fresh EmbeddedMaster for fault tests (pause, kill, restart); killed after
rpc_base_path        session  VLLM_RPC_BASE_PATH set to a private 0700 folder for the session
lookup_vllm_config   function a minimal real VllmConfig with a lookup_rpc_port unique to the test
upstream_lookup_server function vLLM's real LookupKeyServer over ``prefix_index`` (the harness object)
upstream_server      function its ``ipc://`` address
make_workload        function ``workload.shared_prefix_workload`` (deterministic shared-prefix requests)
make_hashes          function ``workload.unique_hashes`` (one cold chain of block hashes)
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any, Iterator

import pytest

from mooncake_lookout.connector.mooncake_master import EmbeddedMaster, open_writer_store
from mooncake_lookout.connector.prefix_index import PrefixIndex
from mooncake_lookout.connector.workload import shared_prefix_workload, unique_hashes

BLOCK_SIZE = 16  # tokens per block in every index the fixtures build
SESSION_RPC_TIMEOUT_MS = 5000  # bounds any call on the shared client, should the shared master stall

_lookup_ports = itertools.count(1)


@pytest.fixture(scope="session")
def mooncake_master() -> Iterator[EmbeddedMaster]:
    """The session's real Mooncake master on 127.0.0.1 (short 500 ms key lease)."""
    with EmbeddedMaster(kv_lease_ttl_ms=500) as master:
        yield master


@pytest.fixture(scope="session")
def _session_writer(mooncake_master: EmbeddedMaster) -> Iterator[Any]:
    client = open_writer_store(mooncake_master.rpc_address, rpc_timeout_ms=SESSION_RPC_TIMEOUT_MS)
    yield client
    client.close()


@pytest.fixture
def store(_session_writer: Any, mooncake_master: EmbeddedMaster) -> Any:
    """A real writer client on the session master (shared across tests: do not close or reconfigure it)."""
    assert mooncake_master.running, "a test stopped the shared master; use private_master for faults"
    return _session_writer


@pytest.fixture
def prefix_index(store: Any) -> Iterator[PrefixIndex]:
    """A PrefixIndex on the shared store, in a namespace no other test uses; its keys are removed after."""
    index = PrefixIndex(store, BLOCK_SIZE, namespace=f"t-{uuid.uuid4().hex[:12]}")
    yield index
    index.remove_all(force=True)


@pytest.fixture
def private_master() -> Iterator[EmbeddedMaster]:
    """A fresh master of the test's own, free to pause, kill or restart; killed by pid afterwards."""
    master = EmbeddedMaster(kv_lease_ttl_ms=500).start()
    yield master
    master.kill()


@pytest.fixture
def make_workload() -> Any:
    """Build deterministic shared-prefix requests: ``make_workload(n, prefix_blocks=..., ...)``."""
    return shared_prefix_workload


@pytest.fixture
def make_hashes() -> Any:
    """Build one chain of block hashes shared with nothing: ``make_hashes(num_blocks, seed=...)``."""
    return unique_hashes


@pytest.fixture(scope="session")
def rpc_base_path() -> Iterator[str]:
    """VLLM_RPC_BASE_PATH for the session: a private 0700 folder, removed at the end."""
    from mooncake_lookout.connector.upstream_server import private_rpc_base_path

    with private_rpc_base_path() as path:
        yield path


@pytest.fixture
def lookup_vllm_config(rpc_base_path: str) -> Any:
    """A minimal real VllmConfig whose lookup IPC path (in ``rpc_base_path``) no other test uses."""
    from mooncake_lookout.connector.upstream_server import lookup_vllm_config as build

    return build(next(_lookup_ports))


@pytest.fixture
def upstream_lookup_server(prefix_index: PrefixIndex, lookup_vllm_config: Any) -> Iterator[Any]:
    """vLLM's real LookupKeyServer answering from ``prefix_index``; stopped cleanly (thread joined) after."""
    from mooncake_lookout.connector.upstream_server import UpstreamLookupServer

    server = UpstreamLookupServer(prefix_index, lookup_vllm_config).start()
    yield server
    assert server.stop(), "LookupKeyServer thread did not stop"


@pytest.fixture
def upstream_server(upstream_lookup_server: Any) -> str:
    """The ``ipc://`` address of vLLM's real LookupKeyServer over ``prefix_index``."""
    return upstream_lookup_server.address

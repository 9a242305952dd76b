"""Where the lookup channel lives: vLLM's own IPC path, or a private one for the pipelined server."""

from __future__ import annotations

import hashlib
import os
import socket
import tempfile
from typing import Any

from mooncake_lookout.connector.config import LookupConfig


def private_ipc_dir(base: str | None = None) -> str:
    """A directory only this user can enter (mode 0700), for IPC sockets; created if missing.

    Refuses a directory that exists with looser permissions or another owner, instead of trusting it.
    """
    base = base or os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir()
    path = os.path.join(base, f"mooncake-lookout-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} must be owned by uid {os.getuid()} with mode 0700 (is {oct(st.st_mode & 0o777)})")
    return path


def upstream_lookup_address(vllm_config: Any) -> str:
    """vLLM 0.33's lookup channel address, exactly as its ``LookupKeyServer`` binds it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import get_zmq_rpc_path_lookup

    return get_zmq_rpc_path_lookup(vllm_config)


def pipelined_lookup_address(vllm_config: Any, config: LookupConfig) -> str:
    """Our lookup server's address: the configured one, else a private IPC path keyed like vLLM's.

    The key is vLLM's (lookup port, host, data-parallel rank), with the host hashed: a pod's hostname is its name,
    up to 63 characters, and written out it would push the path past the 107 characters a socket path holds.
    """
    if config.lookup_server_address:
        return config.lookup_server_address
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    rpc_port = extra.get("lookup_rpc_port", 0)
    dp_rank = vllm_config.parallel_config.data_parallel_index
    host = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:12]
    name = f"lookup_{rpc_port}_dp{dp_rank}_{host}.sock"
    return "ipc://" + os.path.join(private_ipc_dir(), name)


def lookup_address(vllm_config: Any, config: LookupConfig) -> str:
    """The address the scheduler's client connects to, for the configured transport."""
    if config.lookup_transport == "pipelined":
        return pipelined_lookup_address(vllm_config, config)
    return upstream_lookup_address(vllm_config)


__all__ = ["lookup_address", "pipelined_lookup_address", "private_ipc_dir", "upstream_lookup_address"]

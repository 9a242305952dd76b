"""Where lookup channels live, and the rules for their IPC folders: the one home for both.

* :func:`lookup_address` picks the scheduler's channel for the configured transport: vLLM's own IPC path
  (:func:`upstream_lookup_address`) or a private one for our pipelined server (:func:`pipelined_lookup_address`);
* :func:`private_ipc_dir` and :func:`prepare_ipc_path` keep IPC sockets in folders only this user can
  enter, and refuse anything else instead of trusting it;
* :func:`rpc_base_path` is the only reader of vLLM's ``VLLM_RPC_BASE_PATH`` in this package.
"""

from __future__ import annotations

import errno
import hashlib
import os
import socket
import stat
import tempfile
from typing import Any

from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.transport.names import PIPELINED

RPC_BASE_PATH_ENV = "VLLM_RPC_BASE_PATH"  # vLLM's folder for its IPC sockets (the lookup channel's too)


def rpc_base_path() -> str | None:
    """vLLM's ``VLLM_RPC_BASE_PATH``, or None when unset (vLLM then uses the temp folder)."""
    return os.environ.get(RPC_BASE_PATH_ENV) or None


def private_ipc_dir(base: str | None = None) -> str:
    """A directory only this user can enter (mode 0700), for IPC sockets; created if missing.

    Refuses a directory that exists with looser permissions or another owner, instead of trusting it.
    """
    base = base or rpc_base_path() or tempfile.gettempdir()
    path = os.path.join(base, f"mooncake-lookout-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"{path} must be owned by uid {os.getuid()} with mode 0700 (is {oct(st.st_mode & 0o777)})")
    return path


def prepare_ipc_path(path: str) -> None:
    """Make ``path``'s directory private (create it 0700, or refuse one others can enter); drop a stale socket."""
    parent = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(parent):
        os.makedirs(parent, mode=0o700, exist_ok=True)
        os.chmod(parent, 0o700)
    st = os.stat(parent)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"IPC directory {parent} must be owned by uid {os.getuid()} with mode 0700 "
            f"(is uid {st.st_uid}, mode {oct(st.st_mode & 0o777)}); use a private directory")
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it")
        if _someone_listens(path):
            raise OSError(errno.EADDRINUSE, f"a server already listens on {path}")
        os.unlink(path)


def _someone_listens(path: str) -> bool:
    """True if a process accepts connections on the Unix socket ``path`` (a stale file refuses them)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(path)
        except OSError:
            return False
        return True


def upstream_lookup_address(vllm_config: Any) -> str:
    """vLLM 0.33's lookup channel address, exactly as its ``LookupKeyServer`` binds it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import get_zmq_rpc_path_lookup

    return str(get_zmq_rpc_path_lookup(vllm_config))


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
    if config.lookup_transport == PIPELINED:
        return pipelined_lookup_address(vllm_config, config)
    return upstream_lookup_address(vllm_config)


__all__ = ["RPC_BASE_PATH_ENV", "lookup_address", "pipelined_lookup_address", "prepare_ipc_path", "private_ipc_dir",
           "rpc_base_path", "upstream_lookup_address"]

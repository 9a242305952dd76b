"""``VLLM_RPC_BASE_PATH`` for the rigs: the one place that sets it.

vLLM builds the path of its lookup channel (and every other IPC socket) under this folder; the runtime
only reads it (:func:`mooncake_lookout.connector.addresses.rpc_base_path`). Rigs that start vLLM's own
lookup server, in this process or in a child, point it at a private folder here so servers and clients
meet there and nothing lands in a shared temp folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from mooncake_lookout.connector.addresses import RPC_BASE_PATH_ENV


def use_rpc_base_path(path: str | None) -> str | None:
    """Set ``VLLM_RPC_BASE_PATH`` in this process to ``path`` (None: unset it); returns the previous value.

    vLLM reads the variable each time it builds an IPC path (until ``envs.enable_envs_cache()``), so
    servers and clients built afterwards use the new folder.
    """
    previous = os.environ.get(RPC_BASE_PATH_ENV)
    if path is None:
        os.environ.pop(RPC_BASE_PATH_ENV, None)
    else:
        os.environ[RPC_BASE_PATH_ENV] = path
    return previous


@contextmanager
def private_rpc_base_path() -> Iterator[str]:
    """Point ``VLLM_RPC_BASE_PATH`` at a fresh folder only this user can enter (0700), then remove it."""
    path = tempfile.mkdtemp(prefix="lookout-rpc-")
    os.chmod(path, 0o700)
    previous = use_rpc_base_path(path)
    try:
        yield path
    finally:
        use_rpc_base_path(previous)
        shutil.rmtree(path, ignore_errors=True)


__all__ = ["private_rpc_base_path", "use_rpc_base_path"]

"""Real Mooncake store clients: open one, with Mooncake's environment options applied around its set-up.

:func:`open_store` opens a real ``MooncakeDistributedStore`` client against a master's ``host:port``.
Mooncake reads its ``MC_*`` environment variables when a client is set up, so the options here are
applied around ``setup()`` (which makes :func:`open_store` unsafe to call from two threads at once).
Facts this relies on (measured with Mooncake 0.3.13): sizes 0/0 give a lookup-only client; a writer needs a
global segment (to hold values) and a local buffer (to stage puts); ``setup()`` with no master retries for
~90 s unless ``MC_STORE_CLIENT_SETUP_RETRIES`` is small.

The standalone lookup server, the demo, the bench and the tests open their stores here; in vLLM the
store worker opens its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

INSTALL_HINT = (
    "install the Mooncake wheel: pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 "
    "(CPU hosts; it also needs Debian's libibverbs1) or mooncake-transfer-engine-cuda13 (GPU hosts: vLLM 0.33 is "
    "built for CUDA 13)"
)
IBVERBS_HINT = "the Mooncake wheel needs libibverbs.so.1: apt-get install -y libibverbs1"

class MasterError(RuntimeError):
    """The Mooncake master could not be found, started or stopped; the message says what to do."""


WRITER_GLOBAL_SEGMENT = 64 << 20  # bytes this client lends the store to hold values
WRITER_LOCAL_BUFFER = 16 << 20  # bytes to stage puts; a client without it fails puts with -600
MARKER_LOCAL_BUFFER = 1 << 20  # a lookup server's: enough to put its marker key on a segment others lend


def import_store_class() -> type:
    """Import ``MooncakeDistributedStore``, turning the usual import failures into clear errors.

    Mooncake reads ``MC_LOG_LEVEL`` once, when its logging starts, so it is defaulted to ``ERROR`` in
    this process's environment before the import (a value the caller set is kept).
    """
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        if "libibverbs" in str(exc):
            raise MasterError(f"cannot import mooncake.store ({exc}); {IBVERBS_HINT}") from exc
        raise MasterError(f"cannot import mooncake.store ({exc}); {INSTALL_HINT}") from exc
    return MooncakeDistributedStore


@contextmanager
def _env(overrides: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def open_store(rpc_address: str, *, global_segment_size: int = 0, local_buffer_size: int = 0,
               setup_retries: int = 2, rpc_timeout_ms: int | None = None,
               local_hostname: str = "127.0.0.1", tenant_id: str | None = None) -> Any:
    """Open a real ``MooncakeDistributedStore`` client on ``rpc_address`` (``host:port``).

    Sizes 0/0 (the default) give a lookup-only client; :func:`open_writer_store` gives one that can
    hold puts. ``setup_retries`` is ``MC_STORE_CLIENT_SETUP_RETRIES``: attempts, at least 1, about 4.5 s each
    when the master is down (Mooncake's default makes a dead master cost ~90 s). ``rpc_timeout_ms`` is
    ``MC_RPC_TIMEOUT_MS`` for this client (None keeps Mooncake's 30 s): a stalled master then fails a
    call with -901 after that long. ``MC_TCP_BIND_ADDRESS`` is set to ``local_hostname`` unless the
    caller set it; Mooncake 0.3.13 still opens its handshake and RPC ports on all interfaces. ``tenant_id``
    is Mooncake's tenant (``mooncake.json``'s ``tenant_id``; None: Mooncake's default tenant).
    Raises :class:`MasterError` if ``setup()`` fails. Not thread-safe (it sets environment variables).
    """
    if setup_retries < 1:
        raise ValueError(f"setup_retries must be >= 1 (Mooncake makes 0 attempts with 0), got {setup_retries}")
    store_cls = import_store_class()
    overrides = {
        "MC_STORE_CLIENT_SETUP_RETRIES": str(setup_retries),
        "MC_TCP_BIND_ADDRESS": os.environ.get("MC_TCP_BIND_ADDRESS", local_hostname),
    }
    if rpc_timeout_ms is not None:
        overrides["MC_RPC_TIMEOUT_MS"] = str(int(rpc_timeout_ms))
    store = store_cls()
    with _env(overrides):
        code = store.setup(local_hostname, "P2PHANDSHAKE", global_segment_size, local_buffer_size,
                           "tcp", "", rpc_address, **({"tenant_id": tenant_id} if tenant_id else {}))
    if code != 0:
        raise MasterError(f"MooncakeDistributedStore.setup(master={rpc_address}) failed with code {code}; "
                          "is the master running and reachable?")
    return store


def open_writer_store(rpc_address: str, **kwargs: Any) -> Any:
    """A client that can put values: it lends 64 MiB to the store and stages puts in 16 MiB."""
    kwargs.setdefault("global_segment_size", WRITER_GLOBAL_SEGMENT)
    kwargs.setdefault("local_buffer_size", WRITER_LOCAL_BUFFER)
    return open_store(rpc_address, **kwargs)


__all__ = ["IBVERBS_HINT", "INSTALL_HINT", "MARKER_LOCAL_BUFFER", "MasterError", "WRITER_GLOBAL_SEGMENT",
           "WRITER_LOCAL_BUFFER", "import_store_class", "open_store", "open_writer_store"]

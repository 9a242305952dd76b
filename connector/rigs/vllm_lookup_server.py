"""vLLM 0.33's own ``LookupKeyServer``, unchanged, answering from a :class:`PrefixIndex`.

The ``upstream`` transport must drop into an unchanged vLLM worker, so it is tested against the real
thing: the ``LookupKeyServer`` class from the installed wheel, bound where vLLM binds it
(``get_zmq_rpc_path_lookup``), speaking vLLM's wire format. Only its backend differs: in vLLM it is
the GPU worker's ``MooncakeStoreWorker``; here :class:`PrefixIndexStoreWorker` gives it the three
things the server touches (``lookup``, ``kv_send_thread``, ``store.remove_all(force=True)``) on top
of a real Mooncake store.

Upstream weaknesses this harness keeps visible rather than hides:

* if the backend's ``lookup`` raises, the server thread dies and every later request on the channel
  goes unanswered (a client without a deadline then waits forever). vLLM's own worker never raises:
  it turns store errors into misses, which :class:`PrefixIndexStoreWorker` copies by default
  (``on_store_error="miss"``); ``"raise"`` reproduces the dead thread for fault tests.
* ``LookupKeyServer.close()`` closes the socket while its thread sits in ``recv()``.
  :meth:`UpstreamLookupServer.stop` instead clears the server's ``running`` flag, sends one empty
  lookup (answered without the store) so the loop wakes and exits, joins the thread, then closes
  the socket and terminates the server's private ZMQ context. A thread wedged in its backend is
  left alone (its socket too) and ``stop`` returns False.

The IPC path is ``ipc://{VLLM_RPC_BASE_PATH}/lookup_rpc_port_{port}_host_{hostname}_dp_rank{dp}``:
:func:`~mooncake_lookout.connector.rigs.rpc_base_path.private_rpc_base_path` points ``VLLM_RPC_BASE_PATH``
at a fresh 0700 folder, and
:func:`lookup_vllm_config` builds the minimal real ``VllmConfig`` that names the port and dp rank.
Importing this module imports vLLM (8-10 s cold).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import zmq
from vllm.config import DeviceConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    MooncakeLookupResult,
    TailKeyBoundary,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.protocol import LOOKUP_MSG
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
    LookupKeyServer,
    get_zmq_rpc_path_lookup,
)

from mooncake_lookout.connector.job import LookupResult
from mooncake_lookout.connector.server.prefix_index import PrefixIndex, StoreError

logger = logging.getLogger(__name__)

ON_STORE_ERROR = ("miss", "raise")


def to_vllm_result(result: LookupResult) -> MooncakeLookupResult:
    """Our :class:`LookupResult` as vLLM's ``MooncakeLookupResult`` (same fields)."""
    return MooncakeLookupResult(
        result.hit_length,
        tuple(TailKeyBoundary(b.group_id, b.num_tokens) for b in result.tail_key_boundaries),
    )


class PrefixIndexStoreWorker:
    """What ``LookupKeyServer`` uses of ``MooncakeStoreWorker``, backed by a :class:`PrefixIndex`.

    ``store`` is the index itself, so the server's reset (``store.remove_all(force=True)``) wipes
    this index's namespace only. ``on_store_error``: ``"miss"`` answers 0 like vLLM's worker does;
    ``"raise"`` lets :class:`StoreError` escape, which kills the server's thread (see module doc).
    """

    kv_send_thread = None  # no puts in flight to drain before a reset

    def __init__(self, index: PrefixIndex, on_store_error: str = "miss") -> None:
        if on_store_error not in ON_STORE_ERROR:
            raise ValueError(f"on_store_error must be one of {ON_STORE_ERROR}, got {on_store_error!r}")
        self.index = index
        self.store = index
        self.on_store_error = on_store_error
        self.lookups = 0
        self.store_errors = 0

    def lookup(self, num_tokens: int, block_hashes: Any) -> MooncakeLookupResult:
        """Called on the server's thread with vLLM's ``BlobBlockHashes`` (memoryview items)."""
        self.lookups += 1
        try:
            return to_vllm_result(self.index.lookup(num_tokens, block_hashes))
        except StoreError:
            self.store_errors += 1
            if self.on_store_error == "raise":
                raise
            logger.warning("store error answered as a miss, as vLLM's worker does", exc_info=True)
            return MooncakeLookupResult(0)


def lookup_vllm_config(lookup_rpc_port: int = 0, *, data_parallel_index: int = 0,
                       extra_config: Mapping[str, Any] | None = None) -> VllmConfig:
    """The minimal real ``VllmConfig`` that names a lookup channel: CPU device, Mooncake store connector.

    ``lookup_rpc_port`` is upstream's ``kv_connector_extra_config['lookup_rpc_port']``: it only
    makes the IPC path unique, no TCP port is opened. ``extra_config`` adds more extra-config keys.
    """
    extra = {"lookup_rpc_port": lookup_rpc_port, **(extra_config or {})}
    cfg = VllmConfig(
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(kv_connector="MooncakeStoreConnector", kv_role="kv_both",
                                            kv_connector_extra_config=extra),
    )
    cfg.parallel_config.data_parallel_index = data_parallel_index
    return cfg


class UpstreamLookupServer:
    """vLLM's real ``LookupKeyServer`` over a prefix index (or a given ``worker``: upstream's own
    ``MooncakeStoreWorker``, say), started and stopped cleanly.

    Use as a context manager; ``address`` is the ``ipc://`` path a ``LookupKeyClient`` built from the
    same ``vllm_config`` (and the same ``VLLM_RPC_BASE_PATH``) connects to.
    """

    def __init__(self, index: PrefixIndex | None, vllm_config: VllmConfig, on_store_error: str = "miss", *,
                 worker: Any = None) -> None:
        if worker is None:
            if index is None:
                raise ValueError("give a prefix index or a worker")
            worker = PrefixIndexStoreWorker(index, on_store_error)
        self.worker = worker  # what vLLM's server calls: ``lookup``, ``kv_send_thread``, ``store.remove_all``
        self.vllm_config = vllm_config
        self.address = get_zmq_rpc_path_lookup(vllm_config)
        self.server: LookupKeyServer | None = None

    def start(self) -> UpstreamLookupServer:
        """Bind the server (vLLM's constructor starts its thread)."""
        if self.server is None:
            self.server = LookupKeyServer(self.worker, self.vllm_config)
        return self

    @property
    def alive(self) -> bool:
        """True while the server's thread runs (False once stopped, or after its backend raised)."""
        return self.server is not None and self.server.thread.is_alive()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop the thread, close the socket, terminate the context; True if the thread ended in time."""
        server, self.server = self.server, None
        if server is None:
            return True
        server.running = False
        if server.thread.is_alive():
            self._wake(server.thread, timeout_s)
            server.thread.join(timeout_s)
        if not server.thread.is_alive():
            server.close()
            server.ctx.term()
            return True
        # Wedged in the backend. A ZMQ socket must not be closed under a thread using it, so the
        # socket and the daemon thread are left behind (logged); only the IPC path is removed.
        logger.warning("LookupKeyServer thread did not stop within %.1f s; leaving it", timeout_s)
        path = self.address.removeprefix("ipc://")
        if os.path.exists(path):
            os.unlink(path)
        return False

    def _wake(self, thread: threading.Thread, timeout_s: float) -> None:
        """Send one empty lookup, so the server's blocking ``recv`` returns and its loop sees ``running``.

        The thread may also leave without reading it (it was between two requests when ``running``
        dropped), so the wait ends at the answer or at the thread's end, whichever comes first.
        """
        ctx = zmq.Context()
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        deadline = time.monotonic() + timeout_s
        try:
            sock.connect(self.address)
            sock.send_multipart([LOOKUP_MSG, (0).to_bytes(4, "big"), (0).to_bytes(2, "big"), b""])
            while thread.is_alive() and time.monotonic() < deadline:
                if sock.poll(10, zmq.POLLIN):  # the answer itself does not matter
                    break
        finally:
            sock.close(linger=0)
            ctx.term()

    def __enter__(self) -> UpstreamLookupServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def serve_upstream(index: PrefixIndex, vllm_config: VllmConfig, on_store_error: str = "miss") -> Iterator[str]:
    """Run vLLM's ``LookupKeyServer`` over ``index`` for the block; yields its ``ipc://`` address."""
    with UpstreamLookupServer(index, vllm_config, on_store_error) as server:
        yield server.address


__all__ = [
    "ON_STORE_ERROR",
    "PrefixIndexStoreWorker",
    "UpstreamLookupServer",
    "lookup_vllm_config",
    "serve_upstream",
    "to_vllm_result",
]

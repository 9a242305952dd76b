"""Our lookup server inside a GPU worker: upstream's own store worker as its backend.

With ``lookup_transport: pipelined`` the worker that runs upstream's ``LookupKeyServer`` (rank 0) also
runs our :class:`~mooncake_lookout.connector.server.loop.LookupServer`, answering from the same
``MooncakeStoreWorker``, so its keys and layout are upstream's.
"""

from __future__ import annotations

import logging
from typing import Any

from mooncake_lookout.connector.config import LookupConfig

logger = logging.getLogger(__name__)


class WorkerBackend:
    """Our lookup server's backend on a GPU worker: upstream's own ``MooncakeStoreWorker.lookup``."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def lookup(self, num_tokens: int, block_hashes: Any) -> Any:
        """Upstream's lookup (its result has the fields of :class:`LookupResult`)."""
        return self.worker.lookup(num_tokens, block_hashes)

    def reset(self) -> bool:
        """What upstream's server does on reset: drain in-flight puts, then wipe the store."""
        send_thread = getattr(self.worker, "kv_send_thread", None)
        if send_thread is not None:
            send_thread.request_queue.join()
        self.worker.store.remove_all(force=True)
        return True


def serve_pipelined(vllm_config: Any, config: LookupConfig, worker: Any) -> Any:
    """On the rank that runs upstream's lookup server, also run ours (pipelined) over the worker's lookup."""
    if worker is None or getattr(worker, "lookup_server", None) is None:
        return None
    from mooncake_lookout.connector.addresses import pipelined_lookup_address
    from mooncake_lookout.connector.server.loop import LookupServer

    server = LookupServer(WorkerBackend(worker), pipelined_lookup_address(vllm_config, config))
    server.start()
    logger.info("mooncake-lookout pipelined lookup server on %s", server.address)
    return server


__all__ = ["WorkerBackend", "serve_pipelined"]

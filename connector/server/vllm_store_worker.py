"""vLLM's own ``MooncakeStoreWorker``, set up for lookups only: upstream's key code without a GPU.

Why: a store written by vLLM is keyed ``<cache_prefix@><model>@tp_rank:R@pcp0@dcp0@pp_rank:P@group:G@<hash>``,
and only upstream's worker knows every rule of that layout (rank namespaces, groups, partial-hash hits,
tail boundaries). This module builds that very class without its GPU half (no KV caches registered, no
transfer threads, no lookup server of its own), the way vLLM's own unit tests build it, so that

* our lookup server can answer for a real deployment's keys outside a GPU worker (``serve``, ``bench``);
* tests write keys exactly as upstream's save path does (:func:`saved_keys`) and look them up through
  upstream's lookup, over a real Mooncake master.

It reads vLLM's private worker attributes, so it is pinned to the vLLM versions this package supports.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any


def lookup_worker(vllm_config: Any, kv_cache_config: Any, store: Any, *, tp_rank: int = 0, tp_size: int = 1,
                  pp_rank: int = 0) -> Any:
    """A ``MooncakeStoreWorker`` of rank (``tp_rank``, ``pp_rank``) that looks up through ``store``.

    ``vllm_config`` names the model (the key prefix), the ``cache_prefix`` and the parallel layout;
    ``kv_cache_config`` gives the cache groups; ``store`` is an open ``MooncakeDistributedStore``.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import KeyMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.metrics import MooncakeStoreConnectorStats
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
        MooncakeStoreCoordinator,
        MooncakeStoreWorker,
    )
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    kv_transfer = vllm_config.kv_transfer_config
    extra = kv_transfer.kv_connector_extra_config or {}
    parallel = vllm_config.parallel_config
    worker = object.__new__(MooncakeStoreWorker)
    worker.dp_rank = parallel.data_parallel_index
    worker.tp_rank, worker.tp_size = tp_rank, tp_size
    worker.pp_size, worker.pp_rank = parallel.pipeline_parallel_size, pp_rank
    worker.pcp_size = worker.dcp_size = 1
    worker.pcp_rank = worker.dcp_rank = 0
    worker.kv_role = kv_transfer.kv_role
    worker._capacity_only = False
    worker.block_size, worker.hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    worker.num_kv_head = vllm_config.model_config.get_total_num_kv_heads()
    worker.store = store
    worker.kv_send_thread = None
    worker.kv_recv_threads = []
    worker.lookup_server = None
    worker._kv_connector_stats_lock = threading.Lock()
    worker.kv_connector_stats = MooncakeStoreConnectorStats()
    worker._kv_cache_config = kv_cache_config
    worker.coord = MooncakeStoreCoordinator.from_kv_cache_config(
        kv_cache_config, vllm_config, worker.block_size, worker.hash_block_size)
    worker._kv_cache_groups = worker.coord.kv_cache_groups
    worker.store_tp_size, namespace, layout_cls = worker._select_store_layout(extra)
    metadata = KeyMetadata(
        model_name=vllm_config.model_config.model.rstrip("/").split("/")[-1],
        tp_rank=tp_rank, pcp_rank=0, dcp_rank=0, pp_rank=pp_rank,
        cache_prefix=str(extra.get("cache_prefix", "")), store_namespace=namespace)
    worker._group_tp_replication_factors = worker._compute_group_tp_replication_factors()
    worker.token_dbs = worker._build_token_databases(metadata, layout_cls)
    worker._init_lookup_key_prefixes()
    return worker


def saved_keys(worker: Any, token_len: int, block_hashes: Sequence[bytes]) -> list[str]:
    """The keys this worker's save path writes for the first ``token_len`` tokens (upstream's own key code)."""
    keys: list[str] = []
    for group_id, db in enumerate(worker.token_dbs):
        if not worker._kv_cache_groups[group_id].kv_cache_spec.prefix_cacheable:
            continue
        for _, _, chunk_hash in db.process_tokens(token_len, list(block_hashes)):
            keys.append(db.key_for(chunk_hash))
    return keys


__all__ = ["lookup_worker", "saved_keys"]

"""Bench: what one lookup costs on the server's side, per backend, measured in-process and read-only.

Why: the lookup servers of scenarios (a)-(f) answer from a :class:`PrefixIndex` (keys of its own), the
same for upstream's server and ours, so those scenarios compare clients fairly. Inside vLLM the server
answers from the worker's ``MooncakeStoreWorker`` instead: upstream's server through the worker's own
``lookup``, ours through :class:`~mooncake_lookout.connector.server.worker_backend.WorkerBackend` (its
``lookup_many``). This times, for a cold prompt of each length (keys no store holds):

* ``batch_is_exist``: the store call alone, of the keys vLLM's lookup asks;
* ``prefix_index``: :meth:`PrefixIndex.lookup_many` of one query (the bench's servers);
* ``upstream_worker``: upstream's ``MooncakeStoreWorker.lookup`` (vLLM's server, in vLLM);
* ``worker_backend``: ``WorkerBackend.lookup_many`` of one query (our server, in vLLM).

Each figure is one call on this process's thread; the four take turns prompt by prompt. Only existence
checks reach the store (:class:`~mooncake_lookout.connector.rigs.vllm_layout.ReadOnlyStore`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from mooncake_lookout.connector.bench.rig import summary_us
from mooncake_lookout.connector.job import HashBlob
from mooncake_lookout.connector.rigs.workload import unique_hashes

BLOCKS = (8, 64, 512, 4096)
WAYS = ("batch_is_exist", "prefix_index", "upstream_worker", "worker_backend")


def run(store: Any, worker: Any, *, blocks: Sequence[int] = BLOCKS, rounds: int = 20,
        block_size: int = 16) -> dict[str, Any]:
    """Per prompt length: each way's seconds per lookup (microsecond summaries), and the keys asked.

    ``store`` is a read-only store client; ``worker`` upstream's ``MooncakeStoreWorker`` over it
    (:func:`~mooncake_lookout.connector.rigs.vllm_layout.layout_worker`).
    """
    from mooncake_lookout.connector.rigs.vllm_layout import lookup_keys
    from mooncake_lookout.connector.server.prefix_index import PrefixIndex
    from mooncake_lookout.connector.server.worker_backend import WorkerBackend

    index = PrefixIndex(store, block_size, namespace="bench-cold")
    backend = WorkerBackend(worker)
    seed = random.getrandbits(30)
    out: dict[str, Any] = {}
    for n in blocks:
        num_tokens = n * block_size + 1
        times: dict[str, list[float]] = {way: [] for way in WAYS}
        keys = 0
        for i in range(rounds):
            hashes = unique_hashes(n, seed=seed + 7919 * n + i)
            blob = HashBlob(b"".join(hashes), len(hashes[0]))
            asked = lookup_keys(worker, num_tokens, hashes)
            keys = len(asked)
            calls: dict[str, Callable[[], Any]] = {
                "batch_is_exist": lambda asked=asked: store.batch_is_exist(asked),
                "prefix_index": lambda blob=blob, n=num_tokens: index.lookup_many([(n, blob)]),
                "upstream_worker": lambda hashes=hashes, n=num_tokens: worker.lookup(n, hashes),
                "worker_backend": lambda blob=blob, n=num_tokens: backend.lookup_many([(n, blob)]),
            }
            for k in range(len(WAYS)):
                way = WAYS[(i + k) % len(WAYS)]
                t0 = time.perf_counter()
                calls[way]()
                times[way].append(time.perf_counter() - t0)
        out[str(n)] = {"keys": keys, **{way: summary_us(t) for way, t in times.items()}}
    return out


__all__ = ["BLOCKS", "WAYS", "run"]

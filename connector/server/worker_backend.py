"""Our lookup server inside a GPU worker: upstream's own store worker as its backend.

With ``lookup_transport: pipelined`` the worker that runs upstream's ``LookupKeyServer`` (rank 0) also
runs our :class:`~mooncake_lookout.connector.server.loop.LookupServer`, answering from the same
``MooncakeStoreWorker``, so its keys and layout are upstream's, and a whole batch of lookups costs one
``batch_is_exist``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.job import MISS, HashBlob
from mooncake_lookout.connector.server.prefix_index import StoreError

logger = logging.getLogger(__name__)


class WorkerBackend:
    """Our lookup server's backend on a GPU worker: upstream's own ``MooncakeStoreWorker`` key code.

    :meth:`lookup_many` answers a whole batch with ONE ``batch_is_exist``: upstream's ``lookup`` runs twice
    per query against a stand-in store, first to learn which keys it asks (the stand-in answers "absent"),
    then to compute the hit from the codes of one real call over the union of those keys. The key layout,
    rank namespaces, partial-hash and tail-boundary logic stay upstream's. A negative code (Mooncake's
    store error) is reported as that query's :class:`StoreError`, where upstream would count a miss.
    """

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def lookup(self, num_tokens: int, block_hashes: Any) -> Any:
        """One lookup, through :meth:`lookup_many` (so store errors are errors here too)."""
        result = self.lookup_many([(num_tokens, block_hashes)])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def lookup_many(self, queries: Any, extra_keys: Sequence[str] = ()) -> list[Any]:
        """Each query's upstream result, or the :class:`StoreError` it met; one store call in all.

        A query is ``(num_tokens, hashes)`` or ``(num_tokens, hashes, known)``: keys of the first ``known``
        hashes are taken as present, not asked. The codes of ``extra_keys`` follow the results.
        """
        worker = self.worker
        lookup = type(worker).lookup
        asked: list[list[str]] = []
        present: dict[str, int] = {}
        for query in queries:
            num_tokens, hashes, known = _unpack(query)
            recorder = _KeyRecorder()
            lookup(_WorkerView(worker, recorder), num_tokens, _vllm_hashes(hashes))
            keys = recorder.keys
            if known:
                known_hex = set(_hex(hashes, known))
                present.update((k, 1) for k in keys if k.rsplit("@", 1)[-1] in known_hex)
            asked.append(keys)
        union = [k for k in dict.fromkeys(k for keys in asked for k in keys) if k not in present]
        union += [k for k in extra_keys if k not in present]
        codes: dict[str, int] = dict(present)
        if union:
            t0 = time.perf_counter()
            try:
                answer = list(worker.store.batch_is_exist(union))
                if len(answer) != len(union):
                    raise StoreError(None, "batch_is_exist", f"{len(answer)} answers for {len(union)} keys")
            except Exception as e:
                _record(worker, t0, len(union), failed=len(union))
                err = e if isinstance(e, StoreError) else StoreError(None, "batch_is_exist", repr(e))
                return [err if keys else MISS for keys in asked] + [err] * len(extra_keys)
            codes.update(zip(union, answer))
            _record(worker, t0, len(union), failed=sum(1 for c in answer if c < 0))
        out: list[Any] = []
        for query, keys in zip(queries, asked):
            num_tokens, hashes, _ = _unpack(query)
            bad = next((k for k in keys if codes[k] < 0), None)
            if bad is not None:
                out.append(StoreError(codes[bad], "batch_is_exist", f"key {bad}"))
                continue
            out.append(lookup(_WorkerView(worker, _CodeStore(codes)), num_tokens, _vllm_hashes(hashes)))
        return out + [codes[k] for k in extra_keys]

    @property
    def store(self) -> Any:
        """The worker's own store client."""
        return self.worker.store

    @staticmethod
    def marker_key(name: str) -> str:
        """A key that is no block's (the worker's reset wipes every key, this one too)."""
        return f"mooncake-lookout-marker@{name}"

    def put_marker(self, key: str) -> bool:
        """Store ``key``; False if the store refused it (a worker that lends no memory may)."""
        try:
            return self.worker.store.upsert_batch([key], [b"\x01"]) == 0
        except Exception:
            return False

    def reset(self) -> bool:
        """What upstream's server does on reset: drain in-flight puts, then wipe the store."""
        send_thread = getattr(self.worker, "kv_send_thread", None)
        if send_thread is not None:
            send_thread.request_queue.join()
        self.worker.store.remove_all(force=True)
        return True


class _KeyRecorder:
    """A stand-in store that notes the keys asked and answers "absent" (first pass)."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.keys.extend(keys)
        return [0] * len(keys)


class _CodeStore:
    """A stand-in store answering from the codes of the one real call (second pass)."""

    def __init__(self, codes: dict[str, int]) -> None:
        self.codes = codes

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [self.codes[k] for k in keys]


class _WorkerView:
    """The worker as upstream's ``lookup`` sees it, with a stand-in store and no operation recording.

    Reads every other attribute from the real worker (never writes), so the transfer threads that use the
    real store are untouched.
    """

    def __init__(self, worker: Any, store: Any) -> None:
        self._worker = worker
        self.store = store

    def _record_kv_connector_operation(self, *args: Any, **kwargs: Any) -> None:
        """Recorded once for the real call instead (``_record``)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._worker, name)


def _unpack(query: Any) -> tuple[int, Any, int]:
    num_tokens, hashes, *rest = query
    return num_tokens, hashes, (rest[0] if rest else 0)


def _hex(hashes: Any, count: int) -> list[str]:
    if isinstance(hashes, HashBlob):
        return hashes.hex(count)
    return [bytes(h).hex() for h in hashes[:count]]


def _vllm_hashes(hashes: Any) -> Any:
    """Hashes as upstream's lookup takes them: vLLM's ``BlobBlockHashes`` over a concatenated blob."""
    if isinstance(hashes, HashBlob):
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import BlobBlockHashes

        return BlobBlockHashes(hashes.blob, hashes.hash_len)
    return hashes


def _record(worker: Any, t0: float, keys: int, failed: int) -> None:
    """Upstream's ``lookup_exists`` operation record (its store metrics), once per real call."""
    record = getattr(worker, "_record_kv_connector_operation", None)
    if record is None:
        return
    if failed:
        record("lookup_exists", time.perf_counter() - t0, keys, status="error", num_failed_keys=failed)
    else:
        record("lookup_exists", time.perf_counter() - t0, keys)


def serve_pipelined(vllm_config: Any, config: LookupConfig, worker: Any) -> Any:
    """On the rank that runs upstream's lookup server, also run ours (pipelined) over the worker's lookup."""
    if worker is None or getattr(worker, "lookup_server", None) is None:
        return None
    from mooncake_lookout.connector.addresses import pipelined_lookup_address
    from mooncake_lookout.connector.config import ConfigError
    from mooncake_lookout.connector.server.listen import exposure
    from mooncake_lookout.connector.server.loop import LookupServer

    address, curve = pipelined_lookup_address(vllm_config, config), config.server_curve()
    risk = exposure(address, curve, "set lookup_curve_server_secret_key and lookup_curve_allowed_clients")
    if risk is not None:  # the same rule as ``serve``, with no --insecure: a worker never serves an open port
        raise ConfigError(f"kv_connector_extra_config['lookup_server_address']: {risk}")
    # Clients cache found blocks for lookup_answer_ttl_ms: the server keeps an epoch (lets them) only once
    # the master's key lease is known to cover that (server/lease.py, checked on a thread of its own).
    caching = config.lookup_prefix_cache_blocks > 0
    server = LookupServer(WorkerBackend(worker), address, marker=caching, lease_window_s=config.answer_ttl_s,
                          curve=curve)
    server.start()
    logger.info("mooncake-lookout pipelined lookup server on %s", server.address)
    return server


__all__ = ["WorkerBackend", "serve_pipelined"]

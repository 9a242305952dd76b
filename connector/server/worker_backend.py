"""Our lookup server inside a GPU worker: upstream's own store worker as its backend.

With ``lookup_transport: pipelined`` the worker that runs upstream's ``LookupKeyServer`` (rank 0) also
runs our :class:`~mooncake_lookout.connector.server.loop.LookupServer`, answering from the same
``MooncakeStoreWorker``, so its keys and layout are upstream's.
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


# A query asking more blocks than this gets a store call of its own: one pass of upstream's key code (about
# 1.5 us a block here) then costs more than the fixed cost of a store call (about 60 us).
SOLO_BLOCKS = 256


class _Plan:
    """One query as upstream's ``lookup`` will see it: a known prefix is skipped (``shift`` tokens) when the
    layout allows, else its keys are taken as present (``present``: their hashes' hex digits)."""

    __slots__ = ("num_tokens", "hashes", "shift", "present", "blocks")

    def __init__(self, num_tokens: int, hashes: Any, shift: int, present: frozenset[str]) -> None:
        self.num_tokens, self.hashes, self.shift, self.present = num_tokens, hashes, shift, present
        self.blocks = len(hashes) - len(present)


class WorkerBackend:
    """Our lookup server's backend on a GPU worker: upstream's own ``MooncakeStoreWorker`` key code.

    Every key asked is built by upstream's ``lookup``, run against a stand-in store; the key layout, rank
    namespaces, partial-hash and tail-boundary logic stay upstream's. Short queries share ONE real
    ``batch_is_exist`` (upstream's ``lookup`` runs twice for each: to learn its keys, then to compute its
    hit from the codes of the one call); a long one gets a call of its own (one run). A negative code
    (Mooncake's store error) is that query's :class:`StoreError`, where upstream would count a miss.

    Blocks a client knows present (its prefix cache) are not asked: with one full-attention group keyed per
    hash block, upstream's ``lookup`` runs on the prompt after them, and the hit is shifted back (a key
    depends on its block's hash only, and the hit is the longest present prefix); in other layouts their
    keys are answered "present" without asking.
    """

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self._block = _shift_block(worker)

    def lookup(self, num_tokens: int, block_hashes: Any) -> Any:
        """One lookup, through :meth:`lookup_many` (so store errors are errors here too)."""
        result = self.lookup_many([(num_tokens, block_hashes)])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def lookup_many(self, queries: Any, extra_keys: Sequence[str] = ()) -> list[Any]:
        """Each query's upstream result, or the :class:`StoreError` it met; then the codes of ``extra_keys``.

        A query is ``(num_tokens, hashes)`` or ``(num_tokens, hashes, known)``: its first ``known`` blocks
        are known present (found within their lease) and not asked.
        """
        plans = [self._plan(*_unpack(q)) for q in queries]
        out: list[Any] = [None] * len(plans)
        extra: list[str] = list(extra_keys)
        # Alone, a query is asked in one run; in a batch, short ones share a call (two runs each).
        share = len(plans) > 1
        small = [i for i, p in enumerate(plans) if share and p.blocks <= SOLO_BLOCKS]
        large = [i for i, p in enumerate(plans) if not (share and p.blocks <= SOLO_BLOCKS)]
        extra_codes: list[Any] | None = None
        if small or not large:  # the shared call carries the extra keys (also when nothing else is asked)
            results, extra_codes = self._shared([plans[i] for i in small], extra)
            for i, r in zip(small, results):
                out[i] = r
        for i in large:
            out[i], codes = self._solo(plans[i], extra if extra_codes is None else [])
            if extra_codes is None:
                extra_codes = codes
        return out + (extra_codes or [])

    def _plan(self, num_tokens: int, hashes: Any, known: int) -> _Plan:
        if known and self._block:
            known = min(known, len(hashes), max(0, (num_tokens - 1) // self._block))
            shift = known * self._block
            rest = HashBlob(hashes.blob[known * hashes.hash_len:], hashes.hash_len) if isinstance(
                hashes, HashBlob) else list(hashes[known:])
            return _Plan(num_tokens - shift, rest, shift, frozenset())
        return _Plan(num_tokens, hashes, 0, frozenset(_hex(hashes, known)) if known else frozenset())

    def _run(self, plan: _Plan, store: Any) -> Any:
        """Upstream's ``lookup`` for ``plan`` against ``store``, shifted back by the skipped prefix."""
        result = type(self.worker).lookup(_worker_view(self.worker, store), plan.num_tokens,
                                          _vllm_hashes(plan.hashes))
        return _shifted(result, plan.shift) if plan.shift else result

    def _shared(self, plans: list[_Plan], extra: list[str]) -> tuple[list[Any], list[Any]]:
        """Two runs of upstream's key code per query around ONE real call for all their keys and ``extra``."""
        asked: list[list[str]] = []
        for plan in plans:
            recorder = _KeyRecorder(plan.present)
            self._run(plan, recorder)
            asked.append(recorder.keys)
        union = list(dict.fromkeys(k for keys in asked for k in keys)) + extra
        if not union:
            return [self._run(plan, _CodeStore({})) for plan in plans], []
        answer, error = self._call(union)
        if error is not None:
            return [error if keys else MISS for keys in asked], [error] * len(extra)
        codes = dict(zip(union, answer))
        out: list[Any] = []
        for plan, keys in zip(plans, asked):
            bad = next((k for k in keys if codes[k] < 0), None)
            if bad is not None:
                out.append(StoreError(codes[bad], "batch_is_exist", f"key {bad}"))
                continue
            out.append(self._run(plan, _CodeStore(codes, plan.present)))
        return out, [codes[k] for k in extra]

    def _solo(self, plan: _Plan, extra: list[str]) -> tuple[Any, list[Any]]:
        """One run of upstream's key code, its one real call carrying ``extra`` too."""
        store = _OneCall(self, plan.present, extra)
        result = self._run(plan, store)
        if store.error is not None:
            return store.error, [store.error] * len(extra)
        if store.answer is None:  # nothing asked (an empty prompt): the extra keys still need their call
            if not extra:
                return result, []
            answer, error = self._call(extra)
            return result, [error] * len(extra) if error is not None else answer
        asked, answer = store.asked, store.answer
        n = len(asked)
        if n and min(answer[:n]) < 0:
            i = next(i for i in range(n) if answer[i] < 0)
            result = StoreError(answer[i], "batch_is_exist", f"key {asked[i]}")
        return result, answer[n:]

    def _call(self, keys: list[str]) -> tuple[list[int], StoreError | None]:
        """The real ``batch_is_exist`` (recorded as upstream records it); a failed call is a StoreError."""
        worker = self.worker
        t0 = time.perf_counter()
        try:
            answer = list(worker.store.batch_is_exist(keys))
            if len(answer) != len(keys):
                raise StoreError(None, "batch_is_exist", f"{len(answer)} answers for {len(keys)} keys")
        except Exception as e:
            _record(worker, t0, len(keys), failed=len(keys))
            return [], e if isinstance(e, StoreError) else StoreError(None, "batch_is_exist", repr(e))
        failed = sum(1 for c in answer if c < 0) if answer and min(answer) < 0 else 0
        _record(worker, t0, len(keys), failed=failed)
        return answer, None

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
        """What upstream's server does on reset: drain in-flight puts, then wipe the store; a negative code from
        ``remove_all`` (the store was not wiped) raises :class:`StoreError` (upstream's server ignores it)."""
        send_thread = getattr(self.worker, "kv_send_thread", None)
        if send_thread is not None:
            send_thread.request_queue.join()
        code = self.worker.store.remove_all(force=True)
        if code < 0:
            raise StoreError(code, "remove_all", "the store was not wiped")
        return True


def _known(key: str, present: frozenset[str]) -> bool:
    return bool(present) and key.rsplit("@", 1)[-1] in present


class _KeyRecorder:
    """A stand-in store that notes the keys to ask and answers "absent" (the first of two runs)."""

    def __init__(self, present: frozenset[str] = frozenset()) -> None:
        self.present = present
        self.keys: list[str] = []

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.keys.extend(k for k in keys if not _known(k, self.present))
        return [0] * len(keys)


class _CodeStore:
    """A stand-in store answering from the codes of the one real call (the second run)."""

    def __init__(self, codes: dict[str, int], present: frozenset[str] = frozenset()) -> None:
        self.codes = codes
        self.present = present

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [1 if _known(k, self.present) else self.codes[k] for k in keys]


class _OneCall:
    """A stand-in store for a single run: asks the real store once, for the keys not known present and the
    extra keys. A failure is kept (``error``) and answered "absent", so upstream neither logs nor hides it;
    negative codes pass through (upstream counts only 1 as present) and are reported after the run."""

    def __init__(self, backend: WorkerBackend, present: frozenset[str], extra: list[str]) -> None:
        self.backend, self.present, self.extra = backend, present, extra
        self.asked: list[str] = []
        self.answer: list[int] | None = None
        self.error: StoreError | None = None

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        present = self.present
        ask = [k for k in keys if not _known(k, present)] if present else keys
        answer, self.error = self.backend._call(ask + self.extra if self.extra else ask)
        if self.error is not None:
            return [0] * len(keys)
        self.asked, self.answer = ask, answer
        if not present:
            return answer[:len(keys)] if self.extra else answer
        codes = dict(zip(ask, answer))
        return [1 if _known(k, present) else codes[k] for k in keys]


def _worker_view(worker: Any, store: Any) -> Any:
    """The worker as upstream's ``lookup`` sees it, with a stand-in store and no operation recording.

    A shallow copy, made per run (a few microseconds) so it always reads the worker's current attributes at
    full speed; the real worker is never written, so the transfer threads that use the real store are
    untouched.
    """
    view = object.__new__(type(worker))
    view.__dict__.update(worker.__dict__)
    view.store = store
    view._record_kv_connector_operation = _not_recorded
    return view


def _not_recorded(*args: Any, **kwargs: Any) -> None:
    """Recorded once for the real call instead (``_record``)."""


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


def _shift_block(worker: Any) -> int:
    """Tokens per block when a known prefix can be skipped: one prefix-cached full-attention group keyed per
    hash block (a key then depends on its block's hash only); 0 otherwise."""
    try:
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        (group,) = worker._kv_cache_groups
        (db,) = worker.token_dbs
        spec = group.kv_cache_spec
        if isinstance(spec, FullAttentionSpec) and spec.prefix_cacheable and db.block_size == worker.hash_block_size:
            return int(db.block_size)
    except (AttributeError, ImportError, TypeError, ValueError):  # another layout (or a stand-in worker)
        pass
    return 0


def _shifted(result: Any, shift: int) -> Any:
    """Upstream's result for the prompt after a known prefix of ``shift`` tokens, as one for the whole prompt."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        MooncakeLookupResult,
        TailKeyBoundary,
    )

    if result.hit_length:
        tails = tuple(TailKeyBoundary(t.group_id, t.num_tokens + shift) for t in result.tail_key_boundaries)
    else:  # nothing found past the prefix: the hit ends at it, keyed by its last block (the one group)
        tails = (TailKeyBoundary(0, shift),)
    return MooncakeLookupResult(result.hit_length + shift, tails)


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
    # Clients cache found blocks and hold hits for lookup_answer_ttl_ms: the server keeps an epoch (lets them)
    # only once the master's key lease is known to cover that (server/lease.py, checked on a thread of its own).
    # Kept with the prefix cache off too: a held hit needs the proof, and the epoch tells held answers of a wipe.
    server = LookupServer(WorkerBackend(worker), address, marker=True, lease_window_s=config.answer_ttl_s,
                          curve=curve)
    server.start()
    logger.info("mooncake-lookout pipelined lookup server on %s", server.address)
    return server


__all__ = ["WorkerBackend", "serve_pipelined"]

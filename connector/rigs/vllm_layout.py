"""vLLM's store-key layout for a named deployment, without a GPU, and a store client that can only ask.

Why: a vLLM deployment keys its blocks ``<cache_prefix@><model>@tp_rank:R@...@group:G@<hash>``, and
only upstream's ``MooncakeStoreWorker`` knows every rule of that layout. :func:`layout_worker` builds
that worker (:func:`~mooncake_lookout.connector.server.vllm_store_worker.lookup_worker`) for the model
name, ``cache_prefix``, tensor-parallel size and block size a deployment runs with, so a tool outside
the deployment asks exactly the keys vLLM's own lookup asks (``bench --master``).

:class:`ReadOnlyStore` wraps a store client so that only existence checks go through: anything that
could write or wipe (``put``, ``upsert``, ``remove_all``, ...) raises :class:`PermissionError` naming
the call. Together with a lookup-only client (no segment lent, no buffer), a tool built on it cannot
change what a user's store holds.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9_.+-]{1,200}$")
READS = frozenset({"batch_is_exist", "is_exist"})


class ReadOnlyStore:
    """A Mooncake store client through which only ``batch_is_exist`` and ``is_exist`` can be called."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.calls = 0  # existence checks made, so a caller can report the load it put on the store

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        """Mooncake's ``batch_is_exist``: 1 present, 0 absent, negative an error, per key."""
        self.calls += 1
        return self._store.batch_is_exist(keys)

    def is_exist(self, key: str) -> int:
        """Mooncake's ``is_exist`` of one key."""
        self.calls += 1
        return self._store.is_exist(key)

    def __getattr__(self, name: str) -> Any:
        raise PermissionError(f"read-only store: {name}() is not allowed (only {', '.join(sorted(READS))})")


@dataclass(frozen=True)
class Layout:
    """What vLLM's store keys depend on: model name, ``cache_prefix``, tensor-parallel size, block size."""

    model: str
    cache_prefix: str = ""
    tp_size: int = 1
    block_size: int = 16

    def __post_init__(self) -> None:
        name = self.model.rstrip("/").split("/")[-1]
        if not MODEL_NAME_RE.match(name) or set(name) == {"."}:
            raise ValueError(f"model name {self.model!r}: its last part must match {MODEL_NAME_RE.pattern}")
        if "@" in self.cache_prefix:
            raise ValueError(f"cache_prefix {self.cache_prefix!r} must not contain '@'")
        if not 1 <= self.tp_size <= 1024:
            raise ValueError(f"tp_size must be 1..1024, got {self.tp_size}")
        if self.block_size <= 0 or self.block_size % 16:
            raise ValueError(f"block_size must be a positive multiple of 16, got {self.block_size}")

    def vllm_config(self) -> Any:
        """A real ``VllmConfig`` naming this model, ``cache_prefix`` and tensor-parallel size."""
        from mooncake_lookout.connector.rigs.scheduler_driver import make_vllm_config

        extra: dict[str, Any] = {"cache_prefix": self.cache_prefix} if self.cache_prefix else {}
        config = make_vllm_config(extra, model_name=self.model, block_size=self.block_size)
        config.parallel_config.tensor_parallel_size = self.tp_size
        return config


def layout_worker(store: Any, layout: Layout) -> Any:
    """Upstream's ``MooncakeStoreWorker`` of rank 0 for ``layout``, looking up through ``store``."""
    from mooncake_lookout.connector.rigs.scheduler_driver import make_kv_cache_config
    from mooncake_lookout.connector.server.vllm_store_worker import lookup_worker

    return lookup_worker(layout.vllm_config(), make_kv_cache_config(4096, layout.block_size), store,
                         tp_size=layout.tp_size)


def key_prefix(worker: Any) -> str:
    """The part of a rank-0, group-0 key before the block hash (what sampled keys are matched against)."""
    probe = bytes(32)
    key: str = worker.token_dbs[0].key_for(probe)
    if not key.endswith(probe.hex()):
        raise ValueError(f"unexpected vLLM key layout: {key!r} does not end with the block hash")
    return key[:-len(probe.hex())]


def lookup_keys(worker: Any, num_tokens: int, block_hashes: Sequence[bytes]) -> list[str]:
    """The keys upstream's lookup asks for this prompt (every rank namespace, every group), in its order."""
    asked: list[str] = []

    class _Recorder:
        def batch_is_exist(self, keys: list[str]) -> list[int]:
            asked.extend(keys)
            return [0] * len(keys)

    view = _View(worker, _Recorder())
    type(worker).lookup(view, num_tokens, list(block_hashes))
    return asked


class _View:
    """The worker as upstream's ``lookup`` sees it, with another store and no operation recording."""

    def __init__(self, worker: Any, store: Any) -> None:
        self._worker = worker
        self.store = store

    def _record_kv_connector_operation(self, *args: Any, **kwargs: Any) -> None:
        """Not recorded: this lookup never reached a store."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._worker, name)


__all__ = ["Layout", "MODEL_NAME_RE", "READS", "ReadOnlyStore", "key_prefix", "layout_worker", "lookup_keys"]

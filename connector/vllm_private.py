"""Every part of vLLM's internals mooncake-lookout reads or replaces, in one table, and the check of each.

Why: the connector subclasses vLLM's Mooncake store connector and reaches into objects vLLM does not promise
to keep (its scheduler's block sizes and lookup client, its worker's key databases and lookup server, its
engine core's request hand-on). A release that renames one breaks the connector while serving, not at start.
So each such attribute is written here once, with the reason it is read, and :func:`missing` checks the table
against the vLLM it runs in: the tests run it against every release in
:data:`~mooncake_lookout.connector.vllm_version.SUPPORTED_VLLM_VERSIONS` (each installed in its own venv), and
``python -m mooncake_lookout.connector.vllm_private`` prints what a given vLLM lacks.

An ``attribute`` is an instance attribute vLLM's own code assigns (``self.NAME = ...`` in the class or a base
class of vLLM's, found in the source, so no instance has to be built) or a dataclass field; a ``method`` is
callable on the class; a ``name`` is a module-level class, function or constant.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import sys
import textwrap
from dataclasses import dataclass
from typing import Any

_STORE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store"
_SCHEDULER = f"{_STORE}.scheduler.MooncakeStoreScheduler"
_CONNECTOR = f"{_STORE}.connector.MooncakeStoreConnector"
_WORKER = f"{_STORE}.worker.MooncakeStoreWorker"


@dataclass(frozen=True)
class Private:
    """One part of vLLM's internals: where it lives, what kind it is, and why mooncake-lookout reads it."""

    owner: str  # dotted path of a class (attribute, method) or a module (name)
    name: str
    kind: str  # "attribute", "method" or "name"
    why: str


PRIVATE: tuple[Private, ...] = (
    # The scheduler side (scheduler_adapter.py): upstream's scheduler, its client replaced by ours.
    Private(_SCHEDULER, "_block_size", "attribute", "the block size a hit is aligned to; the prefix cache's unit"),
    Private(_SCHEDULER, "_hash_block_size", "attribute", "tokens per block hash: what a lookup is aligned to"),
    Private(_SCHEDULER, "enable_partial_hash_hits", "attribute", "picks the alignment; off for the prefix cache"),
    Private(_SCHEDULER, "enable_lookup", "attribute", "no lookups at all: ours start none either"),
    Private(_SCHEDULER, "lookup_async", "attribute", "set from our config: upstream's deferral follows it"),
    Private(_SCHEDULER, "client", "attribute", "upstream's LookupKeyClient, retired and replaced by ours"),
    Private(f"{_STORE}.worker.LookupKeyClient", "ctx", "attribute", "its ZMQ context, closed with it on retiring"),
    Private(f"{_STORE}.worker.LookupKeyClient", "close", "method", "retires upstream's idle client"),
    # The connector (vllm_connector.py): its two roles' halves.
    Private(_CONNECTOR, "connector_scheduler", "attribute", "the scheduler half, replaced by ours"),
    Private(_CONNECTOR, "connector_worker", "attribute", "the worker half our lookup server answers through"),
    Private(_CONNECTOR, "request_finished_all_groups", "method", "ends a request's lookup record, then upstream's"),
    # The worker side (server/worker_backend.py, server/vllm_store_worker.py): upstream's key code as a backend.
    Private(_WORKER, "store", "attribute", "the worker's MooncakeDistributedStore: batch_is_exist, remove_all"),
    Private(_WORKER, "lookup_server", "attribute", "set on the rank that serves lookups: ours serves beside it"),
    Private(_WORKER, "token_dbs", "attribute", "the key databases: a key per block hash and group"),
    Private(_WORKER, "_kv_cache_groups", "attribute", "which groups are prefix-cacheable (the key layout)"),
    Private(_WORKER, "hash_block_size", "attribute", "tells whether a known prefix can be skipped per block"),
    Private(_WORKER, "lookup", "method", "upstream's own lookup, run over our batched store call"),
    Private(_WORKER, "_record_kv_connector_operation", "method", "upstream's store metrics, once per real call"),
    Private(_WORKER, "_select_store_layout", "method", "the key namespace of a worker built without a GPU"),
    Private(_WORKER, "_compute_group_tp_replication_factors", "method", "the same, per cache group"),
    Private(_WORKER, "_build_token_databases", "method", "the same: the key databases"),
    Private(_WORKER, "_init_lookup_key_prefixes", "method", "the same: the lookup key prefixes"),
    Private(f"{_STORE}.worker", "MooncakeStoreCoordinator", "name", "the cache groups of a GPU-less worker"),
    Private(f"{_STORE}.worker", "get_zmq_rpc_path_lookup", "name", "upstream's lookup socket (transport upstream)"),
    Private(f"{_STORE}.data", "KeyMetadata", "name", "a GPU-less worker's key prefix"),
    Private(f"{_STORE}.data", "BlobBlockHashes", "name", "hashes as upstream's lookup takes them"),
    Private(f"{_STORE}.data", "MooncakeLookupResult", "name", "a hit past a skipped prefix, as upstream's"),
    Private(f"{_STORE}.data", "TailKeyBoundary", "name", "the same, its tail boundary"),
    Private(f"{_STORE}.protocol", "LOOKUP_MSG", "name", "upstream's lookup frame (transport upstream)"),
    Private(f"{_STORE}.metrics", "MooncakeStoreConnectorStats", "name", "upstream's stats, carried beside ours"),
    Private(f"{_STORE}.metrics", "MooncakeStorePromMetrics", "name", "upstream's families, served beside ours"),
    # vLLM's connector stats pipeline (metrics/vllm_stats.py): our families on vLLM's own /metrics.
    Private("vllm.distributed.kv_transfer.kv_connector.v1.metrics.KVConnectorPromMetrics", "_counter_cls",
            "attribute", "the metric classes vLLM's logger hands on (its multiprocess-safe wrappers)"),
    Private("vllm.distributed.kv_transfer.kv_connector.v1.metrics.KVConnectorPromMetrics", "_gauge_cls",
            "attribute", "the same"),
    Private("vllm.distributed.kv_transfer.kv_connector.v1.metrics.KVConnectorPromMetrics", "_histogram_cls",
            "attribute", "the same"),
    Private("vllm.distributed.kv_transfer.kv_connector.v1.metrics.KVConnectorPromMetrics",
            "per_engine_labelvalues", "attribute", "each engine's labels (model_name, engine)"),
    Private("vllm.distributed.kv_transfer.kv_connector.v1.metrics.KVConnectorStats", "data", "attribute",
            "the per-step records vLLM carries from the scheduler to the logger"),
    Private("vllm.v1.core.kv_cache_utils", "resolve_kv_cache_block_sizes", "name", "a GPU-less worker's blocks"),
    # The engine core (input_thread.py): where a request is handed on, on vLLM's input thread.
    Private("vllm.v1.engine.core.EngineCore", "preprocess_add_request", "method",
            "wrapped: a request's lookup is sent as soon as the input thread has built it"),
)


def _resolve(dotted: str) -> Any:
    """The module, or the class inside a module, named ``dotted``."""
    module, _, rest = dotted.partition(".")
    obj: Any = importlib.import_module(module)
    path = module
    for part in rest.split(".") if rest else []:
        path = f"{path}.{part}"
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(path)
    return obj


def _assigned(cls: type) -> set[str]:
    """The ``self.NAME`` targets assigned in the source of ``cls`` and of its bases from vLLM."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("vllm"):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                names.add(node.attr)
    return names


def missing(entries: tuple[Private, ...] = PRIVATE) -> list[str]:
    """One line for each entry the vLLM this process imports lacks (empty: every one is there)."""
    problems: list[str] = []
    assigned: dict[str, set[str]] = {}
    for entry in entries:
        where = f"{entry.owner}.{entry.name}"
        try:
            owner = _resolve(entry.owner)
        except (ImportError, AttributeError) as e:
            problems.append(f"{where}: its owner does not import ({e})")
            continue
        if entry.kind == "attribute":
            if entry.owner not in assigned:
                assigned[entry.owner] = _assigned(owner)
            ok = (entry.name in assigned[entry.owner] or hasattr(owner, entry.name)
                  or entry.name in getattr(owner, "__dataclass_fields__", {}))
        elif entry.kind == "method":
            ok = callable(getattr(owner, entry.name, None))
        else:
            ok = hasattr(owner, entry.name)
        if not ok:
            problems.append(f"{where}: no such {entry.kind} ({entry.why})")
    return problems


def main() -> int:
    """Print the vLLM version and what it lacks as JSON; exit 1 when anything is missing."""
    import vllm

    problems = missing()
    print(json.dumps({"vllm": str(getattr(vllm, "__version__", "unknown")), "checked": len(PRIVATE),
                      "missing": problems}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["PRIVATE", "Private", "main", "missing"]

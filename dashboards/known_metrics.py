"""Metric names the dashboards and alerts read that are not ours: vLLM's own and the Mooncake master's.

Our names come from ``mooncake_lookout.metrics.catalogue``. These are the only other names a query may
use; tests check them against the real producers (vLLM's source, a real ``mooncake_master``'s /metrics),
so an upstream rename fails a test instead of leaving an empty panel.
"""

from __future__ import annotations

# vLLM 0.33 (vllm/v1/metrics/loggers.py): per-engine series with model_name and engine labels.
# Keyed by the name vLLM registers (prometheus_client adds ``_total`` to counters).
VLLM_COUNTERS: tuple[str, ...] = ("vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits")
VLLM_GAUGES: tuple[str, ...] = ("vllm:num_requests_waiting_by_reason",)

# vLLM 0.33's Mooncake store connector (distributed/kv_transfer/kv_connector/v1/mooncake/store/metrics.py):
# the worker's store operations (lookup_exists, save_exists, save_put, load_get) by operation and status.
VLLM_STORE_OP_HISTOGRAMS: tuple[str, ...] = ("vllm:mooncake_store_operation_time_seconds",)
VLLM_STORE_OP_COUNTERS: tuple[str, ...] = (
    "vllm:mooncake_store_operation_total", "vllm:mooncake_store_operation_keys_total",
    "vllm:mooncake_store_operation_bytes_total", "vllm:mooncake_store_operation_failed_keys_total")
STORE_OP_SECONDS = "vllm:mooncake_store_operation_time_seconds"
STORE_OP_CALLS = "vllm:mooncake_store_operation_total"
STORE_OP_KEYS = "vllm:mooncake_store_operation_keys_total"
STORE_OP_BYTES = "vllm:mooncake_store_operation_bytes_total"
STORE_OP_FAILED_KEYS = "vllm:mooncake_store_operation_failed_keys_total"
STORE_OP_SERIES: frozenset[str] = frozenset(
    {STORE_OP_CALLS, STORE_OP_KEYS, STORE_OP_BYTES, STORE_OP_FAILED_KEYS}
    | {STORE_OP_SECONDS + s for s in ("_bucket", "_sum", "_count")})

EXTERNAL_PREFIX_QUERIES = "vllm:external_prefix_cache_queries_total"
EXTERNAL_PREFIX_HITS = "vllm:external_prefix_cache_hits_total"
REQUESTS_WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"

# Mooncake master (mooncake-transfer-engine 0.3.13): series exactly as its /metrics serves them.
MASTER_BATCH_EXIST_REQUESTS = "master_batch_exist_key_requests_total"
MASTER_BATCH_EXIST_ITEMS = "master_batch_exist_key_items_total"
MASTER_BATCH_EXIST_FAILURES = "master_batch_exist_key_failures_total"
MASTER_BATCH_EXIST_FAILED_ITEMS = "master_batch_exist_key_failed_items_total"
MASTER_KEY_COUNT = "master_key_count"
MASTER_ACTIVE_CLIENTS = "master_active_clients"
MASTER_ALLOCATED_BYTES = "master_allocated_bytes"
MASTER_CAPACITY_BYTES = "master_total_capacity_bytes"
MASTER_EVICTED_KEYS = "master_evicted_key_count"  # a counter, served without ``_total``
MASTER_SUCCESSFUL_EVICTIONS = "master_successful_evictions_total"

MASTER_SERIES: frozenset[str] = frozenset({
    MASTER_BATCH_EXIST_REQUESTS, MASTER_BATCH_EXIST_ITEMS, MASTER_BATCH_EXIST_FAILURES,
    MASTER_BATCH_EXIST_FAILED_ITEMS, MASTER_KEY_COUNT, MASTER_ACTIVE_CLIENTS, MASTER_ALLOCATED_BYTES,
    MASTER_CAPACITY_BYTES, MASTER_EVICTED_KEYS, MASTER_SUCCESSFUL_EVICTIONS,
})
VLLM_SERIES: frozenset[str] = frozenset({EXTERNAL_PREFIX_QUERIES, EXTERNAL_PREFIX_HITS, REQUESTS_WAITING_BY_REASON}
                                       | STORE_OP_SERIES)
# Prometheus' own per-target series.
PROMETHEUS_SERIES: frozenset[str] = frozenset({"up"})

__all__ = [
    "EXTERNAL_PREFIX_HITS", "EXTERNAL_PREFIX_QUERIES", "MASTER_ACTIVE_CLIENTS", "MASTER_ALLOCATED_BYTES",
    "MASTER_BATCH_EXIST_FAILED_ITEMS", "MASTER_BATCH_EXIST_FAILURES", "MASTER_BATCH_EXIST_ITEMS",
    "MASTER_BATCH_EXIST_REQUESTS", "MASTER_CAPACITY_BYTES", "MASTER_EVICTED_KEYS", "MASTER_KEY_COUNT",
    "MASTER_SERIES", "MASTER_SUCCESSFUL_EVICTIONS", "PROMETHEUS_SERIES", "REQUESTS_WAITING_BY_REASON",
    "STORE_OP_BYTES", "STORE_OP_CALLS", "STORE_OP_FAILED_KEYS", "STORE_OP_KEYS", "STORE_OP_SECONDS", "STORE_OP_SERIES",
    "VLLM_COUNTERS", "VLLM_GAUGES", "VLLM_SERIES", "VLLM_STORE_OP_COUNTERS", "VLLM_STORE_OP_HISTOGRAMS",
]

"""``LookoutMooncakeStoreConnector``: vLLM's Mooncake store connector with the lookout lookup path.

Enable it in ``vllm serve`` either by module path::

    --kv-transfer-config '{"kv_connector": "LookoutMooncakeStoreConnector",
        "kv_connector_module_path": "mooncake_lookout.connector.vllm_connector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"lookup_async": true, ...}}'

or, with this package installed, by name alone (its ``vllm.general_plugins`` entry point registers it).

The scheduler role runs :class:`LookoutMooncakeStoreScheduler`; the worker role keeps upstream's data
path untouched and, with ``lookup_transport: pipelined``, also serves our lookup server on rank 0, beside
upstream's own. Importing this module checks the vLLM version first (:mod:`.vllm_version`).
"""

from __future__ import annotations

from typing import Any

from mooncake_lookout.connector.vllm_version import require_supported_vllm

# Before any of vLLM's internals is touched: a vLLM this package was not tested with fails here, in one line.
require_supported_vllm()

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import MooncakeStoreConnector  # noqa: E402

from mooncake_lookout.connector.config import LookupConfig  # noqa: E402
from mooncake_lookout.connector.plugin import CONNECTOR_NAME  # noqa: E402
from mooncake_lookout.connector.scheduler_adapter import (  # noqa: E402
    LookoutMooncakeStoreScheduler,
    retire_upstream_client,
)
from mooncake_lookout.connector.server.worker_backend import serve_pipelined  # noqa: E402
from mooncake_lookout.connector.transport.names import PIPELINED  # noqa: E402


class LookoutMooncakeStoreConnector(MooncakeStoreConnector):
    """Upstream's connector; the scheduler's lookups go through mooncake-lookout's client."""

    connector_scheduler: Any  # upstream's scheduler until __init__ replaces it with ours (scheduler role)

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.lookup_config = LookupConfig.from_extra_config(extra)  # bad keys fail here, in both roles
        super().__init__(vllm_config, role, kv_cache_config)
        self._lookup_server = None
        if role == KVConnectorRole.SCHEDULER:
            # super() built upstream's scheduler; replace it (it held only an idle client).
            upstream = self.connector_scheduler
            if upstream is not None:
                retire_upstream_client(upstream.client)
            # owner=self: vLLM's scheduler holds this connector, so its engine core's arrivals (and only those) reach
            # ours (input_thread.py).
            ours = self.connector_scheduler = LookoutMooncakeStoreScheduler(vllm_config, kv_cache_config, owner=self)
            # vLLM calls these on its engine thread once or more a request or a step, each cold after the model
            # step: straight to the scheduler side, without the hop through this class (the methods below remain
            # for the worker role and for calls through the class).
            self.on_new_request = ours.on_new_request  # type: ignore[method-assign]
            self.get_num_new_matched_tokens = ours.get_num_new_matched_tokens
            self.update_state_after_alloc = ours.update_state_after_alloc
            self.build_connector_meta = ours.build_connector_meta
            self.get_kv_connector_stats = ours.take_stats  # type: ignore[method-assign]
        elif self.lookup_config.lookup_transport == PIPELINED:
            self._lookup_server = serve_pipelined(vllm_config, self.lookup_config, self.connector_worker)

    @property
    def lookup_client(self) -> Any:
        """The scheduler's :class:`LookupClient` (scheduler role only)."""
        assert self.connector_scheduler is not None
        return self.connector_scheduler.client

    def on_new_request(self, request: Any) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.on_new_request(request)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        if self.connector_scheduler is not None:
            self.connector_scheduler.request_finished(request)
        return super().request_finished_all_groups(request, block_ids)

    def get_kv_connector_stats(self) -> Any:
        """Scheduler role: this step's lookup figures; worker role: upstream's store-operation stats."""
        if isinstance(self.connector_scheduler, LookoutMooncakeStoreScheduler):
            return self.connector_scheduler.take_stats()  # None for a step with nothing to report
        return super().get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        from mooncake_lookout.metrics.vllm_stats import build_kv_connector_stats

        return build_kv_connector_stats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: Any,
                           per_engine_labelvalues: Any) -> Any:
        from mooncake_lookout.metrics.vllm_stats import build_prom_metrics

        return build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        scheduler = getattr(self, "connector_scheduler", None)
        ours = LookoutMooncakeStoreScheduler  # None when this runs from __del__ at interpreter exit
        if ours is not None and isinstance(scheduler, ours):
            scheduler.close()
        server = getattr(self, "_lookup_server", None)
        if server is not None:
            server.close()
            self._lookup_server = None
        super().shutdown()


__all__ = ["CONNECTOR_NAME", "LookoutMooncakeStoreConnector"]

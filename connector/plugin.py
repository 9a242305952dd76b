"""vLLM plugin entry point: registers ``LookoutMooncakeStoreConnector`` by name.

vLLM calls :func:`register` in every process at start-up (entry point group ``vllm.general_plugins``),
so ``"kv_connector": "LookoutMooncakeStoreConnector"`` works without ``kv_connector_module_path``.
"""

from __future__ import annotations

CONNECTOR_NAME = "LookoutMooncakeStoreConnector"
MODULE_PATH = "mooncake_lookout.connector.vllm_connector"


def register() -> None:
    """Register the connector with vLLM's factory; registering twice is harmless.

    vLLM calls this in every process, also where the connector is not configured, so it never fails vLLM's
    start for an unsupported version: registering only names the module. The version check runs when the
    connector's module loads (:mod:`.vllm_version`), so a deployment that uses the connector on an unsupported
    vLLM fails at start-up, in one line.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in getattr(KVConnectorFactory, "_registry", {}):
        KVConnectorFactory.register_connector(CONNECTOR_NAME, MODULE_PATH, CONNECTOR_NAME)


__all__ = ["CONNECTOR_NAME", "MODULE_PATH", "register"]

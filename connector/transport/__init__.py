"""Builds the configured transport; the only place that knows every transport by name."""

from __future__ import annotations

from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.transport import Transport


def make_transport(config: LookupConfig, address: str) -> Transport:
    """The transport ``config.lookup_transport`` names, connected to ``address``."""
    if config.lookup_transport == "pipelined":
        from mooncake_lookout.connector.pipelined import PipelinedTransport

        return PipelinedTransport(address, timeout_s=config.timeout_s)
    from mooncake_lookout.connector.upstream import UpstreamTransport

    return UpstreamTransport(address)


__all__ = ["make_transport"]

"""Serve a ``prometheus_client`` registry on ``/metrics`` for a standalone process, and read such a page.

vLLM serves its own ``/metrics``; the lookup server, demo and bench use this. Binds 127.0.0.1 unless
told otherwise, and port 0 picks a free port (read it back from :attr:`MetricsEndpoint.port`).

Always the classic text format (0.0.4): prometheus_client 0.26 answers an OpenMetrics ``Accept`` with
``escaping=underscores``, rewriting ``vllm:`` sample names but not their ``# TYPE`` lines, and
Prometheus 2.x then keeps only the first family of the scrape. The text format keeps the colon intact.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.parser import text_string_to_metric_families

TEXT_FORMAT = "text/plain; version=0.0.4"


class _QuietHandler(WSGIRequestHandler):
    """Logs nothing per scrape."""

    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing."""


def _text_only(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    """Wrap a WSGI app so every scrape is answered in the classic text format."""

    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        environ["HTTP_ACCEPT"] = TEXT_FORMAT
        return app(environ, start_response)

    return wrapped


class MetricsEndpoint:
    """A running ``/metrics`` HTTP endpoint; a context manager that stops it on exit."""

    def __init__(self, port: int = 0, addr: str = "127.0.0.1",
                 registry: CollectorRegistry = REGISTRY) -> None:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        server_cls = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
        try:
            self._server: ThreadingWSGIServer = make_server(addr, port, _text_only(make_wsgi_app(registry)), server_cls,
                                       handler_class=_QuietHandler)
        except OSError as exc:
            raise OSError(exc.errno, f"{exc.strerror} (metrics endpoint addr={addr}, port={port})") from exc
        self.addr = addr
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="lookout-metrics", daemon=True)
        self._thread.start()
        self._stopped = False

    @property
    def url(self) -> str:
        """The ``/metrics`` URL of this endpoint."""
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving and close the socket; idempotent. ``timeout_s``: wait for the serving thread."""
        if self._stopped:
            return
        self._stopped = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout_s)

    def __enter__(self) -> MetricsEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_metrics(port: int = 0, addr: str = "127.0.0.1",
                  registry: CollectorRegistry = REGISTRY) -> MetricsEndpoint:
    """Start serving ``registry`` on ``http://addr:port/metrics``; the bound port is ``.port``."""
    return MetricsEndpoint(port, addr, registry)


def new_registry() -> CollectorRegistry:
    """A fresh registry of this process's own (not the global one), for one server or one run."""
    return CollectorRegistry()


def sum_samples(text: str, names: Iterable[str]) -> dict[str, float]:
    """Each of ``names`` found in a ``/metrics`` page (text format), summed over its label sets.

    Raises ValueError if the text does not parse.
    """
    wanted = set(names)
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


__all__ = ["MetricsEndpoint", "TEXT_FORMAT", "new_registry", "serve_metrics", "sum_samples"]

"""A place for the bench's spans to go: an OTLP/HTTP endpoint on 127.0.0.1 that accepts every export and keeps none.

Why: production exports spans over OTLP/HTTP (protobuf) to a collector; the bench prices that path as it runs,
serialisation and the HTTP post included, so it needs something listening. This is the least a collector does:
it reads the body, answers ``200`` with an empty ``ExportTraceServiceResponse`` and counts what came. It runs on
a daemon thread of the bench's process; one is shared by every client of a process (:func:`shared`), started on
first use. With the chart's sampling a post comes every few seconds at most (the SDK's batch processor sends
every 5 s or 512 spans).
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PATH = "/v1/traces"


class OtlpSink:
    """An OTLP/HTTP traces endpoint on ``127.0.0.1`` (a free port): counts posts and bytes, answers 200."""

    def __init__(self) -> None:
        self.posts = 0
        self.bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                size = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(size)
                sink.posts += 1
                sink.bytes += size
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:  # quiet: the bench prints its own report
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="lookout-otlp-sink")
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """The URL an exporter posts to (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``)."""
        return f"http://127.0.0.1:{self.port}{PATH}"

    def close(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()


_shared: OtlpSink | None = None
_lock = threading.Lock()


def shared() -> OtlpSink:
    """This process's sink, started on first use (it lives as long as the process)."""
    global _shared
    with _lock:
        if _shared is None:
            _shared = OtlpSink()
        return _shared


__all__ = ["PATH", "OtlpSink", "shared"]

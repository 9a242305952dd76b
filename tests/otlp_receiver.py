"""An OTLP/HTTP traces endpoint on 127.0.0.1 that keeps what it is sent: where spans really arrive in a test (a
helper of tests/, which conftest puts on sys.path: in the package only metrics/ imports opentelemetry).

Why: the tracing tests export through the real OTLP/HTTP exporter (ours, and vLLM's own with
``--otlp-traces-endpoint``), so the check is what reaches a collector, decoded from the wire.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class OtlpReceiver:
    """Decodes every POSTed ``ExportTraceServiceRequest``; :meth:`spans` lists what came. Stop it with :meth:`close`
    (or use it as a context manager)."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.paths: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                msg = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.paths.append(self.path)
                receiver.requests.append(msg)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def spans(self) -> list[tuple[str, Any]]:
        """(service name, span) for every span received so far."""
        out = []
        for req in list(self.requests):
            for rs in req.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                out.extend((service, span) for ss in rs.scope_spans for span in ss.spans)
        return out

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> OtlpReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["OtlpReceiver"]

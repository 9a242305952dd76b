"""``mooncake-lookout serve``: the lookup server as a standalone process over a real Mooncake store.

Why: demo, bench, tests and deployments without a vLLM worker need the same server the worker runs
in-process. It listens on a private IPC socket unless told otherwise (TCP binds loopback by default),
prints ``listening on <address>`` once it serves, exposes ``/metrics`` when ``--metrics-port`` is given,
and stops cleanly on SIGTERM / SIGINT. It refuses (exit code 2, one line naming the window, the lease and the
rule) a ``--lease-window-ms`` the master's key lease cannot cover: at once with ``--embedded-master`` (its lease
is known), else as soon as its lease probe sees the lease end (server/lease.py).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from mooncake_lookout.connector.cli.serve_security import ServeRefused, add_security_arguments, server_security
from mooncake_lookout.connector.cli.serve_vllm_layout import (
    LayoutError,
    add_vllm_layout_arguments,
    read_layout,
    vllm_layout_backend,
)
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.server import lease
from mooncake_lookout.connector.server.observer import ServerObserver

logger = logging.getLogger(__name__)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to an ``argparse`` subparsers object; returns its parser."""
    p = subparsers.add_parser("serve", help="run a standalone lookup server over a Mooncake store",
                              description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()  # one is needed, unless --vllm-layout reads it from mooncake.json
    src.add_argument("--master", metavar="HOST:PORT", help="address of a running Mooncake master")
    src.add_argument("--embedded-master", action="store_true",
                     help="start a Mooncake master on 127.0.0.1 for this server (demo, tests)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--address", metavar="ENDPOINT",
                       help="ipc://PATH or tcp://HOST:PORT to listen on (default: a private IPC directory)")
    where.add_argument("--tcp-port", type=int, metavar="PORT", help="listen on tcp://127.0.0.1:PORT (0: any free port)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block hash (default 16)")
    p.add_argument("--namespace", default="lookout", help="key namespace in the store (default lookout)")
    p.add_argument("--metrics-port", type=int, metavar="PORT", help="serve Prometheus /metrics on this port")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address for /metrics (default 127.0.0.1)")
    ttl = LookupConfig().lookup_answer_ttl_ms
    p.add_argument("--lease-window-ms", type=float, default=ttl, metavar="MS",
                   help="the clients' lookup_answer_ttl_ms: clients may cache found blocks and hold hits once the "
                        f"master's key lease is known to cover it (default {ttl:g}; 0: no store epoch, clients cache "
                        "nothing); serve exits with code 2 if the lease is too short for it")
    p.add_argument("--log-level", default="INFO", help="Python log level (default INFO)")
    p.add_argument("--verbose", action="store_true",
                   help="show every log line, the known harmless start-up lines of Mooncake and vLLM included "
                        "(docs/troubleshooting.md)")
    add_vllm_layout_arguments(p)
    add_security_arguments(p)
    p.set_defaults(func=run_serve)
    return p


_WINDOW_KEY = "--lease-window-ms (the clients' lookup_answer_ttl_ms)"


class _LeaseRefusal(ServerObserver):
    """Stops ``serve`` when the server's lease probe finds the master's lease too short for the window."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self.refused = False

    def prefix_cache_state(self, state: str) -> None:
        if state == lease.LEASE_TOO_SHORT:
            self.refused = True
            self.stop.set()


def _listen_address(args: argparse.Namespace) -> str | None:
    if args.address:
        return args.address
    if args.tcp_port is not None:
        return f"tcp://127.0.0.1:{args.tcp_port}"
    return None


def _server_observers(args: argparse.Namespace, stack: contextlib.ExitStack) -> list[ServerObserver]:
    """The server's Prometheus figures and their ``/metrics`` endpoint when ``--metrics-port`` is set."""
    if args.metrics_port is None:
        return []
    from mooncake_lookout.metrics.exporter import MetricsEndpoint, new_registry
    from mooncake_lookout.metrics.server_sink import ServerMetrics

    registry = new_registry()
    observer = ServerMetrics(registry)
    endpoint = stack.enter_context(MetricsEndpoint(args.metrics_port, args.metrics_host, registry))
    print(f"metrics on {endpoint.url}", flush=True)
    return [observer]


def run_serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM / SIGINT; returns the process exit code."""
    from mooncake_lookout.connector.rigs.console import Console

    console = Console(verbose=args.verbose, level=args.log_level).install()  # before vLLM is imported
    if args.vllm_layout:
        console.adopt_torch()
    from mooncake_lookout.connector.rigs.master import MOONCAKE_LEASE_MS, EmbeddedMaster, MasterError
    from mooncake_lookout.connector.server import LookupServer
    from mooncake_lookout.connector.server.prefix_index import PrefixIndex
    from mooncake_lookout.connector.server.store import MARKER_LOCAL_BUFFER, WRITER_GLOBAL_SEGMENT, open_store

    try:
        security = server_security(args, _listen_address(args))
    except ServeRefused as e:
        print(f"mooncake-lookout serve: {e}", file=sys.stderr)
        return 2
    window_s = args.lease_window_ms / 1000
    if args.embedded_master and window_s > 0 and lease.probe_window_s(window_s) * 1000 > MOONCAKE_LEASE_MS:
        # The embedded master's lease is known: refuse at once (with --master, the server's probe finds it).
        rule = lease.lease_rule(window_s, MOONCAKE_LEASE_MS / 1000, measured=False, key=_WINDOW_KEY)
        print(f"mooncake-lookout serve: {rule}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with contextlib.ExitStack() as stack:
        try:
            layout = read_layout(args) if args.vllm_layout else None
            if args.embedded_master:
                master = stack.enter_context(EmbeddedMaster(kv_lease_ttl_ms=MOONCAKE_LEASE_MS))
                master_address = master.rpc_address
                print(f"embedded Mooncake master on {master_address}, pid {master.pid}; its metrics: "
                      f"{master.metrics_url} (doctor --master-metrics {master.metrics_url})", flush=True)
            else:
                master_address = args.master or (layout.master if layout else None)
            if not master_address:
                raise LayoutError("give --master HOST:PORT or --embedded-master (with --vllm-layout, "
                                  "--mooncake-config may name the master)")
            # It puts its marker; an embedded master has no other client, so this one lends it memory.
            with console.native():  # Mooncake's client logs its set-up from C++
                store = open_store(master_address, local_buffer_size=MARKER_LOCAL_BUFFER,
                                   global_segment_size=WRITER_GLOBAL_SEGMENT if args.embedded_master else 0,
                                   tenant_id=layout.tenant_id if layout else None)
            stack.callback(store.close)
            backend = (vllm_layout_backend(layout, store, stack) if layout
                       else PrefixIndex(store, args.block_size, args.namespace))
        except (MasterError, LayoutError) as e:
            print(f"mooncake-lookout serve: {e}", file=sys.stderr)
            return 2
        refusal = _LeaseRefusal(stop)
        server = stack.enter_context(LookupServer(backend, _listen_address(args), marker=window_s > 0,
                                                  lease_window_s=window_s,
                                                  observers=[refusal, *_server_observers(args, stack)], **security))
        print(f"listening on {server.address}", flush=True)
        note = console.summary()
        if note:
            print(note, flush=True)
        stop.wait()
        if refusal.refused and server.lease_probe is not None:  # the lease is the master's: serving would not help
            print(f"mooncake-lookout serve: {server.lease_probe.refusal} ({_WINDOW_KEY})", file=sys.stderr)
            return 2
        logger.info("stopping the lookup server")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mooncake_lookout.connector.cli.serve ...``: the ``serve`` subcommand on its own."""
    parser = argparse.ArgumentParser(prog="mooncake-lookout")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


__all__ = ["add_serve_parser", "main", "run_serve"]

if __name__ == "__main__":
    sys.exit(main())

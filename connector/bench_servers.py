"""Both lookup servers in a child process, as in vLLM, where the lookup server lives in the worker.

Why: the scheduler's process must not host the servers' threads in a benchmark: they would fight the
scheduler for the GIL and skew every latency it measures. The child runs vLLM's own
``LookupKeyServer`` and our :class:`LookupServer` over one :class:`PrefixIndex` on its own store client,
prints one JSON line with their addresses, and serves until its stdin closes. The kernel kills it if
its parent dies (Linux ``PR_SET_PDEATHSIG``); :meth:`ServerProcess.stop` ends it by pid otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from mooncake_lookout.connector.processes import die_with_parent

BLOCK_SIZE = 16


class ServerProcess:
    """Start, address and stop the server child process (context manager)."""

    def __init__(self, master_address: str, namespace: str, rpc_base_path: str, lookup_rpc_port: int, *,
                 rpc_timeout_ms: int | None = 30_000, start_timeout_s: float = 120.0) -> None:
        self.args = [f"--master={master_address}", f"--namespace={namespace}", f"--rpc-base-path={rpc_base_path}",
                     f"--lookup-rpc-port={lookup_rpc_port}"]
        if rpc_timeout_ms is not None:
            self.args.append(f"--rpc-timeout-ms={rpc_timeout_ms}")
        self.start_timeout_s = start_timeout_s
        self.addresses: dict[str, str] = {}
        self._proc: subprocess.Popen[str] | None = None

    @property
    def pid(self) -> int | None:
        """The child's process id while it runs."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> ServerProcess:
        """Spawn the child and wait (bounded) for its addresses line."""
        import selectors

        env = dict(os.environ, MC_LOG_LEVEL=os.environ.get("MC_LOG_LEVEL", "ERROR"))
        self._proc = subprocess.Popen([sys.executable, "-m", __name__, *self.args], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                                      preexec_fn=die_with_parent())
        assert self._proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self._proc.stdout, selectors.EVENT_READ)
        ready = sel.select(self.start_timeout_s)
        sel.close()
        line = self._proc.stdout.readline() if ready else ""
        try:
            msg = json.loads(line) if line else {"error": f"no answer within {self.start_timeout_s} s"}
        except json.JSONDecodeError:
            msg = {"error": f"unexpected output {line!r}"}
        if "error" in msg:
            self.stop()
            raise RuntimeError(f"lookup server process failed: {msg['error']}")
        self.addresses = msg
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close its stdin (the stop signal), then SIGKILL it by pid if it has not ended within ``timeout_s``."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout_s)
        except (subprocess.TimeoutExpired, OSError):
            proc.kill()
            proc.wait(timeout_s)
        if proc.stdout is not None:
            proc.stdout.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(argv: Sequence[str] | None = None) -> int:
    """The child's body: both servers over one index until stdin closes."""
    p = argparse.ArgumentParser(prog="python -m mooncake_lookout.connector.bench_servers")
    p.add_argument("--master", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--rpc-base-path", required=True)
    p.add_argument("--lookup-rpc-port", type=int, required=True)
    p.add_argument("--rpc-timeout-ms", type=int, default=None)
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop (Ctrl-C reaches both)
    os.environ["VLLM_RPC_BASE_PATH"] = args.rpc_base_path
    try:
        from mooncake_lookout.connector.mooncake_master import open_store
        from mooncake_lookout.connector.prefix_index import PrefixIndex
        from mooncake_lookout.connector.server import LookupServer
        from mooncake_lookout.connector.upstream_server import (
            UpstreamLookupServer,
            lookup_vllm_config,
        )

        store: Any = open_store(args.master, rpc_timeout_ms=args.rpc_timeout_ms)
        index = PrefixIndex(store, BLOCK_SIZE, namespace=args.namespace)
        upstream = UpstreamLookupServer(index, lookup_vllm_config(args.lookup_rpc_port)).start()
        ours = LookupServer(index, None).start()
    except Exception as exc:  # reported to the parent, which raises it
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    print(json.dumps({"upstream": upstream.address, "pipelined": ours.address}), flush=True)
    sys.stdin.read()  # until the parent closes it (or dies)
    ours.close(timeout_s=2.0)
    upstream.stop(timeout_s=2.0)
    store.close()
    return 0


__all__ = ["ServerProcess", "serve"]

if __name__ == "__main__":
    sys.exit(serve())

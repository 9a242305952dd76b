"""Lookup servers in a child process: the one server process of every rig (fault tests, soak, bench, demo).

Why a process: fault tests and the soak must break a *real* server the way production breaks: the process
dies (SIGKILL), hangs (SIGSTOP) or comes back on the same address, and a thread cannot be killed or frozen
on its own. The bench and the demo need the servers out of the scheduler's process too, as in vLLM where
the lookup server lives in the worker: in-process server threads would fight the scheduler for the GIL and
skew every latency it measures.

One child serves one or more transports over one
:class:`~mooncake_lookout.connector.server.prefix_index.PrefixIndex` on its own real store client:

* ``pipelined``: our :class:`~mooncake_lookout.connector.server.loop.LookupServer` (DEALER/ROUTER, ``ipc://``
  or ``tcp://127.0.0.1``);
* ``upstream``: vLLM 0.33's real ``LookupKeyServer`` (via :mod:`.vllm_lookup_server`), bound where vLLM binds
  it: ``ipc://{VLLM_RPC_BASE_PATH}/lookup_rpc_port_{port}_host_..._dp_rank0``.

The index sits behind an :class:`~.faults.InjectedDelayBackend` (off unless asked for). With a
:class:`~.vllm_layout.Layout` the child serves a vLLM deployment's keys instead: both servers answer from
upstream's own ``MooncakeStoreWorker`` for that layout, over a lookup-only store client wrapped in a
:class:`~.vllm_layout.ReadOnlyStore` (nothing it does can write or wipe a key).

``keep_epoch``: our server keeps the store's epoch marker (``server/epoch.py``) as it does inside vLLM, so
clients' prefix caches are on. That takes a store client with a small staging buffer (a lookup-only client
cannot put the marker, and the server then keeps epoch 0: clients cache nothing) and, with a layout, a
worker whose store is not read-only. The server trusts the master's lease at once (no probe): the rig that
asks for it runs the master with a lease covering the clients' ``lookup_answer_ttl_ms``.

The store client the servers use is wrapped in a :class:`~.counting_store.CountingStore`: the keys they
really ask are counted (:meth:`ServerProcess.store_counts`). The child is this module run as a script; it
prints ``listening on NAME=ADDRESS ...`` once it serves, ``delay on`` / ``delay off`` after SIGUSR1 /
SIGUSR2, ``store calls=N keys=M`` after SIGWINCH, and stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from mooncake_lookout.connector.rigs.processes import ChildProcess, freeze, thaw
from mooncake_lookout.connector.server.limits import Limits, add_limit_arguments, flag_of, limits_from_args
from mooncake_lookout.connector.transport.names import PIPELINED, TRANSPORTS, UPSTREAM

CHILD_MODULE = "mooncake_lookout.connector.rigs.server_process"  # this module, run as the child
READY_PREFIX = "listening on "
STANDBY_READY = "ready"
DELAY_ON_SIGNAL = signal.SIGUSR1
DELAY_OFF_SIGNAL = signal.SIGUSR2
# Asks the child for its store counts. SIGWINCH because its default action is to ignore it: one that reaches
# the child before the handler is installed does no harm.
COUNTS_SIGNAL = signal.SIGWINCH
COUNTS_PREFIX = "store calls="
# ServerProcess(server_options=...) names -> the child's flags: CURVE's, and one per field of server.limits.Limits
_SERVER_OPTIONS = {"curve_secret_key": "--curve-secret-key", "curve_allowed_clients": "--curve-allowed-clients",
                   **{f.name: flag_of(f.name) for f in dataclasses.fields(Limits)}}


def parse_ready_line(line: str) -> dict[str, str]:
    """The addresses a ready line announces: ``listening on pipelined=ipc://... upstream=ipc://...``."""
    pairs = (item.split("=", 1) for item in line[len(READY_PREFIX):].split())
    return {name: address for name, address in pairs}


def parse_counts_line(line: str) -> tuple[int, int]:
    """``(calls, keys)`` from the child's ``store calls=N keys=M`` line."""
    fields = dict(item.split("=", 1) for item in line.strip().split()[1:])
    return int(fields["calls"]), int(fields["keys"])


# -- parent side -----------------------------------------------------------------------------------------------

class ServerProcess:
    """Lookup servers in a child process: start, kill, pause, resume and restart them by pid, same addresses.

    ``transports``: ``pipelined`` (our server), ``upstream`` (vLLM's ``LookupKeyServer``), or a sequence of
    both, served by one child over one index. ``master``: the Mooncake master's ``host:port``.
    ``address`` (pipelined only): ``ipc://PATH`` or ``tcp://127.0.0.1:PORT`` (port 0 picks one, kept across
    restarts); default an IPC socket in a private 0700 folder made here. ``rpc_port`` / ``rpc_base_path``
    (upstream only): vLLM's ``lookup_rpc_port`` and ``VLLM_RPC_BASE_PATH``. ``delay_ms`` is the injected
    store delay, active from the start if ``delay_on``; ``reset_delay_ms``, one before each wipe.
    ``store_rpc_timeout_ms`` bounds one store call in the child when the master stalls (None: Mooncake's
    30 s). ``start_timeout_s`` bounds the wait for the ready line (an upstream child imports vLLM: 10-15 s).
    ``server_options`` (pipelined only): more ``LookupServer`` settings, as ``curve_secret_key`` and
    ``curve_allowed_clients`` (key files: a CURVE server), and the fields of
    :class:`~mooncake_lookout.connector.server.limits.Limits` (``max_peer_lookups``, ``max_peer_bytes``, ...,
    ``share_keys``).

    ``layout`` (a :class:`~.vllm_layout.Layout`, block size from ``block_size``): answer for a vLLM
    deployment's keys from upstream's own worker, through a read-only store client; no injected delay.

    ``keep_epoch``: our server keeps the store's epoch marker (clients' prefix caches on; see the module
    docstring). Counts of the store calls the servers made: :meth:`store_counts`.

    ``gil_busy``: the child also runs a pure-Python busy loop on a thread (the GIL taken from the servers as a
    model runner's Python thread takes it in vLLM's rank-0 worker; bench scenario (j)).

    ``standby``: keep the next child already spawned and imported, waiting for a word on stdin, so a
    restart costs a bind (~0.1 s) instead of an interpreter and a vLLM import. What a restart measures
    is then the client's recovery, not Python's start-up.

    Children die with the *thread* that spawned them (``PR_SET_PDEATHSIG``), so no server outlives a
    killed test: call :meth:`start` from a thread that lives as long as the server should. A restarted
    child starts with the delay as ``delay_on`` says, whatever :meth:`set_delay` switched since.
    """

    def __init__(self, transports: str | Sequence[str], master: str, *, namespace: str, address: str | None = None,
                 rpc_port: int = 0, rpc_base_path: str | None = None, block_size: int = 16,
                 delay_ms: float = 0.0, delay_on: bool = False, reset_delay_ms: float = 0.0,
                 store_rpc_timeout_ms: int | None = 1000, start_timeout_s: float = 90.0,
                 standby: bool = True, layout: Any = None, keep_epoch: bool = False,
                 server_options: dict[str, Any] | None = None, gil_busy: bool = False) -> None:
        self.transports = (transports,) if isinstance(transports, str) else tuple(transports)
        unknown = [t for t in self.transports if t not in TRANSPORTS]
        if unknown or not self.transports:
            raise ValueError(f"transports must be some of {TRANSPORTS}, got {transports!r}")
        self.transport = self.transports[0]
        self.master = master
        self.namespace = namespace
        self.rpc_port = rpc_port
        self.rpc_base_path = rpc_base_path
        self.block_size = block_size
        self.delay_ms = delay_ms
        self.delay_on = delay_on
        self.reset_delay_ms = reset_delay_ms
        self.store_rpc_timeout_ms = store_rpc_timeout_ms
        self.start_timeout_s = start_timeout_s
        self.use_standby = standby
        self.layout = layout  # a vllm_layout.Layout: serve a vLLM deployment's keys, read-only
        self.keep_epoch = keep_epoch
        self.gil_busy = gil_busy
        self.server_options = dict(server_options or {})
        unknown_options = set(self.server_options) - set(_SERVER_OPTIONS)
        if unknown_options:
            raise ValueError(f"unknown server_options {sorted(unknown_options)}; known: {sorted(_SERVER_OPTIONS)}")
        self.starts = 0
        self.start_seconds: list[float] = []  # from the start call (or the standby's go) until serving
        self._own_dir: str | None = None
        if PIPELINED in self.transports and address is None:
            self._own_dir = tempfile.mkdtemp(prefix="lookout-servers-")  # mode 0700
            address = "ipc://" + os.path.join(self._own_dir, "lookup.sock")
        self._requested = address
        self.addresses: dict[str, str] = {}  # transport -> address, once started
        self._child: ChildProcess | None = None
        self._standby: ChildProcess | None = None
        self._prepared = False  # the standby was spawned by prepare(), with the addresses a first start uses

    # -- state -------------------------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """The address of the first transport served ('' before the first start)."""
        return self.addresses.get(self.transport, "")

    @property
    def pid(self) -> int:
        """Process id of the running child."""
        if self._child is None:
            raise RuntimeError("the lookup server process is not running")
        return self._child.pid

    @property
    def running(self) -> bool:
        """True while the child exists (paused counts as running)."""
        return self._child is not None and self._child.running

    def pids(self) -> list[int]:
        """Every child process this object holds (the server and its standby), for leak checks."""
        return [c.pid for c in (self._child, self._standby) if c is not None]

    def output(self) -> str:
        """The running child's last output lines (stdout and stderr), for error messages."""
        return self._child.output() if self._child is not None else ""

    def _argv(self, standby: bool) -> list[str]:
        argv = [sys.executable, "-m", CHILD_MODULE, "--master", self.master, "--namespace", self.namespace,
                "--block-size", str(self.block_size), "--delay-ms", str(self.delay_ms),
                "--reset-delay-ms", str(self.reset_delay_ms)]
        for transport in self.transports:
            argv += ["--serve", transport]
        if self.store_rpc_timeout_ms is not None:
            argv += ["--store-rpc-timeout-ms", str(self.store_rpc_timeout_ms)]
        if self.delay_on:
            argv.append("--delay-on")
        if self.layout is not None:
            argv += ["--vllm-model", self.layout.model, "--cache-prefix", self.layout.cache_prefix,
                     "--tp-size", str(self.layout.tp_size)]
        if self.keep_epoch:
            argv.append("--keep-epoch")
        if self.gil_busy:
            argv.append("--gil-busy")
        if standby:
            argv.append("--wait-go")
        if PIPELINED in self.transports:
            argv += ["--address", self.addresses.get(PIPELINED) or self._requested or ""]
            for name, value in self.server_options.items():
                argv += [_SERVER_OPTIONS[name], str(value)]
        if UPSTREAM in self.transports:
            argv += ["--rpc-port", str(self.rpc_port)]
            if self.rpc_base_path is not None:
                argv += ["--rpc-base-path", self.rpc_base_path]
        return argv

    def _spawn(self, standby: bool) -> ChildProcess:
        env = dict(os.environ, MC_LOG_LEVEL=os.environ.get("MC_LOG_LEVEL", "ERROR"), PYTHONUNBUFFERED="1")
        return ChildProcess(self._argv(standby), env=env, stdin=standby, keep_lines=200, name="lookup-servers")

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def prepare(self) -> ServerProcess:
        """Spawn the child now, to import while other work goes on; :meth:`start` then only waits for it to serve.

        Several servers started at once import in parallel this way (each ``start`` alone waits for its import).
        """
        if not self.running and self._standby is None:
            self._standby = self._spawn(standby=True)
            self._prepared = True
        return self

    def start(self) -> ServerProcess:
        """Start the servers (the standby if one is ready; the previous start's addresses) and wait until they serve."""
        if self.running:
            return self
        t0 = time.perf_counter()
        child, self._standby = self._standby, None
        if child is not None and (not child.running or not (self.addresses or self._prepared)):
            child.kill()
            child = None
        if child is None:
            child = self._spawn(standby=False)
        else:
            child.wait_line(lambda ln: ln.strip() == STANDBY_READY, self.start_timeout_s, "standby import")
            t0 = time.perf_counter()
            child.send("go\n")
        self._child = child
        try:
            line = child.wait_line(READY_PREFIX, self.start_timeout_s, "start")
        except Exception:
            self.kill()
            raise
        self.addresses = parse_ready_line(line)
        self.starts += 1
        self.start_seconds.append(time.perf_counter() - t0)
        if self.use_standby:
            self._standby = self._spawn(standby=True)
        return self

    def kill(self) -> None:
        """Crash the servers: SIGKILL by pid, then reap the child (a standby stays ready)."""
        child, self._child = self._child, None
        if child is not None:
            child.kill()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop cleanly: SIGCONT, SIGTERM, then SIGKILL after ``timeout_s`` (a standby stays ready)."""
        child, self._child = self._child, None
        if child is not None:
            child.stop(signal.SIGTERM, timeout_s)

    def restart(self) -> ServerProcess:
        """Kill (if running) and start again on the same addresses."""
        self.kill()
        return self.start()

    def pause(self, timeout_s: float = 5.0) -> None:
        """Hang the servers (SIGSTOP) and return once the kernel reports the child stopped."""
        freeze(self.pid, timeout_s, "lookup server process")

    def resume(self, timeout_s: float = 5.0) -> None:
        """Thaw hung servers (SIGCONT) and return once the child runs again."""
        thaw(self.pid, timeout_s, "lookup server process")

    def set_delay(self, on: bool, timeout_s: float = 10.0) -> None:
        """Switch the injected store delay on or off in the running child; returns once the child says so."""
        child = self._child
        if child is None:
            raise RuntimeError("the lookup server process is not running")
        seen = child.line_count
        os.kill(child.pid, DELAY_ON_SIGNAL if on else DELAY_OFF_SIGNAL)
        want = "delay on" if on else "delay off"
        child.wait_line(lambda ln: ln.strip() == want, timeout_s, want, after=seen)

    def store_counts(self, timeout_s: float = 10.0) -> tuple[int, int]:
        """``(calls, keys)``: the existence checks the running child's servers sent to the store so far, and the
        keys they asked (counted around its store client; a restarted child counts from zero)."""
        child = self._child
        if child is None:
            raise RuntimeError("the lookup server process is not running")
        seen = child.line_count
        os.kill(child.pid, COUNTS_SIGNAL)
        line = child.wait_line(COUNTS_PREFIX, timeout_s, "store counts", after=seen)
        return parse_counts_line(line)

    def close(self) -> None:
        """Stop the servers and the standby, and remove the private folder made for the socket."""
        self.stop()
        standby, self._standby = self._standby, None
        if standby is not None:
            standby.kill()
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
            self._own_dir = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = self.addresses or self._requested
        return f"ServerProcess({'+'.join(self.transports)}, {where}, running={self.running})"


# -- child side ------------------------------------------------------------------------------------------------

def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mooncake_lookout.connector.rigs.server_process",
                                description="lookup servers in a child process")
    p.add_argument("--serve", choices=TRANSPORTS, action="append", required=True, help="a transport to serve")
    p.add_argument("--master", required=True, metavar="HOST:PORT")
    p.add_argument("--namespace", required=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--address", default="", help="pipelined: ipc://PATH or tcp://127.0.0.1:PORT ('' = private dir)")
    p.add_argument("--rpc-port", type=int, default=0, help="upstream: vLLM's lookup_rpc_port")
    p.add_argument("--rpc-base-path", default=None, help="upstream: VLLM_RPC_BASE_PATH for vLLM's IPC path")
    p.add_argument("--delay-ms", type=float, default=0.0, help="INJECTED store delay, in milliseconds")
    p.add_argument("--delay-on", action="store_true", help="inject the delay from the start")
    p.add_argument("--store-rpc-timeout-ms", type=int, default=None)
    p.add_argument("--reset-delay-ms", type=float, default=0.0, help="INJECTED delay before each wipe")
    p.add_argument("--vllm-model", default=None,
                   help="serve a vLLM deployment's keys for this model (read-only store client)")
    p.add_argument("--cache-prefix", default="", help="with --vllm-model: vLLM's cache_prefix")
    p.add_argument("--tp-size", type=int, default=1, help="with --vllm-model: the tensor-parallel size")
    p.add_argument("--keep-epoch", action="store_true",
                   help="our server keeps the store's epoch marker (clients' prefix caches on): a store client "
                        "that can put it, and with --vllm-model a worker store that is not read-only")
    p.add_argument("--curve-secret-key", default=None, help="pipelined: the server's CURVE key pair file")
    p.add_argument("--curve-allowed-clients", default=None, help="pipelined: the CURVE client keys admitted")
    add_limit_arguments(p.add_argument_group("pipelined: what may wait in the server"))
    p.add_argument("--gil-busy", action="store_true",
                   help="run a pure-Python busy loop on a thread of this process, holding the GIL as a model "
                        "runner's Python thread does beside the lookup server in vLLM's rank-0 worker")
    p.add_argument("--wait-go", action="store_true",
                   help="standby: import everything, print 'ready', then wait for a line on stdin before serving")
    return p.parse_args(argv)


def _start_servers(args: argparse.Namespace, backend: Any, worker: Any = None) -> dict[str, Any]:
    """Bind every server asked for; returns them by transport name. ``worker``: vLLM's own store worker,
    which vLLM's server then answers from (else ``backend``, a prefix index)."""
    from mooncake_lookout.connector.server import LookupServer

    servers: dict[str, Any] = {}
    if UPSTREAM in args.serve:
        from mooncake_lookout.connector.rigs.vllm_lookup_server import UpstreamLookupServer, lookup_vllm_config

        index = None if worker is not None else backend
        servers[UPSTREAM] = UpstreamLookupServer(index, lookup_vllm_config(args.rpc_port), worker=worker).start()
    if PIPELINED in args.serve:
        options: dict[str, Any] = {}
        if args.curve_secret_key:
            from mooncake_lookout.connector.curve import ServerCurve

            options["curve"] = ServerCurve.from_files(args.curve_secret_key, args.curve_allowed_clients)
        options["limits"] = limits_from_args(args)
        # Over a deployment's store (``worker``) the server keeps no epoch marker unless asked: it is a write.
        servers[PIPELINED] = LookupServer(backend, args.address or None, marker=worker is None or args.keep_epoch,
                                          **options).start()
    return servers


def _busy(stop: threading.Event) -> None:
    """Pure Python, never blocking: it holds the GIL but for the interpreter's switch interval (5 ms)."""
    n = 0
    while not stop.is_set():
        for _ in range(10_000):
            n += 1


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until SIGTERM / SIGINT; prints ``listening on NAME=ADDRESS ...`` once serving."""
    args = _parse(argv)
    from mooncake_lookout.connector.rigs.counting_store import CountingStore
    from mooncake_lookout.connector.rigs.faults import InjectedDelayBackend
    from mooncake_lookout.connector.rigs.rpc_base_path import use_rpc_base_path
    from mooncake_lookout.connector.server.prefix_index import PrefixIndex
    from mooncake_lookout.connector.server.store import MARKER_LOCAL_BUFFER, open_store

    if args.rpc_base_path is not None:
        use_rpc_base_path(args.rpc_base_path)
    if UPSTREAM in args.serve:  # imports vLLM (seconds): before the standby says it is ready
        import mooncake_lookout.connector.rigs.vllm_lookup_server  # noqa: F401
    if args.wait_go:
        print(STANDBY_READY, flush=True)
        if not sys.stdin.readline():  # the parent went away before it needed this standby
            return 0
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    store = open_store(args.master, rpc_timeout_ms=args.store_rpc_timeout_ms,
                       local_buffer_size=MARKER_LOCAL_BUFFER if args.keep_epoch else 0)  # it puts its marker
    worker = None
    if args.vllm_model is not None:
        from mooncake_lookout.connector.rigs.vllm_layout import Layout, ReadOnlyStore, layout_worker
        from mooncake_lookout.connector.server.worker_backend import WorkerBackend

        layout = Layout(args.vllm_model, args.cache_prefix, args.tp_size, args.block_size)
        counted = CountingStore(store if args.keep_epoch else ReadOnlyStore(store))
        worker = layout_worker(counted, layout)
        backend: Any = WorkerBackend(worker)
    else:
        counted = CountingStore(store)
        backend = InjectedDelayBackend(PrefixIndex(counted, args.block_size, args.namespace),
                                       args.delay_ms / 1000.0, enabled=args.delay_on,
                                       reset_delay_s=args.reset_delay_ms / 1000.0)

    def switch(on: bool) -> None:
        backend.enabled = on
        print("delay on" if on else "delay off", flush=True)

    def report_counts() -> None:
        calls, keys = counted.counts()
        print(f"{COUNTS_PREFIX}{calls} keys={keys}", flush=True)

    signal.signal(DELAY_ON_SIGNAL, lambda *_: switch(True))
    signal.signal(DELAY_OFF_SIGNAL, lambda *_: switch(False))
    signal.signal(COUNTS_SIGNAL, lambda *_: report_counts())
    servers = _start_servers(args, backend, worker)
    if args.gil_busy:
        threading.Thread(target=_busy, args=(stop,), name="gil-busy", daemon=True).start()
    print(READY_PREFIX + " ".join(f"{name}={server.address}" for name, server in servers.items()), flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for name, server in servers.items():
            if name == UPSTREAM:
                server.stop(timeout_s=2.0)
            else:
                server.close(timeout_s=2.0)
        # The store client's close() takes ~1 s; a child being stopped need not wait for it.
    os._exit(0)


__all__ = ["COUNTS_SIGNAL", "DELAY_OFF_SIGNAL", "DELAY_ON_SIGNAL", "READY_PREFIX", "ServerProcess", "main",
           "parse_counts_line", "parse_ready_line"]

if __name__ == "__main__":
    sys.exit(main())

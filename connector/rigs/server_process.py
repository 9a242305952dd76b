"""Real faults for the lookup path: a lookup server in a child process, and an injected slow store.

Fault tests and the soak must break a *real* server the way production breaks: the process dies
(SIGKILL), hangs (SIGSTOP) or comes back on the same address. A thread cannot be killed or frozen on
its own, so the server runs as a separate process, started and signalled by pid:

* ``pipelined``: our :class:`~.server.LookupServer` (DEALER/ROUTER, ``ipc://`` or ``tcp://127.0.0.1``);
* ``upstream``: vLLM 0.33's real ``LookupKeyServer`` (via :mod:`.upstream_server`), bound where vLLM binds
  it: ``ipc://{VLLM_RPC_BASE_PATH}/lookup_rpc_port_{port}_host_..._dp_rank0``.

Both answer from a :class:`~.prefix_index.PrefixIndex` over a real Mooncake master. The only fake here is
:class:`InjectedDelayBackend`: a store that is *slow but healthy* cannot be produced for real on demand,
so a fixed delay is injected in front of the real store call (and labelled as injected everywhere).

The child is this module run as a script (``python -m mooncake_lookout.connector.faults ...``); it prints
``listening on <address>`` once it serves, ``delay on`` / ``delay off`` after SIGUSR1 / SIGUSR2, and
stops cleanly on SIGTERM.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Sequence

from mooncake_lookout.connector.processes import die_with_parent, freeze, stop_process, thaw
from mooncake_lookout.connector.job import LookupResult

TRANSPORTS = ("pipelined", "upstream")
READY_PREFIX = "listening on "
DELAY_ON_SIGNAL = signal.SIGUSR1
DELAY_OFF_SIGNAL = signal.SIGUSR2


class InjectedDelayBackend:
    """INJECTED FAULT: a lookup backend that sleeps ``delay_s`` before each real store call.

    Wraps a real backend (a :class:`PrefixIndex`); everything else (``reset``, ``remove_all``, ...) passes
    through. ``enabled`` switches the delay at run time (the child process flips it on SIGUSR1/SIGUSR2).
    """

    def __init__(self, backend: Any, delay_s: float, enabled: bool = True) -> None:
        self.backend = backend
        self.delay_s = delay_s
        self.enabled = enabled
        self.delayed_calls = 0

    def _delay(self) -> None:
        if self.enabled and self.delay_s > 0:
            self.delayed_calls += 1
            time.sleep(self.delay_s)  # the injected fault itself, not a wait for a condition

    def lookup(self, num_tokens: int, hashes: Sequence[bytes]) -> LookupResult:
        """The real lookup, after the injected delay."""
        self._delay()
        return self.backend.lookup(num_tokens, hashes)

    def lookup_many(self, queries: Sequence[tuple[int, Sequence[bytes]]]) -> list[Any]:
        """The real batched lookup, after one injected delay for the whole batch."""
        self._delay()
        return self.backend.lookup_many(queries)

    def reset(self) -> Any:
        """Wipe the real store (no delay: a reset is not a lookup)."""
        return self.backend.reset()

    def __getattr__(self, name: str) -> Any:  # remove_all, key, namespace, ... of the real backend
        return getattr(self.backend, name)


# -- parent side -----------------------------------------------------------------------------------------------

class _Child:
    """One child process and the lines it printed (read on a daemon thread)."""

    def __init__(self, argv: list[str], env: dict[str, str], standby: bool) -> None:
        self.standby = standby
        self.t_spawn = time.perf_counter()
        self.lines: collections.deque[str] = collections.deque(maxlen=200)
        self.cond = threading.Condition()
        self.proc: subprocess.Popen[str] = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if standby else subprocess.DEVNULL, env=env, text=True,
            start_new_session=True, preexec_fn=die_with_parent())
        self.reader = threading.Thread(target=self._pump, daemon=True, name=f"lookout-server-proc-{self.proc.pid}")
        self.reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            with self.cond:
                self.lines.append(raw.rstrip())
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def output(self) -> str:
        with self.cond:
            return "\n".join(self.lines)

    def wait_line(self, match: Any, timeout_s: float, what: str, after: int = 0) -> str:
        """Wait (bounded) for an output line matching ``match`` among the lines after the first ``after``."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                for line in list(self.lines)[after:]:
                    if match(line):
                        return line
                if self.proc.poll() is not None:
                    raise RuntimeError(f"lookup server process exited during {what}; output:\n"
                                       + "\n".join(self.lines))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"lookup server process: no {what} within {timeout_s} s; output:\n"
                                       + "\n".join(self.lines))
                self.cond.wait(min(left, 0.5))

    def go(self) -> None:
        """Tell a standby child to bind and serve now."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def kill(self, sig: signal.Signals = signal.SIGKILL, timeout_s: float = 10.0) -> None:
        """End the child by pid (``SIGKILL``, or SIGCONT+SIGTERM then SIGKILL for a clean stop) and reap it."""
        proc = self.proc
        stop_process(proc, sig, timeout_s)
        self.reader.join(timeout=5.0)
        for stream in (proc.stdout, proc.stdin):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass


class ServerProcess:
    """A lookup server in a child process: start, kill, pause, resume and restart it by pid, same address.

    ``transport``: ``pipelined`` (our server) or ``upstream`` (vLLM's ``LookupKeyServer``).
    ``master``: the Mooncake master's ``host:port``. ``address`` (pipelined only): ``ipc://PATH`` or
    ``tcp://127.0.0.1:PORT`` (port 0 picks one, kept across restarts); default an IPC socket in a private
    0700 folder made here. ``rpc_port`` / ``rpc_base_path`` (upstream only): vLLM's ``lookup_rpc_port``
    and ``VLLM_RPC_BASE_PATH``. ``delay_ms`` is the injected store delay, active from the start if
    ``delay_on``. ``store_rpc_timeout_ms`` bounds one store call in the child when the master stalls.
    ``start_timeout_s`` bounds the wait for ``listening on`` (an upstream child imports vLLM: 10-15 s).

    ``standby``: keep the next child already spawned and imported, waiting for a word on stdin, so a
    restart costs a bind (~0.1 s) instead of an interpreter and a vLLM import. What a restart measures
    is then the client's recovery, not Python's start-up.

    Children die with the *thread* that spawned them (``PR_SET_PDEATHSIG``), so no server outlives a
    killed test: call :meth:`start` from a thread that lives as long as the server should. A restarted
    child starts with the delay as ``delay_on`` says, whatever :meth:`set_delay` switched since.
    """

    def __init__(self, transport: str, master: str, *, namespace: str, address: str | None = None,
                 rpc_port: int = 0, rpc_base_path: str | None = None, block_size: int = 16,
                 delay_ms: float = 0.0, delay_on: bool = False, store_rpc_timeout_ms: int = 1000,
                 workers: int = 2, start_timeout_s: float = 90.0, standby: bool = True) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.transport = transport
        self.master = master
        self.namespace = namespace
        self.rpc_port = rpc_port
        self.rpc_base_path = rpc_base_path
        self.block_size = block_size
        self.delay_ms = delay_ms
        self.delay_on = delay_on
        self.store_rpc_timeout_ms = store_rpc_timeout_ms
        self.workers = workers
        self.start_timeout_s = start_timeout_s
        self.use_standby = standby
        self.starts = 0
        self.start_seconds: list[float] = []  # from the start call (or the standby's go) until serving
        self._own_dir: str | None = None
        if transport == "pipelined" and address is None:
            self._own_dir = tempfile.mkdtemp(prefix="lookout-faults-")  # mode 0700
            address = "ipc://" + os.path.join(self._own_dir, "lookup.sock")
        self._requested = address
        self.address: str = ""
        self._child: _Child | None = None
        self._standby: _Child | None = None

    # -- state -------------------------------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        """Process id of the running child."""
        if self._child is None:
            raise RuntimeError("the lookup server process is not running")
        return self._child.proc.pid

    @property
    def running(self) -> bool:
        """True while the child exists (paused counts as running)."""
        return self._child is not None and self._child.proc.poll() is None

    def pids(self) -> list[int]:
        """Every child process this object holds (the server and its standby), for leak checks."""
        return [c.proc.pid for c in (self._child, self._standby) if c is not None]

    def output(self) -> str:
        """The running child's last output lines (stdout and stderr), for error messages."""
        return self._child.output() if self._child is not None else ""

    def _argv(self, standby: bool) -> list[str]:
        argv = [sys.executable, "-m", "mooncake_lookout.connector.faults", "--transport", self.transport,
                "--master", self.master, "--namespace", self.namespace, "--block-size", str(self.block_size),
                "--delay-ms", str(self.delay_ms), "--store-rpc-timeout-ms", str(self.store_rpc_timeout_ms),
                "--workers", str(self.workers)]
        if self.delay_on:
            argv.append("--delay-on")
        if standby:
            argv.append("--wait-go")
        if self.transport == "pipelined":
            argv += ["--address", self.address or self._requested or ""]
        else:
            argv += ["--rpc-port", str(self.rpc_port)]
        return argv

    def _spawn(self, standby: bool) -> _Child:
        env = dict(os.environ, MC_LOG_LEVEL=os.environ.get("MC_LOG_LEVEL", "ERROR"), PYTHONUNBUFFERED="1")
        if self.rpc_base_path is not None:
            env["VLLM_RPC_BASE_PATH"] = self.rpc_base_path
        return _Child(self._argv(standby), env, standby)

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> "ServerProcess":
        """Start a server (the standby if one is ready; the previous start's address) and wait until it serves."""
        if self.running:
            return self
        t0 = time.perf_counter()
        child, self._standby = self._standby, None
        if child is not None and (child.proc.poll() is not None or not self.address):
            child.kill()
            child = None
        if child is None:
            child = self._spawn(standby=False)
        else:
            child.wait_line(lambda ln: ln.strip() == "ready", self.start_timeout_s, "standby import")
            t0 = time.perf_counter()
            child.go()
        self._child = child
        try:
            line = child.wait_line(lambda ln: ln.startswith(READY_PREFIX), self.start_timeout_s, "start")
        except Exception:
            self.kill()
            raise
        self.address = line[len(READY_PREFIX):].strip()
        self.starts += 1
        self.start_seconds.append(time.perf_counter() - t0)
        if self.use_standby:
            self._standby = self._spawn(standby=True)
        return self

    def kill(self) -> None:
        """Crash the server: SIGKILL by pid, then reap it (a standby stays ready)."""
        child, self._child = self._child, None
        if child is not None:
            child.kill(signal.SIGKILL)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop cleanly: SIGCONT, SIGTERM, then SIGKILL after ``timeout_s`` (a standby stays ready)."""
        child, self._child = self._child, None
        if child is not None:
            child.kill(signal.SIGTERM, timeout_s)

    def restart(self) -> "ServerProcess":
        """Kill (if running) and start again on the same address."""
        self.kill()
        return self.start()

    def pause(self, timeout_s: float = 5.0) -> None:
        """Hang the server (SIGSTOP) and return once the kernel reports it stopped."""
        freeze(self.pid, timeout_s, "lookup server process")

    def resume(self, timeout_s: float = 5.0) -> None:
        """Thaw a hung server (SIGCONT) and return once it runs again."""
        thaw(self.pid, timeout_s, "lookup server process")

    def set_delay(self, on: bool, timeout_s: float = 10.0) -> None:
        """Switch the injected store delay on or off in the running child; returns once the child says so."""
        child = self._child
        if child is None:
            raise RuntimeError("the lookup server process is not running")
        with child.cond:
            seen = len(child.lines)
        os.kill(child.proc.pid, DELAY_ON_SIGNAL if on else DELAY_OFF_SIGNAL)
        want = "delay on" if on else "delay off"
        child.wait_line(lambda ln: ln.strip() == want, timeout_s, want, after=seen)

    def close(self) -> None:
        """Stop the server and its standby, and remove the private folder made for the socket."""
        self.stop()
        standby, self._standby = self._standby, None
        if standby is not None:
            standby.kill(signal.SIGKILL)
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
            self._own_dir = None

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ServerProcess({self.transport}, {self.address or self._requested}, running={self.running})"


# -- child side ------------------------------------------------------------------------------------------------

def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mooncake_lookout.connector.faults",
                                description="a lookup server child process for fault tests")
    p.add_argument("--transport", choices=TRANSPORTS, required=True)
    p.add_argument("--master", required=True, metavar="HOST:PORT")
    p.add_argument("--namespace", required=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--address", default="", help="pipelined: ipc://PATH or tcp://127.0.0.1:PORT ('' = private dir)")
    p.add_argument("--rpc-port", type=int, default=0, help="upstream: vLLM's lookup_rpc_port")
    p.add_argument("--delay-ms", type=float, default=0.0, help="INJECTED store delay, in milliseconds")
    p.add_argument("--delay-on", action="store_true", help="inject the delay from the start")
    p.add_argument("--store-rpc-timeout-ms", type=int, default=1000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--wait-go", action="store_true",
                   help="standby: import everything, print 'ready', then wait for a line on stdin before serving")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one lookup server until SIGTERM; prints ``listening on <address>`` once serving."""
    args = _parse(argv)
    from mooncake_lookout.connector.mooncake_master import open_store
    from mooncake_lookout.connector.prefix_index import PrefixIndex

    from mooncake_lookout.connector.server import LookupServer

    if args.transport == "upstream":
        from mooncake_lookout.connector.upstream_server import UpstreamLookupServer, lookup_vllm_config
    if args.wait_go:
        print("ready", flush=True)
        if not sys.stdin.readline():  # the parent went away before it needed this standby
            return 0
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    store = open_store(args.master, rpc_timeout_ms=args.store_rpc_timeout_ms)
    backend = InjectedDelayBackend(PrefixIndex(store, args.block_size, args.namespace), args.delay_ms / 1000.0,
                                   enabled=args.delay_on)

    def switch(on: bool) -> None:
        backend.enabled = on
        print("delay on" if on else "delay off", flush=True)

    signal.signal(DELAY_ON_SIGNAL, lambda *_: switch(True))
    signal.signal(DELAY_OFF_SIGNAL, lambda *_: switch(False))
    if args.transport == "pipelined":
        server: Any = LookupServer(backend, args.address or None, workers=args.workers).start()
        address = server.address
    else:
        server = UpstreamLookupServer(backend, lookup_vllm_config(args.rpc_port)).start()  # type: ignore[arg-type]
        address = server.address
    print(f"{READY_PREFIX}{address}", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        if args.transport == "pipelined":
            server.close(timeout_s=2.0)
        else:
            server.stop(timeout_s=2.0)
        # The store client's close() takes ~1 s; a child being stopped need not wait for it.
    os._exit(0)


__all__ = ["InjectedDelayBackend", "ServerProcess", "TRANSPORTS", "main"]

if __name__ == "__main__":
    sys.exit(main())

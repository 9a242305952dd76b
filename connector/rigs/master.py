"""A real Mooncake master on loopback, started, frozen, crashed and restarted by pid.

Tests, the demo and the bench need a Mooncake store without a cluster. :class:`EmbeddedMaster` starts
the real ``mooncake_master`` binary on ``127.0.0.1`` with free ports, waits until its ``/health``
answers, and stops it by pid. It can also pause (SIGSTOP) and restart the master on the same ports,
which is how fault tests produce real store errors and real reconnects. Clients to it are opened with
:mod:`mooncake_lookout.connector.server.store`.

Facts this relies on (measured with Mooncake 0.3.13): the master is up in ~0.1 s; with the master
paused, a call fails with -901 after ``MC_RPC_TIMEOUT_MS``; with it killed, the first call fails fast
with -900 and later ones block ~4 s.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path

from mooncake_lookout.connector.rigs.processes import ChildProcess, freeze, thaw
from mooncake_lookout.connector.server.store import IBVERBS_HINT, INSTALL_HINT, MasterError

BINARY_NAME = "mooncake_master"
LOG_LINES_KEPT = 40


def find_master_binary(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Locate the ``mooncake_master`` executable.

    Order: ``explicit`` (or ``$MOONCAKE_MASTER_BIN``), the ELF inside the installed ``mooncake``
    package (so the pid we signal is the master itself, not a Python launcher), this interpreter's
    ``bin`` folder, then ``$PATH``.
    """
    explicit = explicit if explicit is not None else os.environ.get("MOONCAKE_MASTER_BIN") or None
    if explicit is not None:
        path = Path(explicit)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise MasterError(f"mooncake_master not found or not executable at {str(path)!r}; {INSTALL_HINT}")
    candidates: list[Path] = []
    try:
        import importlib.util

        spec = importlib.util.find_spec("mooncake")
        if spec is not None and spec.submodule_search_locations:
            candidates += [Path(p) / BINARY_NAME for p in spec.submodule_search_locations]
    except (ImportError, ValueError):
        pass
    candidates.append(Path(sys.executable).parent / BINARY_NAME)
    on_path = shutil.which(BINARY_NAME)
    if on_path:
        candidates.append(Path(on_path))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    looked = ", ".join(str(p) for p in candidates) or "(nowhere)"
    raise MasterError(f"mooncake_master not found (looked in {looked}); {INSTALL_HINT}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


_LIVE: weakref.WeakSet[EmbeddedMaster] = weakref.WeakSet()


@atexit.register
def _stop_leftover_masters() -> None:
    """Never leave a master behind when the interpreter exits without calling ``stop()``."""
    for master in list(_LIVE):
        master.kill()


def read_metrics(metrics_url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """The master's own ``/metrics`` as ``{series: value}`` (unlabelled series; labelled ones keep their labels)."""
    with urllib.request.urlopen(f"{metrics_url}/metrics", timeout=timeout_s) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name.strip()] = float(value)
            except ValueError:
                continue
    return out


MOONCAKE_LEASE_MS = 10_000  # Mooncake 0.3.13's --default_kv_lease_ttl, what a master runs with unless told


class EmbeddedMaster:
    """A real ``mooncake_master`` on 127.0.0.1, started and stopped by pid.

    Use as a context manager. ``kv_lease_ttl_ms`` is the master's ``--default_kv_lease_ttl``: an
    existence check leases a key for that long, and non-forced removes skip leased keys, so tests keep
    it short. ``start_timeout_s`` bounds the wait for ``/health``.

    ``die_with_parent`` (Linux) has the kernel kill the master when the process that started it dies,
    even by SIGKILL, so no master outlives a killed test or CLI. The kernel ties this to the *thread*
    that started it: start the master from a thread that lives as long as the master should.
    """

    def __init__(self, *, binary: str | os.PathLike[str] | None = None, kv_lease_ttl_ms: int = 500,
                 start_timeout_s: float = 15.0, extra_args: tuple[str, ...] = (),
                 host: str = "127.0.0.1", die_with_parent: bool = True) -> None:
        self.binary = find_master_binary(binary)
        self.die_with_parent = die_with_parent
        self.host = host
        self.kv_lease_ttl_ms = kv_lease_ttl_ms
        self.start_timeout_s = start_timeout_s
        self.extra_args = tuple(extra_args)
        self.rpc_port = 0
        self.metrics_port = 0
        self.start_seconds: float | None = None  # how long the last start took, until /health answered
        self._child: ChildProcess | None = None  # the running master
        self._last: ChildProcess | None = None  # the last one started, kept for its log lines

    # -- addresses ---------------------------------------------------------------------------
    @property
    def rpc_address(self) -> str:
        """``host:port`` of the master's RPC service, what clients pass as ``master_server_addr``."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def metrics_url(self) -> str:
        """Base URL of the master's HTTP server (``/metrics``, ``/health``, ``/metrics/summary``)."""
        return f"http://{self.host}:{self.metrics_port}"

    @property
    def pid(self) -> int:
        """Process id of the running master."""
        if self._child is None:
            raise MasterError("the Mooncake master is not running")
        return self._child.pid

    @property
    def running(self) -> bool:
        """True while the master process exists (paused counts as running)."""
        return self._child is not None and self._child.running

    def log_tail(self) -> str:
        """The master's last log lines (stdout and stderr), for error messages."""
        return self._last.output() if self._last is not None else ""

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> EmbeddedMaster:
        """Start the master on fresh free ports (or the same ports after :meth:`stop`) and wait for health.

        Fresh ports are picked by the OS and may be taken by someone else before the master binds
        them; then the start is retried on new ports (three tries in all).
        """
        if self.running:
            return self
        if self.rpc_port:
            return self._start_once()
        for attempt in range(3):
            self.rpc_port, self.metrics_port = free_port(self.host), free_port(self.host)
            try:
                return self._start_once()
            except MasterError:
                if attempt == 2:
                    raise
                self.rpc_port = self.metrics_port = 0
        raise AssertionError("unreachable")

    def _start_once(self) -> EmbeddedMaster:
        args = [
            str(self.binary),
            f"--rpc_address={self.host}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            f"--default_kv_lease_ttl={self.kv_lease_ttl_ms}",
            *self.extra_args,
        ]
        env = dict(os.environ, MC_LOG_LEVEL=os.environ.get("MC_LOG_LEVEL", "ERROR"))
        t0 = time.perf_counter()
        try:
            self._child = self._last = ChildProcess(args, env=env, keep_lines=LOG_LINES_KEPT,
                                                    die_with_parent=self.die_with_parent, name="mooncake-master")
        except OSError as exc:
            raise MasterError(f"cannot run {self.binary}: {exc}; {INSTALL_HINT}") from exc
        _LIVE.add(self)
        self._wait_healthy(t0)
        self.start_seconds = time.perf_counter() - t0
        return self

    def _wait_healthy(self, t0: float) -> None:
        deadline = t0 + self.start_timeout_s
        delay = 0.005
        while True:
            child = self._child
            if child is not None and not child.running:
                code = child.wait_exit(2.0)
                tail = self.log_tail()
                self._child = None
                hint = f"; {IBVERBS_HINT}" if "libibverbs" in tail else ""
                raise MasterError(f"mooncake_master exited early with code {code}{hint}; "
                                  f"its last log lines:\n{tail or '(none)'}")
            if self.healthy(timeout_s=0.5):
                return
            if time.perf_counter() > deadline:
                tail = self.log_tail()
                self.stop()
                raise MasterError(f"mooncake_master did not answer {self.metrics_url}/health within "
                                  f"{self.start_timeout_s} s; its last log lines:\n{tail or '(none)'}")
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def healthy(self, timeout_s: float = 1.0) -> bool:
        """True if ``/health`` on the metrics port answers 200 within ``timeout_s`` seconds."""
        try:
            with urllib.request.urlopen(f"{self.metrics_url}/health", timeout=timeout_s) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the master: SIGTERM, then SIGKILL after ``timeout_s`` seconds; by pid, idempotent."""
        child, self._child = self._child, None
        if child is not None:
            child.stop(signal.SIGTERM, timeout_s)

    def kill(self) -> None:
        """Kill the master at once (SIGKILL by pid): a crash, for fault tests."""
        child, self._child = self._child, None
        if child is not None:
            child.kill()

    def restart(self) -> EmbeddedMaster:
        """Stop and start again on the same ports; the master's keys are gone (its index is in memory)."""
        self.stop()
        return self.start()

    def pause(self, timeout_s: float = 5.0) -> None:
        """Freeze the master (SIGSTOP) and return once the kernel reports it stopped."""
        try:
            freeze(self.pid, timeout_s, "mooncake_master")
        except TimeoutError as e:
            raise MasterError(str(e)) from e

    def resume(self, timeout_s: float = 5.0) -> None:
        """Thaw a paused master (SIGCONT) and return once it runs again."""
        try:
            thaw(self.pid, timeout_s, "mooncake_master")
        except TimeoutError as e:
            raise MasterError(str(e)) from e

    def __enter__(self) -> EmbeddedMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"EmbeddedMaster({self.rpc_address}, metrics={self.metrics_url}, {state})"


__all__ = ["MOONCAKE_LEASE_MS", "EmbeddedMaster", "MasterError", "find_master_binary", "free_port", "read_metrics"]

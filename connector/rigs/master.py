"""A real Mooncake master on loopback, and real store clients to talk to it.

Tests, the demo and the bench need a Mooncake store without a cluster. :class:`EmbeddedMaster` starts
the real ``mooncake_master`` binary on ``127.0.0.1`` with free ports, waits until its ``/health``
answers, and stops it by pid. It can also pause (SIGSTOP) and restart the master on the same ports,
which is how fault tests produce real store errors and real reconnects.

:func:`open_store` opens a real ``MooncakeDistributedStore`` client against it. Mooncake reads its
``MC_*`` environment variables when a client is set up, so the options here are applied around
``setup()`` (which makes :func:`open_store` unsafe to call from two threads at once).

Facts this relies on (measured here, see ANCHORS §3): the master is up in ~0.1 s; sizes 0/0 give a
lookup-only client; a writer needs a global segment (to hold values) and a local buffer (to stage puts);
with the master paused, a call fails with -901 after ``MC_RPC_TIMEOUT_MS``; with it killed, the
first call fails fast with -900 and later ones block ~4 s; ``setup()`` with no master retries for
~90 s unless ``MC_STORE_CLIENT_SETUP_RETRIES`` is small.
"""

from __future__ import annotations

import atexit
import collections
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from mooncake_lookout.connector.processes import die_with_parent, freeze, stop_process, thaw

BINARY_NAME = "mooncake_master"
INSTALL_HINT = (
    "install the Mooncake wheel: pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 "
    "(CPU hosts; it also needs Debian's libibverbs1) or mooncake-transfer-engine (CUDA hosts)"
)
IBVERBS_HINT = "the Mooncake wheel needs libibverbs.so.1: apt-get install -y libibverbs1"
LOG_LINES_KEPT = 40


class MasterError(RuntimeError):
    """The Mooncake master could not be found, started or stopped; the message says what to do."""


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


_LIVE: "weakref.WeakSet[EmbeddedMaster]" = weakref.WeakSet()


@atexit.register
def _stop_leftover_masters() -> None:
    """Never leave a master behind when the interpreter exits without calling ``stop()``."""
    for master in list(_LIVE):
        master.kill()


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
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: collections.deque[str] = collections.deque(maxlen=LOG_LINES_KEPT)
        self._log_thread: threading.Thread | None = None

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
        if self._proc is None:
            raise MasterError("the Mooncake master is not running")
        return self._proc.pid

    @property
    def running(self) -> bool:
        """True while the master process exists (paused counts as running)."""
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self) -> str:
        """The master's last log lines (stdout and stderr), for error messages."""
        return "\n".join(self._log)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "EmbeddedMaster":
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

    def _start_once(self) -> "EmbeddedMaster":
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
        self._log.clear()
        t0 = time.perf_counter()
        try:
            self._proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                          preexec_fn=die_with_parent() if self.die_with_parent else None)
        except OSError as exc:
            raise MasterError(f"cannot run {self.binary}: {exc}; {INSTALL_HINT}") from exc
        self._log_thread = threading.Thread(target=self._pump_log, args=(self._proc,),
                                            name=f"mooncake-master-log-{self._proc.pid}", daemon=True)
        self._log_thread.start()
        _LIVE.add(self)
        self._wait_healthy(t0)
        self.start_seconds = time.perf_counter() - t0
        return self

    def _pump_log(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            self._log.append(raw.decode(errors="replace").rstrip())

    def _wait_healthy(self, t0: float) -> None:
        deadline = t0 + self.start_timeout_s
        delay = 0.005
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                self._join_log()
                tail = self.log_tail()
                code = self._proc.returncode
                self._proc = None
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

    def _join_log(self) -> None:
        if self._log_thread is not None:
            self._log_thread.join(timeout=2.0)
            self._log_thread = None

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the master: SIGTERM, then SIGKILL after ``timeout_s`` seconds; by pid, idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        stop_process(proc, signal.SIGTERM, timeout_s)
        self._join_log()
        if proc.stdout is not None:
            proc.stdout.close()

    def kill(self) -> None:
        """Kill the master at once (SIGKILL by pid): a crash, for fault tests."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10.0)
        self._join_log()
        if proc.stdout is not None:
            proc.stdout.close()

    def restart(self) -> "EmbeddedMaster":
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

    def __enter__(self) -> "EmbeddedMaster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"EmbeddedMaster({self.rpc_address}, metrics={self.metrics_url}, {state})"


# -- clients --------------------------------------------------------------------------------------

WRITER_GLOBAL_SEGMENT = 64 << 20  # bytes this client lends the store to hold values
WRITER_LOCAL_BUFFER = 16 << 20  # bytes to stage puts; a client without it fails puts with -600


def import_store_class() -> type:
    """Import ``MooncakeDistributedStore``, turning the usual import failures into clear errors.

    Mooncake reads ``MC_LOG_LEVEL`` once, when its logging starts, so it is defaulted to ``ERROR`` in
    this process's environment before the import (a value the caller set is kept).
    """
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        if "libibverbs" in str(exc):
            raise MasterError(f"cannot import mooncake.store ({exc}); {IBVERBS_HINT}") from exc
        raise MasterError(f"cannot import mooncake.store ({exc}); {INSTALL_HINT}") from exc
    return MooncakeDistributedStore


@contextmanager
def _env(overrides: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def open_store(rpc_address: str, *, global_segment_size: int = 0, local_buffer_size: int = 0,
               setup_retries: int = 2, rpc_timeout_ms: int | None = None,
               local_hostname: str = "127.0.0.1") -> Any:
    """Open a real ``MooncakeDistributedStore`` client on ``rpc_address`` (``host:port``).

    Sizes 0/0 (the default) give a lookup-only client; :func:`open_writer_store` gives one that can
    hold puts. ``setup_retries`` is ``MC_STORE_CLIENT_SETUP_RETRIES``: attempts, at least 1, about 4.5 s each
    when the master is down (Mooncake's default makes a dead master cost ~90 s). ``rpc_timeout_ms`` is
    ``MC_RPC_TIMEOUT_MS`` for this client (None keeps Mooncake's 30 s): a stalled master then fails a
    call with -901 after that long. ``MC_TCP_BIND_ADDRESS`` is set to ``local_hostname`` unless the
    caller set it; Mooncake 0.3.13 still opens its handshake and RPC ports on all interfaces.
    Raises :class:`MasterError` if ``setup()`` fails. Not thread-safe (it sets environment variables).
    """
    if setup_retries < 1:
        raise ValueError(f"setup_retries must be >= 1 (Mooncake makes 0 attempts with 0), got {setup_retries}")
    store_cls = import_store_class()
    overrides = {
        "MC_STORE_CLIENT_SETUP_RETRIES": str(setup_retries),
        "MC_TCP_BIND_ADDRESS": os.environ.get("MC_TCP_BIND_ADDRESS", local_hostname),
    }
    if rpc_timeout_ms is not None:
        overrides["MC_RPC_TIMEOUT_MS"] = str(int(rpc_timeout_ms))
    store = store_cls()
    with _env(overrides):
        code = store.setup(local_hostname, "P2PHANDSHAKE", global_segment_size, local_buffer_size,
                           "tcp", "", rpc_address)
    if code != 0:
        raise MasterError(f"MooncakeDistributedStore.setup(master={rpc_address}) failed with code {code}; "
                          "is the master running and reachable?")
    return store


def open_writer_store(rpc_address: str, **kwargs: Any) -> Any:
    """A client that can put values: it lends 64 MiB to the store and stages puts in 16 MiB."""
    kwargs.setdefault("global_segment_size", WRITER_GLOBAL_SEGMENT)
    kwargs.setdefault("local_buffer_size", WRITER_LOCAL_BUFFER)
    return open_store(rpc_address, **kwargs)


__all__ = [
    "EmbeddedMaster",
    "MasterError",
    "find_master_binary",
    "free_port",
    "import_store_class",
    "open_store",
    "open_writer_store",
]

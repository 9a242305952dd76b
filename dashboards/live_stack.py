"""A small real deployment for proving and picturing the dashboards: real master, server, scheduler, Prometheus.

``LiveStack`` starts, all on 127.0.0.1: a ``mooncake_master``; a lookup server over it (with its
``/metrics``); two vLLM V1 schedulers with the lookout connector on the pipelined transport, one in
async mode and one in sync mode, each with its own ``/metrics``; vLLM's own Mooncake store-operation
metrics (``MooncakeStorePromMetrics``, what a GPU worker's connector reports) fed with the real store calls
of this stack (the server's existence checks as ``lookup_exists``, the filler's puts as ``save_put``; no GPU
worker runs here to make loads and saves of its own); and a Prometheus scraping all of them every second.
:meth:`LiveStack.drive` feeds the schedulers a shared-prefix workload (half the prompt is in the store).
Every process it starts is stopped by pid on exit.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.rigs.master import EmbeddedMaster
from mooncake_lookout.connector.rigs.processes import stop_process
from mooncake_lookout.connector.server import LookupServer, ServerObserver
from mooncake_lookout.connector.server.prefix_index import PrefixIndex
from mooncake_lookout.connector.server.store import MARKER_LOCAL_BUFFER, open_store, open_writer_store
from mooncake_lookout.metrics.exporter import serve_metrics
from mooncake_lookout.metrics.prometheus_sink import PrometheusSink
from mooncake_lookout.metrics.server_sink import ServerMetrics

SCRAPE_S = 1
RATE_INTERVAL = "10s"  # what Grafana's $__rate_interval is at a 1 s scrape (4 x scrape, rounded up)
PREFIX_BLOCKS = 4
UNIQUE_BLOCKS = 4
BLOCK = 16
JOBS = {"clients": "vllm", "server": "lookup-server", "master": "mooncake-master"}
STORE_OP_LABELS = {"model_name": "live-model", "engine": "0"}


class StoreOperationFeed(ServerObserver):
    """vLLM's ``MooncakeStorePromMetrics`` fed with real store calls, as its worker-side connector feeds it.

    The lookup server's store calls are existence checks of the keys it is asked about: vLLM's worker records
    those as ``lookup_exists``. :meth:`record` adds any other timed operation (the filler's ``save_put``).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        from functools import partial

        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.metrics import MooncakeStorePromMetrics

        types = {cls: partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
        self.prom = MooncakeStorePromMetrics(_store_op_config(), types, list(STORE_OP_LABELS),
                                             {0: list(STORE_OP_LABELS.values())})
        self._lock = threading.Lock()

    def record(self, operation: str, seconds: float, keys: int, *, num_bytes: int = 0, failed: bool = False) -> None:
        """One store call, recorded the way vLLM's ``MooncakeStoreConnectorStats.record_operation`` does."""
        record = {"duration_seconds": seconds, "num_keys": keys, "num_bytes": num_bytes,
                  "status": "error" if failed else "ok", "num_failed_keys": keys if failed else 0}
        with self._lock:
            self.prom.observe({operation: [record]})

    def store_call(self, batch_size: int, seconds: float, failed: bool) -> None:
        self.record("lookup_exists", seconds, batch_size, failed=failed)


def _store_op_config() -> Any:
    """The smallest real VllmConfig the store metrics accept (they keep its kv_transfer_config)."""
    from mooncake_lookout.connector.rigs.vllm_lookup_server import lookup_vllm_config

    return lookup_vllm_config()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


class PromAPI:
    """Prometheus' HTTP API at ``url`` (a server of ours or any other)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def api(self, path: str, **params: str) -> dict[str, Any]:
        """GET ``/api/v1/<path>``; returns the JSON body (HTTP errors carry Prometheus' error text)."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            return _get(url)
        except urllib.error.HTTPError as e:
            return json.loads(e.read())

    def query_range(self, expr: str, seconds: float, step: str = "1s") -> dict[str, Any]:
        """A range query over the last ``seconds``, as a panel would run it."""
        end = time.time()
        return self.api("query_range", query=expr, start=f"{end - seconds:.3f}", end=f"{end:.3f}", step=step)


class Prometheus(PromAPI):
    """A real ``prometheus`` server on 127.0.0.1 with a given scrape config; stopped by pid."""

    def __init__(self, targets: dict[str, list[str]], workdir: Path, binary: str | None = None) -> None:
        self.binary = binary or shutil.which("prometheus") or "/usr/bin/prometheus"
        self.port = _free_port()
        super().__init__(f"http://127.0.0.1:{self.port}")
        self.workdir = workdir
        jobs = []
        for job, addrs in targets.items():
            jobs.append(f"  - job_name: {json.dumps(job)}\n    static_configs:\n"
                        f"      - targets: {json.dumps(addrs)}\n")
        config = (f"global:\n  scrape_interval: {SCRAPE_S}s\n  evaluation_interval: {SCRAPE_S}s\n"
                  "scrape_configs:\n" + "".join(jobs))
        (workdir / "prometheus.yml").write_text(config)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> Prometheus:
        """Start and wait (bounded) until ready."""
        with open(self.workdir / "prometheus.log", "wb") as log:
            self.proc = subprocess.Popen(
                [self.binary, f"--config.file={self.workdir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={self.workdir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(self.workdir / 'prometheus.log').read_text()[-2000:]}")
            with contextlib.suppress(OSError), urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                if r.status == 200:
                    return self
            time.sleep(0.1)
        raise TimeoutError("prometheus did not become ready")

    def stop(self) -> None:
        """Terminate by pid, kill if it does not stop."""
        if self.proc is not None:
            stop_process(self.proc, signal.SIGTERM, timeout_s=10.0)
        self.proc = None


class LiveStack(contextlib.ExitStack):
    """Master, lookup server, two vLLM schedulers and Prometheus on 127.0.0.1 (see the module docstring)."""

    def __enter__(self) -> LiveStack:
        super().__enter__()
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        from mooncake_lookout.connector.rigs.scheduler_driver import SchedulerDriver, make_vllm_config

        self.workdir = Path(self.enter_context(tempfile.TemporaryDirectory(prefix="lookout-live-")))
        self.master = self.enter_context(EmbeddedMaster())
        writer = open_writer_store(self.master.rpc_address)
        self.callback(writer.close)
        # A buffer for the server's epoch marker, as `serve` has: with it the clients' prefix caches are on, and the
        # Tuning dashboard's prefix-cache row has something to show.
        reader = open_store(self.master.rpc_address, local_buffer_size=MARKER_LOCAL_BUFFER)
        self.callback(reader.close)
        self.filler = PrefixIndex(writer, BLOCK)
        server_registry = CollectorRegistry()
        # vLLM serves its store-operation metrics on the same /metrics as ours: the async scheduler's, here.
        store_op_registry = CollectorRegistry()
        self.store_ops = StoreOperationFeed(store_op_registry)
        self.server = self.enter_context(LookupServer(PrefixIndex(reader, BLOCK), "tcp://127.0.0.1:0",
                                                      observers=[ServerMetrics(server_registry), self.store_ops]))
        server_ep = self.enter_context(serve_metrics(0, registry=server_registry))
        self.drivers: dict[str, Any] = {}
        client_eps = []
        for mode, extra in (("async", {"lookup_async": True}), ("sync", {"lookup_async": False})):
            # load_async=False: upstream then loads hits inside the (made-up) forward pass instead of
            # parking the request until a worker reports the load done; there is no worker here.
            extra = {**extra, "lookup_transport": "pipelined", "lookup_server_address": self.server.address,
                     "load_async": False}
            driver = SchedulerDriver(make_vllm_config(extra))
            self.callback(driver.close)
            registry = store_op_registry if mode == "async" else CollectorRegistry()
            sink = PrometheusSink(LookupConfig.from_extra_config(extra), registry)
            driver.connector.connector_scheduler.observers.add(sink)
            client_eps.append(self.enter_context(serve_metrics(0, registry=registry)))
            self.drivers[mode] = driver
        master_target = self.master.metrics_url.removeprefix("http://")
        self.prometheus = Prometheus({
            JOBS["clients"]: [f"127.0.0.1:{ep.port}" for ep in client_eps],
            JOBS["server"]: [f"127.0.0.1:{server_ep.port}"],
            JOBS["master"]: [master_target],
        }, self.workdir)
        self.callback(self.prometheus.stop)
        self.prometheus.start()
        self._prefix = list(range(1000, 1000 + PREFIX_BLOCKS * BLOCK))
        any_driver = next(iter(self.drivers.values()))
        t0 = time.perf_counter()
        written = self.filler.store_prefixes([any_driver.block_hashes(self._prefix + [1])[:PREFIX_BLOCKS]])
        self.store_ops.record("save_put", time.perf_counter() - t0, written, num_bytes=written)  # one-byte values
        self._count = 0

    def _prompt(self, i: int) -> list[int]:
        own = [(7919 * i + j) % 40000 + 5000 for j in range(UNIQUE_BLOCKS * BLOCK + 1)]
        return self._prefix + own

    def drive(self, seconds: float, per_step: int = 2, step_s: float = 0.002) -> int:
        """Add ``per_step`` requests per step to each scheduler and step them for ``seconds``; returns requests."""
        deadline = time.monotonic() + seconds
        added = 0
        while time.monotonic() < deadline:
            for mode, driver in self.drivers.items():
                for _ in range(per_step):
                    self._count += 1
                    driver.add(driver.make_request(f"{mode}-{self._count}", self._prompt(self._count)))
                    added += 1
                driver.step()
            time.sleep(step_s)  # pacing between scheduler steps, not a wait for a condition
        for driver in self.drivers.values():
            driver.run_until_idle()
        return added

    def drive_in_background(self, stop: threading.Event, **kw: Any) -> threading.Thread:
        """Keep driving in a thread until ``stop`` is set (in one-second slices)."""
        def loop() -> None:
            while not stop.is_set():
                self.drive(1.0, **kw)

        t = threading.Thread(target=loop, name="live-workload", daemon=True)
        t.start()
        return t


__all__ = ["JOBS", "LiveStack", "PromAPI", "Prometheus", "RATE_INTERVAL", "SCRAPE_S", "StoreOperationFeed"]


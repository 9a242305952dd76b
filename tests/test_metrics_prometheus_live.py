"""A real Prometheus scrapes the standalone /metrics during a real workload and reads every family back.

Real parts throughout: the session's Mooncake master, a PrefixIndex over a real store client, our
LookupServer (ROUTER) with ServerMetrics, a real LookupClient over the pipelined transport, the
PrometheusSink served by the exporter, and Debian's ``prometheus`` on 127.0.0.1 (killed by pid).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from mooncake_lookout.connector.client import LookupClient
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.rigs.master import free_port
from mooncake_lookout.connector.rigs.processes import stop_process
from mooncake_lookout.connector.server import LookupServer
from mooncake_lookout.connector.transport.pipelined import PipelinedTransport
from mooncake_lookout.metrics import catalogue as cat
from mooncake_lookout.metrics.exporter import serve_metrics
from mooncake_lookout.metrics.prometheus_sink import PrometheusSink, info_labels
from mooncake_lookout.metrics.server_sink import ServerMetrics

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)


class Prometheus:
    """Debian's prometheus on 127.0.0.1, scraping one target every second; stopped by pid.

    The port comes from the OS and is free when picked, but another process may take it before
    prometheus binds it: then the instance answering is checked to be ours (its tsdb path), and the
    start is retried on a new port.
    """

    def __init__(self, binary: str, target: str, workdir: Path) -> None:
        self.target = target
        self.workdir = workdir
        config = workdir / "prometheus.yml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [{"job_name": "lookout", "static_configs": [{"targets": [target]}]}],
        }))
        self.log = workdir / "prometheus.log"
        for attempt in range(3):
            self.port = free_port()
            self.tsdb = workdir / f"tsdb-{attempt}"
            with self.log.open("wb") as log:
                self.proc = subprocess.Popen(
                    [binary, f"--config.file={config}", f"--storage.tsdb.path={self.tsdb}",
                     f"--web.listen-address=127.0.0.1:{self.port}"],
                    stdout=log, stderr=subprocess.STDOUT)
            try:
                self.wait_until(lambda: self.api("status/flags")["storage.tsdb.path"] == str(self.tsdb),
                                timeout_s=30)
                return
            except AssertionError:
                self.stop()
        raise AssertionError(f"prometheus did not start: {self.log.read_text()[-2000:]}")

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, promql: str) -> dict[str, float]:
        """Instant query: {sorted label items as text: value}."""
        out = {}
        for r in self.api("query", query=promql)["result"]:
            labels = {k: v for k, v in r["metric"].items() if k not in ("__name__", "instance", "job")}
            out[",".join(f"{k}={v}" for k, v in sorted(labels.items()))] = float(r["value"][1])
        return out

    def wait_until(self, check: Any, timeout_s: float = 60.0) -> None:
        """Poll ``check()`` until it returns True (not merely truthy) within ``timeout_s``, else show its last value."""
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited: {self.log.read_text()[-2000:]}")
            try:
                last = check()
                if last is True:
                    return
            except (OSError, AssertionError, KeyError, ValueError) as exc:
                last = exc
            time.sleep(0.2)
        try:
            targets = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in self.api("targets")["activeTargets"]]
        except OSError as exc:
            targets = [repr(exc)]
        raise AssertionError(f"condition not met in {timeout_s} s; last: {last!r}; targets: {targets}")

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGTERM, timeout_s=10.0)


@pytest.fixture
def prometheus_factory(tmp_path: Path, prometheus_binary: str) -> Iterator[Any]:
    started: list[Prometheus] = []

    def start(target: str) -> Prometheus:
        prom = Prometheus(prometheus_binary, target, tmp_path)
        started.append(prom)
        return prom

    yield start
    for prom in started:
        prom.stop()


def _poll_answer(client: LookupClient, req: Any, deferrals: list[int], timeout_s: float = 10.0) -> Any:
    """Ask as the async scheduler does, once per 'step', until the answer comes (bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        result = client.lookup(req.req_id, req.num_tokens, req.block_hashes, non_block=True)
        # The test plays the scheduler adapter's part: it times its own call into the lookup path.
        client.observers.scheduler_call("async", time.perf_counter() - t0)
        if result is not None:
            return result
        deferrals[0] += 1
        time.sleep(0.0005)
    raise AssertionError(f"{req.req_id}: no answer in {timeout_s} s")


def test_prometheus_reads_every_family_back(prefix_index: Any, make_workload: Any,
                                            prometheus_factory: Any, promtool: Any) -> None:
    registry = CollectorRegistry()
    config = LookupConfig(lookup_async=True, lookup_transport="pipelined", lookup_max_pending=32,
                          lookup_timeout_ms=2000)
    sink = PrometheusSink(config, registry=registry)
    server_metrics = ServerMetrics(registry=registry)
    requests = make_workload(48, prefix_blocks=4, unique_blocks=2, num_prefixes=4)
    warm = [r for i, r in enumerate(requests) if i % 4 < 2]  # prefixes 0 and 1 are in the store
    prefix_index.store_prefixes(r.block_hashes[:4] for r in warm)

    with serve_metrics(0, registry=registry) as endpoint, \
            LookupServer(prefix_index, observers=[server_metrics]) as server:
        prom = prometheus_factory(f"127.0.0.1:{endpoint.port}")
        transport = PipelinedTransport(server.address, timeout_s=config.timeout_s, on_late_reply=sink.late_reply)
        client = LookupClient(config, transport, observer=sink)
        try:
            # Wave 1: 40 arrivals at once; the first 32 are pending, the other 8 are asked blocking past the
            # bound and refused at once (rejected).
            wave, later = requests[:40], requests[40:]
            for req in wave[:32]:
                client.start(req.req_id, req.num_tokens, req.block_hashes)
            refused = {req.req_id: client.lookup(req.req_id, req.num_tokens, req.block_hashes) for req in wave[32:]}
            # Scrape while lookups are pending: the gauge shows them.
            prom.wait_until(lambda: prom.query(cat.PENDING.name) == {"": 32.0} or prom.query(cat.PENDING.name))
            deferrals = [0]
            answers = {}
            answers.update(refused)
            for req in wave[:32]:
                answers[req.req_id] = _poll_answer(client, req, deferrals)
                client.discard(req.req_id)  # used: forgetting it now is not a discard
            # Wave 2: 8 lookups dropped before their answer is used (request aborted).
            for req in later:
                client.start(req.req_id, req.num_tokens, req.block_hashes)
                client.discard(req.req_id)
        finally:
            client.close()

        rejected = wave[32:]
        hits = [r for r in wave[:32] if answers[r.req_id].hit_length > 0]
        misses = [r for r in wave[:32] if answers[r.req_id].hit_length == 0]
        assert {r.req_id for r in hits} == {r.req_id for r in wave[:32] if r in warm}
        assert all(answers[r.req_id].hit_length == 0 for r in rejected)
        expected_outcomes = {"hit": len(hits), "miss": len(misses), "rejected": len(rejected),
                             "discarded": len(later), "error": 0, "timeout": 0, "breaker_open": 0}

        def requests_match() -> bool:
            got = prom.query(cat.REQUESTS.sample_names[0])
            return got == {f"outcome={o}": float(n) for o, n in expected_outcomes.items()}

        prom.wait_until(requests_match)
        # The server answered whatever reached it: the 32 pending lookups, plus those of the 8 discarded
        # ones that left before their discard (their replies are late, or lost when the client closed).
        def local(spec: cat.MetricSpec, suffix: str = "", **labels: str) -> float:
            return registry.get_sample_value(spec.sample_names[0] if spec.kind == "counter" else spec.name + suffix,
                                             labels) or 0.0

        prom.wait_until(lambda: local(cat.SERVER_QUEUE_DEPTH) == 0 and local(cat.SERVER_INFLIGHT) == 0)
        served, late = local(cat.SERVER_REQUESTS, status="ok"), local(cat.LATE_REPLIES)
        assert 32 + late <= served <= 40
        prom.wait_until(lambda: prom.query(f'{cat.SERVER_REQUESTS.sample_names[0]}{{status="ok"}}')
                        == {"status=ok": served} and prom.query(cat.LATE_REPLIES.sample_names[0]) == {"": late})

        def one(promql: str) -> float:
            [value] = prom.query(promql).values()
            return value

        assert one(cat.PENDING.name) == 0
        assert one(cat.MAX_PENDING.name) == config.lookup_max_pending
        # Tokens count as queried only when the store answered for them: not for the refused lookups.
        assert one(cat.QUERIED_TOKENS.sample_names[0]) == sum(r.num_tokens for r in wave[:32])
        assert one(cat.HIT_TOKENS.sample_names[0]) == 64 * len(hits)
        assert one(cat.DEFERRALS.sample_names[0]) == deferrals[0]
        assert one(f"{cat.DEFERRED_STEPS.name}_sum") == deferrals[0]
        assert one(f"{cat.DEFERRED_STEPS.name}_count") == len(wave)
        assert one(f"{cat.SECONDS.name}_count") == 32  # submit-to-use time only for lookups that were sent
        assert one(f"{cat.RPC_SECONDS.name}_count") == 32  # rejected lookups never travel
        assert one(f"{cat.QUEUE_SECONDS.name}_count") == 32
        assert 0 < one(f"{cat.RPC_SECONDS.name}_sum") < 32 * config.timeout_s
        assert one(f'{cat.SCHEDULER_BLOCKED_SECONDS.name}_count{{mode="async"}}') >= 32  # each polled lookup
        assert one(cat.BREAKER_OPEN.name) == 0
        info = prom.query(cat.INFO.name)
        assert info == {",".join(f"{k}={v}" for k, v in sorted(info_labels(config).items())): 1.0}
        assert one(cat.SERVER_QUEUE_DEPTH.name) == 0
        assert one(cat.SERVER_INFLIGHT.name) == 0
        assert one(cat.SERVER_STORE_ERRORS.sample_names[0]) == 0
        assert one(f"{cat.SERVER_BATCH_SIZE.name}_sum") == served
        assert one(f"{cat.SERVER_STORE_SECONDS.name}_count") == one(f"{cat.SERVER_BATCH_SIZE.name}_count") >= 1
        # Every series of every family is stored in Prometheus.
        for spec in cat.CATALOGUE:
            for series in spec.sample_names:
                assert prom.query(f'count({{__name__="{series}"}})'), series
        # No request id in any label value Prometheus holds.
        all_values = {v for name in prom.api("labels") for v in prom.api(f"label/{name}/values")}
        for req in requests:
            assert not any(req.req_id in v for v in all_values)
        text = urllib.request.urlopen(endpoint.url, timeout=5).read().decode()
    promtool.assert_metrics_clean(text)

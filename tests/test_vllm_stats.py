"""Lookup figures through vLLM's own stats pipeline: collector -> KVConnectorStats -> wire -> Prometheus logger."""

from __future__ import annotations

import pickle
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import REGISTRY, generate_latest
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.metrics import MooncakeStoreConnectorStats
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from mooncake_lookout.connector.client import LookupClient
from mooncake_lookout.connector.config import SYNC_BLOCK_MS, TIMEOUT_MS, LookupConfig
from mooncake_lookout.connector.lookup import Outcome
from mooncake_lookout.connector.transport import make_transport
from mooncake_lookout.metrics import catalogue as cat
from mooncake_lookout.metrics.vllm_stats import (
    STATS_KEY,
    LookoutLookupStats,
    LookoutPromMetrics,
    LookupStatsCollector,
)

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

BLOCK = 16


def _upstream_op(duration: float = 0.002) -> dict[str, Any]:
    return {"duration_seconds": duration, "num_keys": 4, "num_bytes": 4096, "status": "ok", "num_failed_keys": 0}


@pytest.fixture
def lookup_server(prefix_index: Any) -> Iterator[Any]:
    from mooncake_lookout.connector.server import LookupServer

    with LookupServer(prefix_index) as server:
        yield server


@pytest.fixture
def client(lookup_server: Any) -> Iterator[LookupClient]:
    """Our client as vLLM runs it in async mode (the socket on its own thread), against a real server."""
    config = LookupConfig(lookup_async=True, lookup_timeout_ms=5000)
    c = LookupClient(config, make_transport(config, lookup_server.address))
    yield c
    c.close()


def _answer(client: LookupClient, req_id: str, hashes: list[bytes], bound_s: float = 10.0) -> Any:
    """Ask as vLLM's async scheduler does, a step at a time, until the answer comes."""
    end = time.monotonic() + bound_s
    while (result := client.lookup(req_id, len(hashes) * BLOCK + 1, hashes, non_block=True)) is None:
        assert time.monotonic() < end, f"{req_id} never answered"
        client.end_step()
        time.sleep(0.001)
    return result


# -- the collector and the stats object -------------------------------------------------------------------


def test_collector_makes_one_record_a_step_from_the_clients_log(client: LookupClient, prefix_index: Any,
                                                               make_hashes: Any) -> None:
    collector = LookupStatsCollector(client, every_s=0)  # a record whenever there is something
    assert collector.take() is None  # a quiet step ships nothing
    hit = make_hashes(4, seed=31)
    prefix_index.store_prefixes([hit[:3]])
    client.start("a", 4 * BLOCK + 1, hit, admission=True)
    client.scheduler_call("async", 3e-5)
    answer = _answer(client, "a", hit)
    assert answer.hit_length == 3 * BLOCK and answer.deferrals >= 1
    client.start("b", 2 * BLOCK + 1, make_hashes(2, seed=32), admission=True)  # still pending at the step's end
    [s] = collector.take().lookup_steps()
    assert s[cat.REQUESTS.key] == {"hit": 1}
    assert [type(k) for k in s[cat.REQUESTS.key]] == [str]  # a label value ("hit"), not the enum ("Outcome.HIT")
    assert s[cat.QUERIED_TOKENS.key] == 4 * BLOCK + 1 and s[cat.HIT_TOKENS.key] == 3 * BLOCK
    assert s[cat.DEFERRALS.key] == answer.deferrals and s[cat.DEFERRED_STEPS.key] == [answer.deferrals]
    assert s[cat.PENDING.key] == 1 and s[cat.HELD.key] == 1
    assert s[cat.RPC_SECONDS.key] == [pytest.approx(answer.rpc_seconds)]
    assert s[cat.SCHEDULER_BLOCKED_SECONDS.key] == {"async": [3e-5]}
    assert len(s.get(cat.STEP_INTERVAL_SECONDS.key, [])) == answer.deferrals - 1  # one a step after the first
    client.discard("b")
    [s2] = collector.take().lookup_steps()
    assert s2[cat.REQUESTS.key] == {"discarded": 1} and s2[cat.PENDING.key] == 0
    assert cat.BREAKER_OPEN.key not in s2  # a gauge travels only when it changed


def test_records_come_at_most_every_interval_and_lose_nothing(client: LookupClient, prefix_index: Any,
                                                              make_hashes: Any) -> None:
    """Between records the log keeps growing; ``flush`` (the engine about to idle) or the interval's end wraps it
    all, so every lookup reaches vLLM exactly once."""
    collector = LookupStatsCollector(client, every_s=3600)
    hashes = {f"r{i}": make_hashes(2, seed=60 + i) for i in range(3)}
    _answer(client, "r0", hashes["r0"])
    [first] = collector.take().lookup_steps()  # the first record comes at once
    _answer(client, "r1", hashes["r1"])
    assert collector.take() is None  # within the interval: kept
    _answer(client, "r2", hashes["r2"])
    assert collector.take() is None
    [flushed] = collector.take(flush=True).lookup_steps()
    assert first[cat.REQUESTS.key] == {"miss": 1} and flushed[cat.REQUESTS.key] == {"miss": 2}
    assert flushed[cat.DEFERRALS.key] >= 2  # both lookups' deferrals, kept across the steps
    assert collector.take(flush=True) is None  # nothing new: nothing to send
    due = LookupStatsCollector(client, every_s=0.05)
    client.start("r3", 2 * BLOCK + 1, make_hashes(2, seed=63), admission=True)
    client.end_step()  # a step interval, in the log until a record
    time.sleep(0.06)  # past the interval: a record with what the log has (memory stays bounded)
    assert due.take() is not None


def test_late_replies_and_the_breaker_reach_the_record(tmp_path: Any) -> None:
    """A real late reply: a server that answers after the lookup's deadline (a ROUTER answering by hand 0.3 s
    late: a slow server cannot be made slow on demand otherwise); one timeout opens a 1-failure breaker."""
    import zmq

    from mooncake_lookout.connector.wire import pipelined as protocol

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    address = f"ipc://{tmp_path}/late.sock"
    router.bind(address)
    config = LookupConfig(lookup_async=True, lookup_timeout_ms=50, lookup_breaker_failures=1)
    client = LookupClient(config, make_transport(config, address))
    collector = LookupStatsCollector(client, every_s=0)
    try:
        hashes = [bytes([7]) * 32] * 2
        assert client.lookup("a", 33, hashes, non_block=True) is None
        assert router.poll(5000)
        peer, header, body = router.recv_multipart()
        request = protocol.decode_request([header, body])
        time.sleep(0.1)  # past the deadline
        assert client.lookup("a", 33, hashes, non_block=True).outcome is Outcome.TIMEOUT
        router.send_multipart([peer, protocol.encode_reply(request.frame_id, [protocol.result_of(
            request.queries[0].lookup_id, protocol.LookupResult(0))])])
        end = time.monotonic() + 5
        while client.transport.late_replies == 0:
            assert time.monotonic() < end, "the late reply never came"
            time.sleep(0.005)
        [s] = collector.take().lookup_steps()
        assert s[cat.LATE_REPLIES.key] == 1 and s[cat.REQUESTS.key] == {"timeout": 1}
        assert s[cat.BREAKER_OPEN.key] == 1
        assert collector.take() is None  # counted once
    finally:
        client.close()
        ctx.destroy(linger=0)


def _one_step(client: LookupClient, prefix_index: Any, make_hashes: Any, seed: int, cached: int) -> Any:
    hashes = make_hashes(4, seed=seed)
    if cached:
        prefix_index.store_prefixes([hashes[:cached]])
    return _answer(client, f"r{seed}", hashes)


def test_payload_survives_vllm_wire_formats(client: LookupClient, prefix_index: Any, make_hashes: Any) -> None:
    collector = LookupStatsCollector(client, every_s=0)
    _one_step(client, prefix_index, make_hashes, 41, 0)
    _one_step(client, prefix_index, make_hashes, 42, 2)
    client.scheduler_call("budget", 1e-4)
    payload = collector.take().to_dict()
    stats = SchedulerStats(kv_connector_stats=payload)
    decoded = MsgpackDecoder(SchedulerStats).decode(MsgpackEncoder().encode(stats))
    sent = LookoutLookupStats(data=payload).lookup_steps()
    assert LookoutLookupStats(data=decoded.kv_connector_stats).lookup_steps() == sent  # rows arrive as lists
    assert LookoutLookupStats(data=pickle.loads(pickle.dumps(payload))).lookup_steps() == sent
    assert sent[0][cat.REQUESTS.key] == {"hit": 1, "miss": 1}
    reduced = LookoutLookupStats(data=decoded.kv_connector_stats).reduce()
    assert reduced["lookup_miss"] == 1 and reduced["lookup_hit"] == 1


@pytest.mark.parametrize("ours_first", [True, False])
def test_aggregates_with_upstream_worker_stats_either_way(client: LookupClient, prefix_index: Any,
                                                          make_hashes: Any, ours_first: bool) -> None:
    """vLLM calls ``worker_stats.aggregate(scheduler_stats)``: upstream's class must keep our records too."""
    collector = LookupStatsCollector(client, every_s=0)
    _one_step(client, prefix_index, make_hashes, 51, 1)
    ours: KVConnectorStats = collector.take()
    upstream = MooncakeStoreConnectorStats()
    upstream.record_operation("lookup_exists", 0.002, 4, num_bytes=4096)
    merged = ours.aggregate(upstream) if ours_first else upstream.aggregate(ours)
    data = merged.to_dict()
    assert len(data[STATS_KEY]) == 1 and len(data["lookup_exists"]) == 1
    _one_step(client, prefix_index, make_hashes, 52, 0)
    both = LookoutLookupStats(data=data).aggregate(collector.take())
    reduced = both.reduce()
    assert reduced["lookups"] == 2 and reduced["lookup_hit"] == 1 and reduced["lookup_miss"] == 1
    assert reduced["lookup_exists_count"] == 1  # upstream's own summary is kept


# -- vLLM's Prometheus logger path -------------------------------------------------------------------------


def _vllm_config(extra: dict[str, Any]) -> Any:
    from mooncake_lookout.connector.rigs.scheduler_driver import make_vllm_config

    return make_vllm_config(extra)


def _scrape_vllm_registry() -> str:
    return generate_latest(REGISTRY).decode()


def _labels(**labels: str) -> str:
    """Label text as the exposition writes it (sorted by name)."""
    return "{" + ",".join(f'{k}="{labels[k]}"' for k in sorted(labels)) + "}"


def _series(text: str, name: str) -> dict[str, float]:
    """Samples of one series name in a text exposition: {label text: value}."""
    out = {}
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        out[m.group(1) or ""] = float(m.group(2))
    return out


def test_prom_metrics_carry_model_and_engine_labels(lookup_server: Any, prefix_index: Any,
                                                    make_hashes: Any) -> None:
    """LookoutPromMetrics on vLLM's own metric classes, two engines, info from the extra config."""
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    unregister_vllm_metrics()
    cfg = _vllm_config({"lookup_async": True, "lookup_wait_us": 200, "lookup_transport": "pipelined",
                        "lookup_max_pending": 64})
    prom = LookoutPromMetrics(cfg, {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
                              ["model_name", "engine"], {0: ["tiny", "0"], 1: ["tiny", "1"]})
    config = LookupConfig(lookup_async=True, lookup_wait_us=200, lookup_timeout_ms=5000)
    client = LookupClient(config, make_transport(config, lookup_server.address))
    try:
        collector = LookupStatsCollector(client)
        _one_step(client, prefix_index, make_hashes, 61, 2)
        client.scheduler_call("budget", 5e-5)
        data = collector.take().aggregate(_wrap_upstream()).to_dict()
    finally:
        client.close()
    prom.observe(data, engine_idx=1)
    text = _scrape_vllm_registry()
    hits = _series(text, cat.REQUESTS.name + "_total")
    assert hits['{engine="1",model_name="tiny",outcome="hit"}'] == 1
    assert hits['{engine="0",model_name="tiny",outcome="hit"}'] == 0
    info = _series(text, cat.INFO.name)
    assert any('mode="budget"' in k and 'transport="pipelined"' in k and 'engine="0"' in k for k in info)
    # The configured bound is a number per engine, so alerts can divide pending by it.
    assert _series(text, cat.MAX_PENDING.name) == {'{engine="0",model_name="tiny"}': 64.0,
                                                    '{engine="1",model_name="tiny"}': 64.0}
    blocked = _series(text, cat.SCHEDULER_BLOCKED_SECONDS.name + "_count")
    assert blocked['{engine="1",mode="budget",model_name="tiny"}'] == 1
    # Upstream's store-operation records in the same payload still reach upstream's metrics.
    assert _series(text, "vllm:mooncake_store_operation_total")
    unregister_vllm_metrics()


def _wrap_upstream() -> MooncakeStoreConnectorStats:
    upstream = MooncakeStoreConnectorStats()
    upstream.record_operation("lookup_exists", 0.002, 4, num_bytes=4096)
    return upstream


# -- vLLM's real scheduler, the wire and vLLM's PrometheusStatLogger ----------------------------------------

def test_scheduler_stats_reach_vllm_prometheus_logger(prefix_index: Any, lookup_server: Any,
                                                      promtool: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every lookup reaches vLLM's logger by the end of the run: with records an hour apart, only the first and the
    one made when the last request finished (the engine would idle after it) can carry them."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    from mooncake_lookout.metrics import vllm_stats

    monkeypatch.setattr(vllm_stats, "RECORD_EVERY_S", 3600.0)
    from vllm.v1.outputs import ModelRunnerOutput

    from mooncake_lookout.connector.rigs.scheduler_driver import SchedulerDriver, make_vllm_config

    # load_async=False (upstream's key): hits load within the step; no worker here reports async loads done.
    cfg = make_vllm_config({"lookup_async": True, "lookup_transport": "pipelined", "load_async": False,
                            "lookup_server_address": lookup_server.address})
    driver = SchedulerDriver(cfg, num_blocks=1024)
    try:
        # vLLM's logger loads LookoutMooncakeStoreConnector and calls its build_prom_metrics.
        prom_logger = PrometheusStatLogger(cfg, engine_indexes=[0])
        prompts = {f"req-{i}": [1000 * i + t for t in range(80)] for i in range(6)}  # 5 blocks each
        warm = [r for i, r in enumerate(prompts) if i % 2 == 0]
        prefix_index.store_prefixes(driver.block_hashes(prompts[r])[:4] for r in warm)  # 64 tokens each
        for req_id, prompt in prompts.items():
            driver.add(driver.make_request(req_id, prompt, max_tokens=2))
        encoder, decoder = MsgpackEncoder(), MsgpackDecoder(SchedulerStats)
        shipped = 0
        for _ in range(2000):  # bounded: lookups take ~1 ms, the run a few dozen steps
            if not driver.scheduler.has_requests():
                break
            out = driver.scheduler.schedule()
            req_ids = list(out.num_scheduled_tokens)
            runner = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                       sampled_token_ids=[[1] for _ in req_ids])
            for eco in driver.scheduler.update_from_output(out, runner).values():
                if eco.scheduler_stats is None:
                    continue
                # The engine core ships SchedulerStats to the API server as msgpack; do the same.
                stats = decoder.decode(encoder.encode(eco.scheduler_stats))
                shipped += bool(stats.kv_connector_stats)
                prom_logger.record(stats, None, engine_idx=0)
            time.sleep(0.001)  # a model step's worth of time, so answers arrive while requests wait
        assert not driver.scheduler.has_requests()
        assert shipped > 0
    finally:
        driver.close()

    text = _scrape_vllm_registry()
    engine = {"engine": "0", "model_name": cfg.model_config.served_model_name}

    def value(spec: cat.MetricSpec, suffix: str = "", **labels: str) -> float:
        return _series(text, spec.name + suffix)[_labels(**engine, **labels)]

    assert value(cat.REQUESTS, "_total", outcome="hit") == len(warm)
    assert value(cat.REQUESTS, "_total", outcome="miss") == len(prompts) - len(warm)
    for outcome in set(cat.OUTCOMES) - {"hit", "miss"}:
        assert value(cat.REQUESTS, "_total", outcome=outcome) == 0
    assert value(cat.HIT_TOKENS, "_total") == 64 * len(warm)
    assert value(cat.QUERIED_TOKENS, "_total") == 80 * len(prompts)
    assert value(cat.PENDING) == 0
    assert value(cat.SECONDS, "_count") == len(prompts)
    assert value(cat.RPC_SECONDS, "_count") == len(prompts)
    assert value(cat.SCHEDULER_BLOCKED_SECONDS, "_count", mode="async") >= len(prompts)
    assert value(cat.DEFERRED_STEPS, "_sum") == value(cat.DEFERRALS, "_total")
    assert value(cat.INFO, transport="pipelined", lookup_async="true", mode="async", lookup_wait_us="0",
                 lookup_wait_auto_share="0.25", lookup_timeout_ms=f"{TIMEOUT_MS:g}",
                 lookup_block_ms=f"{SYNC_BLOCK_MS:g}", lookup_max_pending="1024") == 1
    # Step intervals (what advise divides lookup time by) travel in the records made when lookups end: one per
    # scheduler step after the first, up to the step of the last answer.
    assert value(cat.STEP_INTERVAL_SECONDS, "_count") >= value(cat.DEFERRALS, "_total") / len(prompts) > 0
    assert value(cat.MAX_PENDING) == 1024
    # Request ids never become labels.
    for req_id in prompts:
        assert f'"{req_id}"' not in text
    # Only our families: vLLM's own output is not ours to lint.
    promtool.assert_metrics_clean("\n".join(line for line in text.splitlines() if cat.PREFIX in line) + "\n")

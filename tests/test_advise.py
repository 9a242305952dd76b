"""``mooncake-lookout advise``: its rules on given figures, its fragments through the real chart, its errors
against a real Prometheus.

* The rules (connector/cli/advise_rules.py) are pure arithmetic on the figures read from Prometheus; each
  branch the live scenarios (tests/test_advise_live.py) do not reach is driven here with chosen figures. The
  ``info`` labels come from the real sink function, so they read exactly as a deployment exports them.
* The Helm fragment is rendered by the real chart (``helm template``) and must reach the engine's
  ``--kv-transfer-config`` unchanged; the vLLM fragment must pass the connector's own config check.
* The errors (one line, non-zero exit) run the console script against a real Prometheus on 127.0.0.1 that
  scrapes two idle exporters of this process with different configurations, and against a closed port.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mooncake_lookout.connector.cli.advise import HELM_LOOKUP_PATH, as_json, helm_values, kv_transfer_config
from mooncake_lookout.connector.cli.advise_prom import (
    VLLM_SERIES,
    AdviseError,
    Figures,
    bucket_quantile,
    selector_matchers,
    window_seconds,
)
from mooncake_lookout.connector.cli.advise_rules import DECIDED, decide, settings
from mooncake_lookout.connector.config import KEYS_BY_NAME, LookupConfig
from mooncake_lookout.connector.plugin import CONNECTOR_NAME
from mooncake_lookout.connector.rigs.master import free_port
from mooncake_lookout.metrics import catalogue as cat
from mooncake_lookout.metrics.exporter import new_registry, serve_metrics
from mooncake_lookout.metrics.prometheus_sink import PrometheusSink, info_labels

import chart  # noqa: E402 - helm/tools (conftest puts it on sys.path)
from live_stack import Prometheus  # noqa: E402 - dashboards/ (conftest puts it on sys.path)

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

SCRIPT = Path(sys.executable).parent / "mooncake-lookout"
BOUNDS = (*cat.SECONDS_BUCKETS, math.inf)


def buckets(counts: dict[float, float]) -> list[tuple[float, float]]:
    """Cumulative bucket counts from observations per bucket upper bound (every catalogue bound present)."""
    total, out = 0.0, []
    for le in BOUNDS:
        total += counts.get(le, 0.0)
        out.append((le, total))
    return out


def figures(config: LookupConfig, **over: Any) -> Figures:
    """A busy, healthy window: 4 lookups per 10 ms step, answered in about 0.5-1 ms, one step deferred."""
    f = Figures(url="http://prometheus", selector="{}", window="1h", window_s=3600,
                configs=[info_labels(config)], configs_in_window=1)
    f.outcomes = {"hit": 4000.0, "miss": 0.0}
    f.steps, f.step_mean_s, f.step_p50_s = 1000.0, 0.010, 0.010
    f.blocked_s, f.blocked_calls = 0.05, 8000.0
    f.rpc_buckets = buckets({0.0005: 2000, 0.001: 1800, 0.0025: 200})
    f.deferred_count, f.deferred_sum, f.deferred_p90 = 4000.0, 4000.0, 0.9
    f.pending_peak, f.max_pending = 8.0, float(config.lookup_max_pending)
    f.held_peak, f.max_held = 10.0, float(config.lookup_max_held)
    for key, value in over.items():
        setattr(f, key, value)
    return f


def advised(f: Figures) -> dict[str, Any]:
    return {a.key: a for a in decide(f)[2]}


ASYNC = LookupConfig(lookup_async=True, lookup_timeout_ms=100)  # the figures below are drawn around 100 ms


def test_timeouts_a_busy_host_alone_causes_ask_for_no_change() -> None:
    """The trial's reading (issue 49): 4 timeouts in 53,097 lookups, replies late, the breaker closed. That is
    contention, below CONTENTION_SHARE: keep the deadline, keep sync, no failing store, no restart."""
    sync = LookupConfig(lookup_async=False)
    busy = dict(outcomes={"hit": 53_093.0, "timeout": 4.0}, steps=13_000.0, blocked_s=0.2, late_replies=4.0,
                rpc_buckets=buckets({0.001: 50_000, 0.025: 3_000, 0.05: 60, 0.1: 33, 0.25: 4}))
    a = advised(figures(sync, **busy))
    assert not a["lookup_timeout_ms"].changed and "not a deadline to change" in a["lookup_timeout_ms"].reason
    assert not a["lookup_async"].changed and "failed" not in a["lookup_async"].reason
    assert "restart" not in " ".join(x.reason for x in a.values() if x.changed)
    b = advised(figures(ASYNC, **busy))
    assert not b["lookup_timeout_ms"].changed and b["lookup_wait_us"].reason.startswith("keep deferring") is False
    # Past the share, timeouts whose replies came late are a slow server, alive: raise the deadline, no failing store.
    slow = advised(figures(ASYNC, outcomes={"hit": 3_900.0, "timeout": 100.0}, late_replies=90.0,
                           rpc_buckets=buckets({0.001: 3_900, 0.25: 100})))
    assert slow["lookup_timeout_ms"].value == 200.0 and "late replies" in slow["lookup_timeout_ms"].reason
    assert "keep deferring" not in slow["lookup_wait_us"].reason


def test_deadline_is_raised_only_when_answers_come_right_up_to_it() -> None:
    """A slow store whose answers spread up to the 100 ms deadline and past it: the deadline cuts real answers."""
    slow = buckets({0.025: 3000, 0.05: 600, 0.1: 300, 0.25: 100})  # the 100 past the deadline are the timeouts
    a = advised(figures(ASYNC, rpc_buckets=slow, outcomes={"hit": 3900.0, "timeout": 100.0}))
    assert a["lookup_timeout_ms"].value == 200.0 and a["lookup_timeout_ms"].changed
    # The same timeouts from a stall (answers far below the deadline): the deadline stays.
    stall = buckets({0.001: 3900, 0.25: 100})
    a = advised(figures(ASYNC, rpc_buckets=stall, outcomes={"hit": 3900.0, "timeout": 100.0}))
    assert a["lookup_timeout_ms"].value == 100.0 and not a["lookup_timeout_ms"].changed
    assert "stalled" in a["lookup_timeout_ms"].reason


def test_sync_that_costs_little_of_the_step_stays_sync() -> None:
    """2% of the step blocked: async would defer every request a step to save that."""
    sync = LookupConfig(lookup_async=False)
    a = advised(figures(sync, blocked_s=0.2, deferred_sum=0.0, deferred_p90=0.0))
    assert a["lookup_async"].value is False and not a["lookup_async"].changed
    assert a["lookup_wait_us"].reason == "not used while lookup_async is false"
    # The same sync deployment whose store fails: leave sync, whatever the share.
    failing = advised(figures(sync, blocked_s=0.2, outcomes={"hit": 3900.0, "timeout": 100.0}))
    assert failing["lookup_async"].value is True and "failed or stalled" in failing["lookup_async"].reason


def test_sync_round_trip_within_the_cap_is_advised_auto_and_beyond_it_zero() -> None:
    """Sync measures the round trip exactly: 0.5-1 ms against a 10 ms step fits auto's 2.5 ms cap; against a
    2 ms step (cap 0.5 ms minus what lookups take) it does not."""
    sync = LookupConfig(lookup_async=False)
    roomy = advised(figures(sync, blocked_s=4.0))  # 4 ms of a 10 ms step: 40%, far above 5%
    assert roomy["lookup_async"].value is True and roomy["lookup_wait_us"].value == "auto"
    tight = advised(figures(sync, blocked_s=0.5, step_mean_s=0.002, step_p50_s=0.002))
    assert tight["lookup_async"].value is True and tight["lookup_wait_us"].value == 0


def test_async_answers_later_than_a_step_get_no_wait() -> None:
    late = advised(figures(ASYNC, step_mean_s=0.001, step_p50_s=0.001, deferred_sum=12000.0, deferred_p90=4.0,
                           rpc_buckets=buckets({0.0025: 2000, 0.005: 2000})))
    assert late["lookup_wait_us"].value == 0 and "more than a step" in late["lookup_wait_us"].reason


def test_a_fixed_budget_that_covers_the_round_trip_is_kept() -> None:
    budget = LookupConfig(lookup_async=True, lookup_wait_us=1500)
    a = advised(figures(budget, deferred_sum=100.0, deferred_p90=0.0,
                        rpc_buckets=buckets({0.0005: 3000, 0.001: 1000})))
    assert a["lookup_wait_us"].value == 1500 and not a["lookup_wait_us"].changed


def test_bounds_grow_after_rejections_and_evictions_but_not_for_a_failing_store() -> None:
    a = advised(figures(ASYNC, outcomes={"hit": 3900.0, "rejected": 100.0}, pending_peak=1024.0,
                        dropped={"evicted": 50.0}))
    assert a["lookup_max_pending"].value == 2048 and a["lookup_max_held"].value == 32768
    stalled = advised(figures(ASYNC, outcomes={"hit": 3000.0, "rejected": 100.0, "timeout": 900.0},
                              pending_peak=1024.0))
    assert stalled["lookup_max_pending"].value == 1024 and "failing store" in stalled["lookup_max_pending"].reason


def test_upstream_wire_with_several_lookups_per_step_is_advised_pipelined() -> None:
    a = advised(figures(LookupConfig(lookup_async=True, lookup_transport="upstream")))
    assert a["lookup_transport"].value == "pipelined" and a["lookup_transport"].changed


def test_idle_gaps_do_not_stretch_the_step() -> None:
    """An engine idle for a while: one interval of minutes lifts the mean; the median is the step."""
    _, costs, _ = decide(figures(ASYNC, step_mean_s=0.5, step_p50_s=0.010))
    assert costs.step_s == 0.010


def test_too_little_traffic_and_several_configurations_are_refused() -> None:
    with pytest.raises(AdviseError, match="too little traffic") as e:
        decide(figures(ASYNC, outcomes={"hit": 40.0}))
    assert e.value.code == 4
    with pytest.raises(AdviseError, match="does not count scheduler steps") as e:
        decide(figures(ASYNC, steps=0.0))  # an exporter from before the step interval metric
    assert e.value.code == 3
    f = figures(ASYNC)
    f.configs = [info_labels(ASYNC), info_labels(LookupConfig())]
    with pytest.raises(AdviseError, match="2 lookup configurations") as e:
        decide(f)
    assert e.value.code == 3


def test_bucket_quantile_interpolates_within_a_bucket_and_stops_at_a_bound() -> None:
    b = buckets({0.001: 50, 0.0025: 50, 0.25: 10})
    assert bucket_quantile(b, 0.5, upto=0.1) == pytest.approx(0.001)  # the 10 past 0.1 s are left out
    assert bucket_quantile(b, 0.5) == pytest.approx(0.001 + 0.0015 * 5 / 50)  # rank 55 of 110
    assert bucket_quantile(b, 0.75, upto=0.1) == pytest.approx(0.001 + 0.0015 * 0.5)
    assert bucket_quantile(buckets({}), 0.5) is None


def test_window_and_selector_parsing() -> None:
    assert window_seconds("90s") == 90 and window_seconds("1h") == 3600
    for bad in ("1h30m", "0s", "soon"):
        with pytest.raises(ValueError, match="--window"):
            window_seconds(bad)
    assert selector_matchers('{namespace="a", model_name="m"}') == 'namespace="a", model_name="m"'
    assert selector_matchers("{}") == "" and selector_matchers('job="x"') == 'job="x"'


def test_fragments_reach_the_engine_through_the_chart_and_pass_the_connectors_check(tmp_path: Path) -> None:
    now, costs, advice = decide(figures(LookupConfig(lookup_async=False), blocked_s=4.0))
    doc = as_json(figures(LookupConfig(lookup_async=False), blocked_s=4.0), now, costs, advice)
    extra = doc["kv_transfer_config"]["kv_connector_extra_config"]
    assert list(extra) == list(DECIDED) and set(DECIDED) <= set(KEYS_BY_NAME)
    assert extra["lookup_async"] is True and extra["lookup_wait_us"] == "auto"
    assert LookupConfig.from_extra_config(extra).mode == "budget"
    assert doc["kv_transfer_config"] == kv_transfer_config(extra) and extra == settings(advice)
    values = tmp_path / "advised-values.yaml"
    values.write_text(helm_values(extra))
    objects = chart.template([values])
    (container,) = chart.one(objects, "Deployment", "-engine")["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    rendered = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert rendered["kv_connector"] == CONNECTOR_NAME
    for key, value in extra.items():
        assert rendered["kv_connector_extra_config"][key] == value, key
    assert HELM_LOOKUP_PATH[0] in chart.load_values()


def test_vllm_series_advise_reads_are_vllms_own() -> None:
    import vllm

    source = (Path(vllm.__file__).parent / "v1" / "metrics" / "loggers.py").read_text()
    for name in VLLM_SERIES:
        assert f'name="{name}"' in source, name


# -- errors, against a real Prometheus -------------------------------------------------------------------------

def _advise(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), "advise", *args], capture_output=True, text=True, timeout=60)


def _one_line_error(done: subprocess.CompletedProcess, code: int, words: str) -> None:
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mooncake-lookout advise: ") and words in lines[0], lines


@pytest.fixture(scope="module")
def idle_prometheus(prometheus_binary: str) -> Iterator[Prometheus]:
    """A real Prometheus scraping two idle exporters (job quiet-a: async; job quiet-b: sync), both scraped once."""
    endpoints = []
    for config in (ASYNC, LookupConfig()):
        registry = new_registry()
        PrometheusSink(config, registry)
        endpoints.append(serve_metrics(0, registry=registry))
    with tempfile.TemporaryDirectory(prefix="lookout-advise-") as tmp:
        prom = Prometheus({"quiet-a": [f"127.0.0.1:{endpoints[0].port}"],
                           "quiet-b": [f"127.0.0.1:{endpoints[1].port}"]}, Path(tmp), binary=prometheus_binary)
        try:
            prom.start()
            deadline = time.monotonic() + 30
            while len(prom.api("query", query=cat.INFO.name)["data"]["result"]) < 2:
                assert time.monotonic() < deadline, "Prometheus never scraped both exporters"
                time.sleep(0.3)  # poll interval at a 1 s scrape, bounded above
            yield prom
        finally:
            prom.stop()
            for ep in endpoints:
                ep.stop()


def test_unreachable_prometheus_is_one_line_and_exit_2() -> None:
    _one_line_error(_advise("--prometheus", f"http://127.0.0.1:{free_port()}"), 2, "cannot reach Prometheus")


def test_no_lookup_series_under_the_selector_is_one_line_and_exit_3(idle_prometheus: Prometheus) -> None:
    done = _advise("--prometheus", idle_prometheus.url, "--selector", '{job="nowhere"}', "--window", "5m")
    _one_line_error(done, 3, 'no lookup series')
    assert 'job="quiet-a"' in done.stderr  # and where there are some


def test_too_little_traffic_is_one_line_and_exit_4(idle_prometheus: Prometheus) -> None:
    done = _advise("--prometheus", idle_prometheus.url, "--selector", '{job="quiet-a"}', "--window", "5m")
    _one_line_error(done, 4, "too little traffic")


def test_a_selector_over_two_configurations_is_refused(idle_prometheus: Prometheus) -> None:
    _one_line_error(_advise("--prometheus", idle_prometheus.url, "--window", "5m"), 3, "2 lookup configurations")


def test_a_selector_prometheus_rejects_is_one_line_and_exit_2(idle_prometheus: Prometheus) -> None:
    _one_line_error(_advise("--prometheus", idle_prometheus.url, "--selector", '{job=~"("}'), 2, "rejected a query")


def test_every_step_time_the_report_quotes_is_named() -> None:
    """Two step times matter: the step interval (what lookups cost a share of) and the step without lookups (what
    auto's cap is a share of). Each figure the text quotes next to "step" says which one it is."""
    from mooncake_lookout.connector.cli.advise import report

    f = figures(LookupConfig(lookup_async=False), blocked_s=4.0)
    now, costs, advice = decide(f)
    text = report(f, now, costs, advice)
    quoted = re.findall(r"(\d+(?:\.\d+)? ms) step(?! interval| without lookups)", text)
    assert quoted == [], text
    assert f"step interval {costs.step_s * 1e3:.2f} ms" in text and "without lookups" in text

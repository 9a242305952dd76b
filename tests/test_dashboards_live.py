"""Every dashboard query and alert expression runs on a real Prometheus scraping a real workload.

The stack (dashboards/live_stack.py): a real ``mooncake_master``, our lookup server over it, vLLM's real
V1 scheduler with the lookout connector twice (async and sync mode, pipelined transport), each process
part with its own ``/metrics``, and a real ``prometheus`` on 127.0.0.1 scraping all of them every second.
A workload runs in the background for the whole module; checks poll Prometheus with a bound.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from mooncake_lookout.metrics.catalogue import PREFIX, all_series_names

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = ROOT / "dashboards"

import generate  # noqa: E402
import importable  # noqa: E402
import known_metrics as km  # noqa: E402
import lint  # noqa: E402
from live_queries import QueryRun, all_values, run_exprs, run_queries, variable_options  # noqa: E402
from live_stack import JOBS, RATE_INTERVAL, LiveStack  # noqa: E402

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

DATA_TIMEOUT_S = 60.0  # bound on waiting for enough scrapes for every rate() to have two samples
OURS = all_series_names()


def _dashboards() -> dict[str, dict]:
    return {n: json.loads((DASHBOARDS / n).read_text()) for n in (generate.OVERVIEW_JSON, generate.TUNING_JSON)}


@pytest.fixture(scope="module")
def stack(prometheus_binary: str) -> Iterator[LiveStack]:
    with LiveStack() as s:
        stop = threading.Event()
        worker = s.drive_in_background(stop)
        try:
            yield s
        finally:
            stop.set()
            worker.join(60)


def _needs_data(run: QueryRun) -> bool:
    """Queries on our catalogue, on the master and on vLLM's store operations (the stack feeds vLLM's own store
    metrics with its real store calls) must return data; vLLM's other series may be absent here. Failed store
    operations need a failing store: none here."""
    names = {m for m, _ in lint.selectors(run.expr)}
    if 'status="error"' in run.expr or names & {km.STORE_OP_FAILED_KEYS}:
        return False
    return not (names & (km.VLLM_SERIES - km.STORE_OP_SERIES))


def _poll_runs(stack: LiveStack, values_for) -> list[QueryRun]:
    """Run all panel queries until every one that must have data has it, or the bound passes."""
    deadline = time.monotonic() + DATA_TIMEOUT_S
    while True:
        runs = [r for name, d in _dashboards().items()
                for r in run_queries(stack.prometheus, name, d, values_for(d), rate_interval=RATE_INTERVAL)]
        missing = [r for r in runs if r.error is None and _needs_data(r) and not r.has_data]
        if not missing or time.monotonic() > deadline:
            return runs
        time.sleep(1.0)  # poll interval while scrapes accumulate (bounded by DATA_TIMEOUT_S)


def test_master_serves_the_metric_names_we_chart(stack):
    text = urllib.request.urlopen(stack.master.metrics_url + "/metrics", timeout=5).read().decode()
    served = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert km.MASTER_SERIES <= served, f"master no longer serves {km.MASTER_SERIES - served}"


@pytest.fixture(scope="module")
def stored_names(stack) -> set[str]:
    """Metric names Prometheus holds once every target has been scraped (polled, bounded)."""
    deadline = time.monotonic() + DATA_TIMEOUT_S
    while True:
        names = set(stack.prometheus.api("label/__name__/values")["data"])
        escaped = {n for n in names if n.startswith(PREFIX.replace(":", "_"))}
        if (OURS | km.MASTER_SERIES) <= names or escaped or time.monotonic() > deadline:
            return names
        time.sleep(0.5)  # poll interval until the first scrapes of all targets land (bounded)


def test_our_metric_names_reach_prometheus_unchanged(stored_names):
    """prometheus_client's OpenMetrics output must not rename ``vllm:...`` to ``vllm_...`` (client_python #1177)."""
    escaped = sorted(n for n in stored_names if n.startswith(PREFIX.replace(":", "_")))
    assert not escaped, ("Prometheus stored our metrics with ':' escaped to '_' (prometheus_client OpenMetrics "
                         f"exposition, client_python #1177): {escaped[:3]}... The exporter must serve the "
                         "text format 0.0.4 (or a fixed prometheus_client) for any dashboard to work.")
    assert OURS <= stored_names, sorted(OURS - stored_names)


def test_variables_resolve_and_chain(stack, stored_names):
    d = _dashboards()[generate.OVERVIEW_JSON]
    deadline = time.monotonic() + DATA_TIMEOUT_S
    while True:  # every target's first scrape with our series must land (polled, bounded)
        options = variable_options(stack.prometheus, d, all_values(d))
        if len(options["instance"]) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {JOBS["clients"], JOBS["server"]} <= set(options["job"]), options
    assert options["master_job"] == [JOBS["master"]]
    assert len(options["instance"]) >= 3 and len(options["master_instance"]) == 1
    # Standalone processes export no model_name/engine: the variables are empty and All ('.*') keeps them.
    assert options["model_name"] == [] and options["engine"] == []
    # Chained: picking the lookup-server job narrows instances to that one target.
    narrowed = variable_options(stack.prometheus, d, {**all_values(d), "job": JOBS["server"]})
    assert len(narrowed["instance"]) == 1 and set(narrowed["instance"]) < set(options["instance"])


def test_every_dashboard_query_runs_and_ours_return_data(stack, stored_names):
    runs = _poll_runs(stack, all_values)
    assert len(runs) > 40
    errors = [(r.panel["title"], r.expr, r.error) for r in runs if r.error]
    assert not errors, errors
    empty = [(r.dashboard, r.panel["title"], r.expr) for r in runs if _needs_data(r) and not r.has_data]
    assert not empty, empty


def test_the_import_form_once_imported_runs_its_variables_and_queries(stack, stored_names):
    """The import form (dashboards/import/), as Grafana's import stores it with a Prometheus picked: its variables
    resolve and every panel query runs (the provisioned form is checked above)."""
    for name in (generate.OVERVIEW_JSON, generate.TUNING_JSON):
        template = json.loads((DASHBOARDS / generate.IMPORT_DIR / name).read_text())
        d = importable.grafana_import(template, {importable.DS_INPUT: "picked-prometheus"})
        assert variable_options(stack.prometheus, d, all_values(d))["master_job"] == [JOBS["master"]]
        runs = run_queries(stack.prometheus, name, d, all_values(d), rate_interval=RATE_INTERVAL)
        assert len(runs) == len(list(lint.queries(d))) > 10
        assert not [(r.panel["title"], r.error) for r in runs if r.error]
        assert [r for r in runs if r.has_data]


def test_queries_filtered_to_one_instance_return_only_it(stack, stored_names):
    d = _dashboards()[generate.TUNING_JSON]
    clients = variable_options(stack.prometheus, d, {**all_values(d), "job": JOBS["clients"]})["instance"]
    one = clients[0]
    values = {**all_values(d), "job": JOBS["clients"], "instance": one}  # '.' matching any char is harmless
    runs = run_queries(stack.prometheus, generate.TUNING_JSON, d, values, rate_interval=RATE_INTERVAL)
    assert not [r.error for r in runs if r.error]
    seen = {s["metric"].get("instance") for r in runs for s in r.response["data"]["result"]}
    assert seen - {None} == {one}


def test_every_alert_expression_runs(stack, stored_names):
    doc = yaml.safe_load((DASHBOARDS / "alerts.rules.yaml").read_text())
    exprs = [r["expr"] for g in doc["groups"] for r in g["rules"]]
    results = run_exprs(stack.prometheus, exprs)
    bad = [(e, body) for e, body in results if body.get("status") != "success"]
    assert not bad, bad
    # A healthy stack fires nothing.
    firing = [e for e, body in results if body["data"]["result"]]
    assert not firing, firing


def test_render_draws_a_png_per_dashboard(stack, stored_names, tmp_path):
    import render

    paths = render.render_all(stack.prometheus, tmp_path, rate_interval=RATE_INTERVAL, seconds=30)
    assert {p.name for p in paths} == set(render.IMAGES.values())
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 20_000

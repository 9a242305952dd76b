"""The committed dashboards are what the generator makes: well formed, querying only known metrics, with variables."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake_lookout.metrics.catalogue import CATALOGUE, all_series_names

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = ROOT / "dashboards"

import generate  # noqa: E402
import known_metrics as km  # noqa: E402
import lint  # noqa: E402
import queries as q  # noqa: E402

FILES = (generate.OVERVIEW_JSON, generate.TUNING_JSON)
REQUIRED_VARS = ("datasource", "namespace", "job", "pod", "model_name", "instance", "engine")


def _load(name: str) -> dict:
    return json.loads((DASHBOARDS / name).read_text())


@pytest.fixture(scope="module")
def dashboards() -> dict[str, dict]:
    return {name: _load(name) for name in FILES}


def test_committed_files_are_what_the_generator_makes():
    run = subprocess.run([sys.executable, str(DASHBOARDS / "generate.py"), "--check"], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, f"stale generated files, run python dashboards/generate.py:\n{run.stdout}{run.stderr}"


def test_check_reports_a_hand_edit(tmp_path):
    for name, text in generate.outputs().items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert generate.check(tmp_path) == []
    path = tmp_path / generate.OVERVIEW_JSON
    path.write_text(path.read_text().replace("Lookups per second", "Lookups per minute"))
    diffs = generate.check(tmp_path)
    assert len(diffs) == 1 and "Lookups per minute" in diffs[0]


def test_uids_and_panel_ids_are_unique(dashboards):
    uids = [d["uid"] for d in dashboards.values()]
    assert len(set(uids)) == len(uids)
    for name, d in dashboards.items():
        ids = [p["id"] for p in lint.iter_panels(d)]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"


def test_grid_fits_and_nothing_overlaps(dashboards):
    for name, d in dashboards.items():
        panels = list(lint.iter_panels(d))
        for p in panels:
            g = p["gridPos"]
            assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0 and g["w"] > 0, (name, p["title"], g)
        assert lint.overlaps(panels) == [], name


def test_overlap_check_finds_an_overlap():
    a = {"id": 1, "gridPos": {"x": 0, "y": 0, "w": 12, "h": 8}}
    b = {"id": 2, "gridPos": {"x": 11, "y": 7, "w": 4, "h": 4}}
    c = {"id": 3, "gridPos": {"x": 12, "y": 0, "w": 12, "h": 8}}
    assert lint.overlaps([a, b, c]) == [(1, 2), (2, 3)]


def test_variables_are_chained_multi_and_include_all(dashboards):
    for name, d in dashboards.items():
        variables = {v["name"]: v for v in d["templating"]["list"]}
        assert set(REQUIRED_VARS) <= set(variables), name
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        earlier: list[str] = []
        for var in q.LOOKUP_VARS:
            v = variables[var]
            assert v["multi"] and v["includeAll"] and v["allValue"] == ".*", (name, var)
            assert v["datasource"]["uid"] == "${datasource}"
            for prev in earlier:  # chained: each one is narrowed by those before it
                assert f"${prev}" in v["query"], (name, var, prev)
            earlier.append(var)
        assert "$master_job" in variables["master_instance"]["query"]


def _allowed_series() -> set[str]:
    return all_series_names() | km.MASTER_SERIES | km.VLLM_SERIES


def test_every_query_uses_the_variables_and_known_metrics(dashboards):
    allowed = _allowed_series()
    count = 0
    for name, d in dashboards.items():
        for panel, target in lint.queries(d):
            expr = target["expr"]
            count += 1
            assert target["datasource"]["uid"] == "${datasource}", (name, panel["title"])
            assert lint.bare_names(expr) == [], f"{panel['title']}: metric without filters in {expr}"
            sels = lint.selectors(expr)
            assert sels, (panel["title"], expr)
            for metric, matchers in sels:
                assert metric in allowed, f"{panel['title']}: unknown metric {metric}"
                wanted = q.MASTER_VARS if metric in km.MASTER_SERIES else q.LOOKUP_VARS
                for var in wanted:
                    label = q.MASTER_LABEL_OF.get(var, var)
                    assert matchers.get(label) == ("=~", f"${var}"), f"{panel['title']}: {metric} lacks ${var}"
            for window in lint.windows(expr):
                assert window == "$__rate_interval", f"{panel['title']}: window {window}"
            assert lint.unguarded_divisions(expr) == [], f"{panel['title']}: division by zero possible: {expr}"
    assert count > 40


def test_the_query_checks_catch_bad_queries():
    assert lint.bare_names("sum(rate(vllm:mooncake_lookup_requests_total[5m]))") == [
        "vllm:mooncake_lookup_requests_total"]
    assert lint.unguarded_divisions("sum(a{x=\"1\"}) / sum(b{x=\"1\"})")
    assert lint.unguarded_divisions("(a{x=\"1\"})\n/\n(b{x=\"1\"} > 0)") == []
    # A PromQL comment is not a metric name.
    assert lint.bare_names('a{x="1"} > 0.9 # eviction_high_watermark_ratio') == []
    assert lint.selectors('m{job=~"$job", outcome="hit"}') == [("m", {"job": ("=~", "$job"), "outcome": ("=", "hit")})]


def test_every_catalogue_metric_is_charted(dashboards):
    charted = {m for d in dashboards.values() for _, t in lint.queries(d) for m, _ in lint.selectors(t["expr"])}
    for spec in CATALOGUE:
        assert charted & set(spec.sample_names), f"{spec.name} is on no panel"


def test_panels_have_units_and_descriptions_naming_their_metrics(dashboards):
    for name, d in dashboards.items():
        for panel in lint.iter_panels(d):
            if panel["type"] in ("row", "text"):
                continue
            assert panel["fieldConfig"]["defaults"].get("unit"), (name, panel["title"])
            names = {m for t in panel["targets"] for m, _ in lint.selectors(t["expr"])}
            described = panel["description"]
            assert described.rstrip().endswith(".") and "Metrics: " in described, panel["title"]
            for metric in names:
                family = re.sub(r"_(bucket|sum|count)$", "", metric)
                assert metric in described or family in described, (panel["title"], metric)


def test_dashboards_link_to_each_other(dashboards):
    overview, tuning = dashboards[generate.OVERVIEW_JSON], dashboards[generate.TUNING_JSON]
    assert any(link["url"] == f"/d/{tuning['uid']}" and link["includeVars"] and link["keepTime"]
               for link in overview["links"])
    assert any(link["url"] == f"/d/{overview['uid']}" for link in tuning["links"])


def test_required_content(dashboards):
    overview = dashboards[generate.OVERVIEW_JSON]
    rows = [p for p in overview["panels"] if p["type"] == "row"]
    master = [r for r in rows if r["title"].startswith("Mooncake master")]
    assert len(master) == 1 and master[0]["collapsed"] and len(master[0]["panels"]) >= 5
    exprs = " ".join(t["expr"] for _, t in lint.queries(overview))
    for quant in ("histogram_quantile(0.5,", "histogram_quantile(0.95,", "histogram_quantile(0.99,"):
        assert quant in exprs
    tuning = dashboards[generate.TUNING_JSON]
    assert sum(p["type"] == "text" for p in lint.iter_panels(tuning)) >= 1
    assert 'by (le, mode, instance)' in " ".join(t["expr"] for _, t in lint.queries(tuning))


def test_known_vllm_metrics_exist_in_vllm():
    import importlib.util

    spec = importlib.util.find_spec("vllm")  # locate without importing (a cold import takes ~10 s)
    assert spec is not None and spec.origin
    vllm_dir = Path(spec.origin).parent
    source = (vllm_dir / "v1" / "metrics" / "loggers.py").read_text()
    for name in km.VLLM_COUNTERS + km.VLLM_GAUGES:
        assert f'name="{name}"' in source, f"vLLM no longer registers {name}"
    # The Mooncake store connector's own metrics (worker store operations); its counters are named with _total.
    store = (vllm_dir / "distributed" / "kv_transfer" / "kv_connector" / "v1" / "mooncake" / "store"
             / "metrics.py").read_text()
    for name in km.VLLM_STORE_OP_COUNTERS + km.VLLM_STORE_OP_HISTOGRAMS:
        assert f'name="{name}"' in store, f"vLLM's Mooncake store connector no longer registers {name}"
    assert '+ ["operation", "status"]' in store  # the labels the store panels group by
    expected = ({n + "_total" for n in km.VLLM_COUNTERS} | set(km.VLLM_GAUGES) | set(km.VLLM_STORE_OP_COUNTERS)
                | {km.STORE_OP_SECONDS + s for s in ("_bucket", "_sum", "_count")})
    assert km.VLLM_SERIES == expected


def test_variable_queries_are_cheap_and_name_their_sources_exactly(dashboards):
    """No variable query matches series names by pattern: each names small gauges exactly (one series per process)."""
    from mooncake_lookout.metrics.catalogue import CATALOGUE

    import variables as v

    by_name = {spec.name: spec for spec in CATALOGUE}
    for source in v.VARIABLE_SOURCES:
        spec = by_name[source]
        assert spec.kind == "gauge" and "outcome" not in spec.labels and "status" not in spec.labels, source
    assert {by_name[s].side for s in v.VARIABLE_SOURCES} == {"client", "server"}  # clients and servers both listed
    for name, d in dashboards.items():
        for var in d["templating"]["list"]:
            if var["type"] != "query":
                continue
            selector = var["query"].removeprefix("label_values(").rsplit(",", 1)[0]
            name_matchers = re.findall(r'__name__=~"([^"]*)"', selector)
            for pattern in name_matchers:
                names = pattern.split("|")
                assert all(re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", n) for n in names), (name, var["name"], pattern)
                assert set(names) == set(v.VARIABLE_SOURCES), (name, var["name"])
            if not name_matchers:
                assert re.match(r"^[a-zA-Z_:][a-zA-Z0-9_:]*(\{|$)", selector), (name, var["name"], selector)


def test_namespace_and_pod_filter_every_lookup_query(dashboards):
    variables = {v["name"] for v in dashboards[generate.OVERVIEW_JSON]["templating"]["list"]}
    assert {"namespace", "pod"} <= variables
    assert {"namespace", "pod"} <= set(q.LOOKUP_VARS)
    # Chained: the job list is narrowed by the chosen namespace, the pod list by namespace and job.
    chain = {v["name"]: v["query"] for v in dashboards[generate.OVERVIEW_JSON]["templating"]["list"]}
    assert "$namespace" in chain["job"] and "$job" in chain["pod"] and "$namespace" in chain["pod"]


def test_store_operation_panels_chart_every_store_operation_series(dashboards):
    overview = dashboards[generate.OVERVIEW_JSON]
    (row,) = [p for p in overview["panels"] if p["type"] == "row" and p["title"].startswith("Store operations")]
    assert row["collapsed"] and len(row["panels"]) >= 4
    read = {m for panel in row["panels"] for t in panel["targets"] for m, _ in lint.selectors(t["expr"])}
    assert read == km.STORE_OP_SERIES - {km.STORE_OP_SECONDS + "_sum", km.STORE_OP_SECONDS + "_count"}
    exprs = " ".join(t["expr"] for panel in row["panels"] for t in panel["targets"])
    assert "by (le, operation)" in exprs and "by (operation, status)" in exprs

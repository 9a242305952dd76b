"""The chart's monitoring objects: Prometheus Operator CRDs checked by their own fields (kubernetes-validate has
no schema for them), alert rules and dashboards checked to be the files of dashboards/ (one source).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

import chart  # helm/tools/chart.py (conftest puts helm/tools on sys.path)

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = ROOT / "dashboards"
RULES = DASHBOARDS / "alerts.rules.yaml"
CRD_API = "monitoring.coreos.com/v1"
# prometheus-operator's ScrapeProtocol enum (pkg/apis/monitoring/v1, `+kubebuilder:validation:Enum`; the
# ServiceMonitor/PodMonitor field `scrapeProtocols` exists since operator v0.72.0).
OPERATOR_SCRAPE_PROTOCOLS = {"PrometheusProto", "OpenMetricsText0.0.1", "OpenMetricsText1.0.0", "PrometheusText0.0.4",
                             "PrometheusText1.0.0"}
DURATION = re.compile(r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$")


def with_crds(values_files=(), sets=None) -> list[dict[str, Any]]:
    """The chart rendered for a cluster that serves the Prometheus Operator's CRDs, with kube-prometheus-stack
    installed as release ``kps`` (unless ``sets`` say otherwise)."""
    return chart.template(values_files, sets={"monitoring.release": '"kps"', **(sets or {})},
                          api_versions=chart.MONITORING_APIS)


@pytest.fixture(scope="module")
def default() -> list[dict[str, Any]]:
    return with_crds()


def dashboard_files() -> list[Path]:
    files = sorted(DASHBOARDS.glob("*.json"))
    assert files, "dashboards/*.json: no dashboards yet (the dashboards part writes them; the chart ships them)"
    return files


def test_the_one_sources_exist():
    assert dashboard_files()
    assert RULES.is_file(), "dashboards/alerts.rules.yaml is missing"
    assert yaml.safe_load(RULES.read_text())["groups"], "the rule file has no groups"
    link = chart.CHART / "files" / "dashboards"
    assert link.is_symlink() and link.resolve() == DASHBOARDS.resolve()


def _check_endpoint(endpoint: dict[str, Any], port_names: set[str]) -> None:
    assert endpoint["port"] in port_names, f"endpoint port {endpoint['port']} not among {port_names}"
    assert endpoint["path"] == "/metrics"
    for field in ("interval", "scrapeTimeout"):
        assert DURATION.match(endpoint[field]), endpoint[field]
    assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "relabelings",
                             "metricRelabelings", "honorLabels"}


def _selected(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return bool(selector["matchLabels"]) and all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_engine_service_monitor_selects_the_engine_service(default):
    monitor = chart.one(default, "ServiceMonitor", "-engine")
    assert monitor["apiVersion"] == CRD_API
    spec = monitor["spec"]
    assert set(spec) == {"namespaceSelector", "selector", "endpoints", "scrapeProtocols"}
    service = chart.one(default, "Service", "-engine")
    assert _selected(spec["selector"], service["metadata"]["labels"])
    assert not _selected(spec["selector"], chart.one(default, "Service", "-master")["metadata"]["labels"])
    assert spec["namespaceSelector"] == {"matchNames": [service["metadata"]["namespace"]]}
    (endpoint,) = spec["endpoints"]
    _check_endpoint(endpoint, {p["name"] for p in service["spec"]["ports"]})


def test_engine_is_scraped_in_the_classic_text_format_unless_told_otherwise(default):
    """vLLM's prometheus_client escapes ``vllm:`` names when offered OpenMetrics: ask for text 0.0.4 by default."""
    values = chart.load_values()["monitoring"]["serviceMonitor"]
    assert values["scrapeProtocols"] == ["PrometheusText0.0.4"]
    assert chart.one(default, "ServiceMonitor", "-engine")["spec"]["scrapeProtocols"] == ["PrometheusText0.0.4"]
    # Every value the schema allows is one of the operator's ScrapeProtocol enum, spelled as its CRD does.
    schema = json.loads((chart.CHART / "values.schema.json").read_text())
    allowed = schema["properties"]["monitoring"]["properties"]["serviceMonitor"]["properties"]["scrapeProtocols"]
    assert set(allowed["items"]["enum"]) == OPERATOR_SCRAPE_PROTOCOLS
    chosen = ["OpenMetricsText1.0.0", "PrometheusText0.0.4"]
    objects = with_crds(sets={"monitoring.serviceMonitor.scrapeProtocols": json.dumps(chosen)})
    assert chart.one(objects, "ServiceMonitor", "-engine")["spec"]["scrapeProtocols"] == chosen
    # An empty list leaves the field out: Prometheus negotiates as it would by default.
    objects = with_crds(sets={"monitoring.serviceMonitor.scrapeProtocols": "[]"})
    assert "scrapeProtocols" not in chart.one(objects, "ServiceMonitor", "-engine")["spec"]


def test_master_pod_monitor_selects_the_master_pods(default):
    monitor = chart.one(default, "PodMonitor", "-master")
    assert monitor["apiVersion"] == CRD_API
    spec = monitor["spec"]
    assert set(spec) == {"namespaceSelector", "selector", "podMetricsEndpoints"}
    pod = chart.one(default, "Deployment", "-master")["spec"]["template"]
    engine_pod = chart.one(default, "Deployment", "-engine")["spec"]["template"]
    assert _selected(spec["selector"], pod["metadata"]["labels"])
    assert not _selected(spec["selector"], engine_pod["metadata"]["labels"])
    (endpoint,) = spec["podMetricsEndpoints"]
    _check_endpoint(endpoint, {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]})


def test_master_service_monitor_variant_selects_the_master_service():
    objects = with_crds([chart.ci_value_sets()["pipelined"]])
    assert not chart.find(objects, "PodMonitor")
    monitor = chart.one(objects, "ServiceMonitor", "-master")
    service = chart.one(objects, "Service", "-master")
    assert _selected(monitor["spec"]["selector"], service["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["endpoints"]
    _check_endpoint(endpoint, {p["name"] for p in service["spec"]["ports"]})


def test_monitor_labels_reach_the_objects():
    # async-budget sets monitoring.release (and monitoring.enabled: true, so no capability is needed).
    objects = chart.template([chart.ci_value_sets()["async-budget"]])
    for kind, suffix in (("ServiceMonitor", "-engine"), ("PodMonitor", "-master"), ("PrometheusRule", "")):
        assert chart.one(objects, kind, suffix)["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # Per-object labels add to it; with monitoring.release false there is no release label at all.
    objects = with_crds(sets={"monitoring.serviceMonitor.labels": '{"team": "infra"}', "monitoring.release": "false"})
    labels = chart.one(objects, "ServiceMonitor", "-engine")["metadata"]["labels"]
    assert labels["team"] == "infra" and "release" not in labels
    assert "release" not in chart.one(objects, "PrometheusRule")["metadata"]["labels"]


def test_monitoring_objects_without_a_release_label_render_and_notes_name_the_label():
    """monitoring.release empty (the default) and no labels of the object's own: the objects render unlabelled (a
    Prometheus that selects every monitor picks them up; the render used to fail on every cluster with the CRDs),
    and NOTES names the value kube-prometheus-stack's selectors need (tests/test_helm_adoption.py)."""
    unlabelled = with_crds(sets={"monitoring.release": '""'})
    monitoring = [o for o in unlabelled if o["apiVersion"] == CRD_API]
    assert len(monitoring) == 3 and not [o for o in monitoring if "release" in o["metadata"]["labels"]]
    labelled = {f"monitoring.{o}.labels": '{"team": "infra"}'
                for o in ("serviceMonitor", "masterMonitor", "prometheusRule")}
    objects = with_crds(sets={"monitoring.release": '""', **labelled})
    assert len([o for o in objects if o["apiVersion"] == CRD_API]) == 3
    # Without the Operator's CRDs nothing renders, so nothing is asked for.
    assert chart.template(sets={"monitoring.release": '""'})


def rule_file_for_the_release(master_job: str, namespace: str = "serving") -> dict[str, Any]:
    """The rule file as the chart should render it: MooncakeMasterNeverScraped watches the release's masters."""
    text = RULES.read_text().replace('up{job="mooncake-master"}', f'up{{namespace="{namespace}", job="{master_job}"}}')
    return yaml.safe_load(text)


def test_prometheus_rule_is_the_rule_file(default):
    rule = chart.one(default, "PrometheusRule")
    assert rule["apiVersion"] == CRD_API and set(rule["spec"]) == {"groups"}
    # The master job the rule watches is the one the master's monitor gives its targets.
    monitor = chart.one(default, "PodMonitor", "-master")
    master_job = monitor["spec"]["podMetricsEndpoints"][0]["relabelings"][-1]["replacement"]
    source = rule_file_for_the_release(master_job)
    assert source != yaml.safe_load(RULES.read_text())
    assert rule["spec"] == source  # the default watermark is the rule file's own (Mooncake's default)
    for group in rule["spec"]["groups"]:
        assert group["name"] and group["rules"]
        for r in group["rules"]:
            assert set(r) <= {"alert", "record", "expr", "for", "labels", "annotations", "keep_firing_for"}
            assert r["expr"] and ("alert" in r) != ("record" in r)
            if "alert" in r:
                assert r["labels"]["severity"] and r["annotations"]["runbook"]
            if "for" in r:
                assert DURATION.match(r["for"]), r["for"]


def test_runbook_base_url_adds_a_link_to_each_alert_and_changes_nothing_else():
    base = "https://runbooks.example.com/mooncake-lookout/runbook.md"
    objects = with_crds(sets={"monitoring.prometheusRule.runbookBaseUrl": json.dumps(base)})
    rendered = chart.one(objects, "PrometheusRule")["spec"]
    source = rule_file_for_the_release("lookout-mooncake-lookout-master")
    urls = []
    for got_group, want_group in zip(rendered["groups"], source["groups"], strict=True):
        for got, want in zip(got_group["rules"], want_group["rules"], strict=True):
            if "alert" not in want:
                assert got == want
                continue
            assert "runbook_url" not in want["annotations"]
            got_url = got["annotations"].pop("runbook_url")
            assert got_url == base + "#" + want["alert"].lower()
            urls.append(got_url)
            assert got == want
    assert urls


def dashboards_of(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The rendered dashboards by their file in dashboards/ (the ConfigMap's key ends with it)."""
    maps = [o for o in chart.find(objects, "ConfigMap") if o["metadata"]["labels"].get("grafana_dashboard") == "1"]
    out = {}
    for o in maps:
        assert len(o["metadata"]["name"]) <= 63 and len(o["data"]) == 1
        ((key, text),) = o["data"].items()
        (path,) = [p for p in dashboard_files() if key.endswith("-" + p.name)]
        out[path.name] = json.loads(text)
    return out


def test_dashboard_configmaps_are_the_dashboards_with_a_uid_and_title_of_the_release(default):
    """Everything but uid, title, the links between them and (here, with the monitors on) the variables' starting
    values is the file as generated; the links follow the new uids."""
    rendered = dashboards_of(default)
    files = {p.name: json.loads(p.read_text()) for p in dashboard_files()}
    assert sorted(rendered) == sorted(files)
    new_uid = {files[name]["uid"]: rendered[name]["uid"] for name in files}
    for name, original in files.items():
        got = rendered[name]
        assert got["uid"] != original["uid"] and got["uid"].startswith(original["uid"][:20]) and len(got["uid"]) <= 40
        assert got["title"] == f"{original['title']} (serving/lookout)"
        for link, old in zip(got["links"], original["links"]):
            assert link["url"] == f"/d/{new_uid[old['url'].removeprefix('/d/')]}", link
        same = {k: v for k, v in got.items() if k not in ("uid", "title", "links", "templating")}
        assert same == {k: v for k, v in original.items() if k not in ("uid", "title", "links", "templating")}
        for variable, old in zip(got["templating"]["list"], original["templating"]["list"]):
            assert {k: v for k, v in variable.items() if k != "current"} == {
                k: v for k, v in old.items() if k != "current"}, variable["name"]


def test_two_releases_provision_dashboards_grafana_and_its_sidecar_tell_apart():
    """Fixed uids made a second release's dashboards duplicates of the first's (and, under the same file name, the
    sidecar overwrote one with the other)."""
    first = with_crds()
    second = chart.template(release="second", namespace="team-b", sets={"monitoring.release": '"kps"'},
                            api_versions=chart.MONITORING_APIS)
    keys = [{k for o in chart.find(objects, "ConfigMap") for k in o["data"]
             if o["metadata"]["labels"].get("grafana_dashboard")} for objects in (first, second)]
    assert not keys[0] & keys[1]
    uids = [{d["uid"] for d in dashboards_of(objects).values()} for objects in (first, second)]
    assert len(uids[0]) == len(uids[1]) == len(dashboard_files()) and not uids[0] & uids[1]
    titles = [{d["title"] for d in dashboards_of(objects).values()} for objects in (first, second)]
    assert not titles[0] & titles[1]


def test_dashboards_open_on_the_releases_own_jobs_where_its_monitors_render(default):
    for dashboard in dashboards_of(default).values():
        current = {v["name"]: v["current"] for v in dashboard["templating"]["list"] if "current" in v}
        assert current["namespace"]["value"] == ["serving"]
        assert current["job"]["value"] == ["lookout-mooncake-lookout-engine"]
        assert current["master_job"]["value"] == ["lookout-mooncake-lookout-master"]
        assert current["pod"]["value"] == "$__all"
    # Without the chart's monitors the jobs are someone else's: every variable starts at All.
    for dashboard in dashboards_of(chart.template()).values():
        assert {json.dumps(v["current"]["value"]) for v in dashboard["templating"]["list"] if "current" in v} == {
            '"$__all"'}


def test_dashboard_label_folder_and_namespace_follow_values():
    objects = chart.template([chart.ci_value_sets()["pipelined"]])
    maps = [o for o in chart.find(objects, "ConfigMap") if "grafana_dashboard" in o["metadata"]["labels"]]
    assert len(maps) == len(dashboard_files())
    for o in maps:
        assert o["metadata"]["namespace"] == "monitoring"
        assert o["metadata"]["annotations"]["grafana_folder"] == "Mooncake"
    objects = chart.template([chart.ci_value_sets()["pipelined"]],
                             sets={"grafana.dashboards.folderAnnotation": '"k8s-sidecar-target-directory"'})
    for o in [o for o in chart.find(objects, "ConfigMap") if "grafana_dashboard" in o["metadata"]["labels"]]:
        assert o["metadata"]["annotations"] == {"k8s-sidecar-target-directory": "Mooncake"}
    custom = chart.template(sets={"grafana.dashboards.label": '"my_dash"', "grafana.dashboards.labelValue": '"yes"'})
    assert [o for o in chart.find(custom, "ConfigMap") if o["metadata"]["labels"].get("my_dash") == "yes"]


def test_monitoring_off_renders_no_monitoring_objects():
    # Off outright, even on a cluster that serves the CRDs.
    objects = with_crds([chart.ci_value_sets()["monitoring-off"]])
    assert not [o for o in objects if o["apiVersion"] == CRD_API]
    assert not [o for o in chart.find(objects, "ConfigMap") if "grafana_dashboard" in o["metadata"]["labels"]]
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "ConfigMap", "ServiceAccount"} <= kinds


def test_store_pods_are_scraped_by_a_pod_monitor_of_their_own():
    """Store pods serve /metrics on store.httpPort: a PodMonitor scrapes them (none did before)."""
    assert not chart.find(with_crds(), "PodMonitor", "-store")  # no store pods, no monitor
    objects = with_crds(sets={"store.enabled": "true"})
    monitor = chart.one(objects, "PodMonitor", "-store")
    pod = chart.one(objects, "Deployment", "-store")["spec"]["template"]
    assert _selected(monitor["spec"]["selector"], pod["metadata"]["labels"])
    for other in ("-engine", "-master"):
        assert not _selected(monitor["spec"]["selector"],
                             chart.one(objects, "Deployment", other)["spec"]["template"]["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ports = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"]}
    _check_endpoint(endpoint, set(ports))
    assert ports[endpoint["port"]] == chart.load_values()["store"]["httpPort"]
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert not chart.find(with_crds(sets={"store.enabled": "true", "monitoring.storeMonitor.enabled": "false"}),
                          "PodMonitor", "-store")


def test_each_monitor_switches_off_alone():
    for switch, gone in (("monitoring.serviceMonitor.enabled", ("ServiceMonitor", "-engine")),
                         ("monitoring.masterMonitor.enabled", ("PodMonitor", "-master")),
                         ("monitoring.prometheusRule.enabled", ("PrometheusRule", ""))):
        objects = with_crds(sets={switch: "false"})
        assert not chart.find(objects, *gone), switch
        assert len([o for o in objects if o["apiVersion"] == CRD_API]) == 2, switch


def test_monitoring_objects_follow_the_clusters_capabilities():
    """auto (the default): no monitoring.coreos.com objects unless the cluster serves the API; true forces them."""
    def crd_kinds(objects):
        return sorted(o["kind"] for o in objects if o["apiVersion"] == CRD_API)

    assert chart.load_values()["monitoring"]["enabled"] == "auto"
    assert crd_kinds(chart.template()) == []
    assert crd_kinds(with_crds()) == ["PodMonitor", "PrometheusRule", "ServiceMonitor"]
    assert crd_kinds(chart.template(sets={"monitoring.enabled": "true", "monitoring.release": '"kps"'})) == [
        "PodMonitor", "PrometheusRule", "ServiceMonitor"]
    # Each kind on its own: a cluster with the monitors' CRDs but not PrometheusRule's still installs.
    monitors_only = [chart.MONITORING_GROUP, f"{chart.MONITORING_GROUP}/ServiceMonitor",
                     f"{chart.MONITORING_GROUP}/PodMonitor"]
    assert crd_kinds(chart.template(sets={"monitoring.release": '"kps"'}, api_versions=monitors_only)) == [
        "PodMonitor", "ServiceMonitor"]
    assert crd_kinds(chart.template(sets={"monitoring.release": '"kps"'},
                                    api_versions=[f"{chart.MONITORING_GROUP}/PrometheusRule"])) == ["PrometheusRule"]
    assert crd_kinds(with_crds(sets={"monitoring.enabled": "false"})) == []
    # The dashboards are plain ConfigMaps: they do not depend on the operator.
    assert [o for o in chart.find(chart.template(), "ConfigMap") if "grafana_dashboard" in o["metadata"]["labels"]]
    with pytest.raises(chart.HelmError, match="monitoring.enabled"):
        chart.template(sets={"monitoring.enabled": '"yes"'})


def test_notes_say_why_monitoring_is_off_and_name_the_jobs():
    notes = chart.render_notes()
    assert "off: the cluster does not serve monitoring.coreos.com/v1/PrometheusRule" in notes
    on = chart.render_notes([chart.ci_value_sets()["async-budget"]])
    assert "engine ServiceMonitor: on, job lookout-mooncake-lookout-engine" in on
    assert "Labelled release=kube-prometheus-stack" in on


def test_capacity_alert_follows_the_masters_eviction_watermark(tmp_path, promtool):
    """The rendered rule compares with master.evictionHighWatermarkRatio: 78% allocated fires under a 0.8
    watermark (threshold 76%), not under the default 0.9 (85.5%)."""
    series = [{"series": 'master_allocated_bytes{namespace="store", job="m", instance="a:9003"}', "values": "78x30"},
              {"series": 'master_total_capacity_bytes{namespace="store", job="m", instance="a:9003"}',
               "values": "100x30"}]
    results = {}
    for watermark in (0.8, 0.9):
        rules = chart.one(with_crds(sets={"master.evictionHighWatermarkRatio": str(watermark)}),
                          "PrometheusRule")["spec"]
        (expr,) = [r["expr"] for g in rules["groups"] for r in g["rules"] if r["alert"] == "MooncakeMasterNearCapacity"]
        assert f"* {watermark} # eviction_high_watermark_ratio" in expr
        folder = tmp_path / str(watermark)
        folder.mkdir()
        (folder / "rules.yaml").write_text(yaml.safe_dump(rules))
        (folder / "test.yaml").write_text(yaml.safe_dump({
            "rule_files": ["rules.yaml"], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": [
                {"eval_time": "20m", "alertname": "MooncakeMasterNearCapacity", "exp_alerts": []}]}]}))
        run = promtool.run("test", "rules", "test.yaml", cwd=folder)
        results[watermark] = run.returncode == 0  # passes when nothing fires
    assert results == {0.8: False, 0.9: True}


def test_rendered_rules_pass_promtool(tmp_path, promtool):
    objects = with_crds(sets={"monitoring.prometheusRule.runbookBaseUrl": '"https://runbooks.example.com/r.md"'})
    path = tmp_path / "rendered.rules.yaml"
    path.write_text(yaml.safe_dump(chart.one(objects, "PrometheusRule")["spec"]))
    promtool.check_rules(path)

"""One Prometheus job per component, and the alert rules fed the labels the chart's own monitors give.

The repository's promtool unit tests (dashboards/alerts.test.yaml) name their jobs by hand, one per component, so
they cannot see what the chart's monitors do to the ``job`` label. Here the rendered PrometheusRule runs in
promtool against series whose ``job`` is the one the Prometheus Operator would give each target of the rendered
ServiceMonitors and PodMonitors. No Operator runs here: :func:`operator_job` reproduces the rules of its config
generator (pkg/prometheus/promcfg.go): a ServiceMonitor's job defaults to the Service's name, a PodMonitor's to
``<namespace>/<monitor name>``; ``spec.jobLabel``, when the Service (or pod) carries that label, replaces it; an
endpoint's own ``relabelings`` run after both. Relabelings of another form fail the test rather than be guessed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

import chart  # helm/tools/chart.py (conftest puts helm/tools on sys.path)

COMPONENT = "app.kubernetes.io/component"
ABSENT = "MooncakeLookupMetricsAbsent"


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def _pod_templates(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o["spec"]["template"] for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def operator_job(monitor: dict[str, Any], target_labels: dict[str, str], default: str) -> str:
    """The job the Operator gives a target of ``monitor``: ``default``, then jobLabel, then the endpoint relabelings."""
    job = default
    label = monitor["spec"].get("jobLabel")
    if label and target_labels.get(label):
        job = target_labels[label]
    (endpoint,) = monitor["spec"].get("endpoints") or monitor["spec"]["podMetricsEndpoints"]
    for rule in endpoint.get("relabelings", []):
        if rule.get("targetLabel") != "job":
            continue
        assert rule.get("action", "replace") == "replace" and not rule.get("sourceLabels"), (
            f"a job relabeling this test does not model: {rule}")
        job = rule["replacement"]
    return job


def jobs_by_component(objects: list[dict[str, Any]]) -> dict[str, str]:
    """Component (engine, master, store) to the job label of its targets, for every rendered monitor."""
    jobs: dict[str, str] = {}
    for monitor in chart.find(objects, "ServiceMonitor") + chart.find(objects, "PodMonitor"):
        namespace, selector = monitor["metadata"]["namespace"], monitor["spec"]["selector"]
        if monitor["kind"] == "ServiceMonitor":
            targets = [(s["metadata"]["labels"], s["metadata"]["name"]) for s in chart.find(objects, "Service")
                       if s["metadata"]["namespace"] == namespace and _selects(selector, s["metadata"]["labels"])]
        else:
            default = f"{namespace}/{monitor['metadata']['name']}"
            targets = [(t["metadata"]["labels"], default) for t in _pod_templates(objects)
                       if _selects(selector, t["metadata"]["labels"])]
        assert targets, f"{monitor['kind']} {monitor['metadata']['name']} selects nothing"
        for labels, default in targets:
            jobs[labels[COMPONENT]] = operator_job(monitor, labels, default)
    return jobs


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    """Engines, the master and store pods, on a cluster with the Operator's CRDs (kube-prometheus-stack as kps)."""
    return chart.template(sets={"store.enabled": "true", "monitoring.release": '"kps"'},
                          api_versions=chart.MONITORING_APIS)


def test_every_component_and_release_is_a_job_of_its_own(rendered):
    jobs = jobs_by_component(rendered)
    assert jobs == {c: f"lookout-mooncake-lookout-{c}" for c in ("engine", "master", "store")}
    other = chart.template(release="second", sets={"store.enabled": "true", "monitoring.release": '"kps"'},
                           api_versions=chart.MONITORING_APIS)
    assert not set(jobs.values()) & set(jobs_by_component(other).values())
    # The master's ServiceMonitor variant gives its targets the same job as the PodMonitor does.
    variant = chart.template(sets={"monitoring.masterMonitor.kind": '"ServiceMonitor"', "monitoring.release": '"kps"'},
                             api_versions=chart.MONITORING_APIS)
    assert jobs_by_component(variant)["master"] == jobs["master"]


def test_the_model_of_the_operator_reads_a_shared_job_label_as_one_job():
    """The control: a jobLabel that every component carries (what the chart set before) makes one job of all."""
    monitor = {"spec": {"jobLabel": "app.kubernetes.io/name", "endpoints": [{"port": "http"}]}}
    labels = {"app.kubernetes.io/name": "mooncake-lookout", COMPONENT: "master"}
    assert operator_job(monitor, labels, "lookout-mooncake-lookout-master") == "mooncake-lookout"


def absent_case(rules: dict[str, Any], jobs: dict[str, str], namespace: str) -> dict[str, Any]:
    """A promtool test: every component's target answers scrapes for 70 minutes; engine ``e-ok`` exports the lookup
    metrics, engine ``e-plain`` (same job) does not. Only ``e-plain`` may raise MooncakeLookupMetricsAbsent."""
    def target(component: str, pod: str) -> str:
        return f'namespace="{namespace}", job="{jobs[component]}", pod="{pod}", instance="{pod}:1"'

    series = [{"series": f"up{{{target('engine', 'e-ok')}}}", "values": "1x70"},
              {"series": f"vllm:mooncake_lookup_info{{{target('engine', 'e-ok')}, model_name=\"m\", engine=\"0\"}}",
               "values": "1x70"},
              {"series": f"up{{{target('engine', 'e-plain')}}}", "values": "1x70"},
              {"series": f"up{{{target('master', 'm-0')}}}", "values": "1x70"},
              {"series": f"master_key_count{{{target('master', 'm-0')}}}", "values": "5x70"}]
    if "store" in jobs:
        series.append({"series": f"up{{{target('store', 's-0')}}}", "values": "1x70"})
    firing = f'ALERTS{{alertname="{ABSENT}", alertstate="firing"}}'
    expected = {"labels": f'ALERTS{{alertname="{ABSENT}", alertstate="firing", severity="warning", '
                          f'{target("engine", "e-plain")}}}', "value": 1}
    return {"rule_files": ["rules.yaml"], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series,
                       "promql_expr_test": [{"expr": firing, "eval_time": "70m", "exp_samples": [expected]}]}],
            "_rules": rules}


def run_case(promtool: Any, folder: Path, case: dict[str, Any]) -> Any:
    folder.mkdir()
    (folder / "rules.yaml").write_text(yaml.safe_dump(case.pop("_rules")))
    (folder / "test.yaml").write_text(yaml.safe_dump(case, sort_keys=False))
    return promtool.run("test", "rules", "test.yaml", cwd=folder)


def test_metrics_absent_fires_for_an_engine_without_the_plugin_not_for_the_master_or_store(rendered, promtool,
                                                                                            tmp_path):
    """The rendered rules, fed the jobs the rendered monitors give: only the plain engine alerts."""
    rules = chart.one(rendered, "PrometheusRule")["spec"]
    run = run_case(promtool, tmp_path / "chart", absent_case(rules, jobs_by_component(rendered), "serving"))
    assert run.returncode == 0, run.stdout + run.stderr
    # The control: with one job for engines and master (the chart's old jobLabel), the master alerts for ever.
    shared = {c: "mooncake-lookout" for c in ("engine", "master", "store")}
    run = run_case(promtool, tmp_path / "shared", absent_case(rules, shared, "serving"))
    assert run.returncode != 0 and 'pod="m-0"' in run.stdout + run.stderr, run.stdout + run.stderr


NEVER = "MooncakeMasterNeverScraped"


def never_scraped_case(rules: dict[str, Any], master_job: str, namespace: str) -> dict[str, Any]:
    """A promtool test: master m-0 of the given job and namespace answers no scrape for 30 minutes (a NetworkPolicy
    drops them); the engine and a master of another release answer no scrape either. Only m-0 may alert."""
    series = [{"series": f'up{{namespace="{namespace}", job="{master_job}", pod="m-0", instance="m-0:1"}}',
               "values": "0x30"},
              {"series": f'up{{namespace="{namespace}", job="lookout-mooncake-lookout-engine", pod="e-0", '
                         f'instance="e-0:1"}}', "values": "0x30"},
              {"series": 'up{namespace="other", job="other-mooncake-lookout-master", pod="m-9", instance="m-9:1"}',
               "values": "0x30"}]
    expected = {"labels": f'ALERTS{{alertname="{NEVER}", alertstate="firing", severity="warning", '
                          f'namespace="{namespace}", job="{master_job}", pod="m-0", instance="m-0:1"}}', "value": 1}
    firing = f'ALERTS{{alertname="{NEVER}", alertstate="firing"}}'
    return {"rule_files": ["rules.yaml"], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series,
                       "promql_expr_test": [{"expr": firing, "eval_time": "20m", "exp_samples": [expected]}]}],
            "_rules": rules}


def test_never_scraped_fires_for_this_releases_master_job_only(rendered, promtool, tmp_path):
    """The rendered rule watches the job the rendered master monitor gives its targets, in the release's namespace:
    a master Prometheus never reaches alerts; another release's master and the engine do not."""
    rules = chart.one(rendered, "PrometheusRule")["spec"]
    run = run_case(promtool, tmp_path / "chart", never_scraped_case(rules, jobs_by_component(rendered)["master"],
                                                                    "serving"))
    assert run.returncode == 0, run.stdout + run.stderr
    # The control: the rule file as it is (job mooncake-master) would not see the chart's master.
    plain = yaml.safe_load((chart.ROOT / "dashboards" / "alerts.rules.yaml").read_text())
    run = run_case(promtool, tmp_path / "plain", never_scraped_case(plain, jobs_by_component(rendered)["master"],
                                                                    "serving"))
    assert run.returncode != 0, run.stdout + run.stderr

"""docs/integrate.md's snippets, read out of the page (so the guide cannot drift), checked the way a cluster would.

* production-stack values: valid against that chart's values.schema.json, every key one the schema names (it does not
  forbid unknown keys itself), then rendered by the real chart (vendored in tests/data/production-stack, see its
  README) with the real helm: the engine container must carry our connector's configuration, valid for our parser.
* plain manifests: validated strictly against the Kubernetes 1.32 schema (kubernetes-validate), monitors checked by
  the Prometheus Operator's fields (kubernetes-validate has no schema for CRDs) and shown to select the pods and
  ports they mean to.
* this chart with no engine: rendered with the CRDs, validated strictly, its PrometheusRule through promtool.
* the by-hand PrometheusRule: the shell snippet run, its spec.groups through promtool.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from mooncake_lookout.connector.config import LookupConfig

import chart  # helm/tools/chart.py (conftest puts helm/tools on sys.path)

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "integrate.md"
PS_CHART = ROOT / "tests" / "data" / "production-stack" / "chart"
KUBE = "1.32.0"
CRD_GROUP = "monitoring.coreos.com/v1"
# prometheus-operator's ScrapeProtocol enum (as tests/test_helm_observability.py spells it).
SCRAPE_PROTOCOLS = {"PrometheusProto", "OpenMetricsText0.0.1", "OpenMetricsText1.0.0", "PrometheusText0.0.4",
                    "PrometheusText1.0.0"}
DURATION = re.compile(r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$")
SNIPPET = re.compile(r"<!-- snippet: ([\w-]+) -->\n```(\w+)\n(.*?)\n```", re.S)
# production-stack keys the guide's prose names (tests/test_docs_drift.py lets docs name them: OUTSIDE).
PS_KEYS_NAMED = ("lmcacheConfig", "lmcacheConfig.enabled", "servingEngineSpec.modelSpec",
                 "servingEngineSpec.serviceMonitor.enabled", "vllmConfig.extraArgs", "vllmConfig.v0",
                 "vllmConfig.enablePrefixCaching")
NAMES = {"master-values", "store-client-configmap", "production-stack-values", "production-stack-servicemonitor",
         "plain-deployment", "plain-monitors", "prometheusrule"}


def snippets() -> dict[str, str]:
    """The guide's marked snippets by name (``<!-- snippet: NAME -->`` on the line before the fence)."""
    found = SNIPPET.findall(GUIDE.read_text())
    names = [name for name, _, _ in found]
    assert len(names) == len(set(names)), f"a snippet name twice in docs/integrate.md: {names}"
    return {name: body for name, _, body in found}


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(snippets()[name]) if d]


def validate_strictly(objects: list[dict[str, Any]]) -> int:
    """kubernetes-validate --strict on every object but the Prometheus Operator's; returns how many were checked."""
    checked = 0
    for obj in objects:
        if obj["apiVersion"] == CRD_GROUP:
            continue
        try:
            kubernetes_validate.validate(obj, KUBE, strict=True)
        except kubernetes_validate.ValidationError as exc:
            name = f"{obj['kind']}/{obj['metadata']['name']}"
            pytest.fail(f"{name} invalid for {KUBE}: {exc.message} at {list(exc.path)}")
        checked += 1
    return checked


def check_monitor(monitor: dict[str, Any]) -> dict[str, Any]:
    """The Operator's fields of a ServiceMonitor/PodMonitor; returns its one endpoint."""
    assert monitor["apiVersion"] == CRD_GROUP and monitor["kind"] in ("ServiceMonitor", "PodMonitor")
    spec = monitor["spec"]
    assert spec["scrapeProtocols"] == ["PrometheusText0.0.4"] and set(spec["scrapeProtocols"]) <= SCRAPE_PROTOCOLS
    assert monitor["metadata"]["labels"].get("release"), "kube-prometheus-stack selects monitors by release"
    (endpoint,) = spec["podMetricsEndpoints" if monitor["kind"] == "PodMonitor" else "endpoints"]
    assert endpoint["path"] == "/metrics"
    assert DURATION.match(endpoint["interval"]) and DURATION.match(endpoint["scrapeTimeout"])
    return endpoint


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return selector["matchLabels"].items() <= labels.items()


def connector_config(args: list[str]) -> dict[str, Any]:
    """The one --kv-transfer-config of a container's arguments, parsed; its extra config must pass our parser."""
    assert args.count("--kv-transfer-config") == 1, args
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "LookoutMooncakeStoreConnector" and config["kv_role"] == "kv_both"
    LookupConfig.from_extra_config(config["kv_connector_extra_config"])
    return config


def unknown_keys(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Keys of ``value`` the schema does not name, where it names properties (it does not forbid others)."""
    out = []
    if isinstance(value, dict) and "properties" in schema:
        for key, item in value.items():
            if key not in schema["properties"]:
                out.append(f"{path}.{key}")
            else:
                out += unknown_keys(item, schema["properties"][key], f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            out += unknown_keys(item, schema["items"], f"{path}[{i}]")
    return out


def test_the_guide_carries_every_snippet_and_the_readme_links_it():
    assert set(snippets()) == NAMES
    assert "(docs/integrate.md)" in (ROOT / "README.md").read_text()


def test_production_stack_values_follow_that_charts_schema():
    schema = json.loads((PS_CHART / "values.schema.json").read_text())
    values = yaml.safe_load(snippets()["production-stack-values"])
    jsonschema.validate(values, schema)
    assert unknown_keys(values, schema) == []
    # The key check catches what the schema lets through: a misspelt key.
    values["servingEngineSpec"]["modelSpec"][0]["vllmConfig"]["extraArg"] = ["--x"]
    jsonschema.validate(values, schema)
    assert unknown_keys(values, schema) == [".servingEngineSpec.modelSpec[0].vllmConfig.extraArg"]


def test_the_production_stack_keys_the_guide_names_are_that_charts():
    schema = json.loads((PS_CHART / "values.schema.json").read_text())
    model_spec = schema["properties"]["servingEngineSpec"]["properties"]["modelSpec"]["items"]
    text = GUIDE.read_text()
    for key in PS_KEYS_NAMED:
        assert f"`{key}" in text, key
        node = schema if key.startswith("servingEngineSpec") else model_spec
        for part in key.split("."):
            node = node["properties"][part]  # KeyError: the chart has no such key


@pytest.fixture(scope="module")
def production_stack(tmp_path_factory) -> list[dict[str, Any]]:
    """The vendored production-stack chart rendered with the guide's values (its two optional subcharts, off by
    default, dropped from Chart.yaml: helm refuses to render a chart whose listed dependencies are not in charts/)."""
    tmp = tmp_path_factory.mktemp("production-stack")
    copy = tmp / "vllm-stack"
    shutil.copytree(PS_CHART, copy)
    meta = yaml.safe_load((copy / "Chart.yaml").read_text())
    meta.pop("dependencies")
    (copy / "Chart.yaml").write_text(yaml.safe_dump(meta))
    values = tmp / "values.yaml"
    values.write_text(snippets()["production-stack-values"])
    text = chart.run_helm("template", "vllm", str(copy), "--namespace", "serving", "--kube-version", KUBE,
                          "--values", str(values))
    return [d for d in yaml.safe_load_all(text) if d]


def test_production_stack_renders_the_engine_with_our_connector(production_stack):
    assert validate_strictly(production_stack) >= 2
    (deployment,) = [o for o in production_stack if o["kind"] == "Deployment" and "qwen3-8b" in o["metadata"]["name"]]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "vllm"]
    assert container["image"] == "REGISTRY/mooncake-lookout-engine:0.1.0"
    command = container["command"] + container.get("args", [])
    assert command[:3] == ["vllm", "serve", "Qwen/Qwen3-8B"]
    assert "--enable-prefix-caching" in command and "--no-enable-prefix-caching" not in command
    assert connector_config(command)["kv_connector_extra_config"]["lookup_async"] is True
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MOONCAKE_CONFIG_PATH"] == "/etc/mooncake/mooncake.json" and "LMCACHE_LOG_LEVEL" not in env
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/etc/mooncake")
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == docs("store-client-configmap")[0]["metadata"]["name"]
    # The master admits these pods (section 2's extraClients).
    peers = yaml.safe_load(snippets()["master-values"])["networkPolicy"]["extraClients"]
    assert any(selects(p["podSelector"], deployment["spec"]["template"]["metadata"]["labels"]) for p in peers)


def test_production_stack_servicemonitor_scrapes_its_engine_service(production_stack):
    (monitor,) = docs("production-stack-servicemonitor")
    endpoint = check_monitor(monitor)
    services = [o for o in production_stack if o["kind"] == "Service"
                and selects(monitor["spec"]["selector"], o["metadata"].get("labels", {}))]
    assert [s["metadata"]["name"] for s in services] == ["vllm-qwen3-8b-engine-service"]
    assert endpoint["port"] in {p["name"] for p in services[0]["spec"]["ports"]}


def test_plain_manifests_validate_strictly_and_carry_our_connector():
    objects = docs("plain-deployment") + docs("store-client-configmap")
    assert validate_strictly(objects) == 3
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    connector_config(container["args"])
    store = json.loads(docs("store-client-configmap")[0]["data"]["mooncake.json"])
    assert store["metadata_server"] == "P2PHANDSHAKE" and store["protocol"] == "tcp"


def test_plain_monitors_select_the_plain_engine():
    objects = docs("plain-deployment")
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    (service,) = [o for o in objects if o["kind"] == "Service"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    monitors = {m["kind"]: m for m in docs("plain-monitors")}
    assert set(monitors) == {"ServiceMonitor", "PodMonitor"}
    endpoint = check_monitor(monitors["ServiceMonitor"])
    assert selects(monitors["ServiceMonitor"]["spec"]["selector"], service["metadata"]["labels"])
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    endpoint = check_monitor(monitors["PodMonitor"])
    assert selects(monitors["PodMonitor"]["spec"]["selector"], pod["metadata"]["labels"])
    assert endpoint["port"] in {p["name"] for p in container["ports"]}
    peers = yaml.safe_load(snippets()["master-values"])["networkPolicy"]["extraClients"]
    assert any(selects(p["podSelector"], pod["metadata"]["labels"]) for p in peers)


def test_this_chart_with_no_engine_runs_the_master_rules_and_dashboards(tmp_path, promtool):
    values = tmp_path / "master-values.yaml"
    values.write_text(snippets()["master-values"])
    objects = chart.template([values], api_versions=chart.MONITORING_APIS)
    assert validate_strictly(objects) >= 5
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert ("PodMonitor", "lookout-mooncake-lookout-master") in kinds
    assert not [o for o in objects if o["kind"] == "ServiceMonitor"] and not [o for o in objects if o["kind"] == "Pod"]
    assert chart.one(objects, "Deployment", "-engine")["spec"]["replicas"] == 0
    assert len([o for o in objects if o["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]) == 2
    # The store clients' file names the master Service this release runs.
    master = chart.one(objects, "Service", "-master")
    address = json.loads(docs("store-client-configmap")[0]["data"]["mooncake.json"])["master_server_address"]
    rpc = next(p["port"] for p in master["spec"]["ports"] if p["port"] == int(address.rsplit(":", 1)[1]))
    assert address == f"{master['metadata']['name']}.{master['metadata']['namespace']}.svc:{rpc}"
    policy = chart.one(objects, "NetworkPolicy", "-master")
    admitted = [peer for rule in policy["spec"]["ingress"] for peer in rule.get("from", [])]
    for peer in yaml.safe_load(snippets()["master-values"])["networkPolicy"]["extraClients"]:
        assert peer in admitted
    rule = chart.one(objects, "PrometheusRule")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    promtool.check_rules(path)


def test_the_by_hand_prometheusrule_is_the_rule_file_and_passes_promtool(tmp_path, promtool):
    (tmp_path / "dashboards").symlink_to(ROOT / "dashboards")
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", snippets()["prometheusrule"]], cwd=tmp_path,
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    rule = yaml.safe_load((tmp_path / "prometheusrule.yaml").read_text())
    assert rule["apiVersion"] == CRD_GROUP and rule["kind"] == "PrometheusRule"
    assert rule["metadata"]["labels"]["release"]
    source = yaml.safe_load((ROOT / "dashboards" / "alerts.rules.yaml").read_text())
    assert rule["spec"] == source
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    promtool.check_rules(path)

"""The Helm chart, rendered by the real helm v3 and checked object by object.

Covers: lint --strict, rendering of the default values and of every ci/*-values.yaml, Kubernetes schema
validation (1.29 and 1.32, strict), the kv-transfer-config and mooncake.json the engine gets, the master's
flags, external master, the network policy's selections, security contexts, disruption budgets, the test hook
and what the packaged chart contains.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from mooncake_lookout.connector.config import KEYS, LookupConfig

import chart  # helm/tools/chart.py (conftest puts helm/tools on sys.path)

ROOT = Path(__file__).resolve().parents[1]


KUBE_VERSIONS = ("1.29.0", "1.32.0")
VALUE_SETS = {"default": None, **chart.ci_value_sets()}
CRD_GROUP = "monitoring.coreos.com/v1"


@pytest.fixture(scope="module")
def rendered() -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Every value set rendered for every Kubernetes version, by (set name, version), for a cluster that serves
    the Prometheus Operator's CRDs (so the monitoring objects render too), where kube-prometheus-stack runs as
    release kps (a value set that names no release gets that one)."""
    out = {}
    for name, path in VALUE_SETS.items():
        sets = {} if values_of(name)["monitoring"]["release"] else {"monitoring.release": '"kps"'}
        for version in KUBE_VERSIONS:
            out[(name, version)] = chart.template([path] if path else [], kube_version=version, sets=sets,
                                                  api_versions=chart.MONITORING_APIS)
    return out


def engine_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = chart.one(objects, "Deployment", "-engine")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def arg_after(container: dict[str, Any], flag: str) -> str | None:
    args = container["args"]
    return args[args.index(flag) + 1] if flag in args else None


def values_of(name: str) -> dict[str, Any]:
    """Default values merged with a ci value set (maps merge, lists and scalars replace, as helm does)."""
    import yaml

    def merge(base: Any, over: Any) -> Any:
        if isinstance(base, dict) and isinstance(over, dict):
            return {k: merge(base.get(k), over[k]) if k in base else over[k] for k in over} | {
                k: v for k, v in base.items() if k not in over}
        return over

    values = chart.load_values()
    path = VALUE_SETS[name]
    return merge(values, yaml.safe_load(path.read_text())) if path else values


def test_the_ci_value_sets_the_issue_asks_for_exist():
    assert {"monitoring-off", "async-budget", "external-master", "pipelined", "ha", "ha-k8s",
            "external-ha-master"} <= set(VALUE_SETS)


def test_a_missing_helm_is_a_clear_error_not_a_skip(monkeypatch, tmp_path):
    monkeypatch.setenv("LOOKOUT_HELM", str(tmp_path / "no-helm"))
    with pytest.raises(RuntimeError, match="LOOKOUT_HELM=.*not an executable helm"):
        chart.helm_binary()
    monkeypatch.delenv("LOOKOUT_HELM")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(chart, "ROOT", tmp_path)
    with pytest.raises(RuntimeError, match="helm v3 not found .* run scripts/setup.sh"):
        chart.helm_binary()


def test_kubernetes_older_than_1_29_is_refused():
    with pytest.raises(chart.HelmError, match="kubeVersion"):
        chart.template(kube_version="1.28.0")


def test_helm_is_a_v3_binary():
    assert chart.run_helm("version", "--short").startswith("v3.")


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_lint_strict(name):
    path = VALUE_SETS[name]
    out = chart.run_helm("lint", "--strict", str(chart.CHART), *(["--values", str(path)] if path else []))
    assert "0 chart(s) failed" in out


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_rendered_objects_pass_kubernetes_strict_validation(rendered, name, version):
    checked = 0
    for obj in rendered[(name, version)]:
        if obj["apiVersion"] == CRD_GROUP:
            continue  # CRDs: no schema in kubernetes-validate; tests/test_helm_observability.py checks their fields
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            name = f"{obj['kind']}/{obj['metadata']['name']}"
            pytest.fail(f"{name} invalid for {version}: {exc.message} at {list(exc.path)}")
        checked += 1
    assert checked >= 5


def test_kv_transfer_config_carries_every_lookup_key_and_parses(rendered):
    for name in VALUE_SETS:
        values = values_of(name)
        container = engine_container(rendered[(name, "1.32.0")])
        config = json.loads(arg_after(container, "--kv-transfer-config"))
        connector = values["engine"]["connector"]
        assert config["kv_connector"] == "LookoutMooncakeStoreConnector" == connector["name"]
        assert config["kv_role"] == "kv_both"
        extra = config["kv_connector_extra_config"]
        assert {k.name for k in KEYS} <= set(extra), name
        # The values set, except that held answers stay younger than half the masters' key lease (the chart
        # takes the lower; tests/test_helm_production.py checks that rule on its own).
        pod = chart.one(rendered[(name, "1.32.0")], "Deployment", "-engine")["spec"]["template"]
        half_lease = int(pod["metadata"]["annotations"]["mooncake-lookout/master-lease-ms"]) // 2
        lookup = {**connector["lookup"]}
        lookup["lookup_answer_ttl_ms"] = min(lookup["lookup_answer_ttl_ms"], half_lease)
        if connector["curve"]["secretName"]:  # the mounted key files (tests/test_helm_security.py reads them)
            lookup.update(curve_paths(connector["curve"]["mountPath"]))
        assert extra == {**connector["extraConfig"], **lookup}, name
        # The connector's own parser accepts it and reads back the values we set (key files exist only in the pod).
        no_files = {k: "" for k in curve_paths("")}
        assert LookupConfig.from_extra_config({**extra, **no_files}) == LookupConfig(**{**lookup, **no_files}), name


def curve_paths(mount: str) -> dict[str, str]:
    """The lookup_curve_* keys the chart sets for CURVE keys mounted at ``mount``."""
    return {"lookup_curve_server_public_key": f"{mount}/server.key",
            "lookup_curve_client_secret_key": f"{mount}/client.key_secret",
            "lookup_curve_server_secret_key": f"{mount}/server.key_secret",
            "lookup_curve_allowed_clients": f"{mount}/allowed"}


def test_async_budget_set_reaches_the_connector(rendered):
    extra = json.loads(arg_after(engine_container(rendered[("async-budget", "1.32.0")]), "--kv-transfer-config"))[
        "kv_connector_extra_config"]
    parsed = LookupConfig.from_extra_config(extra)
    assert parsed.mode == "budget" and parsed.lookup_wait_us == 200 and parsed.lookup_timeout_ms == 25.5
    assert extra["load_async"] is True  # upstream pass-through key


def test_pipelined_set_selects_the_pipelined_transport(rendered):
    extra = json.loads(arg_after(engine_container(rendered[("pipelined", "1.32.0")]), "--kv-transfer-config"))[
        "kv_connector_extra_config"]
    assert LookupConfig.from_extra_config(extra).lookup_transport == "pipelined"


def test_engine_points_at_the_master_service_by_name(rendered):
    objects = rendered[("default", "1.32.0")]
    service = chart.one(objects, "Service", "-master")
    mooncake = json.loads(chart.one(objects, "ConfigMap", "-engine")["data"]["mooncake.json"])
    rpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "rpc")
    ns = service["metadata"]["namespace"]
    assert mooncake["master_server_address"] == f"{service['metadata']['name']}.{ns}.svc:{rpc_port}"
    assert mooncake["metadata_server"] == "P2PHANDSHAKE"
    env = {e["name"]: e.get("value") for e in engine_container(objects)["env"]}
    mount = next(m for m in engine_container(objects)["volumeMounts"] if m["name"] == "mooncake-config")
    assert env["MOONCAKE_CONFIG_PATH"] == mount["mountPath"] + "/mooncake.json"


@pytest.mark.parametrize("name", ["external-master", "external-ha-master"])
def test_external_master_deploys_no_master_and_points_the_engine_at_it(rendered, name):
    objects = rendered[(name, "1.32.0")]
    assert not [o for o in objects if o["metadata"]["name"].endswith("-master")]
    mooncake = json.loads(chart.one(objects, "ConfigMap", "-engine")["data"]["mooncake.json"])
    external = values_of(name)["master"]["external"]
    assert mooncake["master_server_address"] == external["address"]
    env = {e["name"]: e["value"] for e in chart.one(objects, "Pod", "-test")["spec"]["containers"][0]["env"]}
    assert env["MASTER_HEALTH_URL"] == external["healthUrl"] and env["MASTER_ADDRESS"] == external["address"]
    # An external HA store's name reaches the store client (MC_STORE_CLUSTER_ID), and only when it is set.
    engine_env = {e["name"]: e.get("value") for e in engine_container(objects)["env"]}
    cluster_id = values_of(name)["master"]["ha"]["clusterId"]
    assert engine_env.get("MC_STORE_CLUSTER_ID") == (cluster_id or None)


def test_master_flags_come_from_values(rendered):
    for name in VALUE_SETS:
        if not values_of(name)["master"]["enabled"]:
            continue
        master = values_of(name)["master"]
        (container,) = chart.one(rendered[(name, "1.32.0")], "Deployment", "-master")["spec"]["template"]["spec"][
            "containers"]
        flags = dict(a.removeprefix("--").split("=", 1) for a in container["args"])
        assert ("enable_ha" in flags) == master["ha"]["enabled"], name
        assert flags["rpc_port"] == str(master["rpcPort"]) and flags["metrics_port"] == str(master["metricsPort"])
        assert flags["default_kv_lease_ttl"] == master["defaultKvLeaseTtl"]
        assert float(flags["eviction_high_watermark_ratio"]) == master["evictionHighWatermarkRatio"]
        assert float(flags["eviction_ratio"]) == master["evictionRatio"]
        assert flags["client_ttl"] == str(master["clientTtl"])
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        for probe in ("livenessProbe", "readinessProbe"):
            assert container[probe]["httpGet"] == {"path": "/health", "port": "metrics"}
        assert ports == {"rpc": master["rpcPort"], "metrics": master["metricsPort"]}


def test_engine_probes_ports_shm_tracing_and_scheduling(rendered):
    objects = rendered[("async-budget", "1.32.0")]
    values = values_of("async-budget")["engine"]
    pod = chart.one(objects, "Deployment", "-engine")["spec"]["template"]["spec"]
    container = engine_container(objects)
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["ports"] == [{"name": "http", "containerPort": values["port"], "protocol": "TCP"}]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert arg_after(container, "--otlp-traces-endpoint") == values["tracing"]["otlpEndpoint"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["OTEL_TRACES_SAMPLER"] == values["tracing"]["sampler"]
    assert env["OTEL_TRACES_SAMPLER_ARG"] == values["tracing"]["samplerArg"]
    # Lookup spans need an exporter named and the one protocol whose exporter the package installs.
    assert env["OTEL_TRACES_EXPORTER"] == "otlp" and env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == values["tracing"]["otlpEndpoint"]
    assert env["VLLM_LOGGING_LEVEL"] == "INFO"  # user env appended
    assert pod["nodeSelector"] == values["nodeSelector"] and pod["tolerations"] == values["tolerations"]
    assert pod["affinity"] == values["affinity"]
    assert arg_after(container, "--served-model-name") == values["servedModelName"]
    assert container["args"][-4:] == values["extraArgs"]
    # Tracing off by default: no endpoint flag, no OTEL_* variables.
    default = engine_container(rendered[("default", "1.32.0")])
    assert "--otlp-traces-endpoint" not in default["args"]
    assert not [e for e in default["env"] if e["name"].startswith("OTEL_")]


def test_every_container_drops_privileges(rendered):
    for (name, _), objects in rendered.items():
        release_sa = chart.one(objects, "ServiceAccount", "-lookout")["metadata"]["name"]
        for obj in objects:
            if obj["kind"] not in ("Deployment", "StatefulSet", "Pod"):
                continue
            spec = obj["spec"]["template"]["spec"] if obj["kind"] != "Pod" else obj["spec"]
            assert spec["securityContext"]["runAsNonRoot"] is True, (name, obj["metadata"]["name"])
            for container in spec["containers"]:
                sc = container["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
            k8s_masters = obj["metadata"]["name"].endswith("-master") and values_of(name)["master"]["ha"]["enabled"] \
                and values_of(name)["master"]["ha"]["backend"] == "k8s"
            if k8s_masters:  # the k8s election backend calls the API, with an account of its own
                assert spec["automountServiceAccountToken"] is True
                assert spec["serviceAccountName"] == obj["metadata"]["name"] != release_sa
            else:
                assert spec["automountServiceAccountToken"] is False, (name, obj["metadata"]["name"])
                assert spec["serviceAccountName"] == release_sa


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _pod_labels(objects: list[dict[str, Any]], suffix: str) -> dict[str, str]:
    for obj in objects:
        if obj["metadata"]["name"].endswith(suffix):
            if obj["kind"] == "Deployment":
                return obj["spec"]["template"]["metadata"]["labels"]
            if obj["kind"] == "Pod":
                return obj["metadata"]["labels"]
    raise AssertionError(f"no pod template named *{suffix}")


def test_network_policy_lets_only_engines_reach_the_master_rpc_port(rendered):
    objects = rendered[("default", "1.32.0")]
    policy = chart.one(objects, "NetworkPolicy", "-master")["spec"]
    engine, master, test = (_pod_labels(objects, s) for s in ("-engine", "-master", "-test"))
    assert _selects(policy["podSelector"], master) and not _selects(policy["podSelector"], engine)
    assert policy["policyTypes"] == ["Ingress"]
    rules = {rule["ports"][0]["port"]: rule["from"] for rule in policy["ingress"]}
    assert set(rules) == {"rpc", "metrics"}
    (rpc_peer,) = rules["rpc"]
    assert set(rpc_peer) == {"podSelector"}  # same namespace, engine pods only
    assert _selects(rpc_peer["podSelector"], engine)
    assert not _selects(rpc_peer["podSelector"], master) and not _selects(rpc_peer["podSelector"], test)
    monitoring = [p for p in rules["metrics"] if "namespaceSelector" in p]
    assert [p["namespaceSelector"] for p in monitoring] == [
        {"matchLabels": {"kubernetes.io/metadata.name": values_of("default")["monitoring"]["namespace"]}}]
    test_peer = [p for p in rules["metrics"] if "namespaceSelector" not in p]
    assert len(test_peer) == 1 and _selects(test_peer[0]["podSelector"], test)
    assert not _selects(test_peer[0]["podSelector"], engine)
    # The named ports exist on the master container.
    container = chart.one(objects, "Deployment", "-master")["spec"]["template"]["spec"]["containers"][0]
    assert {"rpc", "metrics"} <= {p["name"] for p in container["ports"]}


def test_network_policy_monitoring_pod_selector_and_switches(rendered):
    policy = chart.one(rendered[("pipelined", "1.32.0")], "NetworkPolicy", "-master")["spec"]
    metrics_from = next(r["from"] for r in policy["ingress"] if r["ports"][0]["port"] == "metrics")
    monitoring = next(p for p in metrics_from if "namespaceSelector" in p)
    assert monitoring["podSelector"] == values_of("pipelined")["networkPolicy"]["monitoringPodSelector"]
    assert not chart.find(rendered[("monitoring-off", "1.32.0")], "NetworkPolicy")
    assert not chart.find(rendered[("external-master", "1.32.0")], "NetworkPolicy", "-master")


def _pod_templates(objects: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Pod labels by component, from every workload and pod of the release."""
    out = {}
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            labels = obj["spec"]["template"]["metadata"]["labels"]
        elif obj["kind"] == "Pod":
            labels = obj["metadata"]["labels"]
        else:
            continue
        out[labels["app.kubernetes.io/component"]] = labels
    return out


def test_services_select_their_pods(rendered):
    for name in VALUE_SETS:
        objects = rendered[(name, "1.32.0")]
        pods = _pod_templates(objects)
        for service in chart.find(objects, "Service"):
            component = service["metadata"]["labels"]["app.kubernetes.io/component"]
            selector = {"matchLabels": service["spec"]["selector"]}
            own = dict(pods[component])
            if service["metadata"]["name"].endswith("-master-leader"):
                # Selects only the master that Mooncake's k8s backend labels leader at run time.
                assert not _selects(selector, own)
                own["mooncake.io/store-role"] = "leader"
            assert _selects(selector, own), (name, service["metadata"]["name"])
            others = [labels for c, labels in pods.items() if c != component]
            assert not any(_selects(selector, o) for o in others), (name, service["metadata"]["name"])


def test_disruption_budgets(rendered):
    default = rendered[("default", "1.32.0")]
    pdb = chart.one(default, "PodDisruptionBudget", "-engine")["spec"]
    assert pdb["maxUnavailable"] == 1 and _selects(pdb["selector"], _pod_labels(default, "-engine"))
    assert not chart.find(default, "PodDisruptionBudget", "-master")  # one master: off by default
    pipelined = rendered[("pipelined", "1.32.0")]
    master_pdb = chart.one(pipelined, "PodDisruptionBudget", "-master")["spec"]
    assert _selects(master_pdb["selector"], _pod_labels(pipelined, "-master"))


def test_images_default_to_the_chart_app_version(rendered):
    import yaml

    app_version = yaml.safe_load((chart.CHART / "Chart.yaml").read_text())["appVersion"]
    objects = rendered[("default", "1.32.0")]
    images = {c["image"] for o in chart.find(objects, "Deployment")
              for c in o["spec"]["template"]["spec"]["containers"]}
    assert images == {f"ghcr.io/mooncake-lookout/{part}:{app_version}" for part in ("engine", "master")}
    custom = chart.template(sets={"engine.image.tag": '"custom"'})
    assert engine_container(custom)["image"].endswith(":custom")


def test_helm_test_hook_runs_the_check_script_against_the_release(rendered):
    objects = rendered[("default", "1.32.0")]
    pod = chart.one(objects, "Pod", "-test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (container,) = pod["spec"]["containers"]
    assert container["command"][:2] == ["python3", "-c"]
    script = (chart.CHART / "files" / "helm-test" / "check_lookout.py").read_text()
    assert container["command"][2] == script
    env = {e["name"]: e["value"] for e in container["env"]}
    service = chart.one(objects, "Service", "-engine")
    port = service["spec"]["ports"][0]["port"]
    assert env["ENGINE_METRICS_URL"] == (
        f"http://{service['metadata']['name']}.{service['metadata']['namespace']}.svc:{port}/metrics")
    master = chart.one(objects, "Service", "-master")
    assert env["MASTER_HEALTH_URL"].startswith(f"http://{master['metadata']['name']}.")
    assert env["MASTER_HEALTH_URL"].endswith("/health")
    assert not chart.find(rendered[("monitoring-off", "1.32.0")], "Pod")


def test_notes_render_for_every_value_set():
    for name, path in VALUE_SETS.items():
        notes = chart.render_notes([path] if path else [], release="notes")
        assert "vllm:mooncake_lookup_" in notes, name
        assert ("helm test notes -n serving" in notes) == values_of(name)["helmTest"]["enabled"], name
        assert ("external" in notes) == (not values_of(name)["master"]["enabled"]), name


def test_packaged_chart_follows_the_dashboards_link_and_keeps_only_what_templates_read(tmp_path):
    chart.run_helm("package", str(chart.CHART), "--destination", str(tmp_path))
    (archive,) = tmp_path.glob("mooncake-lookout-*.tgz")
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        dashboards = sorted(n.split("files/dashboards/", 1)[1] for n in names if "/files/dashboards/" in n)
        packaged_rules = tar.extractfile("mooncake-lookout/files/dashboards/alerts.rules.yaml").read()
    assert dashboards == sorted([p.name for p in (ROOT / "dashboards").glob("*.json")] + ["alerts.rules.yaml"])
    assert packaged_rules == (ROOT / "dashboards" / "alerts.rules.yaml").read_bytes()
    assert "mooncake-lookout/templates/tests/test-lookout.yaml" in names

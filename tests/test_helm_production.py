"""The chart's production features, rendered by the real helm and checked object by object: HA masters (etcd run by
the chart, an existing etcd, the k8s Lease backend with its RBAC), the master address form every store client
gets, store-only pods, the model-cache PVC, extra volumes and the HF token from a Secret, rollout strategies and
scheduling, the helm test pod's scheduling, the NetworkPolicy for other releases' engines, and the masters' key
lease carried to the engines.

What these objects do at run time is proven elsewhere: tests/test_ha_failover.py runs the rendered master and
etcd flags for real, tests/test_helm_live.py the rendered store pod and master flags, and
tests/test_helm_worker_start.py the engine's lookup server with each rendered config.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from mooncake_lookout.connector.config import LookupConfig

import chart  # helm/tools/chart.py (conftest puts helm/tools on sys.path)

CI = chart.ci_value_sets()
NAMESPACE = "serving"


def render(*files: str, sets: dict[str, str] | None = None) -> list[dict[str, Any]]:
    return chart.template([CI[f] for f in files], sets=sets, namespace=NAMESPACE)


def pod_spec(objects: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    return chart.one(objects, kind, suffix)["spec"]["template"]["spec"]


def container(objects: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    (c,) = pod_spec(objects, kind, suffix)["containers"]
    return c


def flags(c: dict[str, Any]) -> dict[str, str]:
    return dict(a.removeprefix("--").split("=", 1) for a in c["args"] if a.startswith("--") and "=" in a)


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def master_address(objects: list[dict[str, Any]]) -> str:
    return json.loads(chart.one(objects, "ConfigMap", "-engine")["data"]["mooncake.json"])["master_server_address"]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def pod_labels(objects: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, str]:
    return chart.one(objects, kind, suffix)["spec"]["template"]["metadata"]["labels"]


# -- HA masters ---------------------------------------------------------------------------------------------

def test_ha_values_run_two_masters_electing_a_leader_in_the_charts_etcd():
    objects = render("ha")
    master = chart.one(objects, "Deployment", "-master")
    assert master["spec"]["replicas"] == 2
    # One at a time, never two new masters at once, and never a Recreate gap with HA.
    assert master["spec"]["strategy"] == {"type": "RollingUpdate",
                                          "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    f = flags(container(objects, "Deployment", "-master"))
    etcd_service = chart.one(objects, "Service", "-etcd")
    client_port = next(p["port"] for p in etcd_service["spec"]["ports"] if p["name"] == "client")
    endpoint = f"{etcd_service['metadata']['name']}.{NAMESPACE}.svc:{client_port}"
    assert f["enable_ha"] == "true" and f["ha_backend_type"] == "etcd" and f["etcd_endpoints"] == endpoint
    # The leader publishes the address it binds: the pod IP, not 0.0.0.0.
    assert f["rpc_address"] == "$(POD_IP)"
    assert env_of(container(objects, "Deployment", "-master"))["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # Every store client finds the leader in the same etcd, under the same cluster id as the masters.
    assert master_address(objects) == f"etcd://{endpoint}"
    for kind, suffix in (("Deployment", "-engine"), ("Deployment", "-store")):
        assert env_of(container(objects, kind, suffix))["MC_STORE_CLUSTER_ID"] == f["cluster_id"]
    assert flags(container(objects, "Deployment", "-store"))["master_server_address"] == f"etcd://{endpoint}"
    assert f["cluster_id"] == f"{NAMESPACE}-lookout-mooncake-lookout"
    # The masters' PDB keeps one up through voluntary disruptions.
    pdb = chart.one(objects, "PodDisruptionBudget", "-master")["spec"]
    assert pdb["minAvailable"] == 1 and selects(pdb["selector"], pod_labels(objects, "Deployment", "-master"))


def test_the_charts_etcd_is_a_cluster_of_stable_members():
    objects = render("ha")
    sts = chart.one(objects, "StatefulSet", "-etcd")
    members = sts["spec"]["replicas"]
    assert members == 3
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    f = flags(c)
    peers = chart.one(objects, "Service", "-etcd-peer")
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["publishNotReadyAddresses"] is True
    assert sts["spec"]["serviceName"] == peers["metadata"]["name"]
    name = sts["metadata"]["name"]
    domain = f"{peers['metadata']['name']}.{NAMESPACE}.svc"
    expected = ",".join(f"{name}-{i}=http://{name}-{i}.{domain}:2380" for i in range(members))
    assert f["initial-cluster"] == expected and f["initial-cluster-state"] == "new"
    assert f["initial-advertise-peer-urls"] == f"http://$(POD_NAME).{domain}:2380"
    # Members keep their data (a member that lost it cannot rejoin).
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert {"name": "data", "mountPath": "/var/lib/etcd"} in c["volumeMounts"]
    for service in (peers, chart.one(objects, "Service", "-etcd")):
        assert selects({"matchLabels": service["spec"]["selector"]}, sts["spec"]["template"]["metadata"]["labels"])


def test_an_existing_etcd_is_used_by_address_and_none_is_deployed():
    objects = render(sets={"master.replicas": "2", "master.ha.enabled": "true", "master.ha.etcd.deploy": "false",
                           "master.ha.etcd.endpoints": '["etcd-0.infra:2379", "etcd-1.infra:2379"]'})
    assert not chart.find(objects, "StatefulSet") and not chart.find(objects, "Service", "-etcd")
    assert flags(container(objects, "Deployment", "-master"))["etcd_endpoints"] == "etcd-0.infra:2379;etcd-1.infra:2379"
    assert master_address(objects) == "etcd://etcd-0.infra:2379;etcd-1.infra:2379"
    assert not chart.find(objects, "NetworkPolicy", "-etcd")


def test_k8s_backend_gets_its_rbac_and_a_leader_service_engines_use_without_api_access():
    objects = render("ha-k8s")
    f = flags(container(objects, "Deployment", "-master"))
    lease = "mooncake-leader"
    assert f["ha_backend_type"] == "k8s" and f["ha_backend_connstring"] == f"{NAMESPACE}/{lease}"
    spec = pod_spec(objects, "Deployment", "-master")
    sa = chart.one(objects, "ServiceAccount", "-master")["metadata"]["name"]
    assert spec["serviceAccountName"] == sa and spec["automountServiceAccountToken"] is True
    env = env_of(container(objects, "Deployment", "-master"))
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    # What Mooncake's k8s-lease wrapper calls: client-go leader election on a Lease, a watch on it, and a
    # merge patch of the leader's own pod label.
    rules = {(g, r): set(rule["verbs"]) for rule in chart.one(objects, "Role", "-master")["rules"]
             for g in rule["apiGroups"] for r in rule["resources"]}
    assert {"get", "create", "update", "watch"} <= rules[("coordination.k8s.io", "leases")]
    assert {"patch"} <= rules[("", "pods")]
    assert not any("*" in verbs for verbs in rules.values())
    binding = chart.one(objects, "RoleBinding", "-master")
    assert binding["roleRef"]["name"] == chart.one(objects, "Role", "-master")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
    # Engines reach the leader by a Service selecting the label the leader puts on its pod; no token for them.
    leader = chart.one(objects, "Service", "-master-leader")
    assert leader["spec"]["selector"]["mooncake.io/store-role"] == "leader"
    rpc = next(p["port"] for p in leader["spec"]["ports"] if p["name"] == "rpc")
    assert master_address(objects) == f"{leader['metadata']['name']}.{NAMESPACE}.svc:{rpc}"
    assert pod_spec(objects, "Deployment", "-engine")["automountServiceAccountToken"] is False
    assert not chart.find(objects, "StatefulSet")


@pytest.mark.parametrize("sets,message", [
    ({"master.ha.enabled": "true"}, "master.replicas"),
    ({"master.replicas": "2"}, "master.replicas"),
])
def test_master_replicas_must_match_ha(sets, message):
    with pytest.raises(chart.HelmError, match=message):
        render(sets=sets)


def test_without_ha_one_master_is_recreated_and_addressed_by_its_service():
    objects = render()
    master = chart.one(objects, "Deployment", "-master")
    assert master["spec"]["replicas"] == 1 and master["spec"]["strategy"] == {"type": "Recreate"}
    f = flags(container(objects, "Deployment", "-master"))
    assert "enable_ha" not in f and f["rpc_address"] == "0.0.0.0"
    assert "MC_STORE_CLUSTER_ID" not in env_of(container(objects, "Deployment", "-engine"))


# -- the masters' lease, carried to the engines -------------------------------------------------------------

@pytest.mark.parametrize("value,ms", [("10s", 10000), ("500ms", 500), ("2m", 120000), ("1h", 3600000),
                                      ("7000", 7000)])
def test_engine_pods_carry_the_masters_lease_in_milliseconds(value, ms):
    objects = render(sets={"master.defaultKvLeaseTtl": json.dumps(value)})
    annotations = chart.one(objects, "Deployment", "-engine")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["mooncake-lookout/master-lease-ms"] == str(ms)
    assert flags(container(objects, "Deployment", "-master"))["default_kv_lease_ttl"] == value


@pytest.mark.parametrize("lease,ttl_set,ttl", [("10s", None, 5000), ("4s", None, 2000), ("500ms", None, 250),
                                               ("10s", "1200", 1200), ("2s", "1000", 1000)])
def test_held_answers_stay_younger_than_half_the_masters_lease(lease, ttl_set, ttl):
    """A found key is leased for --default_kv_lease_ttl; an answer older than half of it is asked again, so a
    served hit is still leased while it loads. The chart lowers its own default to half the lease (NOTES says
    so); a value set above it fails the render (tests/test_helm_adoption.py)."""
    sets = {"master.defaultKvLeaseTtl": json.dumps(lease)}
    if ttl_set is not None:
        sets["engine.connector.lookup.lookup_answer_ttl_ms"] = ttl_set
    args = container(render(sets=sets), "Deployment", "-engine")["args"]
    extra = json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["lookup_answer_ttl_ms"] == ttl
    assert LookupConfig.from_extra_config(extra).answer_ttl_s == ttl / 1000


# -- store-only pods ----------------------------------------------------------------------------------------

def test_store_pods_lend_memory_to_the_store_and_run_no_model():
    objects = render(sets={"store.enabled": "true", "store.replicas": "3", "store.globalSegmentSize": '"24GB"',
                           "store.resources.limits.memory": '"26Gi"'})
    deployment = chart.one(objects, "Deployment", "-store")
    assert deployment["spec"]["replicas"] == 3
    c = container(objects, "Deployment", "-store")
    assert c["command"] == ["mooncake_client"]
    assert c["image"] == container(objects, "Deployment", "-master")["image"]  # the master image carries it
    f = flags(c)
    assert f["global_segment_size"] == "24GB" and f["master_server_address"] == master_address(objects)
    assert f["metadata_server"] == "P2PHANDSHAKE" and f["host"] == "$(POD_IP)"
    assert f["enable_http_server"] == "true"
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert "nvidia.com/gpu" not in json.dumps(c["resources"])
    assert c["resources"]["limits"]["memory"] == "26Gi"
    pdb = chart.one(objects, "PodDisruptionBudget", "-store")["spec"]
    assert selects(pdb["selector"], pod_labels(objects, "Deployment", "-store"))
    # Store pods are store clients: the master's policy lets them in.
    policy = chart.one(objects, "NetworkPolicy", "-master")["spec"]
    rpc_from = next(r["from"] for r in policy["ingress"] if r["ports"][0]["port"] == "rpc")
    assert any(selects(peer["podSelector"], pod_labels(objects, "Deployment", "-store")) for peer in rpc_from)
    assert not chart.find(render(), "Deployment", "-store")  # off by default


# -- volumes and secrets ------------------------------------------------------------------------------------

def test_model_cache_pvc_is_created_kept_and_mounted_at_hf_home():
    objects = render("async-budget")
    pvc = chart.one(objects, "PersistentVolumeClaim", "-model-cache")
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "200Gi"
    c = container(objects, "Deployment", "-engine")
    mount = next(m for m in c["volumeMounts"] if m["name"] == "model-cache")
    assert mount["mountPath"] == env_of(c)["HF_HOME"]
    volume = next(v for v in pod_spec(objects, "Deployment", "-engine")["volumes"] if v["name"] == "model-cache")
    assert volume["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    # An existing claim is used as it is, none created.
    objects = render(sets={"engine.modelCache.enabled": "true", "engine.modelCache.existingClaim": '"models"'})
    assert not chart.find(objects, "PersistentVolumeClaim")
    volume = next(v for v in pod_spec(objects, "Deployment", "-engine")["volumes"] if v["name"] == "model-cache")
    assert volume["persistentVolumeClaim"]["claimName"] == "models"
    assert not chart.find(render(), "PersistentVolumeClaim")


def test_extra_volumes_and_mounts_reach_the_engine():
    volume = {"name": "templates", "configMap": {"name": "chat-templates"}}
    mount = {"name": "templates", "mountPath": "/templates", "readOnly": True}
    objects = render(sets={"engine.extraVolumes": json.dumps([volume]),
                           "engine.extraVolumeMounts": json.dumps([mount])})
    assert volume in pod_spec(objects, "Deployment", "-engine")["volumes"]
    assert mount in container(objects, "Deployment", "-engine")["volumeMounts"]


def test_hf_token_comes_from_a_secret_never_a_value():
    objects = render("async-budget")
    env = env_of(container(objects, "Deployment", "-engine"))
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert "HF_TOKEN" not in env_of(container(render(), "Deployment", "-engine"))
    schema = json.loads((chart.CHART / "values.schema.json").read_text())
    assert set(schema["properties"]["engine"]["properties"]["hfToken"]["properties"]) == {"secretName", "secretKey"}


# -- rollouts and scheduling --------------------------------------------------------------------------------

def test_default_engine_rollout_needs_no_spare_gpu():
    strategy = chart.one(render(), "Deployment", "-engine")["spec"]["strategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    # With a spare GPU: surge one (helm merges the map with the default's maxUnavailable).
    surge = render(sets={"engine.strategy.rollingUpdate.maxSurge": "1"})
    assert chart.one(surge, "Deployment", "-engine")["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": 1, "maxUnavailable": 1}


def test_priority_runtime_class_and_spread_reach_the_pods():
    objects = render("async-budget")
    spec = pod_spec(objects, "Deployment", "-engine")
    assert spec["priorityClassName"] == "inference-high" and spec["runtimeClassName"] == "nvidia"
    (spread,) = spec["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    # No labelSelector given: the engine pods' own labels, so the constraint counts engines only.
    assert spread["labelSelector"] == {"matchLabels": {
        k: v for k, v in pod_labels(objects, "Deployment", "-engine").items()
        if k in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component")}}
    ha = render("ha")
    (spread,) = pod_spec(ha, "Deployment", "-master")["topologySpreadConstraints"]
    assert selects(spread["labelSelector"], pod_labels(ha, "Deployment", "-master"))
    assert not selects(spread["labelSelector"], pod_labels(ha, "Deployment", "-engine"))
    assert pod_spec(ha, "Deployment", "-master")["priorityClassName"] == "mooncake-store"
    plain = pod_spec(render(), "Deployment", "-engine")
    assert not {"priorityClassName", "runtimeClassName", "topologySpreadConstraints"} & set(plain)


def test_helm_test_pod_tolerates_what_the_engine_does_unless_told_otherwise():
    objects = render("async-budget")
    test_pod = chart.one(objects, "Pod", "-test")["spec"]
    engine = pod_spec(objects, "Deployment", "-engine")
    assert test_pod["tolerations"] == engine["tolerations"] and test_pod["nodeSelector"] == engine["nodeSelector"]
    own = render("async-budget", sets={"helmTest.tolerations": '[{"key": "ci", "operator": "Exists"}]',
                                       "helmTest.nodeSelector": '{"pool": "cpu"}'})
    test_pod = chart.one(own, "Pod", "-test")["spec"]
    assert test_pod["tolerations"] == [{"key": "ci", "operator": "Exists"}]
    assert test_pod["nodeSelector"] == {"pool": "cpu"}


# -- sharing a master with other releases -------------------------------------------------------------------

def test_network_policy_admits_other_releases_engines_to_master_and_etcd():
    objects = render("ha")
    extra = chart.load_values()  # defaults have none
    assert extra["networkPolicy"]["extraClients"] == []
    (peer,) = [p for p in _rpc_peers(chart.one(objects, "NetworkPolicy", "-master")) if "namespaceSelector" in p]
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "team-b"}}
    assert peer["podSelector"] == {"matchLabels": {"app.kubernetes.io/part-of": "mooncake-lookout"}}
    # Another release's engine pod (different instance label, other namespace) matches that peer.
    other_engine = {**pod_labels(objects, "Deployment", "-engine"), "app.kubernetes.io/instance": "other"}
    assert selects(peer["podSelector"], other_engine)
    etcd_policy = chart.one(objects, "NetworkPolicy", "-etcd")["spec"]
    client_from = next(r["from"] for r in etcd_policy["ingress"] if r["ports"][0]["port"] == "client")
    assert peer in client_from
    for suffix in ("-master", "-engine", "-store"):
        assert any(selects(p.get("podSelector", {}), pod_labels(objects, "Deployment", suffix))
                   for p in client_from if "namespaceSelector" not in p), suffix
    peer_from = next(r["from"] for r in etcd_policy["ingress"] if r["ports"][0]["port"] == "peer")
    assert [selects(p["podSelector"], pod_labels(objects, "StatefulSet", "-etcd")) for p in peer_from] == [True]


def _rpc_peers(policy: dict[str, Any]) -> list[dict[str, Any]]:
    return next(r["from"] for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == "rpc")

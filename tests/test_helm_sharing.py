"""One Mooncake store shared by three releases, rendered as each would be installed, and the NetworkPolicies of all
three read together (helm/tools/netpol.py): every store client reaches what it must, and no more.

- ``lookout`` in namespace ``store`` (ci/ha-values.yaml): HA masters, the chart's etcd, store pods; its engines lend
  a little memory.
- ``model-b`` in ``team-b`` (ci/external-ha-master-values.yaml): engines that lend nothing (standalone-store).
- ``model-c`` in ``team-b`` (ci/shared-store-lender-values.yaml): engines that lend memory to the shared store.

Mooncake's transfer engine connects from the client that reads or writes to the pod that holds the segment: a pod
that lends memory must admit every client of the store; one that lends nothing need admit none (a real master and
clients on loopback show it: tests/test_helm_live.py, test_a_client_that_lends_nothing_is_never_connected_to).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

import netpol  # helm/tools/netpol.py

import chart  # helm/tools/chart.py (conftest puts helm/tools on sys.path)

RELEASES = {"lookout": ("store", "ha"), "model-b": ("team-b", "external-ha-master"),
            "model-c": ("team-b", "shared-store-lender")}
STORE_CLIENTS = ("engine", "store")
COMPONENT = "app.kubernetes.io/component"


@pytest.fixture(scope="module")
def releases() -> dict[str, list[dict[str, Any]]]:
    return {name: chart.template([chart.ci_value_sets()[ci]], release=name, namespace=namespace)
            for name, (namespace, ci) in RELEASES.items()}


def by_release(releases: dict[str, list[dict[str, Any]]]) -> dict[str, list[netpol.Pod]]:
    return {name: netpol.pods(objects) for name, objects in releases.items()}


def component(pods: list[netpol.Pod], name: str) -> list[netpol.Pod]:
    return [p for p in pods if p.labels[COMPONENT] == name]


def lends(objects: list[dict[str, Any]], pod: netpol.Pod) -> bool:
    """Whether a store client pod holds a segment others read: store pods always, engines in embedded mode."""
    if pod.labels[COMPONENT] == "store":
        return True
    mooncake = json.loads(chart.one(objects, "ConfigMap", "-engine")["data"]["mooncake.json"])
    return mooncake["mode"] == "embedded" and mooncake["global_segment_size"] not in (0, "0")


def transfer_ports(objects: list[dict[str, Any]], pod: netpol.Pod) -> list[int]:
    """The ports Mooncake listens on in that pod: the pinned range's ends, and a store pod's --port."""
    (container,) = chart.one(objects, "Deployment", pod.name)["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    ports = [int(env["MC_MIN_RPC_PORT"]), int(env["MC_MAX_RPC_PORT"])]
    return ports + ([pod.ports["transfer"]] if "transfer" in pod.ports else [])


def service_target(objects: list[dict[str, Any]], host: str, port: int) -> tuple[list[netpol.Pod], int]:
    """The pods behind ``<service>.<namespace>.svc:port`` and the container port the connection lands on."""
    name, namespace = host.split(".")[:2]
    service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == name
                   and o["metadata"]["namespace"] == namespace)
    (svc_port,) = [p for p in service["spec"]["ports"] if p["port"] == port]
    pods = [p for p in netpol.pods(objects) if p.namespace == namespace
            and netpol.selects({"matchLabels": service["spec"]["selector"]}, p.labels)]
    assert pods, f"{host} selects no pod"
    return pods, pods[0].ports[svc_port["targetPort"]]


def test_the_consumers_take_the_store_releases_address_and_cluster_id(releases):
    store = releases["lookout"]
    etcd = chart.one(store, "Service", "-etcd")
    address = f"etcd://{etcd['metadata']['name']}.store.svc:{etcd['spec']['ports'][0]['port']}"
    master_env = {e["name"]: e.get("value") for e in chart.one(store, "Deployment", "-engine")["spec"]["template"][
        "spec"]["containers"][0]["env"]}
    for name in ("model-b", "model-c"):
        objects = releases[name]
        assert not chart.find(objects, "Deployment", "-master")
        mooncake = json.loads(chart.one(objects, "ConfigMap", "-engine")["data"]["mooncake.json"])
        assert mooncake["master_server_address"] == address, name
        env = {e["name"]: e.get("value") for e in chart.one(objects, "Deployment", "-engine")["spec"]["template"][
            "spec"]["containers"][0]["env"]}
        assert env["MC_STORE_CLUSTER_ID"] == master_env["MC_STORE_CLUSTER_ID"], name
    assert json.loads(chart.one(releases["model-b"], "ConfigMap", "-engine")["data"]["mooncake.json"])[
        "mode"] == "standalone-store"


def test_every_store_client_reaches_the_masters_and_etcd(releases):
    pods = by_release(releases)
    policies = [o for objects in releases.values() for o in objects]
    store = releases["lookout"]
    masters, etcd = component(pods["lookout"], "master"), component(pods["lookout"], "etcd")
    clients = [p for name in RELEASES for c in STORE_CLIENTS for p in component(pods[name], c)]
    assert {p.labels["app.kubernetes.io/instance"] for p in clients} == set(RELEASES)
    for client in clients:
        for master in masters:
            assert netpol.admits(policies, client, master, master.ports["rpc"]), client.name
        for member in etcd:
            assert netpol.admits(policies, client, member, member.ports["client"]), client.name
    # The fence holds: a pod of another namespace is not let in.
    stranger = netpol.Pod("x", "elsewhere", dict(clients[0].labels))
    assert not netpol.admits(policies, stranger, masters[0], masters[0].ports["rpc"])
    assert chart.find(store, "NetworkPolicy", "-etcd")


def test_every_pod_that_lends_memory_admits_every_client_of_the_store_on_its_transfer_ports(releases):
    """What the chart got wrong: a consumer's engines lent memory but admitted only their own release's pods."""
    pods = by_release(releases)
    policies = [o for objects in releases.values() for o in objects]
    clients = [p for name in RELEASES for c in STORE_CLIENTS for p in component(pods[name], c)]
    lenders = [(name, p) for name in RELEASES for p in component(pods[name], "engine") + component(pods[name], "store")
               if lends(releases[name], p)]
    assert {name for name, _ in lenders} == {"lookout", "model-c"}  # model-b lends nothing
    for name, lender in lenders:
        for port in transfer_ports(releases[name], lender):
            for client in clients:
                assert netpol.admits(policies, client, lender, port), (client.name, lender.name, port)
    # The release that lends nothing keeps its transfer ports to itself: nobody needs them.
    (plain,) = component(pods["model-b"], "engine")
    (store_engine,) = component(pods["lookout"], "engine")
    assert not netpol.admits(policies, store_engine, plain, transfer_ports(releases["model-b"], plain)[0])


def test_each_releases_helm_test_checks_a_port_its_store_admits(releases):
    """A consumer's test pod used to check the store release's master metrics port, which admits Prometheus only."""
    pods = by_release(releases)
    policies = [o for objects in releases.values() for o in objects]
    everything = [o for objects in releases.values() for o in objects]
    for name in RELEASES:
        (test_pod,) = component(pods[name], "test")
        (check,) = chart.one(releases[name], "Pod", "-test")["spec"]["containers"]
        env = {e["name"]: e["value"] for e in check["env"]}
        if env["MASTER_HEALTH_URL"]:
            host, port = env["MASTER_HEALTH_URL"].split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        else:  # the RPC address, or the first etcd endpoint of an etcd:// address
            host, port = env["MASTER_ADDRESS"].split("://")[-1].split(";")[0].rsplit(":", 1)
        targets, container_port = service_target(everything, host, int(port))
        for target in targets:
            assert netpol.admits(policies, test_pod, target, container_port), (name, host, port)


def test_the_policy_reader_follows_kubernetes_rules():
    """The control for the reader itself: named ports, port ranges, namespace-wide peers, no policy = open."""
    engine = netpol.Pod("e", "a", {"app": "e"}, {"http": 8000})
    peer = netpol.Pod("p", "b", {"app": "p"})
    policy = {"kind": "NetworkPolicy", "metadata": {"namespace": "a"}, "spec": {
        "podSelector": {"matchLabels": {"app": "e"}}, "policyTypes": ["Ingress"], "ingress": [
            {"from": [{"namespaceSelector": {"matchLabels": {netpol.NAMESPACE_LABEL: "b"}}}],
             "ports": [{"port": 15000, "endPort": 15010, "protocol": "TCP"}, {"port": "http"}]}]}}
    assert netpol.admits([policy], peer, engine, 15005) and netpol.admits([policy], peer, engine, 8000)
    assert not netpol.admits([policy], peer, engine, 15011)
    assert not netpol.admits([policy], netpol.Pod("q", "a", {"app": "p"}), engine, 15005)  # podSelector-less peer
    assert netpol.admits([], peer, engine, 1)  # no policy selects it: open


def test_notes_flag_a_consumer_that_lends_memory_no_other_client_may_read():
    lender_alone = chart.render_notes([chart.ci_value_sets()["external-master"]])
    assert "NOTE: these engines lend memory to a store whose master runs elsewhere" in lender_alone
    for ci in ("external-ha-master", "shared-store-lender", "ha"):  # lends nothing, admits the others, runs the master
        assert "NOTE: these engines lend memory" not in chart.render_notes([chart.ci_value_sets()[ci]]), ci

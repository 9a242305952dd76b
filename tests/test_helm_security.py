"""The chart's trust boundaries, rendered by the real helm: CURVE keys from a Secret for a TCP lookup channel (and
read by the real connector config from the paths the chart gives), the refusal of an open TCP lookup address, the
Mooncake transfer ports pinned and fenced to the release's store clients, and the master's admin/metrics port
open to the Prometheus pods only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.curve import create_key_files

import chart  # helm/tools/chart.py (conftest puts helm/tools on sys.path)

TCP = "tcp://0.0.0.0:5570"


def _engine(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = chart.one(objects, "Deployment", "-engine")["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def _extra(container: dict[str, Any]) -> dict[str, Any]:
    args = container["args"]
    return json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container["env"]}


def _labels(objects: list[dict[str, Any]], suffix: str) -> dict[str, str]:
    return chart.one(objects, "Deployment", suffix)["spec"]["template"]["metadata"]["labels"]


def _selects(peer: dict[str, Any], labels: dict[str, str]) -> bool:
    selector = peer.get("podSelector", {}).get("matchLabels", {})
    return "namespaceSelector" not in peer and bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def test_curve_keys_mount_from_a_secret_where_the_connector_reads_them(tmp_path: Path) -> None:
    mount = tmp_path / "curve"
    objects = chart.template(sets={"engine.connector.lookup.lookup_server_address": json.dumps(TCP),
                                   "engine.connector.curve.secretName": '"lookout-curve"',
                                   "engine.connector.curve.mountPath": json.dumps(str(mount))})
    pod, container = _engine(objects)
    (volume,) = [v for v in pod["volumes"] if v["name"] == "lookup-curve"]
    assert volume["secret"]["secretName"] == "lookout-curve" and volume["secret"]["defaultMode"] == 0o440
    (mounted,) = [m for m in container["volumeMounts"] if m["name"] == "lookup-curve"]
    assert mounted == {"name": "lookup-curve", "mountPath": str(mount), "readOnly": True}
    # Lay out a real Secret's files as the kubelet would from the volume's items, then let the connector read them.
    keys = tmp_path / "secret"
    create_key_files(str(keys), "server")
    create_key_files(str(keys), "client")
    for item in volume["secret"]["items"]:
        (mount / item["path"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(keys / item["key"], mount / item["path"])
    config = LookupConfig.from_extra_config(_extra(container))
    client, server = config.client_curve(), config.server_curve()
    assert client is not None and server is not None
    assert client.server_public == server.public, "the client must trust the server the worker runs"
    assert config.lookup_server_address == TCP


def test_an_open_tcp_lookup_address_needs_curve() -> None:
    with pytest.raises(chart.HelmError, match="beyond loopback without CURVE"):
        chart.template(sets={"engine.connector.lookup.lookup_server_address": json.dumps(TCP)})
    loopback = chart.template(sets={"engine.connector.lookup.lookup_server_address": '"tcp://127.0.0.1:5570"'})
    assert _extra(_engine(loopback)[1])["lookup_curve_server_secret_key"] == ""
    with pytest.raises(chart.HelmError, match="leave it empty"):
        chart.template(sets={"engine.connector.curve.secretName": '"lookout-curve"',
                             "engine.connector.lookup.lookup_curve_allowed_clients": '"/keys/allowed"'})


def test_the_master_admin_port_admits_only_prometheus_pods_and_the_test_pod() -> None:
    objects = chart.template()
    ingress = chart.one(objects, "NetworkPolicy", "-master")["spec"]["ingress"]
    (metrics,) = [rule["from"] for rule in ingress if rule["ports"][0]["port"] == "metrics"]
    prometheus = [p for p in metrics if "namespaceSelector" in p]
    assert prometheus == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                           "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]
    test_pod = chart.one(objects, "Pod", "-test")["metadata"]["labels"]
    assert [_selects(p, test_pod) for p in metrics if "namespaceSelector" not in p] == [True]


def test_transfer_ports_are_pinned_and_open_only_to_the_release_store_clients() -> None:
    objects = chart.template([chart.CI_VALUES / "curve-values.yaml"])  # store pods, ports 16000-16100
    engine, store, master = (_labels(objects, s) for s in ("-engine", "-store", "-master"))
    for suffix in ("-engine", "-store"):
        container = chart.one(objects, "Deployment", suffix)["spec"]["template"]["spec"]["containers"][0]
        assert {k: v for k, v in _env(container).items() if "RPC_PORT" in k} == {
            "MC_MIN_RPC_PORT": "16000", "MC_MAX_RPC_PORT": "16100"}
    policies = {suffix: chart.one(objects, "NetworkPolicy", suffix)["spec"] for suffix in ("-engine", "-store")}
    for suffix, labels in (("-engine", engine), ("-store", store)):
        spec = policies[suffix]
        assert spec["podSelector"]["matchLabels"].items() <= labels.items() and spec["policyTypes"] == ["Ingress"]
        (transfer,) = [r for r in spec["ingress"] if any(p.get("endPort") for p in r["ports"])]
        assert {"port": 16000, "endPort": 16100, "protocol": "TCP"} in transfer["ports"]
        assert [_selects(p, engine) or _selects(p, store) for p in transfer["from"]] == [True, True]
        assert not any(_selects(p, master) for p in transfer["from"])
    (http,) = [r for r in policies["-engine"]["ingress"] if r["ports"] == [{"port": "http", "protocol": "TCP"}]]
    gateway = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
    assert http["from"][0] == gateway and len(http["from"]) == 3  # the gateway, Prometheus, the test pod
    (store_http,) = [r for r in policies["-store"]["ingress"] if r["ports"] == [{"port": "http", "protocol": "TCP"}]]
    assert [set(p) for p in store_http["from"]] == [{"namespaceSelector", "podSelector"}]  # Prometheus only


def test_defaults_leave_the_api_open_and_switches_turn_the_fences_off() -> None:
    objects = chart.template()
    ingress = chart.one(objects, "NetworkPolicy", "-engine")["spec"]["ingress"]
    assert {"ports": [{"port": "http", "protocol": "TCP"}]} in ingress  # vLLM's API: anyone
    assert not chart.find(objects, "NetworkPolicy", "-store")  # no store pods
    assert _env(_engine(objects)[1])["MC_MAX_RPC_PORT"] == "17000"
    off = chart.template(sets={"networkPolicy.storeClients": "false"})
    assert {p["metadata"]["name"].rsplit("-", 1)[1] for p in chart.find(off, "NetworkPolicy")} == {"master"}
    assert not chart.find(chart.template(sets={"networkPolicy.enabled": "false"}), "NetworkPolicy")

"""Which rendered NetworkPolicies let one pod reach another on a port: Kubernetes' ingress rules, evaluated on the
chart's rendered objects (no cluster and no CNI run here; this reads the policies as the API defines them).

A pod is a :class:`Pod`: its namespace, labels and named container ports. A policy isolates the pods its
``podSelector`` picks in its namespace for ingress; such a pod admits a peer on a port when some rule of some policy
that selects it names the peer (``podSelector`` in the policy's namespace, ``namespaceSelector`` with or without a
``podSelector``; no ``from``: anyone) and the port (a number, a number with ``endPort``, or a container port's name;
no ``ports``: every port). A pod no policy selects admits everyone. ``ipBlock`` peers are not modelled (the chart
renders none): a policy that has one fails the check instead of being read wrongly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # set by Kubernetes on every namespace


@dataclass(frozen=True)
class Pod:
    """What a policy sees of a pod."""

    name: str
    namespace: str
    labels: dict[str, str]
    ports: dict[str, int] = field(default_factory=dict)  # container port name -> number


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels and matchExpressions) against labels; {} selects everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        present = key in labels
        ok = {"In": present and labels[key] in values, "NotIn": not (present and labels[key] in values),
              "Exists": present, "DoesNotExist": not present}[op]
        if not ok:
            return False
    return True


def _peer_admits(peer: dict[str, Any], policy_namespace: str, source: Pod) -> bool:
    assert "ipBlock" not in peer, f"ipBlock peers are not modelled: {peer}"
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], {NAMESPACE_LABEL: source.namespace}):
            return False
    elif source.namespace != policy_namespace:
        return False
    return selects(peer.get("podSelector"), source.labels)


def _port_admits(rule_port: dict[str, Any], target: Pod, port: int) -> bool:
    value = rule_port.get("port")
    if value is None:
        return True
    if isinstance(value, str):
        return target.ports.get(value) == port
    return value <= port <= rule_port.get("endPort", value)


def admits(policies: Iterable[dict[str, Any]], source: Pod, target: Pod, port: int) -> bool:
    """True if ``source`` may open a TCP connection to ``target`` on ``port`` under ``policies`` (all rendered
    NetworkPolicies; those of other namespaces, or that select other pods, do not apply)."""
    applying = [p for p in policies if p["kind"] == "NetworkPolicy" and p["metadata"]["namespace"] == target.namespace
                and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                and selects(p["spec"]["podSelector"], target.labels)]
    if not applying:
        return True
    for policy in applying:
        for rule in policy["spec"].get("ingress") or []:
            peers = rule.get("from")
            if peers and not any(_peer_admits(peer, target.namespace, source) for peer in peers):
                continue
            ports = [p for p in rule.get("ports") or [] if p.get("protocol", "TCP") == "TCP"]
            if not rule.get("ports") or any(_port_admits(p, target, port) for p in ports):
                return True
    return False


def pods(objects: Iterable[dict[str, Any]]) -> list[Pod]:
    """The pods of rendered Deployments, StatefulSets and bare Pods (one per template, named after its owner)."""
    out = []
    for o in objects:
        if o["kind"] not in ("Deployment", "StatefulSet", "Pod"):
            continue
        meta, spec = (o["metadata"], o["spec"]) if o["kind"] == "Pod" else (
            o["spec"]["template"]["metadata"], o["spec"]["template"]["spec"])
        ports = {p["name"]: p["containerPort"] for c in spec["containers"] for p in c.get("ports", []) if "name" in p}
        out.append(Pod(o["metadata"]["name"], o["metadata"]["namespace"], dict(meta["labels"]), ports))
    return out


__all__ = ["NAMESPACE_LABEL", "Pod", "admits", "pods", "selects"]

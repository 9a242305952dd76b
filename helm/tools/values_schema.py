"""Build the chart's values.schema.json so that it cannot drift from values.yaml or connector/config.py.

Three sources, each owning one thing:
- this module: the shape of the values (types, limits, enums, which maps are free-form);
- values.yaml: defaults and descriptions (the ``# --`` comment above each key);
- ``mooncake_lookout.connector.config.KEYS``: the lookup keys, their types and meanings.

Run ``python helm/tools/values_schema.py`` to rewrite the schema, ``--check`` to fail if it is stale.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from mooncake_lookout.connector.config import KEYS
from mooncake_lookout.connector.transport.names import TRANSPORTS

CHART = Path(__file__).resolve().parents[1] / "mooncake-lookout"
VALUES = CHART / "values.yaml"
SCHEMA = CHART / "values.schema.json"

# Numeric limits of the lookup keys, mirroring each Key's check (a test compares them value by value).
LOOKUP_LIMITS: dict[str, dict[str, Any]] = {
    "lookup_wait_us": {"minimum": 0, "maximum": 100_000},
    "lookup_wait_auto_share": {"exclusiveMinimum": 0, "maximum": 0.9},
    "lookup_timeout_ms": {"exclusiveMinimum": 0, "maximum": 60_000},
    "lookup_block_ms": {"exclusiveMinimum": 0, "maximum": 60_000},
    "lookup_max_pending": {"minimum": 1, "maximum": 1_000_000},
    "lookup_max_held": {"minimum": 1, "maximum": 10_000_000},
    "lookup_answer_ttl_ms": {"exclusiveMinimum": 0, "maximum": 3_600_000},
    "lookup_prefix_cache_blocks": {"minimum": 0, "maximum": 100_000_000},
    "lookup_prefix_cache_confirm_ms": {"minimum": 0, "maximum": 60_000},
    "lookup_reset_timeout_s": {"exclusiveMinimum": 0, "maximum": 3600},
    "lookup_breaker_failures": {"minimum": 1, "maximum": 10_000},
    "lookup_breaker_failure_rate": {"exclusiveMinimum": 0, "maximum": 1},
    "lookup_breaker_window_s": {"exclusiveMinimum": 0, "maximum": 3600},
    "lookup_breaker_cooldown_s": {"exclusiveMinimum": 0, "maximum": 3600},
    "lookup_transport": {"enum": list(TRANSPORTS)},
    # One line each: "not" a newline anywhere, since "$" also matches before a final newline in some engines.
    "lookup_server_address": {"pattern": "^((ipc|tcp)://.*)?$", "not": {"pattern": "\\n"}},
    "lookup_curve_server_public_key": {"pattern": "^(/.*)?$", "not": {"pattern": "\\n"}},
    "lookup_curve_client_secret_key": {"pattern": "^(/.*)?$", "not": {"pattern": "\\n"}},
    "lookup_curve_server_secret_key": {"pattern": "^(/.*)?$", "not": {"pattern": "\\n"}},
    "lookup_curve_allowed_clients": {"pattern": "^(/.*)?$", "not": {"pattern": "\\n"}},
}
JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}
SIZE = {"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)? ?([GMK]?B|[gmk]?b)?$"}
DURATION = {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)?$"}
PROM_DURATION = {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"}

FREE_MAP = {"type": "object"}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
LIST = {"type": "array"}
STRINGS = {"type": "array", "items": {"type": "string"}}
PULL_POLICY = {"type": "string", "enum": ["Always", "IfNotPresent", "Never"]}
SERVICE_TYPE = {"type": "string", "enum": ["ClusterIP", "NodePort", "LoadBalancer"]}
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
DNS_LABEL = {"type": "string", "pattern": "^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$", "maxLength": 63}
# An object name (DNS subdomain), or empty for "none".
K8S_NAME = {"type": "string", "pattern": "^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$", "maxLength": 253}
SECRET_KEY = {"type": "string", "pattern": "^[-._a-zA-Z0-9]+$", "maxLength": 253}  # a key of a Secret's data
HOST_PORT = {"type": "string", "pattern": "^[^:/;\\s]+:[0-9]{1,5}$"}
# What a store client takes as its master: host:port, or etcd://host:port[;host:port...] for HA masters.
MASTER_ADDRESS = {"type": "string",
                  "pattern": "^(([^:/;\\s]+:[0-9]{1,5})|(etcd://[^:/;\\s]+:[0-9]{1,5}(;[^:/;\\s]+:[0-9]{1,5})*))?$"}
QUANTITY = {"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)?([KMGTPE]i?)?$"}
EXTENDED_RESOURCE = "^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$"  # e.g. rdma/hca
# The Prometheus Operator's ScrapeProtocol enum (monitoring.coreos.com/v1, spelled as its CRD spells it).
SCRAPE_PROTOCOLS = {"type": "array", "uniqueItems": True, "items": {"type": "string", "enum": [
    "PrometheusText0.0.4", "PrometheusText1.0.0", "OpenMetricsText0.0.1", "OpenMetricsText1.0.0", "PrometheusProto"]}}


def obj(**props: dict[str, Any]) -> dict[str, Any]:
    """A strict object: only the listed properties, all of them required."""
    return {"type": "object", "additionalProperties": False, "required": sorted(props), "properties": props}


def positive(maximum: int | None = None) -> dict[str, Any]:
    """A positive integer, optionally bounded."""
    schema: dict[str, Any] = {"type": "integer", "minimum": 1}
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


def image() -> dict[str, Any]:
    return obj(repository={"type": "string", "minLength": 1}, tag={"type": "string"}, pullPolicy=PULL_POLICY)


def pdb(field: str, minimum: int) -> dict[str, Any]:
    """A PodDisruptionBudget switch and its one bound (maxUnavailable or minAvailable)."""
    return obj(enabled={"type": "boolean"}, **{field: {"type": "integer", "minimum": minimum}})


# The scheduling fields every workload offers, passed to the pod spec as they are.
SCHEDULING = {"nodeSelector": STRING_MAP, "tolerations": LIST, "affinity": FREE_MAP,
              "topologySpreadConstraints": LIST, "priorityClassName": K8S_NAME}


def probe() -> dict[str, Any]:
    return obj(periodSeconds=positive(3600), timeoutSeconds=positive(3600), failureThreshold=positive(10_000))


def lookup_schema() -> dict[str, Any]:
    """The lookup keys: one property per ``KEYS`` entry, typed by its kind, limited as its check."""
    props: dict[str, Any] = {}
    for key in KEYS:
        prop: dict[str, Any] = {"type": JSON_TYPES[key.kind]}
        if key.kind in (int, float) or key.name in LOOKUP_LIMITS:
            if key.name not in LOOKUP_LIMITS:
                raise SystemExit(f"{key.name}: add its limits to LOOKUP_LIMITS in {__file__}")
            prop.update(LOOKUP_LIMITS[key.name])
        if key.words:  # a number, or one of its words (lookup_wait_us: auto)
            prop = {"anyOf": [prop, {"type": "string", "enum": list(key.words)}]}
        prop["description"] = re.sub(r"`([^`]*)`", r"\1", key.doc)
        props[key.name] = prop
    return obj(**props)


def transfer_ports() -> dict[str, Any]:
    """Mooncake's transfer-engine port range: min <= max (JSON schema cannot compare two values; the NetworkPolicy's
    endPort, checked by Kubernetes, can: a reversed range fails there)."""
    return obj(min=PORT, max=PORT)


def shape() -> dict[str, Any]:
    """The shape of values.yaml (descriptions and defaults are filled in from values.yaml)."""
    engine = obj(
        replicas={"type": "integer", "minimum": 0},
        strategy=FREE_MAP,
        image=image(),
        model={"type": "string", "minLength": 1},
        servedModelName={"type": "string"},
        port=PORT,
        tensorParallelSize=positive(1024),
        pipelineParallelSize=positive(1024),
        dataParallelSize=positive(1024),
        extraArgs=STRINGS,
        env=LIST,
        hfToken=obj(secretName=K8S_NAME, secretKey={"type": "string", "minLength": 1}),
        hashSeed=obj(secretName=K8S_NAME, secretKey=SECRET_KEY),
        modelCache=obj(
            enabled={"type": "boolean"}, existingClaim=K8S_NAME, size=QUANTITY, storageClassName=K8S_NAME,
            accessModes={"type": "array", "minItems": 1, "uniqueItems": True, "items": {
                "type": "string", "enum": ["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"]}},
        ),
        extraVolumes=LIST,
        extraVolumeMounts=LIST,
        resources=FREE_MAP,
        memoryHeadroom=QUANTITY,
        shm=obj(enabled={"type": "boolean"},
                sizeLimit={"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)?([KMGT]i?)?$"}),
        connector=obj(
            name={"type": "string", "minLength": 1},
            kvRole={"type": "string", "enum": ["kv_both", "kv_producer", "kv_consumer"]},
            lookup=lookup_schema(),
            curve=obj(secretName=K8S_NAME, mountPath={"type": "string", "pattern": "^/.+"},
                      serverPublicKey=SECRET_KEY, serverSecretKey=SECRET_KEY, clientPublicKey=SECRET_KEY,
                      clientSecretKey=SECRET_KEY),
            extraConfig={
                "type": "object",
                "propertyNames": {"anyOf": [{"not": {"pattern": "^lookup_"}}, {"const": "lookup_rpc_port"}]},
            },
        ),
        mooncake=obj(
            mode={"type": "string", "enum": ["embedded", "standalone-store"]},
            metadataServer={"type": "string", "minLength": 1},
            protocol={"type": "string", "enum": ["tcp", "rdma"]},
            deviceName={"type": "string"},
            globalSegmentSize=SIZE,
            localBufferSize=SIZE,
        ),
        tracing=obj(
            otlpEndpoint={"type": "string", "pattern": "^(https?://.+)?$"},
            exporter={"type": "string", "enum": ["otlp"]},
            # Only the OTLP/HTTP exporter is installed with the package (pyproject.toml): grpc would turn
            # lookup tracing off at start-up.
            protocol={"type": "string", "enum": ["http/protobuf"]},
            sampler={"type": "string", "enum": [
                "always_on", "always_off", "traceidratio", "parentbased_always_on",
                "parentbased_always_off", "parentbased_traceidratio"]},
            samplerArg={"type": "string"},
        ),
        probes=obj(startup=probe(), liveness=probe(), readiness=probe()),
        preStopSleepSeconds={"type": "integer", "minimum": 0, "maximum": 3600},
        lifecycle=FREE_MAP,  # a Kubernetes Lifecycle (postStart, preStop)
        service=obj(type=SERVICE_TYPE, annotations=STRING_MAP),
        pdb=pdb("maxUnavailable", 1),
        podSecurityContext=FREE_MAP,
        securityContext=FREE_MAP,
        terminationGracePeriodSeconds={"type": "integer", "minimum": 0},
        podAnnotations=STRING_MAP,
        podLabels=STRING_MAP,
        **SCHEDULING,
        runtimeClassName=K8S_NAME,
    )
    etcd = obj(
        deploy={"type": "boolean"},
        endpoints={"type": "array", "items": HOST_PORT},
        replicas={"type": "integer", "enum": [1, 3, 5, 7]},
        image=image(),
        clientPort=PORT,
        peerPort=PORT,
        resources=FREE_MAP,
        persistence=obj(enabled={"type": "boolean"}, size=QUANTITY, storageClassName=K8S_NAME),
        quotaBackendBytes=QUANTITY,
        autoCompactionRetention={"type": "string", "pattern": "^([0-9]+(\\.[0-9]+)?(ns|us|ms|s|m|h))+$"},
        pdb=obj(enabled={"type": "boolean"}),
        topologySpreadConstraints=LIST,
        affinity=FREE_MAP,
        podSecurityContext=FREE_MAP,
        securityContext=FREE_MAP,
    )
    # An existing etcd needs its address.
    etcd["if"] = {"properties": {"deploy": {"const": False}}}
    etcd["then"] = {"properties": {"endpoints": {"minItems": 1}}}
    ha = obj(
        enabled={"type": "boolean"},
        oplog={"type": "boolean"},
        backend={"type": "string", "enum": ["etcd", "k8s"]},
        clusterId={"type": "string", "pattern": "^[A-Za-z0-9_.-]*$", "maxLength": 128},
        etcd=etcd,
        k8s=obj(leaseName=K8S_NAME),
    )
    master = obj(
        enabled={"type": "boolean"},
        replicas={"type": "integer", "minimum": 1},
        strategy=FREE_MAP,
        ha=ha,
        image=image(),
        rpcPort=PORT,
        metricsPort=PORT,
        defaultKvLeaseTtl=DURATION,
        clientTtl=positive(),
        evictionHighWatermarkRatio={"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        evictionRatio={"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        extraArgs=STRINGS,
        env=LIST,
        resources=FREE_MAP,
        probes=obj(liveness=probe(), readiness=probe()),
        service=obj(type=SERVICE_TYPE, annotations=STRING_MAP),
        pdb=pdb("minAvailable", 0),
        podSecurityContext=FREE_MAP,
        securityContext=FREE_MAP,
        podAnnotations=STRING_MAP,
        podLabels=STRING_MAP,
        **{k: v for k, v in SCHEDULING.items()},
        external=obj(
            address=MASTER_ADDRESS,
            healthUrl={"type": "string", "pattern": "^(https?://.+)?$"},
        ),
    )
    master["allOf"] = [
        # Without a master of its own, the chart needs the address of one.
        {"if": {"properties": {"enabled": {"const": False}}},
         "then": {"properties": {"external": {"properties": {"address": {"minLength": 1}}}}}},
        # HA needs a leader and a standby; without HA, two masters would each hold a part of the index.
        {"if": {"properties": {"ha": {"properties": {"enabled": {"const": True}}}}},
         "then": {"properties": {"replicas": {"minimum": 2}}},
         "else": {"properties": {"replicas": {"maximum": 1}}}},
    ]
    store = obj(
        enabled={"type": "boolean"},
        replicas={"type": "integer", "minimum": 0},
        globalSegmentSize=SIZE,
        localBufferSize=SIZE,
        protocol={"type": "string", "enum": ["tcp", "rdma"]},
        deviceName={"type": "string"},
        port=PORT,
        httpPort=PORT,
        extraArgs=STRINGS,
        env=LIST,
        resources=FREE_MAP,
        memoryHeadroom=QUANTITY,
        strategy=FREE_MAP,
        pdb=pdb("maxUnavailable", 1),
        podSecurityContext=FREE_MAP,
        securityContext=FREE_MAP,
        podAnnotations=STRING_MAP,
        podLabels=STRING_MAP,
        **SCHEDULING,
    )
    monitor = {"enabled": {"type": "boolean"}, "interval": PROM_DURATION, "scrapeTimeout": PROM_DURATION,
               "labels": STRING_MAP}
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "mooncake-lookout chart values",
        **obj(
            nameOverride=DNS_LABEL,
            fullnameOverride=DNS_LABEL,
            commonLabels=STRING_MAP,
            imagePullSecrets=LIST,
            serviceAccount=obj(create={"type": "boolean"}, name={"type": "string"}, annotations=STRING_MAP,
                               automountToken={"type": "boolean"}),
            engine=engine,
            master=master,
            store=store,
            monitoring=obj(
                enabled={"enum": ["auto", True, False]},
                # A label value (kube-prometheus-stack's release name), or false for none.
                release={"anyOf": [{"type": "string", "maxLength": 63}, {"const": False}]},
                namespace=DNS_LABEL,
                serviceMonitor=obj(**monitor, scrapeProtocols=SCRAPE_PROTOCOLS),
                masterMonitor=obj(**monitor, kind={"type": "string", "enum": ["PodMonitor", "ServiceMonitor"]}),
                storeMonitor=obj(**monitor),
                prometheusRule=obj(enabled={"type": "boolean"}, labels=STRING_MAP,
                                   runbookBaseUrl={"type": "string", "pattern": "^(https?://.+)?$"}),
            ),
            grafana=obj(dashboards=obj(
                enabled={"type": "boolean"}, label={"type": "string", "minLength": 1}, labelValue={"type": "string"},
                folder={"type": "string"},
                folderAnnotation={"type": "string",
                                  "pattern": "^([a-z0-9.-]+/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"},
                namespace=DNS_LABEL)),
            rdma=obj(
                # An extended resource name (domain/name), or empty for none.
                resourceName={"type": "string", "maxLength": 253, "pattern": EXTENDED_RESOURCE},
                resourceCount=positive(), ipcLock={"type": "boolean"}, hostNetwork={"type": "boolean"},
                privileged={"type": "boolean"}),
            transferPorts=transfer_ports(),
            networkPolicy=obj(enabled={"type": "boolean"}, monitoringPodSelector=FREE_MAP,
                              storeClients={"type": "boolean"}, engineHttpFrom=LIST, extraEngineIngress=LIST,
                              extraClients=LIST),
            # 0: derived from the engine's startup probe (the test waits as long as a rollout may take).
            helmTest=obj(enabled={"type": "boolean"},
                         timeoutSeconds={"type": "integer", "minimum": 0, "maximum": 36000},
                         nodeSelector=STRING_MAP, tolerations=LIST),
        ),
    }


def comment_descriptions(text: str) -> dict[str, str]:
    """Map each dotted key path of values.yaml to the ``# --`` comment right above it."""
    found: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    pending: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            pending.append(stripped[4:].strip())
            continue
        if stripped.startswith("#"):
            continue
        match = re.match(r"^(\s*)([A-Za-z0-9_./-]+):(\s|$)", line)
        if not match:
            pending = []
            continue
        indent = len(match.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match.group(2)))
        if pending:
            found[".".join(name for _, name in stack)] = " ".join(pending)
        pending = []
    return found


def fill(schema: dict[str, Any], values: Any, docs: dict[str, str], path: str = "") -> None:
    """Copy defaults (from values.yaml) and descriptions (from its comments) into the schema, in place."""
    if path and "description" not in schema and path in docs:
        schema["description"] = docs[path]
    props = schema.get("properties")
    if props is None or schema.get("additionalProperties") is not False:
        if path:
            schema["default"] = values
        return
    for name in props:
        sub = props[name] = copy.deepcopy(props[name])  # the shape shares small dicts; fill private copies
        if name not in values:
            raise SystemExit(f"values.yaml lacks {path + '.' if path else ''}{name}, which the schema defines")
        fill(sub, values[name], docs, f"{path}.{name}" if path else name)
    extra = set(values) - set(props)
    if extra:
        raise SystemExit(f"values.yaml has keys the schema does not define under {path or '(top)'}: {sorted(extra)}")


def build(values_text: str) -> dict[str, Any]:
    """The full schema for this values.yaml text."""
    schema = shape()
    fill(schema, yaml.safe_load(values_text), comment_descriptions(values_text))
    return schema


def render(schema: dict[str, Any]) -> str:
    """The schema as committed: two-space JSON with a final newline."""
    return json.dumps(schema, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if values.schema.json is stale")
    args = parser.parse_args(argv)
    text = render(build(VALUES.read_text()))
    if args.check:
        if SCHEMA.read_text() != text:
            print(f"{SCHEMA} is stale: run python {Path(__file__).relative_to(CHART.parents[1])}", file=sys.stderr)
            return 1
        return 0
    SCHEMA.write_text(text)
    return 0


__all__ = ["LOOKUP_LIMITS", "build", "comment_descriptions", "render", "shape"]

if __name__ == "__main__":
    sys.exit(main())

"""The chart's values, schema and docs against their sources: connector/config.py KEYS, values.yaml, helm.

A lookup key added to (or changed in) connector/config.py without the chart following fails here; a bad value
is rejected by helm itself, with a message naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mooncake_lookout.connector.cli.docs import extract, render_values_table
from mooncake_lookout.connector.config import KEYS, ConfigError, LookupConfig

import chart  # helm/tools/chart.py (conftest puts helm/tools on sys.path)
import values_schema  # helm/tools

ROOT = Path(__file__).resolve().parents[1]


SCHEMA = json.loads((chart.CHART / "values.schema.json").read_text())
LOOKUP_SCHEMA = SCHEMA["properties"]["engine"]["properties"]["connector"]["properties"]["lookup"]


def test_values_carry_every_lookup_key_with_the_connectors_default():
    lookup = chart.load_values()["engine"]["connector"]["lookup"]
    assert list(lookup) == [k.name for k in KEYS]
    for key in KEYS:
        value = lookup[key.name]  # a value of the key's kind, or one of its words (lookup_timeout_ms: auto)
        assert value == key.default and (type(value) is key.kind or value in key.words), key.name


def test_default_connector_name_is_the_one_the_plugin_registers():
    from mooncake_lookout.connector.plugin import CONNECTOR_NAME

    assert chart.load_values()["engine"]["connector"]["name"] == CONNECTOR_NAME


def test_schema_has_every_lookup_key_typed_and_defaulted_like_the_connector():
    types = {bool: "boolean", int: "integer", float: "number", str: "string"}
    assert set(LOOKUP_SCHEMA["properties"]) == {k.name for k in KEYS}
    assert LOOKUP_SCHEMA["additionalProperties"] is False
    for key in KEYS:
        prop = LOOKUP_SCHEMA["properties"][key.name]
        typed = prop["anyOf"][0] if key.words else prop  # a number or one of its words (``auto``)
        assert typed["type"] == types[key.kind] and prop["default"] == key.default, key.name
        if key.words:
            assert prop["anyOf"][1] == {"type": "string", "enum": list(key.words)}


def test_committed_schema_is_the_generated_one():
    assert values_schema.main(["--check"]) == 0, "run: python helm/tools/values_schema.py"


def test_schema_is_strict_everywhere_but_free_form_maps():
    def walk(node, path):
        if node.get("type") == "object" and "properties" in node:
            assert node.get("additionalProperties") is False, path
            for name, sub in node["properties"].items():
                walk(sub, f"{path}.{name}")
        if "properties" not in node:
            assert "description" in node and node["description"], f"{path} lacks a description"
    walk(SCHEMA, "values")


def test_default_values_validate_against_the_schema_and_every_ci_set_too():
    validator = jsonschema.Draft7Validator(SCHEMA)
    assert not list(validator.iter_errors(chart.load_values()))
    for path in chart.ci_value_sets().values():
        override = yaml.safe_load(path.read_text())
        # Overrides hold only a part of the values: check them against the schema without "required".
        partial = json.loads(json.dumps(SCHEMA).replace('"required"', '"x-required"'))
        assert not list(jsonschema.Draft7Validator(partial).iter_errors(override)), path.name


def _lookup_value(key):
    """Values around each key's limits, of the right and of wrong types."""
    around = {
        bool: st.booleans(),
        int: st.one_of(st.integers(-5, 5), st.integers(99_990, 100_010), st.integers(9_990, 10_010),
                       st.integers(999_990, 1_000_010), st.integers()),
        float: st.one_of(st.floats(-1, 1, allow_nan=False), st.floats(3590, 3610), st.floats(59_990, 60_010),
                         st.integers(-2, 2), st.integers(3599, 3601), st.integers(59_999, 60_001)),
        str: st.one_of(st.sampled_from(["upstream", "pipelined", "", "ipc:///tmp/x", "tcp://127.0.0.1:5555",
                                        "http://x", "Upstream"]), st.text(max_size=8)),
    }[key.kind]
    wrong = st.one_of(st.none(), st.text(max_size=3), st.booleans(), st.lists(st.integers(), max_size=1),
                      st.floats(-10, 2e6, allow_nan=False))
    return st.one_of(around, wrong)


CURVE_SERVER_PUBLIC_KEY = next(k for k in KEYS if k.name == "lookup_curve_server_public_key")
PATH_KEYS = {k.name for k in KEYS if k.name.startswith("lookup_curve_")}  # key files, or a folder of them


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(KEYS).flatmap(lambda key: st.tuples(st.just(key), _lookup_value(key))))
@example((CURVE_SERVER_PUBLIC_KEY, "/"))  # found by this test in a fresh-clone run: an absolute path, no key file
@example((next(k for k in KEYS if k.name == "lookup_curve_allowed_clients"), "/"))
@example((CURVE_SERVER_PUBLIC_KEY, "\n"))  # found in a run: Python's "$" also matches before a final newline
@example((next(k for k in KEYS if k.name == "lookup_server_address"), "\n"))
@example((next(k for k in KEYS if k.name == "lookup_server_address"), "tcp://a\nb"))
def test_schema_accepts_a_lookup_value_exactly_when_the_connector_does(key_value):
    key, value = key_value
    if key.name in PATH_KEYS:
        # A key file (or folder): the schema checks its form ('' or an absolute path, as the chart mounts it); only the
        # connector can read the file (a missing or bad file is a ConfigError: tests/test_curve.py).
        assert jsonschema.Draft7Validator(LOOKUP_SCHEMA["properties"][key.name]).is_valid(value) == (
            isinstance(value, str) and (value == "" or value.startswith("/")) and "\n" not in value), \
            f"{key.name}={value!r}"
        return
    # What the engine receives: helm holds numbers as float64 and its toJson writes integral ones without ".0".
    as_rendered = int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 1e21 else value
    try:
        LookupConfig.from_extra_config({key.name: as_rendered})
        connector_ok = True
    except (ConfigError, TypeError):
        connector_ok = False
    schema_ok = jsonschema.Draft7Validator(LOOKUP_SCHEMA["properties"][key.name]).is_valid(value)
    assert schema_ok == connector_ok, f"{key.name}={value!r}: schema {schema_ok}, connector {connector_ok}"


BAD_VALUES = [
    ({"engine.connector.lookup.lookup_timeout_ms": "0"}, "engine.connector.lookup.lookup_timeout_ms"),
    ({"engine.connector.lookup.lookup_transport": '"carrier-pigeon"'}, "engine.connector.lookup.lookup_transport"),
    ({"engine.connector.lookup.lookup_async": '"yes"'}, "engine.connector.lookup.lookup_async"),
    ({"engine.connector.lookup.lookup_max_pending": "0"}, "engine.connector.lookup.lookup_max_pending"),
    ({"engine.connector.lookup.lookup_wiat_us": "10"}, "lookup_wiat_us"),
    ({"engine.connector.extraConfig": '{"lookup_timeout": 5}'}, "engine.connector.extraConfig"),
    ({"engine.connector.kvRole": '"kv_maybe"'}, "engine.connector.kvRole"),
    ({"master.enabled": "false"}, "master.external.address"),
    ({"master.evictionRatio": "1.5"}, "master.evictionRatio"),
    ({"master.defaultKvLeaseTtl": '"ten seconds"'}, "master.defaultKvLeaseTtl"),
    ({"monitoring.masterMonitor.kind": '"ProbeMonitor"'}, "monitoring.masterMonitor.kind"),
    # Spelled as in the 0.0.4 text format's MIME type, not as the operator's CRD spells it.
    ({"monitoring.serviceMonitor.scrapeProtocols": '["PrometheusText004"]'},
     "monitoring.serviceMonitor.scrapeProtocols"),
    ({"monitoring.serviceMonitor.scrapeProtocols": '"PrometheusText0.0.4"'},
     "monitoring.serviceMonitor.scrapeProtocols"),
    ({"engine.tracing.otlpEndpoint": '"collector:4317"'}, "engine.tracing.otlpEndpoint"),
    ({"engine.replica": "2"}, "replica"),
    # Only the OTLP/HTTP exporter ships with the package: grpc would switch lookup spans off at start-up.
    ({"engine.tracing.protocol": '"grpc"'}, "engine.tracing.protocol"),
    # Two masters without HA would each hold a part of the index; HA needs a standby.
    ({"master.replicas": "2"}, "master.replicas"),
    ({"master.ha.enabled": "true"}, "master.replicas"),
    ({"master.ha.enabled": "true", "master.replicas": "2", "master.ha.backend": '"zookeeper"'}, "master.ha.backend"),
    ({"master.ha.enabled": "true", "master.replicas": "2", "master.ha.etcd.deploy": "false"},
     "master.ha.etcd.endpoints"),
    ({"master.ha.etcd.replicas": "2"}, "master.ha.etcd.replicas"),
    ({"master.enabled": "false", "master.external.address": '"http://mc:50051"'}, "master.external.address"),
    ({"monitoring.enabled": '"yes"'}, "monitoring.enabled"),
    ({"engine.hfToken.secretName": '"Not_A_Name"'}, "engine.hfToken.secretName"),
    ({"engine.modelCache.accessModes": '["ReadWriteSometimes"]'}, "engine.modelCache.accessModes"),
    ({"store.globalSegmentSize": '"lots"'}, "store.globalSegmentSize"),
]


@pytest.mark.parametrize("sets,named", BAD_VALUES, ids=[n for _, n in BAD_VALUES])
def test_helm_rejects_bad_values_naming_the_key(sets, named):
    with pytest.raises(chart.HelmError) as err:
        chart.template(sets=sets)
    message = str(err.value)
    assert "values don't meet the specifications of the schema" in message
    assert named in message, message


def test_the_same_values_render_when_correct():
    # The counterpart of the rejections above: nearby good values render.
    objects = chart.template(sets={"engine.connector.lookup.lookup_timeout_ms": "0.5",
                                   "engine.connector.lookup.lookup_transport": '"pipelined"',
                                   "master.enabled": "false",
                                   "master.external.address": '"mc.store:50051"'})
    assert chart.find(objects, "Deployment", "-engine")
    objects = chart.template(sets={"master.enabled": "false",
                                   "master.external.address": '"etcd://e1.store:2379;e2.store:2379"'})
    assert chart.find(objects, "Deployment", "-engine")
    objects = chart.template(sets={"master.ha.enabled": "true", "master.replicas": "2",
                                   "master.ha.etcd.deploy": "false", "master.ha.etcd.endpoints": '["etcd.infra:2379"]'})
    assert chart.find(objects, "Deployment", "-master")


def test_docs_values_table_is_generated_from_the_schema():
    rows = extract((ROOT / "docs" / "helm.md").read_text(), "values-table")
    assert rows is not None, "docs/helm.md has no values-table block"
    assert rows == render_values_table(SCHEMA), "run: python -m mooncake_lookout.connector.cli.docs"
    for key in KEYS:
        assert f"`engine.connector.lookup.{key.name}`" in rows


def test_comment_parser_reads_descriptions_of_nested_keys():
    text = "a:\n  # -- the b\n  b: 1\n  c:\n    # -- the d\n    d: x\n# -- the e\ne: {}\n"
    assert values_schema.comment_descriptions(text) == {"a.b": "the b", "a.c.d": "the d", "e": "the e"}


def test_chart_app_version_is_the_package_version():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    meta = yaml.safe_load((chart.CHART / "Chart.yaml").read_text())
    assert meta["apiVersion"] == "v2"
    assert meta["appVersion"] == project["version"]
    pins = dict(dep.split("==", 1) for group in project["optional-dependencies"].values() for dep in group
                if "==" in dep)
    assert meta["annotations"]["mooncake-lookout/vllm-version"] == pins["vllm"]
    assert meta["annotations"]["mooncake-lookout/mooncake-version"] == pins["mooncake-transfer-engine-cuda13"]

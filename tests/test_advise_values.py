"""``advise --write-values FILE`` writes the file docs/tuning.md tells the user to pass to ``helm upgrade``: valid
against the chart's ``values.schema.json`` (alone and merged over the chart's defaults, as helm validates), linted
strictly and rendered by the real chart into the engine's ``--kv-transfer-config`` with every advised setting.
The advice comes from advise's own rules on chosen figures (a busy sync deployment that should go async); the
console script's flag is exercised against a real Prometheus in tests/test_prometheus_auth_live.py."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from mooncake_lookout.connector.cli.advise import HELM_LOOKUP_PATH, values_file
from mooncake_lookout.connector.cli.advise_prom import Figures
from mooncake_lookout.connector.cli.advise_rules import decide, settings
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.metrics import catalogue as cat
from mooncake_lookout.metrics.prometheus_sink import info_labels

import chart  # noqa: E402 - helm/tools (conftest puts it on sys.path)

SCHEMA = json.loads((chart.CHART / "values.schema.json").read_text())


def _sync_deployment_figures() -> Figures:
    """A busy sync window: 4 lookups per 10 ms step, 4 ms of each step blocked in lookups (advise: go async)."""
    config = LookupConfig(lookup_async=False)
    f = Figures(url="https://prometheus.example", selector='{namespace="serving"}', window="1h", window_s=3600,
                configs=[info_labels(config)], configs_in_window=1)
    f.outcomes = {"hit": 4000.0, "miss": 0.0}
    f.steps, f.step_mean_s, f.step_p50_s = 1000.0, 0.010, 0.010
    f.blocked_s, f.blocked_calls = 4.0, 8000.0
    total, f.rpc_buckets = 0.0, []
    for le in (*cat.SECONDS_BUCKETS, math.inf):
        total += {0.0005: 2000, 0.001: 1800, 0.0025: 200}.get(le, 0.0)
        f.rpc_buckets.append((le, total))
    f.deferred_count, f.deferred_sum, f.deferred_p90 = 4000.0, 4000.0, 0.9
    f.pending_peak, f.max_pending = 8.0, float(config.lookup_max_pending)
    f.held_peak, f.max_held = 10.0, float(config.lookup_max_held)
    return f


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@pytest.fixture
def written(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    f = _sync_deployment_figures()
    _, _, advice = decide(f)
    path = tmp_path / "advised-values.yaml"
    path.write_text(values_file(f, advice))
    return path, settings(advice)


def test_the_written_values_are_valid_against_the_charts_schema(written: tuple[Path, dict[str, Any]]) -> None:
    path, advised = written
    values = yaml.safe_load(path.read_text())
    lookup = values
    for key in HELM_LOOKUP_PATH:
        (only,) = lookup  # nothing but the path to the lookup settings: --reuse-values keeps the rest
        assert only == key
        lookup = lookup[key]
    assert lookup["lookup_async"] is True and set(lookup) == set(advised)
    validator = jsonschema.Draft7Validator(SCHEMA)
    errors = [e.message for e in validator.iter_errors(_merged(chart.load_values(), values))]
    assert errors == []
    lookup_schema = SCHEMA["properties"]["engine"]["properties"]["connector"]["properties"]["lookup"]
    for key, value in lookup.items():  # each advised value on its own, as the schema states the key
        assert jsonschema.Draft7Validator(lookup_schema["properties"][key]).is_valid(value), key
    text = path.read_text()
    assert "# changed: lookup_async false -> true" in text and "--reuse-values -f THIS_FILE" in text


def test_helm_lints_and_renders_the_written_values_into_the_engine(written: tuple[Path, dict[str, Any]]) -> None:
    path, advised = written
    chart.run_helm("lint", str(chart.CHART), "--strict", "--values", str(path))
    objects = chart.template([path])
    (container,) = chart.one(objects, "Deployment", "-engine")["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    extra = json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    for key, value in advised.items():
        assert extra[key] == (int(value) if isinstance(value, float) and value.is_integer() else value), key

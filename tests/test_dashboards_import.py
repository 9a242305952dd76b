"""The two forms of each dashboard work the two ways Grafana reads them (dashboards/importable.py).

* Import (``dashboards/import/*.json``): Grafana's import form asks for every ``__inputs`` entry, then its
  ``DashTemplateEvaluator`` replaces each ``${NAME}``; ``importable.grafana_import`` is a port of it. After the
  import the dashboard must be the provisioned one, opened on the data source picked.
* Provisioning (``dashboards/*.json``, the chart's ConfigMaps): nothing is replaced, so no ``${DS_...}`` may be
  left, and every data source reference must be the ``datasource`` variable.

No Grafana server installs here; the queries of both forms run on a real Prometheus in
tests/test_dashboards_live.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = ROOT / "dashboards"

import generate  # noqa: E402
import importable  # noqa: E402
import lint  # noqa: E402

NAMES = (generate.OVERVIEW_JSON, generate.TUNING_JSON)
PICKED = "prom-uid-7"  # the uid of the data source a user picks in the import form


def provisioned(name: str) -> dict[str, Any]:
    return json.loads((DASHBOARDS / name).read_text())


def for_import(name: str) -> dict[str, Any]:
    path = DASHBOARDS / generate.IMPORT_DIR / name
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing: run python dashboards/generate.py"
    return json.loads(path.read_text())


def datasource_refs(dashboard: dict[str, Any]) -> list[Any]:
    """Every data source reference of panels, their queries and the query variables."""
    refs = []
    for panel in lint.iter_panels(dashboard):
        if panel["type"] != "row":
            refs.append(panel.get("datasource"))
        refs += [t.get("datasource") for t in panel.get("targets") or []]
    refs += [v.get("datasource") for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return [r for r in refs if r is not None]


@pytest.mark.parametrize("name", NAMES)
def test_the_import_form_asks_for_a_prometheus(name):
    inputs = for_import(name)["__inputs"]
    assert [(i["name"], i["type"], i["pluginId"]) for i in inputs] == [(importable.DS_INPUT, "datasource",
                                                                          "prometheus")]
    with pytest.raises(KeyError, match=f"{importable.DS_INPUT} missing from import command"):
        importable.grafana_import(for_import(name), {})


@pytest.mark.parametrize("name", NAMES)
def test_after_grafanas_import_it_is_the_provisioned_dashboard_on_the_data_source_picked(name):
    imported = importable.grafana_import(for_import(name), {importable.DS_INPUT: PICKED})
    assert "__inputs" not in imported and "${DS_" not in json.dumps(imported)
    variables = {v["name"]: v for v in imported["templating"]["list"]}
    assert variables["datasource"]["current"]["value"] == PICKED
    # Panels keep the variable, so it can still switch; the rest is the provisioned file, key for key.
    assert {r["uid"] for r in datasource_refs(imported)} == {"${datasource}"}
    expected = provisioned(name)
    got = {k: v for k, v in imported.items() if k not in ("__requires", "__elements")}
    got_vars = got["templating"]["list"]
    del next(v for v in got_vars if v["name"] == "datasource")["current"]
    assert got == expected


@pytest.mark.parametrize("name", NAMES)
def test_the_provisioned_form_leaves_nothing_for_provisioning_to_resolve(name):
    d = provisioned(name)
    assert not {k for k in d if k.startswith("__")}
    assert not re.search(r"\$\{DS_", json.dumps(d)), "provisioning never fills ${DS_...}: it must not be there"
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {(r["type"], r["uid"]) for r in datasource_refs(d)} == {("prometheus", "${datasource}")}


@pytest.mark.parametrize("name", NAMES)
def test_requires_names_the_grafana_of_the_schema_version_and_every_plugin(name):
    d = for_import(name)
    requires = {r["id"]: r for r in d["__requires"]}
    assert requires["grafana"]["version"] == importable.min_grafana(d) == "11.6.0"
    panel_types = {p["type"] for p in lint.iter_panels(d)} - {"row"}
    assert {k for k, r in requires.items() if r["type"] == "panel"} == panel_types
    assert requires["prometheus"]["type"] == "datasource"


def test_a_newer_schema_version_needs_its_grafana_named():
    with pytest.raises(ValueError, match="schemaVersion 99"):
        importable.min_grafana({"schemaVersion": 99})


def test_the_docs_state_the_minimum_grafana_and_where_each_form_goes():
    page = (ROOT / "docs" / "dashboards.md").read_text()
    version = importable.min_grafana(provisioned(NAMES[0]))
    assert f"Grafana {version} or newer" in page
    for name in NAMES:
        assert f"`dashboards/{generate.IMPORT_DIR}/{name}`" in page and f"`dashboards/{name}`" in page


def test_the_chart_ships_the_provisioned_form_only():
    """The chart's ConfigMaps come from files/dashboards/*.json (a link to dashboards/): the import folder is not
    globbed and is left out of the packaged chart."""
    chart_dir = ROOT / "helm" / "mooncake-lookout"
    assert sorted(p.name for p in (chart_dir / "files" / "dashboards").glob("*.json")) == sorted(NAMES)
    ignored = (chart_dir / ".helmignore").read_text().split()
    assert f"files/dashboards/{generate.IMPORT_DIR}/" in ignored

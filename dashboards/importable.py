"""The import form of a dashboard: what Grafana's "Export for sharing externally" makes of it.

Two forms of each dashboard are committed, because Grafana reads them two ways:

* **provisioned** (``dashboards/*.json``, the chart's ConfigMaps, a provisioning folder): Grafana loads the file as
  it is and resolves nothing. Its panels use the ``datasource`` variable, which opens on the default Prometheus.
* **import** (``dashboards/import/*.json``, Dashboards -> New -> Import): the same dashboard plus ``__inputs`` (one
  data source, ``DS_PROMETHEUS``, so the import form asks for it), ``__requires`` (the Grafana version, the data
  source plugin and the panel plugins it needs) and ``__elements``. As Grafana's own exporter does
  (``makeExportableV1`` in ``dashboard-scene/scene/export/exporters.ts``), the panels keep ``${datasource}`` and
  the ``datasource`` variable's current value becomes ``${DS_PROMETHEUS}``: Grafana's import replaces that string
  with the data source picked (``DashTemplateEvaluator``), so the dashboard opens on it and the variable can still
  switch. A provisioned file must not carry ``${DS_...}``: provisioning never replaces it.

The minimum Grafana version is the first release whose dashboards carry the generated ``schemaVersion``
(:data:`FIRST_GRAFANA_OF_SCHEMA`); an SDK that writes a newer schema fails the generator until the table says which
release that is.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import lint

DS_INPUT = "DS_PROMETHEUS"
DS_VARIABLE = "datasource"
# schemaVersion -> the first Grafana release whose dashboards carry it (v41, timepicker.time_options removed:
# grafana/grafana#100135, merged 2025-02, first released in 11.6.0; grafana-foundation-sdk 11.6.0 writes 41).
FIRST_GRAFANA_OF_SCHEMA: dict[int, str] = {41: "11.6.0"}
# Panel plugins Grafana ships, by id: the names its exporter writes into __requires (version "" for core panels).
PANEL_PLUGINS: dict[str, str] = {"stat": "Stat", "state-timeline": "State timeline", "table": "Table", "text": "Text",
                                 "timeseries": "Time series"}


def min_grafana(dashboard: dict[str, Any]) -> str:
    """The oldest Grafana that reads ``dashboard`` as written (by its schemaVersion)."""
    version = dashboard["schemaVersion"]
    if version not in FIRST_GRAFANA_OF_SCHEMA:
        raise ValueError(f"schemaVersion {version}: add the first Grafana release that writes it to "
                         "importable.FIRST_GRAFANA_OF_SCHEMA (Grafana's apps/dashboard/pkg/migration/schemaversion)")
    return FIRST_GRAFANA_OF_SCHEMA[version]


def _requires(dashboard: dict[str, Any]) -> list[dict[str, str]]:
    kinds = sorted({p["type"] for p in lint.iter_panels(dashboard) if p["type"] != "row"})
    unknown = [k for k in kinds if k not in PANEL_PLUGINS]
    if unknown:
        raise ValueError(f"panel types {unknown}: name them in importable.PANEL_PLUGINS")
    out = [{"type": "grafana", "id": "grafana", "name": "Grafana", "version": min_grafana(dashboard)},
           {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"}]
    out += [{"type": "panel", "id": k, "name": PANEL_PLUGINS[k], "version": ""} for k in kinds]
    return sorted(out, key=lambda r: r["id"])  # Grafana's exporter sorts them by id


def for_import(dashboard: dict[str, Any]) -> dict[str, Any]:
    """The import form of a provisioned dashboard (which is left unchanged)."""
    out = copy.deepcopy(dashboard)
    (variable,) = [v for v in out["templating"]["list"] if v["name"] == DS_VARIABLE]
    if variable["type"] != "datasource" or variable["query"] != "prometheus":
        raise ValueError(f"variable {DS_VARIABLE!r} must be a Prometheus data source variable, got {variable}")
    variable["current"] = {"selected": True, "text": "", "value": "${" + DS_INPUT + "}"}
    return {
        "__inputs": [{"name": DS_INPUT, "label": "Prometheus", "description": "The Prometheus that scrapes vLLM, the "
                      "lookup servers and the Mooncake master.", "type": "datasource", "pluginId": "prometheus",
                      "pluginName": "Prometheus"}],
        "__elements": {},
        "__requires": _requires(dashboard),
        **out,
    }


# Grafana's import (pkg/services/dashboardimport/utils/dash_template_evaluator.go): every "${...}" in any string.
_IMPORT_VAR = re.compile(r"(\$\{.+?\})")


def grafana_import(template: dict[str, Any], inputs: dict[str, str]) -> dict[str, Any]:
    """What Grafana's import stores for ``template`` given ``inputs`` (input name -> value, as the import form sends
    them): a port of its ``DashTemplateEvaluator``. Every ``__inputs`` entry needs a value (Grafana refuses the
    import otherwise: "Dashboard input variable: NAME missing from import command"); each ``${NAME}`` in any string
    becomes its value, other ``${...}`` stay as they are, ``__inputs`` is dropped."""
    values = {}
    for spec in template.get("__inputs", []):
        if spec["name"] not in inputs:
            raise KeyError(f"Dashboard input variable: {spec['name']} missing from import command")
        values["${" + spec["name"] + "}"] = inputs[spec["name"]]

    def walk(node: Any) -> Any:
        if isinstance(node, str):
            return _IMPORT_VAR.sub(lambda m: values.get(m.group(1), m.group(1)), node)
        if isinstance(node, list):
            return [walk(item) for item in node]
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items() if k != "__inputs"}
        return node

    return walk(template)  # type: ignore[no-any-return]


__all__ = ["DS_INPUT", "DS_VARIABLE", "FIRST_GRAFANA_OF_SCHEMA", "PANEL_PLUGINS", "for_import", "grafana_import",
           "min_grafana"]

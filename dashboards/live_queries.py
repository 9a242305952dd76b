"""Run the dashboards' variable queries, panel queries and the alert expressions on a real Prometheus.

Grafana is not available here, so this does what it would: resolve each ``label_values`` variable query
through Prometheus' label API, substitute the chosen values and ``$__rate_interval``, and send each panel
query to ``/api/v1/query_range`` (``/api/v1/query`` for instant ones). Used by the live test and by the
PNG renderer.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import lint
from live_stack import PromAPI

_LABEL_VALUES = re.compile(r"^label_values\((.*),\s*([a-zA-Z_][a-zA-Z0-9_]*)\)$", re.S)


@dataclass
class QueryRun:
    """One panel query as run: where it came from, what was sent, what came back."""

    dashboard: str
    panel: dict[str, Any]
    target: dict[str, Any]
    expr: str
    response: dict[str, Any]

    @property
    def error(self) -> str | None:
        """Prometheus' error text, or None on success."""
        if self.response.get("status") == "success":
            return None
        return f"{self.response.get('errorType')}: {self.response.get('error')}"

    @property
    def has_data(self) -> bool:
        """True if any series came back with at least one finite value."""
        for series in self.response.get("data", {}).get("result", []):
            points = series.get("values") or ([series["value"]] if "value" in series else [])
            if any(math.isfinite(float(v)) for _, v in points):
                return True
        return False


def all_values(dashboard: dict[str, Any]) -> dict[str, str]:
    """Every query variable set to All (its ``allValue``), the datasource to its uid placeholder."""
    return {v["name"]: v.get("allValue") or ".*" for v in dashboard["templating"]["list"] if v["type"] == "query"}


def variable_options(prom: PromAPI, dashboard: dict[str, Any], values: dict[str, str],
                     seconds: float = 300) -> dict[str, list[str]]:
    """What each ``label_values`` variable would offer, given ``values`` for the variables it depends on."""
    out: dict[str, list[str]] = {}
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = _LABEL_VALUES.match(var["query"])
        if not m:
            raise ValueError(f"variable {var['name']}: unsupported query {var['query']!r}")
        selector = lint.substitute(m.group(1), values, "1m")
        end = time.time()
        body = prom.api(f"label/{m.group(2)}/values", **{"match[]": selector, "start": f"{end - seconds:.0f}",
                                                          "end": f"{end:.0f}"})
        if body.get("status") != "success":
            raise RuntimeError(f"variable {var['name']}: {body}")
        out[var["name"]] = body["data"]
    return out


def run_queries(prom: PromAPI, name: str, dashboard: dict[str, Any], values: dict[str, str], *,
                rate_interval: str, seconds: float = 60) -> list[QueryRun]:
    """Every panel query of ``dashboard`` with ``values`` substituted."""
    runs = []
    for panel, target in lint.queries(dashboard):
        expr = lint.substitute(target["expr"], values, rate_interval)
        if target.get("instant"):
            response = prom.api("query", query=expr)
        else:
            response = prom.query_range(expr, seconds)
        runs.append(QueryRun(name, panel, target, expr, response))
    return runs


def run_exprs(prom: PromAPI, exprs: Iterable[str]) -> list[tuple[str, dict[str, Any]]]:
    """Instant queries of plain expressions (alert rules)."""
    return [(e, prom.api("query", query=e)) for e in exprs]


__all__ = ["QueryRun", "all_values", "run_exprs", "run_queries", "variable_options"]

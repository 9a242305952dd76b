"""Checks on generated dashboards and their PromQL, shared by the tests and the PNG renderer.

Light-weight on purpose: it does not parse PromQL fully, it finds the selectors (``name{...}``), the
range windows (``[...]``) and the divisions, which is what the house rules are about. Prometheus itself
validates the syntax in the live test.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

# PromQL words that may appear outside selectors: functions, aggregations, operators, modifiers.
PROMQL_WORDS = frozenset({
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values", "group",
    "rate", "irate", "increase", "delta", "idelta", "deriv", "histogram_quantile", "max_over_time",
    "min_over_time", "avg_over_time", "sum_over_time", "count_over_time", "last_over_time", "absent",
    "absent_over_time", "clamp", "clamp_min", "clamp_max", "label_replace", "vector", "scalar", "time", "abs",
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
})
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_WINDOW = re.compile(r"\[([^\]]+)\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_NUMBER = re.compile(r"\b\d+(\.\d+)?([eE][-+]?\d+)?\b")


def iter_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows and the panels inside collapsed rows included."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(panel, target) for every query of the dashboard."""
    for panel in iter_panels(dashboard):
        for target in panel.get("targets") or []:
            yield panel, target


def selectors(expr: str) -> list[tuple[str, dict[str, tuple[str, str]]]]:
    """``(metric, {label: (op, value)})`` for every ``name{...}`` selector of ``expr``."""
    out = []
    for m in _SELECTOR.finditer(expr):
        out.append((m.group(1), {lab: (op, val) for lab, op, val in _MATCHER.findall(m.group(2))}))
    return out


def windows(expr: str) -> list[str]:
    """The range windows (``5m``, ``$__rate_interval``) in ``expr``."""
    return _WINDOW.findall(expr)


def bare_names(expr: str) -> list[str]:
    """Identifiers outside selectors, groupings, strings and comments that are not PromQL words: metrics without
    filters."""
    text = _SELECTOR.sub(" ", expr)
    text = re.sub(r'"(?:[^"\\]|\\.)*"', " ", text)
    text = re.sub(r"#[^\n]*", " ", text)  # PromQL comments run to the end of the line
    text = _GROUPING.sub(" ", text)
    text = _WINDOW.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    return [w for w in _IDENT.findall(text) if w not in PROMQL_WORDS]


def _group_after(expr: str, start: int) -> str:
    """The text of the parenthesised group that starts at or after ``start`` (empty if none)."""
    i = expr.find("(", start)
    if i < 0 or expr[start:i].strip():
        return ""
    depth = 0
    for j in range(i, len(expr)):
        depth += {"(": 1, ")": -1}.get(expr[j], 0)
        if depth == 0:
            return expr[i:j + 1]
    return ""


def unguarded_divisions(expr: str) -> list[str]:
    """Denominators of ``/`` that are not of the form ``(... > 0)`` (a possible division by zero)."""
    bad = []
    for m in re.finditer(r"/", expr):
        group = _group_after(expr, m.end())
        if not re.search(r">\s*0\s*\)$", group):
            bad.append(expr[m.end():m.end() + 60].strip())
    return bad


def overlaps(panels: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """Pairs of panel ids whose grid rectangles intersect."""
    out = []
    for i, a in enumerate(panels):
        ga = a["gridPos"]
        for b in panels[i + 1:]:
            gb = b["gridPos"]
            if (ga["x"] < gb["x"] + gb["w"] and gb["x"] < ga["x"] + ga["w"]
                    and ga["y"] < gb["y"] + gb["h"] and gb["y"] < ga["y"] + ga["h"]):
                out.append((a["id"], b["id"]))
    return out


def substitute(expr: str, values: dict[str, str], rate_interval: str) -> str:
    """Replace Grafana variables as Grafana would: ``$var``/``${var}`` by a regex value, and the rate interval."""
    expr = expr.replace("$__rate_interval", rate_interval)
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    return expr


__all__ = [
    "PROMQL_WORDS", "bare_names", "iter_panels", "overlaps", "queries", "selectors", "substitute",
    "unguarded_divisions", "windows",
]
